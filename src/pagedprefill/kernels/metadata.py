"""The metadata table from device lengths and offsets, without a host sync.

:func:`device_table_torch` is the definition (a handful of torch ops); :func:`device_table_triton`
computes the same table in one Triton launch, which is what CUDA graphs replay. Nothing here is
trusted: every length is clamped to [0, max_*], to the rows of q / out / K / V / lse after each
start offset and to the page table's reach, so kernels never touch memory outside the given tensors
whatever the device tensors hold. Rows follow ``pagedprefill.batch.META_FIELDS``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagedprefill.batch import INT32_MAX
from pagedprefill.kernels.launch import LaunchSlot, fast_launch, triton

if triton is not None:
    import triton.language as tl


@dataclass(frozen=True)
class Bounds:
    """What the device lengths are clamped to, from the call's shapes (host ints)."""

    max_q: int
    max_kv: int
    rows_q: int
    rows_o: int
    rows_k: int  # ragged K rows (0 when paged)
    rows_v: int
    lse_numel: int
    lse_mode: int  # 0 none, 1 padded (B, max_q, Hq), 2 packed (offsets "stats")
    pages: int  # 0 ragged, 1 block table, 2 CSR
    table_width: int  # block table: page ids per sequence
    table_stride: int  # block table: row stride
    num_indices: int  # CSR: entries of kv_indices
    page_size: int
    num_heads: int
    units: dict  # name -> elements per token (1 for token offsets)


def device_table_torch(bounds: Bounds, lens_q, lens_kv, offsets, indptr, last, meta: Tensor) -> None:
    """Fill ``meta`` (8, B) int32 from device vectors with torch ops (the definition)."""
    bd = bounds
    dev = meta.device
    i64 = torch.int64
    lq = lens_q.to(device=dev, dtype=i64).clamp(0, bd.max_q)
    if bd.pages == 2:
        ptr = indptr.to(device=dev, dtype=i64)
        n = (ptr[1:] - ptr[:-1]).clamp(min=0)
        lst = last.to(device=dev, dtype=i64).clamp(1, bd.page_size)
        lkv = torch.where(n > 0, (n - 1) * bd.page_size + lst, 0)
    else:
        lkv = lens_kv.to(device=dev, dtype=i64)
    lkv = lkv.clamp(0, bd.max_kv)

    def starts(name: str, lens: Tensor) -> Tensor:
        t = offsets.get(name)
        if t is None:
            return torch.cumsum(lens, 0) - lens
        t = t[:-1].to(device=dev, dtype=i64)
        return torch.div(t, bd.units[name], rounding_mode="floor").clamp(0, INT32_MAX)

    q_start = starts("q", lq)
    o_start = starts("o", lq) if "o" in offsets else q_start
    lq = torch.minimum(lq, (bd.rows_q - q_start).clamp(min=0))
    lq = torch.minimum(lq, (bd.rows_o - o_start).clamp(min=0))
    zeros = torch.zeros_like(lq)
    b = torch.arange(lq.shape[0], device=dev, dtype=i64)
    if bd.pages == 1:
        k_start = v_start = zeros
        lkv = lkv.clamp(max=bd.table_width * bd.page_size)
        bt_start = b * bd.table_stride
    elif bd.pages == 2:
        k_start = v_start = zeros
        bt_start = ptr[:-1].clamp(0, bd.num_indices)
        lkv = torch.minimum(lkv, (bd.num_indices - bt_start) * bd.page_size)
    else:
        k_start = starts("k", lkv)
        v_start = starts("v", lkv) if "v" in offsets else k_start
        lkv = torch.minimum(lkv, (bd.rows_k - k_start).clamp(min=0))
        lkv = torch.minimum(lkv, (bd.rows_v - v_start).clamp(min=0))
        bt_start = zeros
    if bd.lse_mode == 0:
        lse_start = zeros
    elif bd.lse_mode == 2:
        lse_start = starts("stats", lq) * bd.num_heads
        lq = torch.minimum(lq, torch.div(bd.lse_numel - lse_start, bd.num_heads, rounding_mode="floor").clamp(min=0))
    else:
        lse_start = b * (bd.max_q * bd.num_heads)
    rows = (lq, lkv, q_start, o_start, k_start, v_start, lse_start, bt_start)
    meta.copy_(torch.stack([r.clamp(max=INT32_MAX) for r in rows]))


