"""The prefill as PyTorch custom ops: ``torch.compile(fullgraph=True)`` traces through them.

``torch.ops.pagedprefill.batch_prefill`` (the one-shot call) and ``torch.ops.pagedprefill.plan_run``
(a plan's per-layer run) write into caller-given ``out`` (and ``lse``) and return nothing; the
functions below allocate the outputs first and return ``(out, lse)``::

    from pagedprefill import ops

    plan = pagedprefill.plan(workspace, ...)        # outside the compiled region, once per batch

    @torch.compile(fullgraph=True)
    def attention(q, k_cache, v_cache):
        out, _ = ops.plan_run(plan, q, k_cache, v_cache)
        return out

Inside the ops every argument is checked and dispatched exactly as in the eager functions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pagedprefill import api, normalise
from pagedprefill.batch import fail
from pagedprefill.prefill_plan import PLANS, PrefillPlan, device_scale

__all__ = ["batch_prefill_with_kv_cache", "plan_run"]


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
    window_left: int,
    logits_soft_cap: float,
    sinks: Tensor | None,
) -> None:
    api.cudnn_batch_prefill_with_kv_cache(
        q,
        k_cache,
        v_cache,
        scale,
        workspace_buffer,
        max_token_per_sequence=max_token_per_sequence,
        max_sequence_kv=max_sequence_kv,
        actual_seq_lens_q=actual_seq_lens_q,
        actual_seq_lens_kv=actual_seq_lens_kv,
        block_tables=block_tables,
        causal=causal,
        return_lse=lse is not None,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        batch_offsets_q=batch_offsets_q,
        batch_offsets_o=batch_offsets_o,
        batch_offsets_k=batch_offsets_k,
        batch_offsets_v=batch_offsets_v,
        batch_offsets_stats=batch_offsets_stats,
        batch_offsets_units=batch_offsets_units,
        out=out,
        lse=lse,
        is_cuda_graph_compatible=is_cuda_graph_compatible,
        backend=backend,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
    )


@_batch_prefill.register_fake
def _(*args, **kwargs) -> None:
    return None


def _out_like(q: object, v_cache: object, o_data_type, out: object) -> torch.dtype:
    """Checks the one-shot path needs before allocating: q and v_cache are tensors, the out dtype."""
    normalise.check_tensor("q", q, 3)
    if not isinstance(v_cache, Tensor):
        raise fail("v_cache", "a torch.Tensor", type(v_cache).__name__)
    dtype = normalise.resolve_out_dtype(q.dtype, o_data_type, out)
    if isinstance(out, Tensor) and out.dtype != dtype:
        raise fail("out", f"dtype {dtype} (o_data_type)", out.dtype)
    return dtype


def _scale_operand(name: str, s: object, device: torch.device) -> object:
    """A q / k / v scale as the op's schema takes it: a float (as the eager functions take it) as a
    one-element float32 tensor; tensors and None as they are (checked inside the op)."""
    return device_scale(s, device) if normalise.number_scale(name, s) else s


def _scales(q: Tensor, q_scale: object, k_scale: object, v_scale: object) -> tuple:
    return tuple(
        _scale_operand(n, x, q.device) for n, x in zip(("q_scale", "k_scale", "v_scale"), (q_scale, k_scale, v_scale))
    )


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
    q_scale: Tensor | float | None = None,
    k_scale: Tensor | float | None = None,
    v_scale: Tensor | float | None = None,
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
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`pagedprefill.batch_prefill_with_kv_cache` through the custom op (same arguments,
    checked as there; float scales reach the op as one-element float32 tensors).

    Outputs not given are allocated here: out (q rows, Hq, Dvo) zero-filled; lse (B,
    max_token_per_sequence, Hq), or (q rows, Hq) with ``batch_offsets_stats``, filled with -inf.
    Offsets that place rows beyond q's rows need caller-given buffers."""
    if lse is not None and not return_lse:  # (as the eager function: never silently ignored)
        raise fail("lse", "None when return_lse=False", "a tensor")
    dtype = _out_like(q, v_cache, o_data_type, out)
    # (checked before the op's schema converts them: an int causal or a float window would pass it)
    if not isinstance(causal, torch.SymBool):
        causal = normalise.bool_arg("causal", causal)
    if not isinstance(window_left, torch.SymInt) and not isinstance(logits_soft_cap, torch.SymFloat):
        window_left, logits_soft_cap = normalise.variant_args(window_left, logits_soft_cap)
    q_scale, k_scale, v_scale = _scales(q, q_scale, k_scale, v_scale)
    if out is None:
        out = torch.zeros((q.shape[0], q.shape[1], v_cache.shape[-1]), dtype=dtype, device=q.device)
    if return_lse and lse is None:
        if not isinstance(actual_seq_lens_q, Tensor):
            raise fail("actual_seq_lens_q", "a (B,) int tensor of query lengths", type(actual_seq_lens_q).__name__)
        rows = (
            (q.shape[0],) if batch_offsets_stats is not None else (actual_seq_lens_q.shape[0], max_token_per_sequence)
        )
        lse = torch.full((*rows, q.shape[1]), -math.inf, dtype=torch.float32, device=q.device)
    _batch_prefill(
        q,
        k_cache,
        v_cache,
        float(scale),
        workspace_buffer,
        max_token_per_sequence,
        max_sequence_kv,
        actual_seq_lens_q,
        actual_seq_lens_kv,
        block_tables,
        causal,
        q_scale,
        k_scale,
        v_scale,
        batch_offsets_q,
        batch_offsets_o,
        batch_offsets_k,
        batch_offsets_v,
        batch_offsets_stats,
        batch_offsets_units,
        out,
        lse if return_lse else None,
        is_cuda_graph_compatible,
        "auto" if backend is None else backend,
        window_left,
        float(logits_soft_cap),
        sinks,
    )
    return out, (lse if return_lse else None)


