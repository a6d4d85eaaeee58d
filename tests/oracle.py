"""Independent test oracle: random prefill cases and their float64 reference results.

Nothing here calls pagedprefill. K/V are materialised per sequence straight from the raw caches
and block tables (advanced indexing per key), and attention is computed row-block by row-block in
float64 with an explicit mask. Every backend's tests compare against this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class Case:
    """A call's keyword arguments plus what the oracle needs to know about it."""

    kwargs: dict
    lens_q: list[int]
    lens_kv: list[int]
    q_start: list[int]  # token rows
    o_start: list[int]
    lse_start: list[int] | None  # flat element offsets into lse, or None for the (B, max_q, Hq) layout
    info: dict = field(default_factory=dict)


def _starts(lens: list[int], gen: torch.Generator, gaps: bool) -> tuple[list[int], int]:
    """Start rows for each sequence, optionally with random gaps before/between; total rows."""
    starts, acc = [], 0
    for n in lens:
        if gaps:
            acc += int(torch.randint(0, 3, (1,), generator=gen))
        starts.append(acc)
        acc += n
    if gaps:
        acc += int(torch.randint(0, 3, (1,), generator=gen))
    return starts, acc


def _rand(shape, dtype, gen, device, scale=1.0):
    x = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    if dtype in FP8:
        x = x.clamp(-200, 200)
    return x.to(dtype).to(device)


