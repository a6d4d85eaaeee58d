"""Which backend ``backend="auto"`` tries first on a CUDA device.

From the H200 measurements recorded in ``bench/results/h200.json`` and ``h200-graph.json`` (kernel
time with host time excluded, both backends in one run, 2026-11-29, after the api's call cache
brought cuDNN's host time per call to ~150 us):

* page size < 16: Triton's per-key gathers beat cuDNN's paged kernel (page 1: 1.23x eager, 1.24x in
  CUDA graphs);
* fp8 KV cache (cuDNN 9.19 refuses fp8 attention on Hopper): Triton;
* everything else, short prefills included: cuDNN's kernels are 22-37% faster than ours
  (llama8b_b16_q1k: 0.376 vs 0.538 ms), and its host time no longer exceeds its kernel time.

Anything cuDNN cannot serve (a head dim it refuses, no graph built yet during CUDA graph capture,
package missing) falls through to the next backend in the list.
"""

from __future__ import annotations

from pagedprefill.api import PrefillBatch


def order(batch: PrefillBatch) -> list[str]:
    triton_first = (
        (batch.paged and batch.page_size < 16) or batch.q.dtype.itemsize == 1 or batch.k.dtype.itemsize == 1
    )
    return ["triton", "cudnn", "torch"] if triton_first else ["cudnn", "triton", "torch"]