@torch.library.custom_op("pagedprefill::plan_run", mutates_args=("out", "lse"))
def _plan_run(
    plan_id: int,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor,
    lse: Tensor | None,
    q_scale: Tensor | None,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    sinks: Tensor | None,
) -> None:
    plan = PLANS.get(plan_id)
    if plan is None:
        raise RuntimeError(f"pagedprefill plan {plan_id} no longer exists (keep the plan alive while it runs)")
    plan.run(
        q,
        k_cache,
        v_cache,
        out,
        lse,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
        return_lse=lse is not None,
    )


@_plan_run.register_fake
def _(*args, **kwargs) -> None:
    return None


def plan_run(
    plan: PrefillPlan,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor | None = None,
    lse: Tensor | None = None,
    *,
    q_scale: Tensor | float | None = None,
    k_scale: Tensor | float | None = None,
    v_scale: Tensor | float | None = None,
    sinks: Tensor | None = None,
    return_lse: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``plan.run(...)`` through the custom op (allocates out / lse like ``plan.run``)."""
    if not isinstance(plan, PrefillPlan):
        raise fail("plan", "a pagedprefill.PrefillPlan", type(plan).__name__)
    pid = plan.op_id
    seq = plan.seq
    dtype = _out_like(q, v_cache, plan.o_data_type, out)
    q_scale, k_scale, v_scale = _scales(q, q_scale, k_scale, v_scale)
    if out is None:
        rows = normalise.alloc_rows(seq, q.shape[0], "o")
        out = torch.zeros((rows, q.shape[1], v_cache.shape[-1]), dtype=dtype, device=q.device)
    if return_lse is None:
        return_lse = plan.default_return_lse
    if lse is not None and not return_lse:  # (as plan.run: never silently ignored)
        raise fail("lse", "None when return_lse=False", "a tensor")
    if return_lse and lse is None:
        shape = (
            (normalise.alloc_rows(seq, q.shape[0], "stats"), seq.num_qo_heads)
            if seq.lse == "packed"
            else (seq.batch_size, seq.max_q, seq.num_qo_heads)
        )
        lse = torch.full(shape, -math.inf, dtype=torch.float32, device=q.device)
    _plan_run(pid, q, k_cache, v_cache, out, lse if return_lse else None, q_scale, k_scale, v_scale, sinks)
    return out, (lse if return_lse else None)
