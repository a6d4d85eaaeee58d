"""The public functions: FlashInfer's one-shot ``cudnn_batch_prefill_with_kv_cache`` and
:func:`plan` (plan once per batch, run per layer).

Both are thin: :mod:`pagedprefill.normalise` checks every argument, :mod:`pagedprefill.dispatch`
picks the backend, :class:`pagedprefill.prefill_plan.PrefillPlan` runs it. A one-shot call whose signature
matches an earlier one (:mod:`pagedprefill.plan_cache`) skips straight to the launch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from pagedprefill import dispatch, normalise, plan_cache
from pagedprefill.batch import DeviceVectors, fail
from pagedprefill.prefill_plan import PrefillPlan

__all__ = [
    "batch_prefill_with_kv_cache",
    "clear_caches",
    "cudnn_batch_prefill_with_kv_cache",
    "plan",
]

_SCALAR_TYPES: frozenset = frozenset((bool, int, float, str, type(None), torch.dtype))
try:  # (numpy's scalars, as lengths and scales computed with numpy arrive: their calls are cached too)
    import numpy as _np

    _SCALAR_TYPES |= {_np.int32, _np.int64, _np.float32, _np.float64}
except ImportError:
    pass


def cudnn_batch_prefill_with_kv_cache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
    workspace_buffer: Tensor,
    *,
    max_token_per_sequence: int,
    max_sequence_kv: int,
    actual_seq_lens_q: Tensor | None = None,
    actual_seq_lens_kv: Tensor | None = None,
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
    backend: str | None = None,
    o_data_type: torch.dtype | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Batched prefill attention over a paged (or ragged) KV cache.

    Drop-in for FlashInfer's ``flashinfer.prefill.cudnn_batch_prefill_with_kv_cache``. For per-layer
    calls over one batch, :func:`plan` then ``plan.run`` costs less host time (everything but the
    layer's tensors is checked once); a repeated one-shot call with the same lengths is also cheap.

    Args:
        q: (total_q_tokens, Hq, Dqk) fp16 / bf16 / fp32 / fp8; last dim unit stride.
        k_cache, v_cache: paged (num_pages, Hkv, page_size, Dqk / Dvo) when ``block_tables`` is
            given (NHD storage as ``.permute(0, 2, 1, 3)``, HND, or two views of one interleaved
            buffer all work), else ragged (total_kv_tokens, Hkv, Dqk / Dvo).
        scale: softmax scale applied to q·kᵀ (typically 1/sqrt(Dqk)).
        workspace_buffer: byte buffer on q's device for metadata and backend scratch (128 MiB is
            plenty); too small raises ``ValueError`` with the bytes needed. One call at a time.
        max_token_per_sequence: upper bound of ``actual_seq_lens_q`` (s_qo_max).
        max_sequence_kv: upper bound of ``actual_seq_lens_kv`` (s_kv_max).
        actual_seq_lens_q, actual_seq_lens_kv: (B,) or (B,1,1,1) int32/int64, on the CPU (validated)
            or on q's device (never read back: clamped on the device; no host sync). As in
            FlashInfer, either may be None with ``batch_offsets_units="tokens"``: q's lengths are
            then the differences of ``batch_offsets_q``, and (ragged K/V) the KV lengths those of
            ``batch_offsets_k`` (sequences packed back to back; computed at every call, on the
            offsets' device).
        block_tables: (B, max_pages_per_seq) int32; row b lists sequence b's pages in order.
        causal: bottom-right aligned causal mask (query i sees keys j <= i + kv_len - q_len).
        return_lse: also return the natural-log log-sum-exp of the scaled logits.
        q_scale, k_scale, v_scale: one-element float32 tensors (or floats): real = stored × scale.
            Required for fp8 tensors.
        batch_offsets_q/_o/_k/_v/_stats: (B+1,) or (B+1,1,1,1) int32/int64 start offsets of each
            sequence, in ``batch_offsets_units``: "elements" (token × H × D of that tensor; stats:
            token × Hq) or "tokens". Absent: prefix sums of the lengths (o defaults to q's, v to
            k's offsets).
        out: optional (rows, Hq, Dvo) output; rows that belong to no sequence are never written.
            Required with ``batch_offsets_o`` on the device other than q's (an allocated out has q's
            rows, and device offsets are never read back).
        lse: optional float32 LSE buffer: (B, max_token_per_sequence, Hq), or any contiguous
            buffer addressed by ``batch_offsets_stats`` (required when those are on the device,
            unless they are q's offsets in tokens).
        is_cuda_graph_compatible: lengths/offsets/tables live on the device; no host sync, and no
            allocation when out (and lse) are given; safe to capture with ``torch.cuda.graph``.
        backend: "auto" / None (fastest correct backend for the call), "cudnn", "triton", "torch".
        o_data_type: output dtype; default: out's dtype when out is given, else q.dtype (bf16 for fp8 q).
        window_left: sliding window: with w >= 0, query i (position p = i + kv_len - q_len) sees only
            keys j >= p - w. -1: off.
        logits_soft_cap: with c > 0, logits are c·tanh(logit / c) (Gemma). 0: off.
        sinks: float32 (Hq,) per-head logits joining every row's softmax denominator (gpt-oss);
            finite, or -inf for no sink. NaN and +inf are not checked (that would read the device
            tensor back) and give backend-dependent rows.

    Returns:
        (out, lse): lse is None unless ``return_lse``. Rows with no visible key get out 0 and lse
        -inf (the sink with ``sinks``).
    """
    if batch_offsets_units == "tokens":  # (FlashInfer's lengths from token indptrs)
        if actual_seq_lens_q is None and batch_offsets_q is not None:
            actual_seq_lens_q = normalise.lengths_of("batch_offsets_q", batch_offsets_q)
        if actual_seq_lens_kv is None and block_tables is None and batch_offsets_k is not None:
            actual_seq_lens_kv = normalise.lengths_of("batch_offsets_k", batch_offsets_k)
    offsets = (batch_offsets_q, batch_offsets_o, batch_offsets_k, batch_offsets_v, batch_offsets_stats)
    scales = (q_scale, k_scale, v_scale)
    scalars = (
        scale,
        max_token_per_sequence,
        max_sequence_kv,
        causal,
        return_lse,
        batch_offsets_units,
        is_cuda_graph_compatible,
        backend,
        o_data_type,
        window_left,
        logits_soft_cap,
    )
    key = None
    types = tuple(map(type, scalars))
    if _SCALAR_TYPES.issuperset(types):
        key = plan_cache.signature(
            (q, k_cache, v_cache, out, lse, workspace_buffer, block_tables, sinks),
            (actual_seq_lens_q, actual_seq_lens_kv, *offsets),
            scales,
            scalars,
            types,
        )
    hit = plan_cache.get(key)
    if hit is None:
        p, lp, ws = _plan_call(
            q,
            k_cache,
            v_cache,
            scale,
            workspace_buffer,
            max_token_per_sequence,
            max_sequence_kv,
            actual_seq_lens_q,
            actual_seq_lens_kv,
            block_tables,
            causal,
            return_lse,
            scales,
            offsets,
            batch_offsets_units,
            out,
            lse,
            is_cuda_graph_compatible,
            backend,
            o_data_type,
            window_left,
            logits_soft_cap,
            sinks,
        )
        plan_cache.put(key, (p, lp))
    else:
        p, lp = hit
        ws = workspace_buffer
        if ws.dtype is not torch.uint8 or ws.dim() != 1:  # (the layout is the first call's: contiguous)
            ws = ws.view(-1).view(torch.uint8) if ws.numel() else ws
    if p.seq.host is None:
        vectors = _call_vectors(p.vectors, actual_seq_lens_q, actual_seq_lens_kv, offsets)
    else:
        vectors = None
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise fail(
                "is_cuda_graph_compatible",
                "True (with lengths, offsets and tables on the device) when the call is captured in a CUDA "
                "graph; host lengths would be baked into the graph",
                is_cuda_graph_compatible,
            )
        if block_tables is not None and block_tables.device.type == "cpu":
            normalise.check_page_ids(block_tables, p.seq, lp.batch.num_pages)
    return p.execute(lp, q, k_cache, v_cache, out, lse, scales, sinks, ws, block_tables, vectors)


