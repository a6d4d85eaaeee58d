"""Which backend ``backend="auto"`` tries first on a CUDA device.

From the H200 measurements recorded in ``bench/results/h200.json`` and ``docs/triton_kernel.md``
(kernel times, both backends in one run, 2026-11-29):

* page size < 16: Triton's per-key gathers beat cuDNN's paged kernel (page 1: 1.75x);
* short prefills (max_q x max_kv <= 2^21, e.g. 16 x 1k x 1k) called eagerly: Triton wins (1.17x):
  less host work per call and no per-shape graph build; captured in a CUDA graph (no host work),
  cuDNN's kernel wins there too (1.25x);
* long prefills and prefixes: cuDNN's kernels are 20-30% faster than ours.

Anything cuDNN cannot serve (fp8 on Hopper, a head dim it refuses, no graph built yet during CUDA
graph capture, package missing) falls through to the next backend in the list.
"""

from __future__ import annotations

from pagedprefill.api import PrefillBatch

SMALL_WORK = 1 << 21  # max_q * max_kv at or below which Triton is preferred


def order(batch: PrefillBatch) -> list[str]:
    triton_first = (
        (batch.paged and batch.page_size < 16)
        or (batch.max_q * batch.max_kv <= SMALL_WORK and not batch.graph_mode)
        or batch.q.dtype.itemsize == 1
        or batch.k.dtype.itemsize == 1
    )
    return ["triton", "cudnn", "torch"] if triton_first else ["cudnn", "triton", "torch"]
