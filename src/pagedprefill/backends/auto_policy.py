"""Which backend ``backend="auto"`` tries first on a CUDA device.

From the H200 measurements recorded in ``bench/results/h200-dynamic.json`` (eager) and
``h200-graph-dynamic.json`` (CUDA graphs), both backends in one run, 2026-11-29 19:46 UTC, kernel
time with host time excluded, and the probes in ``h200-gluon-tma-persistent-probes.log`` and
``h200-dynamic-probes.log``:

* page size < 16: Triton's kernels beat cuDNN's paged kernel (page 1: 1.60x eager and in CUDA
  graphs; page 4: 1.81x, page 8: 1.13x);
* fp8 KV cache (cuDNN 9.19 refuses fp8 attention on Hopper): Triton;
* where the Hopper Gluon kernel serves the call (``triton_backend.runs_gluon``) with Dqk = Dvo, and
  the prefill is longer than 1024 query tokens (the kernel then takes its items off the work
  counter: varlen_b32 1.07-1.10x, llama8b_b4_q4k 1.05-1.08x, llama8b_b1_q16k 1.08-1.11x,
  noncausal_b8_q2k 1.06x, llama70b_b8_q2k 0.99-1.00x), or the head dim is 64 (1.08-1.23x), or a
  chunked prefill that the kernel runs on 128 x 128 tiles (``gluon_sm90.prefers_wide``: max_q >= 512
  and max_kv >= 4 max_q; chunked_b8_q512_p7680 1.10x): Triton;
* everything else: cuDNN. Prompts of up to 1024 tokens are behind (llama8b_b16_q1k 0.92-0.94x,
  page64 0.96-0.97x), and Dqk 192 / Dvo 128 is 0.97-0.98x.

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


def _chunked_on_wide_tiles(batch: PrefillBatch) -> bool:
    from pagedprefill.backends import gluon_sm90

    return (
        batch.causal
        and batch.max_q >= 512
        and batch.max_kv >= 4 * batch.max_q
        and gluon_sm90.prefers_wide(batch)
    )


def order(batch: PrefillBatch) -> list[str]:
    triton_first = (
        (batch.paged and batch.page_size < 16) or batch.q.dtype.itemsize == 1 or batch.k.dtype.itemsize == 1
    ) or (
        batch.head_dim_qk == batch.head_dim_vo
        and (batch.max_q > 1024 or batch.head_dim_qk == 64 or _chunked_on_wide_tiles(batch))
        and _gluon_serves(batch)
    )
    return ["triton", "cudnn", "torch"] if triton_first else ["cudnn", "triton", "torch"]