def _plan_call(
    q,
    k_cache,
    v_cache,
    scale,
    workspace_buffer,
    max_q,
    max_kv,
    lens_q,
    lens_kv,
    block_tables,
    causal,
    return_lse,
    scales,
    offsets,
    units,
    out,
    lse,
    graph_mode,
    backend,
    o_data_type,
    window_left,
    soft_cap,
    sinks,
):
    """The full path of a one-shot call: every argument checked, the plan and its layout made."""
    backend = dispatch.check_backend(backend)
    return_lse = normalise.bool_arg("return_lse", return_lse)
    paged = block_tables is not None
    q, k, v, shape = normalise.layer_tensors(q, k_cache, v_cache, paged)
    ws = normalise.check_workspace(workspace_buffer, q.device)
    seq, vectors, pages = normalise.sequences(
        device=q.device,
        num_qo_heads=shape.num_qo_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim_qk=shape.head_dim_qk,
        head_dim_vo=shape.head_dim_vo,
        page_size=shape.page_size,
        actual_seq_lens_q=lens_q,
        actual_seq_lens_kv=lens_kv,
        max_token_per_sequence=max_q,
        max_sequence_kv=max_kv,
        block_tables=block_tables,
        offsets=dict(zip(normalise.OFFSET_NAMES, offsets)),
        batch_offsets_units=units,
        scale=scale,
        causal=causal,
        return_lse=return_lse,
        window_left=window_left,
        logits_soft_cap=soft_cap,
        is_cuda_graph_compatible=graph_mode,
    )
    table = pages.get("block_tables")
    if table is not None:
        normalise.check_page_ids(table, seq, shape.num_pages)
    # the cached plan keeps no caller tensor: the call's block table and device vectors are passed
    # again at every run (only the device copies it made of host vectors stay with it)
    p = PrefillPlan(
        seq,
        _plan_owned(vectors, (lens_q, lens_kv, *offsets)),
        None,
        device=q.device,
        backend=backend,
        workspace_buffer=None,
        o_data_type=o_data_type,
    )
    lp = p.layer(q, k, v, out, lse, scales, sinks, return_lse, ws, vectors)
    return p, lp, ws


