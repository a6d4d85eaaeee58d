"""The per-run work around a cuDNN graph: its int32 metadata rows, our page table, and the rows no
key is visible to.

Rows with no visible key (kv_len 0, or causal rows ``i < q_len - kv_len``) are never handed to cuDNN
(on cuDNN 9.19 it writes NaN for kv_len 0): the lengths and offsets cuDNN sees start each sequence
``skip = q_len - q_len'`` rows later, with ``q_len' = min(q_len, kv_len)`` (causal) or 0 when
``kv_len == 0``; bottom-right alignment is unchanged by the shift. Those rows are written here
(out 0, lse -inf, or the sink with sinks). Everything comes from the metadata table on the device,
so one Triton launch does it all (:func:`prepare_triton`), before the graph; without Triton the same
rows come from torch ops (:func:`prepare_torch`) and the empty rows from a masked fill after it.

Page table entry (b, j) = ``pages[bt_start_b + min(j, last_b)]`` with ``last_b`` sequence b's last
page, clamped to ``[0, num_pages)``: the caller's table width never has to match
``max_sequence_kv / page_size``, and entries past a sequence's last page (which may name freed pages
full of garbage) are never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedprefill.kernels.launch import LaunchSlot, fast_launch, triton

from .graph import GraphSpec, ScratchLayout

if triton is not None:
    import triton.language as tl

# Rows of the int32 metadata block in scratch (each ``layout.row`` entries; padding entries are 0).
# 0..6 are bound to the cuDNN graph; 7..8 build the page table; 9..12 locate the rows to fix.
R_SEQ_Q, R_SEQ_KV, R_OFF_Q, R_OFF_O, R_OFF_K, R_OFF_V, R_OFF_S = range(7)
R_LAST = 7  # paged: index of the sequence's last page in its page list
R_BASE = 8  # paged: flat element offset of the sequence's page list (metadata row bt_start)
R_FIX = 9  # 4 rows: [lo, hi) of the rows to fix in out, then in lse (viewed as (rows, Hq))
FIX_PROGRAMS = 16  # programs per sequence for the rows without keys


@dataclass
class Consts:
    """Device constants of a plan (created once, before any capture; never written)."""

    cols: Tensor  # (1, table_width) int64: page-table column index
    signs: Tensor  # (2, 2 * row) int32: +1 for the range starts, -1 for the range ends (fix-up)
    fp8: Tensor  # (3,) float32: descale_s, scale_s, scale_o


def make_consts(spec: GraphSpec, layout: ScratchLayout, device: torch.device) -> Consts:
    """Built on the CPU, then blocking copies: complete on the device before any stream uses them."""
    row = layout.row
    return Consts(
        cols=torch.arange(max(spec.table_width, 1), dtype=torch.int64).unsqueeze(0).to(device),
        signs=torch.tensor([1, -1], dtype=torch.int32).repeat_interleave(row).repeat(2, 1).to(device),
        fp8=torch.tensor([1.0 / 256.0, 256.0, 1.0], dtype=torch.float32).to(device),
    )


def skipped_rows(spec: GraphSpec, lens_q, lens_kv) -> bool:
    """Whether some row sees no key (host lengths)."""
    if spec.causal:
        return any(a > b for a, b in zip(lens_q, lens_kv))
    return any(a and not b for a, b in zip(lens_q, lens_kv))


def handed_rows(spec: GraphSpec, lens_q, lens_kv) -> int:
    """Rows handed to cuDNN (host lengths); 0 means the graph has nothing to compute."""
    if spec.causal:
        return sum(min(a, b) for a, b in zip(lens_q, lens_kv))
    return sum(a for a, b in zip(lens_q, lens_kv) if b)


if triton is not None:
    _PREP_INTS = [
        "meta_stride",
        "n_seq",
        "n_table",
        "row",
        "width",
        "num_pages",
        "page_size",
        "num_indices",
        "sq0",
        "so0",
        "sk0",
        "sv0",
        "num_heads",
        "stride_ot",
        "stride_oh",
    ]

    @triton.jit(do_not_specialize=_PREP_INTS)
    def _prepare_kernel(
        META,
        meta_stride,
        n_seq,
        n_table,
        INTS,
        row,
        BT,
        TABLE,
        width,
        num_pages,
        page_size,
        num_indices,
        sq0,
        so0,
        sk0,
        sv0,
        num_heads,
        Out,
        stride_ot,
        stride_oh,
        LSE,
        SINKS,
        PAGED: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_LSE: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        FIX: tl.constexpr,
        BLOCK_W: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """Program (b, r), b < ``row``: with r == 0, entry b of metadata rows 0..6 (zeros past the
        batch) and, b < ``n_table``, row b of our page table; every r: the rows of sequence b that see
        no key, rows r, r + R, ... of them. Those rows are exactly the ones cuDNN is told to skip, so
        this may run before the graph."""
        b = tl.program_id(0)
        r = tl.program_id(1)
        real = b < n_seq
        lq = tl.load(META + b, mask=real, other=0)
        lkv = tl.load(META + meta_stride + b, mask=real, other=0)
        if CAUSAL:
            eff = tl.minimum(lq, lkv)
        else:
            eff = tl.where(lkv > 0, lq, 0)
        skip = lq - eff
        e = eff > 0
        if r == 0:
            qs = tl.load(META + 2 * meta_stride + b, mask=real, other=0).to(tl.int64)
            os_ = tl.load(META + 3 * meta_stride + b, mask=real, other=0).to(tl.int64)
            ls = tl.load(META + 6 * meta_stride + b, mask=real, other=0).to(tl.int64)
            sk = skip.to(tl.int64)
            tl.store(INTS + b, eff)
            tl.store(INTS + row + b, tl.where(e, lkv, 0))
            tl.store(INTS + 2 * row + b, tl.where(e, (qs + sk) * sq0, 0).to(tl.int32))
            tl.store(INTS + 3 * row + b, tl.where(e, (os_ + sk) * so0, 0).to(tl.int32))
            if PAGED:
                tl.store(INTS + 4 * row + b, 0)
                tl.store(INTS + 5 * row + b, 0)
                if b < n_table:
                    last = tl.where(e, tl.maximum(lkv - 1, 0) // page_size, 0)
                    base = tl.where(e, tl.load(META + 7 * meta_stride + b, mask=real, other=0).to(tl.int64), 0)
                    for j0 in range(0, width, BLOCK_W):
                        j = j0 + tl.arange(0, BLOCK_W)
                        idx = tl.minimum(base + tl.minimum(j, last), num_indices - 1)
                        page = tl.load(BT + idx, mask=(j < width) & (num_indices > 0), other=0)
                        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
                        tl.store(TABLE + b * width + j, page, mask=j < width)
            else:
                ks = tl.load(META + 4 * meta_stride + b, mask=real, other=0).to(tl.int64)
                vs = tl.load(META + 5 * meta_stride + b, mask=real, other=0).to(tl.int64)
                tl.store(INTS + 4 * row + b, tl.where(e, ks * sk0, 0).to(tl.int32))
                tl.store(INTS + 5 * row + b, tl.where(e, vs * sv0, 0).to(tl.int32))
            if HAS_LSE:
                tl.store(INTS + 6 * row + b, tl.where(e, ls + sk * num_heads, 0).to(tl.int32))
            else:
                tl.store(INTS + 6 * row + b, 0)
        if FIX:
            o_start = tl.load(META + 3 * meta_stride + b, mask=real, other=0)
            lse_start = tl.load(META + 6 * meta_stride + b, mask=real, other=0)
            d = tl.arange(0, BLOCK_D)
            for i in range(r, skip, tl.num_programs(1)):
                o_row = (o_start + i).to(tl.int64) * stride_ot
                for h0 in range(0, num_heads, BLOCK_H):
                    h = h0 + tl.arange(0, BLOCK_H)
                    ptr = Out + o_row + h[:, None].to(tl.int64) * stride_oh + d[None, :]
                    zero = tl.zeros([BLOCK_H, BLOCK_D], Out.dtype.element_ty)
                    tl.store(ptr, zero, mask=(h[:, None] < num_heads) & (d[None, :] < DV))
                    if HAS_LSE:
                        off = lse_start.to(tl.int64) + i * num_heads + h  # < lse.numel() <= 2^31 - 1
                        if HAS_SINKS:
                            fill = tl.load(SINKS + h, mask=h < num_heads, other=0.0)
                        else:
                            fill = tl.full([BLOCK_H], float("-inf"), tl.float32)
                        tl.store(LSE + off, fill, mask=h < num_heads)

else:
    _prepare_kernel = None


def prepare_triton(
    spec,
    layout,
    ints,
    table,
    meta,
    pages,
    out,
    lse,
    sinks,
    batch_size,
    num_indices,
    fix,
    max_q,
    slot: LaunchSlot | None = None,
):
    """Metadata rows 0..6, the page table and (``fix``) the rows without keys, in one launch.

    ``slot``: a :class:`~pagedprefill.kernels.launch.LaunchSlot` the caller keeps for calls of one
    layout: the launch bound to its fixed arguments (and ``num_indices``) after the first call."""
    tensors = (
        meta,
        ints,
        pages if pages is not None else meta,
        table if table is not None else ints,
        out,
        lse if lse is not None else meta,
        sinks if sinks is not None else meta,
    )
    if slot is not None and slot.launch(tensors, num_indices):
        return
    block_d = triton.next_power_of_2(spec.head_dim_vo)
    block_h = max(1, min(triton.next_power_of_2(spec.num_qo_heads), 4096 // block_d))
    grid = (layout.row, min(FIX_PROGRAMS, max(max_q, 1)) if fix else 1)
    args = (
        meta,
        meta.stride(0),
        batch_size,
        spec.batch,
        ints,
        layout.row,
        pages if pages is not None else meta,
        table if table is not None else ints,
        spec.table_width,
        spec.num_pages,
        max(spec.page_size, 1),
        num_indices,
        spec.q_strides[0],
        spec.o_strides[0],
        spec.k_strides[0],
        spec.v_strides[0],
        spec.num_qo_heads,
        out,
        out.stride(0),
        out.stride(1),
        lse if lse is not None else meta,
        sinks if sinks is not None else meta,
    )
    kwargs = dict(
        PAGED=spec.paged,
        CAUSAL=spec.causal,
        HAS_LSE=spec.lse,
        HAS_SINKS=spec.sinks,
        FIX=fix,
        BLOCK_W=1024,
        DV=spec.head_dim_vo,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        num_warps=4,
    )
    if slot is not None:
        slot.run(_prepare_kernel, grid, args, kwargs, num_indices)
    else:
        fast_launch(_prepare_kernel, grid, args, kwargs)


def table_span(pages: Tensor | None) -> int:
    """Entries of the flat page list that ``pages`` spans: a ``(B, width)`` block table of any row
    stride (unit column stride) ends at ``(B - 1) * stride + width``; 0 without page ids."""
    if pages is None or pages.numel() == 0:
        return 0
    if pages.dim() == 1:
        return pages.numel()
    return (pages.shape[0] - 1) * pages.stride(0) + pages.shape[1]


def prepare_torch(spec, layout, consts, ints, table, meta, pages, batch_size, num_indices) -> Tensor:
    """The same rows with torch ops; returns the (4, row) fix ranges for :func:`fill_empty_rows`.
    ``num_indices``: :func:`table_span` of ``pages`` (the entries the flat page offsets address)."""
    row, n = layout.row, batch_size
    m = torch.nn.functional.pad(meta.long(), (0, row - n))  # (8, row)
    lq, lkv, qs, os_, ks, vs, ls, bs = m
    eff = torch.minimum(lq, lkv) if spec.causal else torch.where(lkv > 0, lq, 0)
    skip = lq - eff
    e = eff > 0
    zero = torch.zeros_like(lq)
    hq = spec.num_qo_heads
    rows = [
        eff,
        torch.where(e, lkv, 0),
        torch.where(e, (qs + skip) * spec.q_strides[0], 0),
        torch.where(e, (os_ + skip) * spec.o_strides[0], 0),
    ]
    if spec.paged:
        rows += [zero, zero]
    else:
        rows += [torch.where(e, ks * spec.k_strides[0], 0), torch.where(e, vs * spec.v_strides[0], 0)]
    rows.append(torch.where(e, ls + skip * hq, 0) if spec.lse else zero)
    last = torch.where(e, (lkv - 1).clamp(min=0) // max(spec.page_size, 1), 0)
    base = torch.where(e, bs, 0)
    rows += [last, base, os_, os_ + skip, ls // hq, ls // hq + skip]
    ints.copy_(torch.stack(rows).to(torch.int32))
    if spec.paged:
        if num_indices == 0:  # no page id at all: then every kv_len is 0, and any valid page will do
            table.zero_()
            return ints[R_FIX:]
        bb = spec.batch
        idx = torch.minimum(consts.cols, last[:bb, None]) + base[:bb, None]
        idx = idx.clamp(0, num_indices - 1)
        flat = pages.as_strided((num_indices,), (1,))  # the rows at their own stride (not a copy)
        torch.index_select(flat, 0, idx.view(-1), out=table.view(-1))
        table.clamp_(0, spec.num_pages - 1)
    return ints[R_FIX:]


def fill_empty_rows(spec, consts, out: Tensor, lse: Tensor | None, sinks: Tensor | None, fx: Tensor) -> None:
    """out = 0 and lse = -inf (the sink with sinks) on the rows no key is visible to. ``fx`` (4, n)
    holds, per sequence, the [lo, hi) row range in out and in lse viewed as (rows, Hq). Difference
    arrays mark them: +1 at each lo, -1 at each hi, prefix sum > 0 inside a range."""
    hq = spec.num_qo_heads
    rows_o = out.shape[0]
    n_l = lse.numel() // hq if lse is not None else 0
    top = max(rows_o, n_l)
    marks = torch.zeros((2, top + 1), dtype=torch.int32, device=out.device)
    marks.scatter_add_(1, fx.long().clamp(0, top).view(2, -1), consts.signs)
    inside = marks.cumsum(1) > 0
    out.masked_fill_(inside[0, :rows_o, None, None], 0)
    if lse is not None:
        view = lse[: n_l * hq].view(n_l, hq)
        if sinks is None:
            view.masked_fill_(inside[1, :n_l, None], -math.inf)
        else:
            view.copy_(torch.where(inside[1, :n_l, None], sinks.view(1, hq), view))
