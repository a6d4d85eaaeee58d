"""Which backend ``backend="auto"`` tries first on a CUDA device.

From the H200 measurements recorded in ``bench/results/h200-ownrows.json`` (eager) and
``h200-graph-ownrows.json`` (CUDA graphs), both backends in one run, 2026-11-29 22:03 UTC, kernel
time with host time excluded (Triton / cuDNN, CUDA graphs / eager), and the probes in
``h200-probe-2026-11-29.log``, ``h200-ostage-probe.log`` and ``h200-dynamic-probes.log``:

* page size < 16: Triton's kernels beat cuDNN's paged kernel (page 1: 1.83x; page 4: 1.81x,
  page 8: 1.13x);
* fp8 KV cache (cuDNN 9.19 refuses fp8 attention on Hopper): Triton;
* where the Hopper Gluon kernel serves the call (``triton_backend.runs_gluon``) with Dqk = Dvo and
  at least 512 query tokens in the longest sequence, or head dim 64: Triton (llama8b_b16_q1k
  1.07x / 1.09x, b4_q4k 1.11x, q16k 1.13x / 1.14x, chunked_b8_q512_p7680 1.12x / 1.07x, varlen
  1.14x / 1.15x, llama70b 1.08x / 1.10x, non-causal 1.09x / 1.10x, page64 1.01x / 1.04x, head dim
  64 1.08-1.23x);
* causal Dqk 192 / Dvo 128 (MLA) with at least 512 query tokens, where the Gluon kernel serves it:
  Triton (mla192_b4_q4k 1.06x / 1.05x);
* everything else: cuDNN. Prefills shorter than 512 query tokens and non-causal Dqk 192 were not
  measured.

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
        (batch.head_dim_qk == batch.head_dim_vo or batch.causal)
        and (batch.max_q >= 512 or batch.head_dim_qk == 64)
        and _gluon_serves(batch)
    )
    return ["triton", "cudnn", "torch"] if triton_first else ["cudnn", "triton", "torch"]
