"""Which backend ``backend="auto"`` tries first on a CUDA device.

From the H200 measurements recorded in ``bench/results/h200-ostage.json`` (eager) and
``h200-graph-ostage.json`` (CUDA graphs), both backends in one run, 2026-11-29 20:55 UTC, kernel
time with host time excluded, and the probes in ``h200-ostage-probe.log``,
``h200-dynamic-probes.log`` and ``h200-gluon-tma-persistent-probes.log``:

* page size < 16: Triton's kernels beat cuDNN's paged kernel (page 1: 1.72-1.74x; page 4: 1.81x,
  page 8: 1.13x);
* fp8 KV cache (cuDNN 9.19 refuses fp8 attention on Hopper): Triton;
* where the Hopper Gluon kernel serves the call (``triton_backend.runs_gluon``) with Dqk = Dvo and
  at least 512 query tokens in the longest sequence, or head dim 64: Triton (llama8b_b16_q1k
  1.05x, b4_q4k 1.06-1.09x, q16k 1.09-1.10x, chunked_b8_q512_p7680 1.08-1.09x, varlen 1.11-1.12x,
  llama70b 1.07x, non-causal 1.09-1.11x, page64 1.00x / 0.99x, head dim 64 1.08-1.23x);
* everything else: cuDNN. Dqk 192 / Dvo 128 measured 0.92-0.98x across runs, and prefills shorter
  than 512 query tokens were not measured.

Anything cuDNN cannot serve (a head dim it refuses, no graph built yet during CUDA graph capture,
package missing) falls through to the next backend in the list.
"""

from __future__ import annotations

from pagedprefill.api import PrefillBatch


def _gluon_serves(batch: PrefillBatch) -> bool:
    try:
        from pagedprefill.backends import triton_backend
    except ImportError:  # no Triton installed
        return False
    return triton_backend.runs_gluon(batch)


def order(batch: PrefillBatch) -> list[str]:
    triton_first = (
        (batch.paged and batch.page_size < 16) or batch.q.dtype.itemsize == 1 or batch.k.dtype.itemsize == 1
    ) or (
        batch.head_dim_qk == batch.head_dim_vo
        and (batch.max_q >= 512 or batch.head_dim_qk == 64)
        and _gluon_serves(batch)
    )
    return ["triton", "cudnn", "torch"] if triton_first else ["cudnn", "triton", "torch"]