def _plan_owned(vectors: DeviceVectors | None, given: tuple) -> DeviceVectors | None:
    """``vectors`` without the caller's own device tensors (None in their place): a tensor that is
    one of them, or a view of what one of them views (a 1-D view of a caller's buffer, reshaped,
    has that buffer as its base), would keep the caller's memory alive in the cache."""
    if vectors is None:
        return None
    caller = set()
    for t in given:
        if isinstance(t, Tensor) and not t.is_cpu:
            caller.add(id(t))
            if t._base is not None:
                caller.add(id(t._base))

    def own(t):
        if t is None or id(t) in caller or (t._base is not None and id(t._base) in caller):
            return None
        return t

    return DeviceVectors(
        own(vectors.lens_q),
        own(vectors.lens_kv),
        {n: own(t) for n, t in vectors.offsets.items()},
        vectors.kv_indptr,
        vectors.kv_last_page_len,
        vectors.units,
    )


def _call_vectors(planned: DeviceVectors, lens_q, lens_kv, offsets) -> DeviceVectors:
    """This call's device lengths / offsets (a CPU one among them: the plan's device copy of it)."""

    def pick(t, mine):  # (mine: the plan's copy; a 1-D tensor as it is: reshape would make a new view)
        if t is None or t.is_cpu:
            return mine
        return t if t.dim() == 1 else t.reshape(-1)

    offs = {}
    for name, t in zip(normalise.OFFSET_NAMES, offsets):
        if name in planned.offsets:
            offs[name] = pick(t, planned.offsets[name])
    return DeviceVectors(
        pick(lens_q, planned.lens_q),
        pick(lens_kv, planned.lens_kv),
        offs,
        planned.kv_indptr,
        planned.kv_last_page_len,
        planned.units,
    )


def batch_prefill_with_kv_cache(
    *args: Any, backend: str | None = "auto", **kwargs: Any
) -> tuple[Tensor, Tensor | None]:
    """An alias of :func:`cudnn_batch_prefill_with_kv_cache` under a name that does not say cuDNN (its
    ``backend=None`` means ``"auto"`` too): the same arguments, shapes and results."""
    return cudnn_batch_prefill_with_kv_cache(*args, backend=backend, **kwargs)


