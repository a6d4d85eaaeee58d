"""The prefill as a PyTorch custom op: ``torch.compile`` traces through it without a graph break.

``torch.ops.pagedprefill.batch_prefill`` writes into caller-given ``out`` (and ``lse``) and returns
nothing; :func:`batch_prefill_with_kv_cache` below allocates the outputs first, so it takes the same
arguments as :func:`pagedprefill.batch_prefill_with_kv_cache` and returns ``(out, lse)``::

    from pagedprefill.ops import batch_prefill_with_kv_cache

    @torch.compile(fullgraph=True)
    def attention(q, k_cache, v_cache, ...):
        out, lse = batch_prefill_with_kv_cache(q, k_cache, v_cache, scale, workspace, ...)
        return out

Inside the op every argument is checked and dispatched exactly as in the eager function.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pagedprefill import api

__all__ = ["batch_prefill_with_kv_cache"]


@torch.library.custom_op("pagedprefill::batch_prefill", mutates_args=("out", "lse", "workspace_buffer"))
def _batch_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
    workspace_buffer: Tensor,
    max_token_per_sequence: int,
    max_sequence_kv: int,
    actual_seq_lens_q: Tensor,
    actual_seq_lens_kv: Tensor,
    block_tables: Tensor | None,
    causal: bool,
    q_scale: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    batch_offsets_q: Tensor | None,
    batch_offsets_o: Tensor | None,
    batch_offsets_k: Tensor | None,
    batch_offsets_v: Tensor | None,
    batch_offsets_stats: Tensor | None,
    batch_offsets_units: str,
    out: Tensor,
    lse: Tensor | None,
    is_cuda_graph_compatible: bool,
    backend: str,
) -> None:
    api.cudnn_batch_prefill_with_kv_cache(
        q, k_cache, v_cache, scale, workspace_buffer,
        max_token_per_sequence=max_token_per_sequence, max_sequence_kv=max_sequence_kv,
        actual_seq_lens_q=actual_seq_lens_q, actual_seq_lens_kv=actual_seq_lens_kv,
        block_tables=block_tables, causal=causal, return_lse=lse is not None,
        q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        batch_offsets_q=batch_offsets_q, batch_offsets_o=batch_offsets_o,
        batch_offsets_k=batch_offsets_k, batch_offsets_v=batch_offsets_v,
        batch_offsets_stats=batch_offsets_stats, batch_offsets_units=batch_offsets_units,
        out=out, lse=lse, is_cuda_graph_compatible=is_cuda_graph_compatible, backend=backend,
    )  # fmt: skip


@_batch_prefill.register_fake
def _(*args, **kwargs) -> None:
    return None


def batch_prefill_with_kv_cache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
    workspace_buffer: Tensor,
    *,
    max_token_per_sequence: int,
    max_sequence_kv: int,
    actual_seq_lens_q: Tensor,
    actual_seq_lens_kv: Tensor,
    block_tables: Tensor | None = None,
    causal: bool,
    return_lse: bool,
    q_scale: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    batch_offsets_q: Tensor | None = None,
    batch_offsets_o: Tensor | None = None,
    batch_offsets_k: Tensor | None = None,
    batch_offsets_v: Tensor | None = None,
    batch_offsets_stats: Tensor | None = None,
    batch_offsets_units: str = "elements",
    out: Tensor | None = None,
    lse: Tensor | None = None,
    is_cuda_graph_compatible: bool = False,
    backend: str | None = "auto",
    o_data_type: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`pagedprefill.batch_prefill_with_kv_cache` through the custom op (same arguments).

    Outputs not given are allocated here: out (q rows, Hq, Dvo) zero-filled; lse (B,
    max_token_per_sequence, Hq), or (q rows, Hq) with ``batch_offsets_stats``, filled with -inf.
    Offsets that place rows beyond q's rows need caller-given buffers.
    """
    if out is not None and o_data_type is not None and out.dtype != o_data_type:
        raise ValueError(f"out: expected dtype {o_data_type} (o_data_type), got {out.dtype}")
    if out is None:
        dtype = o_data_type or (torch.bfloat16 if q.element_size() == 1 else q.dtype)
        out = torch.zeros((q.shape[0], q.shape[1], v_cache.shape[-1]), dtype=dtype, device=q.device)
    if return_lse and lse is None:
        rows = (
            (q.shape[0],)
            if batch_offsets_stats is not None
            else (actual_seq_lens_q.shape[0], max_token_per_sequence)
        )
        lse = torch.full((*rows, q.shape[1]), -math.inf, dtype=torch.float32, device=q.device)
    _batch_prefill(
        q, k_cache, v_cache, float(scale), workspace_buffer, max_token_per_sequence, max_sequence_kv,
        actual_seq_lens_q, actual_seq_lens_kv, block_tables, causal, q_scale, k_scale, v_scale,
        batch_offsets_q, batch_offsets_o, batch_offsets_k, batch_offsets_v, batch_offsets_stats,
        batch_offsets_units, out, lse if return_lse else None, is_cuda_graph_compatible,
        "auto" if backend is None else backend,
    )  # fmt: skip
    return out, (lse if return_lse else None)
