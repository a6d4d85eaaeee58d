"""Semantics of the public function on the torch reference backend (CPU).

Every result is compared with the independent float64 oracle in ``oracle.py`` or with a value the
test computes itself; nothing is compared with the code under test.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import FP8, check, make_case, poison, reference, reference_rows

import pagedprefill
from pagedprefill import batch_prefill_with_kv_cache, cudnn_batch_prefill_with_kv_cache

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# (atol, rtol) of `out` per output dtype: the backend computes in float32 from the exact input
# values, so the error is float32 math plus one rounding to the output dtype.
OUT_TOL = {F32: (2e-5, 1e-5), F16: (2e-4, 1.5e-3), BF16: (2e-3, 8e-3)}
LSE_ATOL = 1e-4  # lse is float32 whatever the output dtype


def call(case, fn=cudnn_batch_prefill_with_kv_cache, **override):
    kw = dict(case.kwargs)
    kw.update(override)
    return fn(**kw)


def check_case(case, out, lse, out_dtype=None):
    out_dtype = out_dtype or out.dtype
    atol, rtol = OUT_TOL[out_dtype]
    assert out.dtype == out_dtype
    check(case, out, lse, atol=atol, rtol=rtol, lse_atol=LSE_ATOL)


def random_bits_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill ``t`` with random bytes (any float bit pattern, NaN payloads included); returns t."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.view(-1).view(torch.uint8).copy_(raw)
    return t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


def seq_kv(case, b, which):
    """float64 (kv_len, Hkv, D) keys/values of sequence b, materialised in the test."""
    kw = case.kwargs
    cache = kw["k_cache" if which == "k" else "v_cache"].double()
    s = kw.get("k_scale" if which == "k" else "v_scale")
    if s is not None:
        cache = cache * float(s)
    lkv = case.lens_kv[b]
    if case.info["page_size"] == 0:
        s0 = case.info["k_start"][b]
        return cache[s0 : s0 + lkv]
    ps = case.info["page_size"]
    table = case.info["block_tables"][b]
    return torch.stack([cache[int(table[j // ps]), :, j % ps] for j in range(lkv)])


# --------------------------------------------------------------------------------------------
# 1. Randomised correctness over the argument space
# --------------------------------------------------------------------------------------------

HEADS = [(4, 4), (4, 2), (8, 2), (4, 1), (6, 3), (3, 1), (10, 2), (12, 2), (7, 1)]  # MHA, GQA 2 / 4, MQA, 3 / 5 / 6 / 7
DIMS = [(64, 64), (192, 128), (128, 128), (16, 16), (8, 8), (32, 16)]
DTYPES = [  # (q dtype, kv dtype)
    (F32, F32),
    (F16, F16),
    (BF16, BF16),
    (F16, E4M3),
    (BF16, E5M2),
    (BF16, E4M3),
    (E4M3, E4M3),
    (E5M2, E5M2),
]
N_GRID = 192


def grid_config(i: int) -> dict:
    r = random.Random(7919 * i + 13)
    bsz = r.choice([1, 1, 2, 3, 4])
    causal = r.random() < 0.6
    lens_q = [r.choice([0, 1, 2, 3, 5, 8, 13]) if bsz > 1 else r.choice([1, 4, 9, 17]) for _ in range(bsz)]
    lens_kv = [r.choice([0, 1, 4, 7, 16, 23]) if bsz > 1 else r.choice([1, 5, 16, 33]) for _ in range(bsz)]
    if all(n == 0 for n in lens_q):
        lens_q[0] = 3
    hq, hkv = r.choice(HEADS)
    dqk, dvo = r.choice(DIMS)
    qd, kvd = DTYPES[i % len(DTYPES)]
    page_size = [0, 1, 3, 16][(i // len(DTYPES)) % 4]
    layout = r.choice(["nhd", "hnd", "interleaved"])
    if layout == "interleaved" and dqk != dvo:
        layout = "hnd"
    offsets = r.choice(["none", "elements", "tokens"])
    lse_layout = r.choice(["padded", "packed", "none"])
    o_dtype = None
    if r.random() < 0.25:
        o_dtype = r.choice([F32, F16, BF16])
    return dict(
        seed=i,
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=hq,
        hkv=hkv,
        dqk=dqk,
        dvo=dvo,
        page_size=page_size,
        kv_layout=layout,
        dtype=qd,
        kv_dtype=kvd,
        causal=causal,
        offsets=offsets,
        gaps=offsets != "none" and r.random() < 0.7,
        lse_layout="padded" if lse_layout == "none" else lse_layout,
        return_lse=lse_layout != "none",
        extra_table_cols=r.choice([0, 1, 3]),
        max_q=max(lens_q) + r.choice([0, 0, 2]),
        max_kv=max(lens_kv + [1]) + r.choice([0, 5]),
        with_out=r.random() < 0.75,
        o_dtype=o_dtype,
        len_dtype=r.choice([torch.int32, torch.int64]),
        len_4d=r.random() < 0.3,
        graph=r.random() < 0.2,
        entry=r.choice(["cudnn:torch", "cudnn:None", "cudnn:auto", "auto:default", "auto:torch"]),
        window_left=r.choice([-1, -1, 0, 3, 11]),
        logits_soft_cap=r.choice([0.0, 0.0, 0.0, 5.0]),
        sinks=r.random() < 0.3,
    )


def build(cfg: dict):
    keys = (
        "lens_q lens_kv hq hkv dqk dvo page_size kv_layout dtype kv_dtype causal offsets gaps "
        "lse_layout return_lse extra_table_cols max_q max_kv with_out window_left logits_soft_cap sinks"
    ).split()
    case = make_case(cfg["seed"], **{k: cfg[k] for k in keys})
    kw = case.kwargs
    # lengths / offsets as int64 and/or (n,1,1,1)
    for name in list(kw):
        if name.startswith("actual_seq_lens") or name.startswith("batch_offsets_") and name != "batch_offsets_units":
            t = kw[name].to(cfg["len_dtype"])
            kw[name] = t.view(-1, 1, 1, 1) if cfg["len_4d"] else t
    out_dtype = BF16 if cfg["dtype"] in FP8 else cfg["dtype"]
    if cfg["o_dtype"] is not None:
        out_dtype = cfg["o_dtype"]
        kw["o_data_type"] = out_dtype
        if "out" in kw:
            kw["out"] = poison(torch.empty(kw["out"].shape, dtype=out_dtype))
    kw["is_cuda_graph_compatible"] = cfg["graph"]
    return case, out_dtype


def grid_id(i: int) -> str:
    c = grid_config(i)
    dt = {F32: "f32", F16: "f16", BF16: "bf16", E4M3: "e4m3", E5M2: "e5m2"}
    return (
        f"{i}-B{len(c['lens_q'])}-ps{c['page_size']}-{c['kv_layout']}-{dt[c['dtype']]}/{dt[c['kv_dtype']]}"
        f"-H{c['hq']}/{c['hkv']}-D{c['dqk']}/{c['dvo']}-{'causal' if c['causal'] else 'full'}"
        f"-off_{c['offsets']}{'+gaps' if c['gaps'] else ''}"
        f"-lse_{c['lse_layout'] if c['return_lse'] else 'none'}"
        f"{'-w' + str(c['window_left']) if c['window_left'] >= 0 else ''}{'-cap' if c['logits_soft_cap'] else ''}"
        f"{'-sinks' if c['sinks'] else ''}"
    )


def test_grid_covers_every_value():
    cfgs = [grid_config(i) for i in range(N_GRID)]
    for key, values in (
        ("page_size", [0, 1, 3, 16]),
        ("kv_layout", ["nhd", "hnd", "interleaved"]),
        ("offsets", ["none", "elements", "tokens"]),
        ("causal", [True, False]),
        ("gaps", [True, False]),
        ("return_lse", [True, False]),
        ("lse_layout", ["padded", "packed"]),
        ("with_out", [True, False]),
        ("len_dtype", [torch.int32, torch.int64]),
        ("len_4d", [True, False]),
        ("graph", [True, False]),
        ("o_dtype", [None, F32, F16, BF16]),
        ("entry", ["cudnn:torch", "cudnn:None", "cudnn:auto", "auto:default", "auto:torch"]),
    ):
        seen = {repr(c[key]) for c in cfgs}
        assert seen >= {repr(v) for v in values}, key
    assert {(c["hq"], c["hkv"]) for c in cfgs} == set(HEADS)
    assert {(c["dqk"], c["dvo"]) for c in cfgs} == set(DIMS)
    assert {(c["dtype"], c["kv_dtype"]) for c in cfgs} == set(DTYPES)
    paged_layouts = {(c["page_size"] > 0, c["kv_layout"]) for c in cfgs}
    assert {(True, "nhd"), (True, "hnd"), (True, "interleaved")} <= paged_layouts


@pytest.mark.parametrize("i", range(N_GRID), ids=grid_id)
def test_random_grid_matches_oracle(i):
    cfg = grid_config(i)
    case, out_dtype = build(cfg)
    fn_name, backend = cfg["entry"].split(":")
    fn = cudnn_batch_prefill_with_kv_cache if fn_name == "cudnn" else batch_prefill_with_kv_cache
    kw = {} if backend == "default" else {"backend": None if backend == "None" else backend}
    out, lse = call(case, fn, **kw)
    if "out" in case.kwargs:
        assert out is case.kwargs["out"]
    else:
        # q's rows, or more when batch_offsets_o places a sequence further
        ends = [s + n for s, n in zip(case.o_start, case.lens_q) if n]
        rows = max([case.kwargs["q"].shape[0], *ends])
        assert out.shape == (rows, cfg["hq"], cfg["dvo"])
    if cfg["return_lse"]:
        assert lse.dtype == torch.float32
        if "lse" in case.kwargs:
            assert lse is case.kwargs["lse"]
        elif cfg["lse_layout"] == "padded":
            assert lse.shape == (len(cfg["lens_q"]), cfg["max_q"], cfg["hq"])
    check_case(case, out, lse, out_dtype)


@settings(
    max_examples=80,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    lens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 12)), min_size=1, max_size=4),
    page_size=st.sampled_from([0, 1, 2, 5]),
    causal=st.booleans(),
    heads=st.sampled_from([(2, 1), (2, 2), (4, 2)]),
    offsets=st.sampled_from(["none", "elements", "tokens"]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_lengths_and_masks(lens, page_size, causal, heads, offsets, seed):
    lens_q = [a for a, _ in lens]
    lens_kv = [b for _, b in lens]
    case = make_case(
        seed,
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=heads[0],
        hkv=heads[1],
        dqk=8,
        page_size=page_size,
        causal=causal,
        offsets=offsets,
        gaps=True,
    )
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)


# --------------------------------------------------------------------------------------------
# 2. Spec edge cases
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [0, 4])
def test_kv_len_zero_gives_zero_out_and_minus_inf_lse(causal, page_size):
    case = make_case(1, lens_q=[3, 2, 4], lens_kv=[0, 5, 0], page_size=page_size, causal=causal)
    out, lse = call(case, backend="torch")
    for b, start in ((0, 0), (2, 5)):
        n = case.lens_q[b]
        assert torch.equal(out[start : start + n], torch.zeros_like(out[start : start + n]))
        assert torch.equal(lse[b, :n], torch.full_like(lse[b, :n], -math.inf))
    check_case(case, out, lse)


@pytest.mark.parametrize("page_size", [0, 3])
def test_causal_q_longer_than_kv_first_rows_empty(page_size):
    # q_len 7, kv_len 3: row i sees keys j <= i - 4, so rows 0..3 see nothing and row 4 sees key 0.
    case = make_case(2, lens_q=[7], lens_kv=[3], hq=4, hkv=2, page_size=page_size, causal=True)
    out, lse = call(case, backend="torch")
    assert torch.equal(out[:4], torch.zeros_like(out[:4]))
    assert torch.equal(lse[0, :4], torch.full_like(lse[0, :4], -math.inf))
    assert torch.isfinite(lse[0, 4:]).all()
    # row 4 sees exactly one key: its output is that key's value row (softmax weight 1)
    v0 = seq_kv(case, 0, "v")[0]  # (Hkv, Dvo)
    expected = v0.repeat_interleave(2, dim=0)  # head h reads KV head h // 2
    torch.testing.assert_close(out[4].double(), expected, atol=1e-6, rtol=0)
    check_case(case, out, lse)


def test_q_len_zero_writes_nothing_for_that_sequence():
    case = make_case(3, lens_q=[3, 0, 2], lens_kv=[4, 6, 5], offsets="tokens", gaps=True, page_size=2)
    kw = case.kwargs
    random_bits_like(kw["out"], 30)
    random_bits_like(kw["lse"], 31)
    out_before, lse_before = as_bytes(kw["out"]), as_bytes(kw["lse"])
    covered_rows = [case.o_start[b] + i for b in range(3) for i in range(case.lens_q[b])]
    out, lse = call(case, backend="torch")
    # the whole lse[1] (padded layout) and every row of out outside seqs 0 and 2 stay byte-identical
    rows = torch.ones(out.shape[0], dtype=torch.bool)
    rows[covered_rows] = False
    assert torch.equal(as_bytes(out[rows]), out_before.view(out.shape[0], -1)[rows].reshape(-1))
    lse_b = lse_before.view(3, -1)
    assert torch.equal(as_bytes(lse[1]), lse_b[1])
    # the other sequences are right
    ref_out, _ = reference(case)
    for row, expected in ref_out.items():
        torch.testing.assert_close(out[row].double(), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("poison_kind", ["nan", "random-bits"])
@pytest.mark.parametrize(
    "layout", [dict(lse_layout="padded"), dict(lse_layout="packed"), dict(offsets="elements", gaps=True)]
)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_uncovered_rows_keep_their_bytes(poison_kind, layout, dtype):
    case = make_case(4, lens_q=[3, 1, 5], lens_kv=[6, 0, 9], max_q=8, page_size=3, dtype=dtype, causal=False, **layout)
    kw = case.kwargs
    if poison_kind == "random-bits":
        random_bits_like(kw["out"], 40)
        random_bits_like(kw["lse"], 41)
    out_before, lse_before = as_bytes(kw["out"]), as_bytes(kw["lse"])
    out, lse = call(case, backend="torch")
    ref_out, ref_lse = reference(case)
    hq, d = out.shape[1], out.shape[2]
    esz = out.element_size()
    out_mask = torch.ones(out.shape[0], hq * d * esz, dtype=torch.bool)
    out_mask[list(ref_out)] = False
    lse_mask = torch.ones(lse.numel() * 4, dtype=torch.bool)
    for off in ref_lse:
        lse_mask[off * 4 : (off + hq) * 4] = False
    assert lse_mask.any()  # the case does have uncovered entries (and out rows when there are gaps)
    assert out_mask.any() == ("offsets" in layout)
    assert torch.equal(as_bytes(out)[out_mask.view(-1)], out_before[out_mask.view(-1)])
    assert torch.equal(as_bytes(lse)[lse_mask], lse_before[lse_mask])
    # and the covered rows were all written (and are right)
    atol, rtol = OUT_TOL[dtype]
    for row, expected in ref_out.items():
        torch.testing.assert_close(out[row].double(), expected, atol=atol, rtol=rtol)
    flat = lse.view(-1).double()
    for off, expected in ref_lse.items():
        torch.testing.assert_close(flat[off : off + hq], expected, atol=LSE_ATOL, rtol=0)


@pytest.mark.parametrize("lse_layout", ["padded", "packed"])
def test_allocated_buffers_are_zero_and_minus_inf_outside_covered_rows(lse_layout):
    case = make_case(
        5,
        lens_q=[2, 0, 3],
        lens_kv=[4, 3, 0],
        max_q=6,
        offsets="tokens",
        gaps=True,
        lse_layout=lse_layout,
        with_out=False,
        page_size=0,
    )
    out, lse = call(case, backend="torch")
    # q's rows, or more when batch_offsets_o places a sequence further
    rows = max(case.kwargs["q"].shape[0], *(s + n for s, n in zip(case.o_start, case.lens_q)))
    assert out.shape == (rows, 4, case.kwargs["v_cache"].shape[-1])
    if lse_layout == "padded":
        assert lse.shape == (3, 6, 4)
    else:  # packed: at least up to the last row the stats offsets address
        assert lse.numel() >= max(s + n * 4 for s, n in zip(case.lse_start, case.lens_q))
    check_case(case, out, lse)  # uncovered: out exactly 0, lse exactly -inf


def test_bottom_right_causal_alignment():
    # q_len 3 < kv_len 8: row i sees keys j <= i + 5. Top-left alignment (j <= i) differs.
    case = make_case(6, lens_q=[3], lens_kv=[8], hq=2, hkv=1, dqk=16, page_size=0, causal=True)
    out, lse = call(case, backend="torch")
    q = case.kwargs["q"].double()
    k, v = seq_kv(case, 0, "k"), seq_kv(case, 0, "v")
    s = torch.einsum("ihd,jd->hij", q, k[:, 0]) * case.kwargs["scale"]
    i = torch.arange(3).view(-1, 1)
    j = torch.arange(8).view(1, -1)
    for visible, should_match in ((j <= i + 5, True), (j <= i, False)):
        sm = s.masked_fill(~visible, -math.inf)
        o = torch.einsum("hij,jd->ihd", torch.softmax(sm, -1), v[:, 0])
        lse_ref = torch.logsumexp(sm, -1).transpose(0, 1)
        close = torch.allclose(out.double(), o, atol=1e-5) and torch.allclose(lse[0].double(), lse_ref, atol=1e-5)
        assert close == should_match
    check_case(case, out, lse)


def test_lse_is_natural_log():
    case = make_case(7, lens_q=[5], lens_kv=[9], hq=4, hkv=4, dqk=32, page_size=0, causal=False, scale=0.7)
    _, lse = call(case, backend="torch")
    q = case.kwargs["q"].double()
    k = case.kwargs["k_cache"].double()
    s = torch.einsum("ihd,jhd->ihj", q, k) * 0.7
    expected = torch.logsumexp(s, dim=-1)  # natural log, (5, Hq)
    torch.testing.assert_close(lse[0].double(), expected, atol=1e-5, rtol=0)
    # a log2 LSE would be off by the factor 1/ln 2
    assert not torch.allclose(lse[0].double(), expected / math.log(2), atol=1e-2)


@pytest.mark.parametrize("garbage", ["minus-one", "huge", "other-pages"])
def test_block_table_entries_past_the_needed_pages_are_ignored(garbage):
    case = make_case(8, lens_q=[3, 4], lens_kv=[5, 9], page_size=4, extra_table_cols=4, causal=False)
    table = case.kwargs["block_tables"].clone()
    for b, lkv in enumerate(case.lens_kv):
        need = -(-lkv // 4)
        tail = table[b, need:]
        if garbage == "minus-one":
            tail.fill_(-1)
        elif garbage == "huge":
            tail.fill_(2**31 - 1)
        else:  # valid page ids, holding other data
            tail.copy_(torch.arange(tail.numel()) % case.kwargs["k_cache"].shape[0])
    case.kwargs["block_tables"] = table
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)


@pytest.mark.parametrize("width_vs_max", ["wider", "narrower"])
def test_block_table_width_independent_of_max_sequence_kv(width_vs_max):
    if width_vs_max == "wider":  # max_kv / page_size = 2 pages; the table has 7 columns
        case = make_case(9, lens_q=[4, 2], lens_kv=[8, 5], max_kv=8, page_size=4, extra_table_cols=5)
        assert case.kwargs["block_tables"].shape[1] > 8 // 4
    else:  # max_kv / page_size = 16 pages; the table has only the 3 columns the lengths need
        case = make_case(9, lens_q=[4, 2], lens_kv=[10, 7], max_kv=64, page_size=4, extra_table_cols=0)
        assert case.kwargs["block_tables"].shape[1] == 3
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)


@pytest.mark.parametrize("page_size", [0, 4])
def test_batch_without_offsets_uses_prefix_sums(page_size):
    lens_q, lens_kv = [5, 3, 4], [7, 9, 4]
    case = make_case(10, lens_q=lens_q, lens_kv=lens_kv, page_size=page_size, causal=True)
    assert "batch_offsets_q" not in case.kwargs and case.q_start == [0, 5, 8]
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)
    # metamorphic: each sequence alone (B = 1) gives the same rows
    for b in range(3):
        kw = dict(case.kwargs)
        rows = slice(case.q_start[b], case.q_start[b] + lens_q[b])
        kw.update(
            q=kw["q"][rows],
            out=None,
            lse=None,
            actual_seq_lens_q=torch.tensor([lens_q[b]]),
            actual_seq_lens_kv=torch.tensor([lens_kv[b]]),
        )
        if page_size:
            kw["block_tables"] = kw["block_tables"][b : b + 1]
        else:
            k0 = case.info["k_start"][b]
            kw["k_cache"] = kw["k_cache"][k0 : k0 + lens_kv[b]]
            kw["v_cache"] = kw["v_cache"][k0 : k0 + lens_kv[b]]
        o1, l1 = cudnn_batch_prefill_with_kv_cache(**kw, backend="torch")
        torch.testing.assert_close(o1, out[rows], atol=1e-6, rtol=0)
        torch.testing.assert_close(l1[0, : lens_q[b]], lse[b, : lens_q[b]], atol=1e-6, rtol=0)


def test_same_shapes_different_scale():
    case = make_case(11, lens_q=[4, 6], lens_kv=[6, 6], page_size=2, causal=False)
    results = []
    for scale in (0.05, 0.9):
        case.kwargs["scale"] = scale
        case.kwargs["out"] = poison(torch.empty_like(case.kwargs["out"]))
        case.kwargs["lse"] = poison(torch.empty_like(case.kwargs["lse"]))
        out, lse = call(case, backend="torch")
        check_case(case, out, lse)
        results.append((out.clone(), torch.cat([lse[0, :4], lse[1, :6]])))
    assert (results[0][0] - results[1][0]).abs().max() > 0.05
    assert (results[0][1] - results[1][1]).abs().max() > 0.05


def test_contiguous_then_interleaved_kv_of_the_same_shapes():
    lens_q, lens_kv = [4, 3], [9, 6]
    first = make_case(12, lens_q=lens_q, lens_kv=lens_kv, page_size=4, kv_layout="hnd", causal=True)
    out, lse = call(first, backend="torch")
    check_case(first, out, lse)
    for layout in ("interleaved", "nhd"):
        case = make_case(13, lens_q=lens_q, lens_kv=lens_kv, page_size=4, kv_layout=layout, causal=True)
        assert case.kwargs["k_cache"].shape == first.kwargs["k_cache"].shape
        assert case.kwargs["k_cache"].stride() != first.kwargs["k_cache"].stride()
        out2, lse2 = call(case, backend="torch")
        check_case(case, out2, lse2)


def test_interleaved_views_equal_contiguous_copy():
    case = make_case(14, lens_q=[5, 2], lens_kv=[11, 3], page_size=4, kv_layout="interleaved")
    k, v = case.kwargs["k_cache"], case.kwargs["v_cache"]
    assert k.data_ptr() != v.data_ptr() and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)
    out_c, lse_c = call(case, backend="torch", k_cache=k.contiguous(), v_cache=v.contiguous(), out=None, lse=None)
    torch.testing.assert_close(out_c, out, atol=0, rtol=0)
    for b, n in enumerate(case.lens_q):
        torch.testing.assert_close(lse_c[b, :n], lse[b, :n], atol=0, rtol=0)


def test_gqa_query_head_reads_kv_head_h_div_group():
    # V constant per KV head: output head h must equal the constant of KV head h // (Hq / Hkv).
    hq, hkv, ps = 6, 3, 2
    case = make_case(15, lens_q=[3, 2], lens_kv=[4, 5], hq=hq, hkv=hkv, page_size=ps, dqk=16)
    consts = torch.tensor([1.5, -2.25, 0.75])
    case.kwargs["v_cache"] = consts.view(1, hkv, 1, 1).expand(case.kwargs["v_cache"].shape).contiguous()
    out, lse = call(case, backend="torch")
    rows = out[:5]
    expected = consts.repeat_interleave(hq // hkv).view(1, hq, 1).expand_as(rows)
    torch.testing.assert_close(rows, expected, atol=1e-6, rtol=0)
    check_case(case, out, lse)


def test_large_logits_are_stable():
    case = make_case(16, lens_q=[6], lens_kv=[20], hq=2, hkv=1, dqk=64, page_size=5, scale=30.0)
    out, lse = call(case, backend="torch")
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, :6]).all()
    assert lse[0, :6].abs().max() > 100  # the logits really are large
    check(case, out, lse, atol=2e-5, lse_atol=2e-3)  # lse ~ 1e3: float32 relative precision


def test_fp8_scales_dequantise_q_k_v():
    case = make_case(17, lens_q=[4, 3], lens_kv=[7, 9], dtype=E4M3, page_size=3, causal=False)
    kw = case.kwargs
    out, lse = call(case, backend="torch")
    assert out.dtype == BF16  # o_data_type defaults to bf16 for fp8 q
    check_case(case, out, lse)
    # doubling the stored-value scale of V doubles the output; of K changes the lse
    kw["v_scale"] = kw["v_scale"] * 2
    kw["out"], kw["lse"] = None, None
    out2, lse2 = call(case, backend="torch")
    torch.testing.assert_close(out2.float(), 2 * out.float(), atol=2e-2, rtol=1e-2)
    check_case(case, out2, lse2)
    assert (out2.float() - out.float()).abs().max() > 0.05


def test_fp8_scale_shapes_1111_and_1():
    case = make_case(18, lens_q=[3], lens_kv=[5], dtype=BF16, kv_dtype=E4M3, page_size=2)
    case.kwargs["k_scale"] = case.kwargs["k_scale"].view(1, 1, 1, 1)
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)


@pytest.mark.parametrize(
    "q_dtype,o_dtype", [(BF16, F32), (F16, F32), (F32, BF16), (E4M3, F16), (E5M2, F32), (BF16, F16)]
)
@pytest.mark.parametrize("given_out", [False, True])
def test_o_data_type(q_dtype, o_dtype, given_out):
    kv_dtype = q_dtype
    case = make_case(19, lens_q=[4, 2], lens_kv=[5, 8], dtype=q_dtype, kv_dtype=kv_dtype, page_size=4)
    kw = case.kwargs
    kw["o_data_type"] = o_dtype
    kw["out"] = poison(torch.empty(kw["out"].shape, dtype=o_dtype)) if given_out else None
    out, lse = call(case, backend="torch")
    assert out.dtype == o_dtype
    check_case(case, out, lse, o_dtype)


def test_out_dtype_follows_given_out_when_o_data_type_is_none():
    case = make_case(20, lens_q=[4], lens_kv=[6], dtype=BF16, page_size=2)
    case.kwargs["out"] = poison(torch.empty(case.kwargs["out"].shape, dtype=F32))
    out, lse = call(case, backend="torch")
    assert out is case.kwargs["out"]
    check_case(case, out, lse, F32)


@pytest.mark.parametrize("len_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape4", [False, True])
@pytest.mark.parametrize("graph", [False, True])
def test_length_and_offset_forms(len_dtype, shape4, graph):
    case = make_case(21, lens_q=[3, 5], lens_kv=[7, 2], offsets="elements", gaps=True, page_size=0)
    kw = case.kwargs
    for name in ("actual_seq_lens_q", "actual_seq_lens_kv", "batch_offsets_q", "batch_offsets_o"):
        t = kw[name].to(len_dtype)
        kw[name] = t.view(-1, 1, 1, 1) if shape4 else t
    kw["is_cuda_graph_compatible"] = graph
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)


def test_cuda_graph_flag_on_cpu_still_validates_host_lengths():
    case = make_case(22, lens_q=[3, 5], lens_kv=[7, 2], page_size=2)
    case.kwargs["actual_seq_lens_kv"] = torch.tensor([7, 9], dtype=torch.int32)  # max_kv is 7
    with pytest.raises(ValueError, match="actual_seq_lens_kv"):
        call(case, backend="torch", is_cuda_graph_compatible=True)


@pytest.mark.parametrize("units", ["elements", "tokens"])
def test_o_offsets_default_to_q_offsets_with_different_head_dims(units):
    case = make_case(23, lens_q=[3, 4], lens_kv=[5, 6], dqk=48, dvo=16, offsets=units, gaps=True, page_size=0)
    del case.kwargs["batch_offsets_o"]
    case.o_start = list(case.q_start)
    case.kwargs["out"] = poison(torch.empty(case.kwargs["q"].shape[:2] + (16,)))
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)


@pytest.mark.parametrize("units", ["elements", "tokens"])
def test_ragged_v_offsets_default_to_k_offsets(units):
    case = make_case(24, lens_q=[3, 4], lens_kv=[5, 6], dqk=32, dvo=16, offsets=units, gaps=True, page_size=0)
    assert case.info["k_start"] != [0, 5]  # gaps: prefix sums would be wrong
    del case.kwargs["batch_offsets_v"]
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)


@pytest.mark.parametrize("omit", ["q", "kv", "both"])
def test_lengths_come_from_token_indptrs_when_omitted(omit):
    """As in FlashInfer: with batch_offsets_units="tokens", a call may omit actual_seq_lens_q (then
    batch_offsets_q's differences) and, K/V ragged, actual_seq_lens_kv (batch_offsets_k's); a
    decreasing indptr is named, and a paged call still needs its KV lengths."""
    case = make_case(26, lens_q=[3, 0, 6, 1], lens_kv=[5, 2, 6, 9], hq=6, hkv=2, offsets="tokens", page_size=0)
    kw = case.kwargs
    assert kw["batch_offsets_q"].tolist() == [0, 3, 3, 9, 10]  # (packed: the differences are the lengths)
    if omit in ("q", "both"):
        kw["actual_seq_lens_q"] = None
    if omit in ("kv", "both"):
        kw["actual_seq_lens_kv"] = None
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)
    kw["actual_seq_lens_q"] = kw["actual_seq_lens_kv"] = None
    bad = kw["batch_offsets_q"].clone()
    bad[2] = 1
    with pytest.raises(ValueError, match="^batch_offsets_q: expected non-decreasing token offsets"):
        call(case, backend="torch", batch_offsets_q=bad)
    paged = make_case(27, lens_q=[3, 5], lens_kv=[5, 6], offsets="tokens", page_size=4)
    paged.kwargs["actual_seq_lens_kv"] = None
    with pytest.raises(ValueError, match="^actual_seq_lens_kv: expected a .B,. int tensor"):
        call(paged, backend="torch")


@pytest.mark.parametrize("window_left", [-1, 4])
def test_query_rows_in_chunks_match_the_oracle(monkeypatch, window_left):
    """The reference scores a sequence's queries in chunks of rows (a memory bound): with the bound
    cut to 3 rows, chunked causal (windowed) rows still match the oracle (each chunk's absolute query
    positions)."""
    from pagedprefill.backends import torch_ref

    case = make_case(28, lens_q=[10, 7], lens_kv=[15, 7], hq=6, hkv=2, dqk=16, window_left=window_left, sinks=True)
    monkeypatch.setattr(torch_ref, "SCORE_BYTES", 4 * 6 * 15 * 3)
    out, lse = call(case, backend="torch")
    check_case(case, out, lse)


def test_packed_lse_in_tokens_and_elements():
    for units in ("elements", "tokens"):
        case = make_case(25, lens_q=[3, 0, 4], lens_kv=[5, 2, 6], offsets=units, lse_layout="packed")
        assert case.kwargs["batch_offsets_units"] == units
        out, lse = call(case, backend="torch")
        check_case(case, out, lse)


def test_strided_q_and_out_views():
    # q as a slice of a fused qkv projection; out as a slice of a wider buffer
    case = make_case(26, lens_q=[4, 3], lens_kv=[6, 5], hq=4, hkv=2, dqk=16, page_size=3)
    q = case.kwargs["q"]
    fused = torch.randn(q.shape[0], 8, 16)
    fused[:, 2:6] = q
    wide = poison(torch.empty(q.shape[0], 4, 40))
    case.kwargs["q"] = fused[:, 2:6]
    case.kwargs["out"] = wide[:, :, 8:24]
    assert not case.kwargs["q"].is_contiguous() and not case.kwargs["out"].is_contiguous()
    out, lse = call(case, backend="torch")
    assert out.data_ptr() == wide[:, :, 8:24].data_ptr()
    check_case(case, out, lse)
    assert torch.isnan(wide[:, :, :8]).all() and torch.isnan(wide[:, :, 24:]).all()


@pytest.mark.parametrize("stats", [False, True])
def test_return_lse_false_refuses_an_lse_buffer_and_leaves_it_alone(stats):
    """An lse buffer (or stats offsets) has no meaning without return_lse: an error, not ignored."""
    case = make_case(27, lens_q=[3, 2], lens_kv=[4, 6], page_size=2, return_lse=False)
    lse_buf = poison(torch.empty(2, 3, 4))
    extra = {"batch_offsets_stats": torch.tensor([0, 12, 20], dtype=torch.int32)} if stats else {}
    with pytest.raises(ValueError, match="batch_offsets_stats: expected None" if stats else "lse: expected None"):
        call(case, backend="torch", lse=lse_buf, **extra)
    assert torch.isnan(lse_buf).all() and torch.isnan(case.kwargs["out"]).all()
    out, lse = call(case, backend="torch")
    assert lse is None
    check_case(case, out, lse)


def test_positional_call_like_flashinfer():
    case = make_case(28, lens_q=[2, 5], lens_kv=[3, 8], page_size=4)
    kw = dict(case.kwargs)
    args = [kw.pop(n) for n in ("q", "k_cache", "v_cache", "scale", "workspace_buffer")]
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(*args, **kw, backend="torch")
    check_case(case, out, lse)


def test_results_are_deterministic():
    case = make_case(29, lens_q=[7, 3], lens_kv=[12, 9], page_size=3, with_out=False)
    a = call(case, backend="torch")
    b = call(case, backend="torch")
    assert torch.equal(as_bytes(a[0]), as_bytes(b[0])) and torch.equal(as_bytes(a[1]), as_bytes(b[1]))


# --------------------------------------------------------------------------------------------
# 16k tokens in one sequence: bounded memory, right on sampled rows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [0, 3])
def test_oracle_reference_rows_agrees_with_reference(page_size):
    # the 16k test trusts reference_rows; it must be the same math as the full oracle
    case = make_case(98, lens_q=[4, 6], lens_kv=[9, 3], hq=4, hkv=2, page_size=page_size, dtype=BF16, kv_dtype=E4M3)
    rows = [(0, 0), (0, 3), (1, 0), (1, 2), (1, 5)]
    got = reference_rows(case, rows)
    ref_out, ref_lse = reference(case)
    for b, i in rows:
        o, lse = got[(b, i)]
        torch.testing.assert_close(o, ref_out[case.o_start[b] + i], atol=1e-12, rtol=0)
        off = b * case.kwargs["max_token_per_sequence"] * 4 + i * 4
        torch.testing.assert_close(lse, ref_lse[off], atol=1e-12, rtol=0)


LONG_SCRIPT = textwrap.dedent(
    """
    import resource, sys, time
    import torch
    sys.path.insert(0, sys.argv[1])
    from oracle import make_case, reference_rows
    from pagedprefill import batch_prefill_with_kv_cache

    T = 16384
    case = make_case(99, lens_q=[T], lens_kv=[T], hq=8, hkv=2, dqk=64, page_size=16,
                     kv_layout="nhd", causal=True, workspace_bytes=1 << 20)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.time()
    out, lse = batch_prefill_with_kv_cache(**case.kwargs)
    elapsed = time.time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rows = [0, 1, 2, 511, 512, 513, 4097, 8191, 8192, 12345, T - 2, T - 1]
    ref = reference_rows(case, [(0, i) for i in rows])
    worst_o = worst_l = 0.0
    for i in rows:
        o, l = ref[(0, i)]
        worst_o = max(worst_o, (out[i].double() - o).abs().max().item())
        worst_l = max(worst_l, (lse[0, i].double() - l).abs().max().item())
    print(f"RESULT {worst_o} {worst_l} {(peak - base) / 2**20} {elapsed}")
    """
)


@pytest.mark.slow
def test_16k_single_sequence_bounded_memory_and_correct():
    tests_dir = str(Path(__file__).parent)
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", LONG_SCRIPT, tests_dir],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    worst_o, worst_l, extra_gib, elapsed = map(float, line.split()[1:])
    assert worst_o < 1e-4, worst_o
    assert worst_l < 1e-3, worst_l
    # the full (Hq, 16k, 16k) float32 score matrix alone would be 8 GiB
    assert extra_gib < 3.0, f"peak memory grew by {extra_gib:.2f} GiB during the call"


@pytest.mark.parametrize("logit", [1e4, 1e6, 1e8])
@pytest.mark.parametrize("sink", [False, True])
def test_large_logits_keep_probabilities_normalised(logit, sink):
    """Keys of equal logits L get equal weights however large L is (P as exp(s - max) / sum, not
    exp(s - lse), whose float32 lse loses log(sum) to rounding at L >= ~1e4): out = mean(V) (with a
    sink far below L: the sink's weight is 0), lse = L + log(n)."""
    n, d = 5, 16
    gen = torch.Generator().manual_seed(int(math.log10(logit)))
    v = torch.randn(1, 1, 8, d, generator=gen)
    c = math.sqrt(logit / d)
    q = torch.full((1, 2, d), c)
    k = torch.full((1, 1, 8, d), c)
    out, lse = cudnn_batch_prefill_with_kv_cache(
        q,
        k,
        v,
        1.0,
        torch.empty(1 << 20, dtype=torch.uint8),
        max_token_per_sequence=1,
        max_sequence_kv=n,
        actual_seq_lens_q=torch.tensor([1]),
        actual_seq_lens_kv=torch.tensor([n]),
        block_tables=torch.tensor([[0]], dtype=torch.int32),
        causal=False,
        return_lse=True,
        sinks=torch.zeros(2) if sink else None,
        backend="torch",
    )
    want = v[0, 0, :n].double().mean(0)
    assert (out[0].double() - want).abs().max().item() < 1e-5
    assert torch.allclose(lse.double().view(-1), torch.full((2,), logit + math.log(n), dtype=torch.float64), rtol=1e-6)