def plan(
    workspace_buffer: Tensor,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim_qk: int,
    head_dim_vo: int | None = None,
    page_size: int = 0,
    actual_seq_lens_q: Tensor,
    actual_seq_lens_kv: Tensor | None = None,
    max_token_per_sequence: int | None = None,
    max_sequence_kv: int | None = None,
    block_tables: Tensor | None = None,
    kv_indptr: Tensor | None = None,
    kv_indices: Tensor | None = None,
    kv_last_page_len: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    batch_offsets_q: Tensor | None = None,
    batch_offsets_o: Tensor | None = None,
    batch_offsets_k: Tensor | None = None,
    batch_offsets_v: Tensor | None = None,
    batch_offsets_stats: Tensor | None = None,
    batch_offsets_units: str = "elements",
    return_lse: bool = False,
    o_data_type: torch.dtype | None = None,
    is_cuda_graph_compatible: bool = False,
    backend: str | None = "auto",
    disable_split_kv: bool = False,
) -> PrefillPlan:
    """Plan a batch once; ``plan.run(q, k_cache, v_cache, ...)`` per layer.

    Everything fixed for the batch is checked here, once: lengths (CPU: validated, the metadata made
    and copied to the device now; device: computed on the device at every run, never read back),
    offsets, the page table (``block_tables`` (B, max_pages) int32, or FlashInfer's CSR form:
    ``kv_indptr`` (B+1,), ``kv_indices``, ``kv_last_page_len`` (B,)), bounds, heads, head dims,
    page size (0: ragged K/V), causal, scale, the variants, the backend and the workspace. A run
    checks only the layer's tensors against the plan and launches; device lengths, offsets and page
    ids are read at every run, so a plan with device tensors may be captured in a CUDA graph and
    replayed after their contents change. Page ids on the CPU are copied here, once (as in
    FlashInfer's ``plan``): a later change to that tensor does not reach the runs.

    Args mirror :func:`cudnn_batch_prefill_with_kv_cache`; ``scale`` defaults to 1/sqrt(head_dim_qk),
    ``max_token_per_sequence`` / ``max_sequence_kv`` to the lengths' maxima when they are on the
    host (required with device lengths). ``return_lse`` sets the default of ``run``.
    ``disable_split_kv=True`` (FlashInfer's name): no backend splits a sequence's keys across
    programs (the Triton backend's split-KV, chosen for small grids over long keys, stays off), so a
    row's result does not depend on how the batch around it is split.
    """
    if not isinstance(workspace_buffer, Tensor):
        raise fail(
            "workspace_buffer",
            "a torch.Tensor byte buffer on the device the plan will run on",
            type(workspace_buffer).__name__,
        )
    device = workspace_buffer.device
    if device.type not in ("cpu", "cuda"):  # (the plan runs where its workspace is)
        raise fail("workspace_buffer", "a buffer on the CPU or a CUDA device (where the plan runs)", f"one on {device}")
    ws = normalise.check_workspace(workspace_buffer, device)
    hq = normalise.int_arg("num_qo_heads", num_qo_heads, 1)
    hkv = normalise.int_arg("num_kv_heads", num_kv_heads, 1)
    if hq % hkv:
        raise fail("num_qo_heads", f"a multiple of num_kv_heads = {hkv} (GQA/MQA)", hq)
    dqk = normalise.int_arg("head_dim_qk", head_dim_qk, 1)
    dvo = dqk if head_dim_vo is None else normalise.int_arg("head_dim_vo", head_dim_vo, 1)
    ps = normalise.int_arg("page_size", page_size, 0)
    if scale is None:
        scale = 1.0 / math.sqrt(dqk)
    csr = kv_indptr is not None
    if (block_tables is not None or csr) and ps == 0:
        raise fail("page_size", "the page size (> 0) of the paged cache the page table addresses", 0)
    max_q = (
        max_token_per_sequence
        if max_token_per_sequence is not None
        else normalise.host_max("max_token_per_sequence", "actual_seq_lens_q", actual_seq_lens_q)
    )
    if max_sequence_kv is not None:
        max_kv = max_sequence_kv
    elif csr:
        max_kv = normalise.csr_max(kv_indptr, kv_last_page_len, ps)
    else:
        max_kv = normalise.host_max("max_sequence_kv", "actual_seq_lens_kv", actual_seq_lens_kv)
    offsets = dict(
        q=batch_offsets_q, o=batch_offsets_o, k=batch_offsets_k, v=batch_offsets_v, stats=batch_offsets_stats
    )
    seq, vectors, pages = normalise.sequences(
        device=device,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim_qk=dqk,
        head_dim_vo=dvo,
        page_size=ps,
        actual_seq_lens_q=actual_seq_lens_q,
        actual_seq_lens_kv=actual_seq_lens_kv,
        max_token_per_sequence=max_q,
        max_sequence_kv=max_kv,
        block_tables=block_tables,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_len=kv_last_page_len,
        offsets=offsets,
        batch_offsets_units=batch_offsets_units,
        scale=scale,
        causal=causal,
        return_lse=True,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        is_cuda_graph_compatible=is_cuda_graph_compatible,
    )
    return_lse = normalise.bool_arg("return_lse", return_lse)
    page_tensor = pages.get("block_tables", pages.get("kv_indices"))
    p = PrefillPlan(
        seq,
        vectors,
        page_tensor,
        device=device,
        backend=backend,
        workspace_buffer=ws,
        o_data_type=o_data_type,
        return_lse=return_lse,
        split_kv=not normalise.bool_arg("disable_split_kv", disable_split_kv),
    )
    return p


def clear_caches() -> None:
    """Forget every cached call plan and what the loaded backends cache (cuDNN's built graphs) (tests;
    after changing backend knobs)."""
    plan_cache.clear()
    dispatch.clear_backend_caches()


def last_backend() -> str | None:
    """The backend that served the most recent successful call in this thread (e.g. what "auto"
    picked), or None before the first call."""
    return dispatch.last_backend()