def make_case(
    seed: int,
    *,
    lens_q: list[int],
    lens_kv: list[int],
    hq: int = 4,
    hkv: int = 2,
    dqk: int = 64,
    dvo: int | None = None,
    page_size: int = 4,
    kv_layout: str = "nhd",
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    causal: bool = True,
    offsets: str = "none",
    gaps: bool = False,
    lse_layout: str = "padded",
    return_lse: bool = True,
    extra_table_cols: int = 1,
    max_q: int | None = None,
    max_kv: int | None = None,
    lens_on_device: bool = False,
    device: str | torch.device = "cpu",
    scale: float | None = None,
    with_out: bool = True,
    workspace_bytes: int = 1 << 22,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    sinks: bool = False,
) -> Case:
    """Build a random case.

    page_size 0 means ragged K/V. kv_layout: "nhd" (storage (pages, page_size, Hkv, D) permuted),
    "hnd" (contiguous (pages, Hkv, page_size, D)), "interleaved" (K and V views of one
    (pages, 2, page_size, Hkv, D) buffer). offsets: "none", "elements" or "tokens".
    lse_layout: "padded" ((B, max_q, Hq)) or "packed" ((rows, Hq) with batch_offsets_stats).
    window_left / logits_soft_cap: passed through (defaults: off); sinks: draw random per-head sink
    logits (float32 (Hq,)).
    """
    gen = torch.Generator().manual_seed(seed)
    dvo = dqk if dvo is None else dvo
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    bsz = len(lens_q)
    max_q = max(lens_q + [1]) if max_q is None else max_q
    max_kv = max(lens_kv + [1]) if max_kv is None else max_kv
    use_offsets = offsets != "none"
    q_start, rows_q = _starts(lens_q, gen, gaps and use_offsets)
    if use_offsets and gaps:
        o_start, rows_o = _starts(lens_q, gen, True)
    else:
        o_start, rows_o = q_start, rows_q
    q = _rand((rows_q, hq, dqk), dtype, gen, device)
    kwargs: dict = dict(
        q=q,
        scale=scale if scale is not None else 1.0 / math.sqrt(dqk),
        max_token_per_sequence=max_q,
        max_sequence_kv=max_kv,
        causal=causal,
        return_lse=return_lse,
    )
    info: dict = {"page_size": page_size}
    if page_size > 0:
        pages_per_seq = [-(-n // page_size) for n in lens_kv]
        width = max(pages_per_seq + [0]) + extra_table_cols
        num_pages = sum(pages_per_seq) + 3
        if kv_layout == "nhd":
            k = _rand((num_pages, page_size, hkv, dqk), kv_dtype, gen, device).permute(0, 2, 1, 3)
            v = _rand((num_pages, page_size, hkv, dvo), kv_dtype, gen, device).permute(0, 2, 1, 3)
        elif kv_layout == "hnd":
            k = _rand((num_pages, hkv, page_size, dqk), kv_dtype, gen, device)
            v = _rand((num_pages, hkv, page_size, dvo), kv_dtype, gen, device)
        elif kv_layout == "interleaved":
            assert dqk == dvo
            kv = _rand((num_pages, 2, page_size, hkv, dqk), kv_dtype, gen, device)
            k, v = kv[:, 0].permute(0, 2, 1, 3), kv[:, 1].permute(0, 2, 1, 3)
        else:
            raise AssertionError(kv_layout)
        perm = torch.randperm(num_pages, generator=gen).tolist()
        table = torch.full((bsz, width), -7, dtype=torch.int32)  # unused entries: garbage
        it = iter(perm)
        for b, n in enumerate(pages_per_seq):
            for j in range(n):
                table[b, j] = next(it)
        kwargs.update(k_cache=k, v_cache=v, block_tables=table.to(device))
        info["block_tables"] = table
    else:
        k_start, rows_k = _starts(lens_kv, gen, gaps and use_offsets)
        k = _rand((rows_k, hkv, dqk), kv_dtype, gen, device)
        v = _rand((rows_k, hkv, dvo), kv_dtype, gen, device)
        kwargs.update(k_cache=k, v_cache=v)
        info["k_start"] = k_start
    if dtype in FP8:
        kwargs["q_scale"] = torch.tensor([0.5 + torch.rand(1, generator=gen).item()], device=device)
    if kv_dtype in FP8:
        kwargs["k_scale"] = torch.tensor([0.05 + 0.1 * torch.rand(1, generator=gen).item()], device=device)
        kwargs["v_scale"] = torch.tensor([0.05 + 0.1 * torch.rand(1, generator=gen).item()], device=device)

    lens_dev = device if lens_on_device else "cpu"
    kwargs["actual_seq_lens_q"] = torch.tensor(lens_q, dtype=torch.int32, device=lens_dev)
    kwargs["actual_seq_lens_kv"] = torch.tensor(lens_kv, dtype=torch.int32, device=lens_dev)

    def off(starts: list[int], last: int, per_token: int) -> torch.Tensor:
        vals = starts + [last]
        if offsets == "elements":
            vals = [x * per_token for x in vals]
        return torch.tensor(vals, dtype=torch.int32, device=lens_dev)

    if use_offsets:
        kwargs["batch_offsets_units"] = offsets
        kwargs["batch_offsets_q"] = off(q_start, rows_q, hq * dqk)
        kwargs["batch_offsets_o"] = off(o_start, rows_o, hq * dvo)
        if page_size == 0:
            kwargs["batch_offsets_k"] = off(info["k_start"], k.shape[0], hkv * dqk)
            kwargs["batch_offsets_v"] = off(info["k_start"], k.shape[0], hkv * dvo)
    lse_start = None
    if return_lse and lse_layout == "packed":
        lse_start_tok, rows_l = _starts(lens_q, gen, True)
        unit = "elements" if offsets == "none" else offsets
        kwargs["batch_offsets_units"] = unit
        per_tok = hq if unit == "elements" else 1
        kwargs["batch_offsets_stats"] = torch.tensor(
            [x * per_tok for x in lse_start_tok + [rows_l]], dtype=torch.int32, device=lens_dev
        )
        lse_start = [x * hq for x in lse_start_tok]
        info["lse_rows"] = rows_l
    if (
        lens_on_device
        and torch.device(device).type != "cpu"
        and any(n in kwargs for n in ("batch_offsets_o", "batch_offsets_stats"))
    ):
        # (an out / lse the call would allocate, addressed by device offsets of their own, is refused:
        # test_plan's test_gpu_an_allocated_buffer_device_offsets_place_is_refused)
        with_out = True
    if with_out:
        out_dtype = torch.bfloat16 if dtype in FP8 else dtype
        kwargs["out"] = poison(torch.empty((rows_o, hq, dvo), dtype=out_dtype, device=device))
        if return_lse:
            shape = (info["lse_rows"], hq) if lse_layout == "packed" else (bsz, max_q, hq)
            kwargs["lse"] = poison(torch.empty(shape, dtype=torch.float32, device=device))
    kwargs["workspace_buffer"] = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
    if window_left >= 0:
        kwargs["window_left"] = window_left
    if logits_soft_cap > 0:
        kwargs["logits_soft_cap"] = logits_soft_cap
    if sinks:
        kwargs["sinks"] = (torch.randn(hq, generator=gen) * 2).to(device)
    return Case(kwargs, list(lens_q), list(lens_kv), q_start, o_start, lse_start, info)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so that an unwritten covered element fails and a stray write is visible."""
    return t.fill_(float("nan"))


def _dequant(t: torch.Tensor, s, device: torch.device | None = None) -> torch.Tensor:
    t = t.to(torch.float32).to(device or "cpu").to(torch.float64)  # (exact for 8- and 16-bit floats)
    return t * float(s.item()) if isinstance(s, torch.Tensor) else t


def _seq_kv(case: Case, k: torch.Tensor, v: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``b``'s K and V, (lkv, Hkv, D) each, gathered key by key from the raw caches."""
    lkv = case.lens_kv[b]
    if case.info["page_size"] > 0:
        ps = case.info["page_size"]
        j = torch.arange(lkv)
        pages = case.info["block_tables"][b].long().cpu()[j // ps]
        pages, slots = pages.to(k.device), (j % ps).to(k.device)
        return k[pages, :, slots, :], v[pages, :, slots, :]
    s0 = case.info["k_start"][b]
    return k[s0 : s0 + lkv], v[s0 : s0 + lkv]


def reference(case: Case) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """float64 results: {out row: (Hq, Dvo)} and {flat lse offset of the row: (Hq,)} for covered rows.

    Per sequence, K/V are materialised once and blocks of query rows are computed at a time with an
    explicit (causal, bottom-right) mask, on the device the case lives on (CUDA float64 on a GPU);
    the results are returned on the CPU. Rows without a visible key get out 0 and lse -inf (the
    sink, with sinks). A non-finite K/V value among a sequence's first kv_len keys makes all of its
    rows NaN (masked weights are 0, and 0 * inf is NaN), as in the kernels: the tests draw finite K/V
    there. Variants: keys below position - window_left are hidden, logits are cap * tanh(s / cap),
    and a sink logit joins each head's denominator."""
    kw = case.kwargs
    dev = kw["q"].device
    q = _dequant(kw["q"], kw.get("q_scale"), dev)
    k = _dequant(kw["k_cache"], kw.get("k_scale"), dev)
    v = _dequant(kw["v_cache"], kw.get("v_scale"), dev)
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    max_q = kw["max_token_per_sequence"]
    window, cap = kw.get("window_left", -1), kw.get("logits_soft_cap", 0.0)
    sinks = kw.get("sinks")
    sink = sinks.to(dev, torch.float64).view(hq, 1, 1) if sinks is not None else None
    outs, lses = {}, {}
    for b, (lq, lkv) in enumerate(zip(case.lens_q, case.lens_kv)):
        if lq == 0:
            continue
        kb, vb = _seq_kv(case, k, v, b)
        kh = kb.repeat_interleave(group, dim=1)  # (lkv, Hq, D)
        vh = vb.repeat_interleave(group, dim=1)
        qb = q[case.q_start[b] : case.q_start[b] + lq]
        keys = torch.arange(lkv, device=dev)
        rows_per_block = max(1, (1 << 24) // (hq * max(lkv, 1)))  # (bounds the score block's size)
        o_seq, lse_seq = [], []
        for r0 in range(0, lq, rows_per_block):
            i = torch.arange(r0, min(lq, r0 + rows_per_block), device=dev)
            pos = i + (lkv - lq)  # absolute positions
            visible = torch.full_like(i, lkv) if not kw["causal"] else (pos + 1).clamp(0, lkv)
            mask = keys[None, :] < visible[:, None]  # (rows, lkv)
            if window >= 0:
                mask &= keys[None, :] >= (pos - window)[:, None]
            s = torch.einsum("ihd,jhd->hij", qb[r0 : r0 + len(i)], kh) * kw["scale"]
            if cap > 0:
                s = cap * torch.tanh(s / cap)
            s = s.masked_fill(~mask, -math.inf)
            if lkv > 0:
                m = s.amax(dim=2, keepdim=True)
            else:
                m = torch.full((hq, len(i), 1), -math.inf, dtype=s.dtype, device=dev)
            if sink is not None:
                m = torch.maximum(m, sink.expand(hq, len(i), 1))
            p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))  # (0 where masked)
            denom = p.sum(dim=2, keepdim=True)
            if sink is not None:
                denom = denom + torch.exp(sink - m)
            o_seq.append(torch.einsum("hij,jhd->ihd", p / torch.where(denom > 0, denom, 1.0), vh))
            lse_seq.append(torch.where(denom > 0, m + torch.log(denom), -math.inf)[..., 0].T)
        o_seq, lse_seq = torch.cat(o_seq).cpu(), torch.cat(lse_seq).cpu()
        for i in range(lq):
            outs[case.o_start[b] + i] = o_seq[i]
            lse_off = (case.lse_start[b] if case.lse_start is not None else b * max_q * hq) + i * hq
            lses[lse_off] = lse_seq[i]
    return outs, lses


def check(
    case: Case,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    atol: float,
    rtol: float = 0.0,
    lse_atol: float | None = None,
) -> None:
    """Compare a call's results with the oracle; uncovered rows must still hold the poison."""
    ref_out, ref_lse = reference(case)
    out_c = out.detach().cpu().to(torch.float64)
    covered = torch.zeros(out.shape[0], dtype=torch.bool)
    if ref_out:
        rows = torch.tensor(list(ref_out))
        covered[rows] = True
        expected = torch.stack(list(ref_out.values()))
        got = out_c[rows]
        unwritten = ~torch.isfinite(got).flatten(1).all(dim=1)
        assert not unwritten.any(), f"out row {rows[unwritten][0].item()} has non-finite values (unwritten?)"
        err = (got - expected).abs()
        over = (~(err <= atol + rtol * expected.abs())).flatten(1).any(dim=1)
        if over.any():
            row = over.nonzero()[0, 0]
            raise AssertionError(
                f"out row {rows[row].item()}: max error {err[row].max().item():.3g} > tol (atol {atol})"
            )
    if case.kwargs.get("out") is not None:
        assert torch.isnan(out_c[~covered]).all(), "an uncovered out row was written"
    else:
        assert (out_c[~covered] == 0).all(), "uncovered rows of an allocated out must be 0"
    if case.kwargs["return_lse"]:
        assert lse is not None
        flat = lse.detach().cpu().reshape(-1).to(torch.float64)
        hq = out.shape[1]
        touched = torch.zeros(flat.numel(), dtype=torch.bool)
        latol = atol if lse_atol is None else lse_atol
        if ref_lse:
            idx = torch.tensor(list(ref_lse))[:, None] + torch.arange(hq)  # (rows, Hq) flat offsets
            touched[idx.flatten()] = True
            expected = torch.stack(list(ref_lse.values()))
            got = flat[idx]
            inf = torch.isinf(expected)
            bad = ((torch.isinf(got) != inf) | (inf & (got > 0))).any(dim=1)
            assert not bad.any(), f"lse at {idx[bad][0, 0].item()}: -inf mismatch"
            err = torch.where(inf, 0.0, (got - expected).abs())
            over = (~(err <= latol)).any(dim=1)  # (NaN: an unwritten entry)
            assert not over.any(), f"lse at {idx[over][0, 0].item()}: max error {err[over][0].max().item():.3g}"
        if case.kwargs.get("lse") is not None:
            assert torch.isnan(flat[~touched]).all(), "an uncovered lse entry was written"
        else:
            assert (torch.isinf(flat[~touched]) & (flat[~touched] < 0)).all(), (
                "uncovered entries of an allocated lse must be -inf"
            )
    else:
        assert lse is None


def reference_rows(case: Case, rows: list[tuple[int, int]]) -> dict[tuple[int, int], tuple]:
    """float64 results for selected query rows only: {(b, i): (out (Hq, Dvo), lse (Hq,))}.

    Same math as :func:`reference`, but K/V are materialised once per sequence and only the
    requested rows are computed, so long sequences (16k tokens) stay cheap.
    """
    kw = case.kwargs
    q = _dequant(kw["q"], kw.get("q_scale"))
    k = _dequant(kw["k_cache"], kw.get("k_scale"))
    v = _dequant(kw["v_cache"], kw.get("v_scale"))
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    by_seq: dict[int, list[int]] = {}
    for b, i in rows:
        assert 0 <= i < case.lens_q[b], (b, i)
        by_seq.setdefault(b, []).append(i)
    result = {}
    for b, idx in by_seq.items():
        lq, lkv = case.lens_q[b], case.lens_kv[b]
        if case.info["page_size"] > 0:
            ps = case.info["page_size"]
            j = torch.arange(lkv)
            pages = case.info["block_tables"][b].long()[j // ps]
            kb, vb = k[pages, :, j % ps, :], v[pages, :, j % ps, :]  # (lkv, Hkv, D)
        else:
            s0 = case.info["k_start"][b]
            kb, vb = k[s0 : s0 + lkv], v[s0 : s0 + lkv]
        kh = kb.repeat_interleave(group, dim=1)  # (lkv, Hq, D)
        vh = vb.repeat_interleave(group, dim=1)
        window, cap = kw.get("window_left", -1), kw.get("logits_soft_cap", 0.0)
        sinks = kw.get("sinks")
        for i in idx:
            pos = i + lkv - lq
            hi = lkv if not kw["causal"] else max(0, min(lkv, pos + 1))
            lo = max(0, pos - window) if window >= 0 else 0
            o = torch.zeros(hq, v.shape[-1], dtype=torch.float64)
            lse = torch.full((hq,), -math.inf, dtype=torch.float64)
            s = torch.einsum("hd,jhd->hj", q[case.q_start[b] + i], kh[lo:hi]) * kw["scale"]
            if cap > 0:
                s = cap * torch.tanh(s / cap)
            if sinks is not None:
                s = torch.cat([s, sinks.cpu().to(torch.float64).view(hq, 1)], dim=1)
            if s.shape[1] > 0:
                m = s.max(dim=1, keepdim=True).values
                m = torch.where(m == -math.inf, 0.0, m)  # (a head with only a -inf sink: no mass at all)
                p = torch.exp(s - m)
                denom = p.sum(dim=1, keepdim=True)
                n = hi - max(lo, 0) if hi > lo else 0
                w = torch.where(denom > 0, p / torch.where(denom > 0, denom, 1.0), 0.0)
                o = torch.einsum("hj,jhd->hd", w[:, :n], vh[lo : lo + n])
                lse = torch.where(denom > 0, m + torch.log(torch.where(denom > 0, denom, 1.0)), -math.inf).squeeze(1)
            result[(b, i)] = (o, lse)
    return result
