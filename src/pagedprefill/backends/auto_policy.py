"""Which backend ``backend="auto"`` tries first on a CUDA device.

From the H200 measurements recorded in ``bench/results/h200-chunk.json`` (eager) and
``h200-graph-chunk.json`` (CUDA graphs), both backends in one run, 2026-11-29 17:01 UTC, kernel time
with host time excluded, and the probes in ``h200-gluon-tma-persistent-probes.log``:

* page size < 16: Triton's kernels beat cuDNN's paged kernel (page 1: 1.59x eager and in CUDA
  graphs; page 4: 1.81x, page 8: 1.13x);
* fp8 KV cache (cuDNN 9.19 refuses fp8 attention on Hopper): Triton;
* where the Hopper Gluon kernel serves the call (``triton_backend.runs_gluon``) with Dqk = Dvo, and
  the prefill is long (max_q >= 4096: llama8b_b4_q4k 1.02-1.03x, llama8b_b1_q16k 1.05-1.06x), or
  non-causal and max_q >= 2048 (noncausal_b8_q2k 1.06x), or the head dim is 64 (1.08-1.13x): Triton;
* everything else: cuDNN. Shorter causal prefills are within +-2% (chunked, varlen, llama70b) or
  behind (llama8b_b16_q1k 0.94-0.96x, page64 0.91-0.93x), and Dqk 192 / Dvo 128 is 0.90-0.95x.

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
        and (batch.max_q >= 4096 or batch.head_dim_qk == 64 or (not batch.causal and batch.max_q >= 2048))
        and _gluon_serves(batch)
    )
    return ["triton", "cudnn", "torch"] if triton_first else ["cudnn", "triton", "torch"]