if triton is not None:
    _INTS = [
        "meta_stride",
        "n_seq",
        "s_lq",
        "s_lkv",
        "s_oq",
        "s_oo",
        "s_ok",
        "s_ov",
        "s_os",
        "s_ip",
        "s_lp",
        "max_q",
        "max_kv",
        "rows_q",
        "rows_o",
        "rows_k",
        "rows_v",
        "lse_numel",
        "table_width",
        "table_stride",
        "num_indices",
        "page_size",
        "unit_q",
        "unit_o",
        "unit_k",
        "unit_v",
        "unit_s",
        "num_heads",
        "lse_b_stride",
    ]

    @triton.jit(do_not_specialize=_INTS)
    def _metadata_kernel(
        META,
        meta_stride,
        n_seq,
        LQ,
        LKV,
        s_lq,
        s_lkv,
        OQ,
        OO,
        OK,
        OV,
        OS,
        s_oq,
        s_oo,
        s_ok,
        s_ov,
        s_os,
        IP,
        LP,
        s_ip,
        s_lp,
        max_q,
        max_kv,
        rows_q,
        rows_o,
        rows_k,
        rows_v,
        lse_numel,
        table_width,
        table_stride,
        num_indices,
        page_size,
        unit_q,
        unit_o,
        unit_k,
        unit_v,
        unit_s,
        num_heads,
        lse_b_stride,
        HAS_OQ: tl.constexpr,
        HAS_OO: tl.constexpr,
        HAS_OK: tl.constexpr,
        HAS_OV: tl.constexpr,
        PAGES: tl.constexpr,
        LSE_MODE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """:func:`device_table_torch` in one program (prefix sums carried across BLOCK-sized chunks)."""
        big = 2147483647
        carry_q = tl.zeros([], tl.int64)
        carry_kv = tl.zeros([], tl.int64)
        for c0 in range(0, n_seq, BLOCK):
            b = c0 + tl.arange(0, BLOCK)
            ok = b < n_seq
            lq = tl.load(LQ + b * s_lq, mask=ok, other=0).to(tl.int64)
            lq = tl.minimum(tl.maximum(lq, 0), max_q)
            if PAGES == 2:
                p0 = tl.load(IP + b * s_ip, mask=ok, other=0).to(tl.int64)
                p1 = tl.load(IP + (b + 1) * s_ip, mask=ok, other=0).to(tl.int64)
                n = tl.maximum(p1 - p0, 0)
                lst = tl.load(LP + b * s_lp, mask=ok, other=1).to(tl.int64)
                lst = tl.minimum(tl.maximum(lst, 1), page_size)
                lkv = tl.where(n > 0, (n - 1) * page_size + lst, 0)
            else:
                lkv = tl.load(LKV + b * s_lkv, mask=ok, other=0).to(tl.int64)
            lkv = tl.minimum(tl.maximum(lkv, 0), max_kv)
            pre_q = carry_q + tl.cumsum(lq, 0) - lq
            pre_kv = carry_kv + tl.cumsum(lkv, 0) - lkv
            carry_q += tl.sum(lq, 0)
            carry_kv += tl.sum(lkv, 0)
            if HAS_OQ:
                qs = tl.load(OQ + b * s_oq, mask=ok, other=0).to(tl.int64) // unit_q
                qs = tl.minimum(tl.maximum(qs, 0), big)
            else:
                qs = pre_q
            if HAS_OO:
                os_ = tl.load(OO + b * s_oo, mask=ok, other=0).to(tl.int64) // unit_o
                os_ = tl.minimum(tl.maximum(os_, 0), big)
            else:
                os_ = qs
            lq = tl.minimum(lq, tl.maximum(rows_q - qs, 0))
            lq = tl.minimum(lq, tl.maximum(rows_o - os_, 0))
            if PAGES == 1:
                ks = tl.zeros_like(lq)
                vs = ks
                lkv = tl.minimum(lkv, table_width * page_size)
                bs = b.to(tl.int64) * table_stride
            elif PAGES == 2:
                ks = tl.zeros_like(lq)
                vs = ks
                bs = tl.minimum(tl.maximum(p0, 0), num_indices)
                lkv = tl.minimum(lkv, (num_indices - bs) * page_size)
            else:
                if HAS_OK:
                    ks = tl.load(OK + b * s_ok, mask=ok, other=0).to(tl.int64) // unit_k
                    ks = tl.minimum(tl.maximum(ks, 0), big)
                else:
                    ks = pre_kv
                if HAS_OV:
                    vs = tl.load(OV + b * s_ov, mask=ok, other=0).to(tl.int64) // unit_v
                    vs = tl.minimum(tl.maximum(vs, 0), big)
                else:
                    vs = ks
                lkv = tl.minimum(lkv, tl.maximum(rows_k - ks, 0))
                lkv = tl.minimum(lkv, tl.maximum(rows_v - vs, 0))
                bs = tl.zeros_like(lq)
            if LSE_MODE == 1:
                ls = b.to(tl.int64) * lse_b_stride
            elif LSE_MODE == 2:
                ls = tl.load(OS + b * s_os, mask=ok, other=0).to(tl.int64) // unit_s
                ls = tl.minimum(tl.maximum(ls, 0), big) * num_heads
                lq = tl.minimum(lq, tl.maximum((lse_numel - ls) // num_heads, 0))
            else:
                ls = tl.zeros_like(lq)
            tl.store(META + b, tl.minimum(lq, big).to(tl.int32), mask=ok)
            tl.store(META + meta_stride + b, tl.minimum(lkv, big).to(tl.int32), mask=ok)
            tl.store(META + 2 * meta_stride + b, tl.minimum(qs, big).to(tl.int32), mask=ok)
            tl.store(META + 3 * meta_stride + b, tl.minimum(os_, big).to(tl.int32), mask=ok)
            tl.store(META + 4 * meta_stride + b, tl.minimum(ks, big).to(tl.int32), mask=ok)
            tl.store(META + 5 * meta_stride + b, tl.minimum(vs, big).to(tl.int32), mask=ok)
            tl.store(META + 6 * meta_stride + b, tl.minimum(ls, big).to(tl.int32), mask=ok)
            tl.store(META + 7 * meta_stride + b, tl.minimum(bs, big).to(tl.int32), mask=ok)

else:
    _metadata_kernel = None


def vector_tensors(lens_q, lens_kv, offsets, indptr, last) -> tuple:
    """The device vectors in the order a kernel takes them: lens_q, lens_kv, the q / o / k / v / stats
    offsets, kv_indptr, kv_last_page_len (an absent one stands in as lens_q)."""
    get = offsets.get
    vecs = [lens_q if (t := get(k)) is None else t for k in ("q", "o", "k", "v", "stats")]
    lkv = lens_kv if lens_kv is not None else lens_q
    ip = indptr if indptr is not None else lens_q
    lp = last if last is not None else lens_q
    return (lens_q, lkv, *vecs, ip, lp)


def launch_tensors(lens_q, lens_kv, offsets, indptr, last, meta: Tensor) -> tuple:
    """The table launch's tensor arguments in order (:func:`vector_tensors` after the table): what a
    :class:`~pagedprefill.kernels.launch.LaunchSlot` bound to it takes."""
    return (meta, *vector_tensors(lens_q, lens_kv, offsets, indptr, last))


def device_table_triton(
    bounds: Bounds,
    lens_q,
    lens_kv,
    offsets,
    indptr,
    last,
    meta: Tensor,
    slot: LaunchSlot | None = None,
) -> None:
    """:func:`device_table_torch` as one Triton launch (Triton must run on meta's device).

    ``slot``: kept by the caller for calls whose bounds and vector layouts are fixed (a plan's
    layout): the launch bound to them after the first call."""
    bd = bounds
    n = meta.shape[1]
    if n == 0:
        return
    tensors = launch_tensors(lens_q, lens_kv, offsets, indptr, last, meta)
    if slot is not None and slot.launch(tensors):
        return
    meta, lens_q, lkv, *vecs, ip, lp = tensors
    names = ("q", "o", "k", "v", "stats")
    strides = [offsets[k].stride(0) if offsets.get(k) is not None else 0 for k in names]
    args = (
        meta,
        meta.stride(0),
        n,
        lens_q,
        lkv,
        lens_q.stride(0),
        lkv.stride(0),
        *vecs,
        *strides,
        ip,
        lp,
        ip.stride(0),
        lp.stride(0),
        bd.max_q,
        bd.max_kv,
        bd.rows_q,
        bd.rows_o,
        bd.rows_k,
        bd.rows_v,
        bd.lse_numel,
        bd.table_width,
        bd.table_stride,
        bd.num_indices,
        max(bd.page_size, 1),
        *(bd.units[k] for k in names),
        bd.num_heads,
        bd.max_q * bd.num_heads,
    )
    kwargs = dict(
        HAS_OQ="q" in offsets,
        HAS_OO="o" in offsets,
        HAS_OK=bd.pages == 0 and "k" in offsets,
        HAS_OV=bd.pages == 0 and "v" in offsets,
        PAGES=bd.pages,
        LSE_MODE=bd.lse_mode,
        BLOCK=1024,
        num_warps=4,
    )
    if slot is not None:
        slot.run(_metadata_kernel, (1,), args, kwargs)
    else:
        fast_launch(_metadata_kernel, (1,), args, kwargs)
