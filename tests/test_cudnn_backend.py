"""cuDNN backend: pure-Python parts on the CPU, numerics against the oracle on a GPU (``gpu`` mark)."""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys
import types

import pytest
import torch
from oracle import check, make_case, poison

import pagedprefill
from pagedprefill import api
from pagedprefill.backends import cudnn_backend as cb

BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: dict(atol=3e-2, lse_atol=2e-2), FP16: dict(atol=1e-2, lse_atol=5e-3)}


def _batch(case, **override) -> api.PrefillBatch:
    """The normalised PrefillBatch of an oracle case (no backend chosen, nothing run)."""
    return api._normalise(**dict(case.kwargs, **override))


def _spec(**kw) -> cb.GraphSpec:
    base = dict(lens_q=[5, 3], lens_kv=[40, 17], hq=8, hkv=2, dqk=128, page_size=16, dtype=BF16)
    base.update(kw)
    return cb.graph_spec(_batch(make_case(0, **base)))


# --------------------------------------------------------------------------------------------
# CPU: bucketing, cache key, availability, static limits, graph declaration
# --------------------------------------------------------------------------------------------


def test_bucket_functions():
    assert [cb.bucket_batch(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert [cb.bucket_len(n) for n in (0, 1, 64, 65, 256, 257, 4096, 4097, 9000)] == [
        64,
        64,
        64,
        256,
        256,
        1024,
        4096,
        8192,
        16384,
    ]
    for n in range(1, 20000, 37):
        assert cb.bucket_len(n) >= n and cb.bucket_batch(n) >= n


def test_bucketing_keeps_distinct_graphs_few():
    """A serving-like loop (random batch 1..64, random lengths, max_* = the batch maxima) maps to
    few (batch, max_q, max_kv) buckets: after warm-up, 200 calls add at most ~20 new ones."""
    rng = random.Random(0)

    def key():
        b = rng.randint(1, 64)
        lq = [rng.randint(1, 300) for _ in range(b)]
        lkv = [q + rng.randint(0, 3000) for q in lq]
        return cb.bucket_batch(b), cb.bucket_len(max(lq)), cb.bucket_len(max(lkv))

    seen = {key() for _ in range(100)}
    before = len(seen)
    seen |= {key() for _ in range(200)}
    assert len(seen) - before <= 20
    assert len(seen) <= 40


def test_spec_keys_every_layout_and_scalar():
    base = _spec()
    assert base == _spec() and hash(base) == hash(_spec())
    # the anchor's silent reuses: another stride set, another scale
    variants = {
        "hnd": _spec(kv_layout="hnd"),
        "interleaved": _spec(kv_layout="interleaved"),
        "scale": _spec(scale=0.3),
        "noncausal": _spec(causal=False),
        "no_lse": _spec(return_lse=False),
        "packed_lse": _spec(lse_layout="packed"),
        "fp16": _spec(dtype=FP16),
        "page64": _spec(page_size=64),
        "gqa4": _spec(hkv=4),
        "d64": _spec(dqk=64),
        "d192": _spec(dqk=192, dvo=128),
        "ragged": _spec(page_size=0),
        "batch3": _spec(lens_q=[5, 3, 2], lens_kv=[40, 17, 9]),
        "long_q": _spec(max_q=500),
        "long_kv": _spec(max_kv=5000, extra_table_cols=400),
    }
    for name, spec in variants.items():
        assert spec != base, name
    assert base.k_strides != variants["hnd"].k_strides != variants["interleaved"].k_strides
    assert variants["scale"].scale == 0.3
    # everything the graph reads from the tensors is in the spec
    b = _batch(make_case(0, lens_q=[5, 3], lens_kv=[40, 17], hq=8, hkv=2, dqk=128, page_size=16, dtype=BF16))
    s = cb.graph_spec(b)
    assert s.q_strides == tuple(b.q.stride()[:2]) and s.o_strides == tuple(b.out.stride()[:2])
    assert s.k_strides == tuple(b.k.stride()) and s.v_strides == tuple(b.v.stride())
    assert (s.num_pages, s.page_size) == (b.k.shape[0], 16)
    assert (s.q_dtype, s.kv_dtype, s.o_dtype) == ("bfloat16", "bfloat16", "bfloat16")
    assert s.lse and not s.lse_packed and s.causal and s.paged


def test_spec_out_dtype_in_key():
    case = make_case(0, lens_q=[5, 3], lens_kv=[40, 17], hq=8, hkv=2, dqk=128, page_size=16, dtype=BF16)
    case.kwargs["out"] = torch.empty(case.kwargs["out"].shape, dtype=torch.float32)
    assert cb.graph_spec(_batch(case)).o_dtype == "float32"
    assert cb.graph_spec(_batch(case)) != _spec()


def test_spec_is_shared_inside_a_bucket():
    a = _spec(lens_q=[5, 3], lens_kv=[40, 17])
    b = _spec(lens_q=[7, 1], lens_kv=[50, 2], max_q=9, max_kv=60)
    assert a == b  # other lengths, same buckets: one graph
    assert a.batch == 2 and a.max_q == 64 and a.max_kv == 64


def test_table_width_comes_from_our_bucket_not_the_callers_table():
    narrow = _spec(extra_table_cols=0)
    wide = _spec(extra_table_cols=37)  # table much wider than max_sequence_kv / page_size
    assert narrow == wide
    assert wide.table_width == -(-wide.max_kv // wide.page_size)
    # the page-table copy covers every key the lengths can reach
    assert wide.table_width * wide.page_size >= wide.max_kv >= 40


def test_max_kv_is_capped_by_table_reach():
    s = _spec(max_kv=100_000)  # table only reaches 3 pages of 16 keys
    assert s.max_kv == cb.bucket_len(3 * 16) == 64


def test_static_limits():
    assert cb.static_unsupported_reason(_batch(make_case(0, lens_q=[3], lens_kv=[5], dtype=BF16))) is None
    r = cb.static_unsupported_reason(_batch(make_case(0, lens_q=[3], lens_kv=[5], dtype=torch.float32)))
    assert "float32" in r
    r = cb.static_unsupported_reason(
        _batch(make_case(0, lens_q=[3], lens_kv=[5], dqk=192, dvo=64, dtype=BF16))
    )
    assert "Dqk=192" in r and "Dvo=64" in r
    r = cb.static_unsupported_reason(_batch(make_case(0, lens_q=[3], lens_kv=[5], page_size=3, dtype=BF16)))
    assert "power-of-two page size" in r
    r = cb.static_unsupported_reason(
        _batch(make_case(0, lens_q=[3], lens_kv=[5], dtype=BF16, kv_dtype=torch.float8_e4m3fn))
    )
    assert "one dtype" in r
    r = cb.static_unsupported_reason(_batch(make_case(0, lens_q=[3], lens_kv=[5], dqk=72, dtype=BF16)))
    assert r is None  # 72 is a multiple of 8: cuDNN decides


def test_scratch_layout_is_aligned_and_sized():
    spec = _spec()
    lay = cb.scratch_layout(spec, 12345)
    for off in (lay.ints, lay.table, lay.floats, lay.workspace):
        assert off % cb.ALIGN == 0
    assert lay.row >= spec.batch + 1 and lay.row % 16 == 0
    assert lay.table >= lay.ints + cb._ROWS * lay.row * 4
    assert lay.floats >= lay.table + spec.batch * spec.table_width * 4
    assert lay.total >= lay.workspace + 12345 + cb.ALIGN


def test_unavailable_without_gpu():
    assert cb.unavailable_reason(torch.device("cpu")) == "needs a CUDA GPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_requesting_cudnn_on_cpu_raises_helpfully():
    case = make_case(0, lens_q=[3, 2], lens_kv=[5, 9], dtype=BF16)
    with pytest.raises(pagedprefill.BackendUnavailableError) as info:
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="cudnn")
    msg = str(info.value)
    assert "backend='cudnn'" in msg and "needs a CUDA GPU" in msg
    assert torch.isnan(case.kwargs["out"]).all()  # nothing written


def test_missing_package_message(monkeypatch):
    monkeypatch.setattr(cb, "_CUDNN", None)
    monkeypatch.setattr(cb, "_CUDNN_ERROR", None)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # makes `import cudnn` raise ImportError
    with pytest.raises(ImportError) as info:
        cb._cudnn()
    assert "pip install pagedprefill[cudnn]" in str(info.value)
    assert "nvidia-cudnn-frontend" in str(info.value)


def test_package_imports_without_cudnn():
    code = (
        "import sys; sys.modules['cudnn'] = None\n"
        "import pagedprefill, pagedprefill.backends.cudnn_backend as cb\n"
        "assert cb.graph_builds() == 0\n"
        "print(cb.unavailable_reason(__import__('torch').device('cpu')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "needs a CUDA GPU" in out.stdout


def test_build_counter_and_clear():
    n = cb.graph_builds()
    cb.clear_graph_cache()
    assert cb.graph_builds() == n  # a count of builds, not of cached graphs
    assert cb.cached_plans() == []


def _signature_kwargs(doc: str) -> set[str]:
    head = doc.split("\n", 1)[0]
    inner = head[head.index("(") + 1 : head.rindex(")")]
    names = set()
    for part in inner.split(","):
        part = part.strip()
        if ":" in part:
            names.add(part.split(":")[0].strip())
    return names


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_graph_declaration_matches_the_binding(paged, fp8):
    """Declare the graph with the real frontend (pure-Python IR, no GPU needed) and check every
    attribute against the batch and every sdpa keyword against the C++ binding's signature."""
    cudnn = pytest.importorskip("cudnn")
    dtype = torch.float8_e4m3fn if fp8 else BF16
    case = make_case(
        0,
        lens_q=[5, 3, 4],
        lens_kv=[40, 17, 3],
        hq=8,
        hkv=2,
        dqk=128,
        page_size=16 if paged else 0,
        dtype=dtype,
    )
    batch = _batch(case)
    spec = cb.graph_spec(batch)
    g, t = cb.make_graph(spec, cudnn)
    (node,) = g.nodes
    op = "sdpa_fp8" if fp8 else "sdpa"
    allowed = _signature_kwargs(getattr(cudnn._pybind_module.backend_graph, op).__doc__)
    captured = set(node.params) | set(node.inputs)
    assert captured <= allowed, captured - allowed
    bb, sq, skv = spec.batch, spec.max_q, spec.max_kv
    assert (bb, sq) == (4, 64)
    q = t["q"]
    s0, s1 = batch.q.stride()[:2]
    assert list(q.dim) == [bb, 8, sq, 128] and list(q.stride) == [sq * s0, s1, s0, 1]
    assert q.ragged_offset is t["off_q"] and list(t["off_q"].dim) == [bb + 1, 1, 1, 1]
    o = t["o"]
    so0, so1 = batch.out.stride()[:2]
    assert list(o.dim) == [bb, 8, sq, 128] and list(o.stride) == [sq * so0, so1, so0, 1]
    assert o.ragged_offset is t["off_o"] and not o.is_virtual
    st = t["stats"]
    assert list(st.dim) == [bb, 8, sq, 1] and list(st.stride) == [sq * 8, 1, 8, 1]
    assert st.ragged_offset is t["off_stats"]
    assert node.params["attn_scale"] == batch.scale
    assert node.params["use_padding_mask"] is True
    if fp8:
        assert node.params["use_causal_mask_bottom_right"] is True
    else:
        assert node.params["diagonal_alignment"] == cudnn.diagonal_alignment.BOTTOM_RIGHT
        assert node.params["diagonal_band_right_bound"] == 0
    if paged:
        assert list(t["k"].dim) == list(batch.k.shape) and list(t["k"].stride) == list(batch.k.stride())
        assert list(t["v"].stride) == list(batch.v.stride())
        w = spec.table_width
        assert list(t["table_k"].dim) == [bb, 1, w, 1] and w == -(-skv // 16)
        assert node.params["paged_attention_max_seq_len_kv"] == skv
        assert node.inputs["paged_attention_k_table"] is t["table_k"]
    else:
        k0, k1 = batch.k.stride()[:2]
        assert list(t["k"].stride) == [skv * k0, k1, k0, 1] and t["k"].ragged_offset is t["off_k"]
        assert "paged_attention_max_seq_len_kv" not in node.params


# --------------------------------------------------------------------------------------------
# CPU: the whole run() pipeline with a pure-torch stand-in for the cuDNN plan
# --------------------------------------------------------------------------------------------


def _emulated_cudnn(plan, batch, views):
    """Do what the cuDNN graph is documented to do, reading ONLY the scratch this backend wrote:
    per-sequence lengths (padding mask), ragged offsets in elements, the page-table copy, bottom-right
    causal mask; write O (and Stats) rows i < seq_len_q only. Rows with no visible key must never
    reach it (the backend skips them)."""
    spec = plan.spec
    bb, hq, hkv = spec.batch, spec.num_qo_heads, spec.num_kv_heads
    ints = views.ints.to(torch.int64)
    seq_q, seq_kv, off_q, off_o, off_k, off_v, off_s = (ints[r] for r in range(7))
    q, k, v, out = batch.q, batch.k, batch.v, batch.out
    for b in range(bb):
        lq, lkv = int(seq_q[b]), int(seq_kv[b])
        if lq == 0:
            continue
        qb = torch.as_strided(
            q, (lq, hq, spec.head_dim_qk), (*spec.q_strides, 1), q.storage_offset() + int(off_q[b])
        )
        if spec.paged:
            j = torch.arange(lkv)
            pages = views.table[b].to(torch.int64)[j // spec.page_size]
            assert pages.max() < spec.num_pages
            kb, vb = k[pages, :, j % spec.page_size], v[pages, :, j % spec.page_size]
        else:
            kb = torch.as_strided(
                k, (lkv, hkv, spec.head_dim_qk), (*spec.k_strides, 1), k.storage_offset() + int(off_k[b])
            )
            vb = torch.as_strided(
                v, (lkv, hkv, spec.head_dim_vo), (*spec.v_strides, 1), v.storage_offset() + int(off_v[b])
            )
        kh = kb.float().repeat_interleave(hq // hkv, dim=1)
        vh = vb.float().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("ihd,jhd->hij", qb.float(), kh) * spec.scale
        if spec.causal:
            i = torch.arange(lq)[:, None]
            s = s.masked_fill(torch.arange(lkv)[None, :] > i + lkv - lq, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # (Hq, lq)
        assert torch.isfinite(lse).all(), "a row without visible keys reached cuDNN"
        o = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), vh)
        ob = torch.as_strided(
            out, (lq, hq, spec.head_dim_vo), (*spec.o_strides, 1), out.storage_offset() + int(off_o[b])
        )
        ob.copy_(o.to(out.dtype))
        if spec.lse:
            torch.as_strided(batch.lse, (lq, hq), (hq, 1), batch.lse.storage_offset() + int(off_s[b])).copy_(
                lse.T
            )


def _emulated_plan(batch, cover: bool = False) -> cb._Plan:
    """The plan of this batch's own buckets, or (``cover``) of a larger graph that covers it."""
    spec = cb.graph_spec(batch)
    if cover:
        big_kv = spec.max_kv * 4
        width = -(-big_kv // spec.page_size) if spec.paged else 0
        spec = dataclasses.replace(
            spec, batch=spec.batch * 4, max_q=spec.max_q * 2, max_kv=big_kv, table_width=width
        )
    return cb._Plan(spec, None, {}, cb.scratch_layout(spec, 4096), "emulated", 0.0)


@pytest.fixture
def emulated(monkeypatch):
    """Route backend='cudnn' on the CPU through run() with the emulated plan. ``device_path``: drop
    the host metadata before the api fills ``batch.meta``, as in CUDA-graph mode (lengths on the
    device), so run() takes its device-ops-only path."""
    opts = {"device_path": False, "plans": [], "cover": False}

    def plan_for(batch):
        plan = batch.extras.get("cudnn_plan")
        if plan is None:
            plan = batch.extras["cudnn_plan"] = _emulated_plan(batch, opts["cover"])
            opts["plans"].append(plan)
            if opts["device_path"]:
                batch.host = None
        return plan

    monkeypatch.setattr(cb, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(cb, "_plan_for", plan_for)
    monkeypatch.setattr(cb, "_EXECUTE", _emulated_cudnn)
    return opts


def _random_case(seed, **over):
    rng = random.Random(seed)
    dqk, dvo = rng.choice([(64, 64), (128, 128), (192, 128)])
    page_size = rng.choice([0, 1, 4, 16])
    hkv = rng.choice([1, 2])
    bsz = rng.randint(1, 6)
    lens_q = [rng.randint(0, 9) for _ in range(bsz)]
    lens_kv = [rng.choice([0, rng.randint(0, 30)]) for _ in range(bsz)]
    offsets = rng.choice(["none", "elements", "tokens"])
    kw = dict(
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=hkv * rng.choice([1, 2, 4]),
        hkv=hkv,
        dqk=dqk,
        dvo=dvo,
        page_size=page_size,
        kv_layout="interleaved" if dqk == dvo and rng.random() < 0.3 else rng.choice(["nhd", "hnd"]),
        dtype=BF16,
        causal=rng.random() < 0.7,
        offsets=offsets,
        gaps=offsets != "none" and rng.random() < 0.6,
        lse_layout=rng.choice(["padded", "packed"]),
        return_lse=rng.random() < 0.85,
        max_q=max(lens_q + [1]) + rng.randint(0, 4),
        max_kv=max(lens_kv + [1]) + rng.randint(0, 4),
        extra_table_cols=rng.randint(0, 3),
        scale=rng.choice([None, 0.2]),
        with_out=rng.random() < 0.8,
    )
    kw.update(over)
    return make_case(seed, **kw)


@pytest.mark.parametrize("seed", range(40))
def test_run_pipeline_emulated(emulated, seed, monkeypatch):
    emulated["device_path"] = seed % 2 == 1
    emulated["cover"] = seed % 8 >= 4  # a larger covering graph serves the call
    if seed % 4 >= 2:  # the torch-ops path (no Triton) instead of the one-launch preparation
        monkeypatch.setattr(cb, "_prepare", lambda batch, plan, views: False)
    case = _random_case(seed)
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="cudnn")
    check(case, out, lse, **TOL[BF16])
    (plan,) = emulated["plans"][-1:]
    assert plan.spec.batch >= len(case.lens_q)


class _Fill:
    """Stand-in for a backend module in api._fill_metadata (only the scratch size matters)."""

    NAME = "cudnn"

    def __init__(self, plan):
        self.plan = plan

    def workspace_bytes(self, batch):
        return self.plan.layout.total


def _prepared(case, plan, device_path):
    """A batch with its metadata filled the way api does it, lengths on the host or the device."""
    batch = _batch(case, workspace_buffer=torch.zeros(1 << 20, dtype=torch.uint8))
    if device_path:
        batch.host = None
    api._fill_metadata(batch, _Fill(plan))
    return batch


@pytest.mark.parametrize("seed", range(60))
def test_host_and_device_metadata_agree(seed):
    """The Python (host lengths) and the device-ops (CUDA-graph) paths write the same cuDNN
    metadata and page table, and mark the same rows for the empty-row fix-up."""
    case = _random_case(1000 + seed, page_size=random.Random(seed).choice([0, 1, 4, 16]))
    plan = _emulated_plan(_batch(case))
    got = {}
    for device_path in (False, True):
        batch = _prepared(case, plan, device_path)
        views = cb._views(batch, plan)
        if device_path:
            fx = cb._write_device_metadata(batch, plan, views)
        else:
            fx = cb._write_host_metadata(batch, plan, views)
        if plan.spec.paged:
            cb._write_table(batch, plan, views)
        table = views.table.clone() if plan.spec.paged else None
        got[device_path] = (views.ints[: cb._R_FIX].clone(), table, fx)
    (ih, th, fh), (idv, td, fd) = got[False], got[True]
    assert torch.equal(ih, idv)
    if plan.spec.paged:
        assert torch.equal(th, td)
    if fh is not None:
        assert torch.equal(fh.to(torch.int64), fd)
    else:  # nothing to fix: every range of the device path is empty
        assert torch.equal(fd[0], fd[1]) and torch.equal(fd[2], fd[3])


@pytest.mark.parametrize("seed", range(40))
def test_prepare_kernel_matches_the_torch_path(seed):
    """The one-launch Triton preparation (run() uses it wherever Triton runs) writes the same
    cuDNN metadata rows 0..6 and page table as the torch-ops path, and the same out / lse bytes
    (0 / -inf on exactly the rows without keys, every other byte untouched)."""
    case = _random_case(3000 + seed, page_size=random.Random(seed).choice([0, 1, 4, 16]))
    plan = _emulated_plan(_batch(case))
    device_path = seed % 2 == 1
    got = []
    for use_kernel in (False, True):
        batch = _prepared(case, plan, device_path)
        gen = torch.Generator().manual_seed(seed)
        batch.out.copy_(torch.randn(batch.out.shape, generator=gen).to(batch.out.dtype))
        if batch.lse is not None:
            batch.lse.copy_(torch.randn(batch.lse.shape, generator=gen))
        views = cb._views(batch, plan)
        views.ints.fill_(-3)
        if plan.spec.paged:
            views.table.fill_(-3)
        if use_kernel:
            assert cb._prepare(batch, plan, views)
        else:
            fx = cb._write_host_metadata(batch, plan, views) if batch.host else None
            if batch.host is None:
                fx = cb._write_device_metadata(batch, plan, views)
            if plan.spec.paged:
                cb._write_table(batch, plan, views)
            if fx is not None:
                cb._fill_empty_rows(batch, plan, fx)
        lse = batch.lse.clone() if batch.lse is not None else None
        table = views.table.clone() if plan.spec.paged else None
        got.append((views.ints[: cb._R_LAST].clone(), table, batch.out.clone(), lse))
    (it, tt, ot, lt), (ik, tk, ok, lk) = got
    assert torch.equal(it, ik), (it, ik)
    if plan.spec.paged:
        assert torch.equal(tt, tk)
    assert torch.equal(ot.view(torch.int16), ok.view(torch.int16))
    if lt is not None:
        assert torch.equal(lt, lk)


@pytest.mark.parametrize("seed", range(20))
def test_page_table_copy_reads_only_listed_pages(seed):
    """Entry (b, j) of our table is block_tables[b, min(j, last page of b)]: entries the caller lists
    past a sequence's last page (garbage, or freed pages) are never handed to cuDNN."""
    rng = random.Random(seed)
    ps = rng.choice([1, 4, 16])
    bsz = rng.randint(1, 7)
    lens_kv = [rng.choice([0, rng.randint(1, 70)]) for _ in range(bsz)]
    lens_q = [rng.randint(1, 5) for _ in range(bsz)]
    case = make_case(seed, lens_q=lens_q, lens_kv=lens_kv, page_size=ps, extra_table_cols=rng.randint(0, 5))
    bt = case.kwargs["block_tables"]
    bt[bt < 0] = 10_000 + seed  # unused entries: out-of-range ids (still clamped if ever read)
    plan = _emulated_plan(_batch(case))
    batch = _prepared(case, plan, device_path=seed % 2 == 1)
    views = cb._views(batch, plan)
    if batch.host is None:
        cb._write_device_metadata(batch, plan, views)
    else:
        cb._write_host_metadata(batch, plan, views)
    cb._write_table(batch, plan, views)
    table, npages = views.table, plan.spec.num_pages
    for b in range(plan.spec.batch):
        need = -(-lens_kv[b] // ps) if b < bsz else 0
        for j in range(plan.spec.table_width):
            if need and lens_q[b]:
                assert int(table[b, j]) == int(bt[b, min(j, need - 1)])
            else:
                assert 0 <= int(table[b, j]) < npages


def _kernel_ops(fn) -> tuple[int, list[str]]:
    """(ops that compute or copy, every aten op) dispatched by ``fn`` (views/metadata ops excluded
    from the first number)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "slice", "select", "unbind", "as_strided", "alias", "unsqueeze", "expand", "detach"}
    names: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return sum(n not in views and n != "lift_fresh" for n in names), names


class _CountingLaunch:
    """Stand-in for ``_prepare_kernel``: records launches (grid, constexprs), runs nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, kw))


@pytest.mark.parametrize("triton_path", [True, False], ids=["triton", "torch-ops"])
@pytest.mark.parametrize("device_path", [False, True], ids=["host-lengths", "device-lengths"])
def test_per_call_device_work_is_fixed_and_independent_of_batch(device_path, triton_path, monkeypatch):
    """The host cost of a call is dominated by its launches: run() issues a fixed handful, none per
    sequence, whatever the batch size. Where Triton runs: ONE launch (metadata, page table and the
    rows without keys) and no torch op but views. Without Triton: lengths on the host, one copy +
    4 ops for the table; lengths on the device, 11 ops for the metadata, 4 for the table, 6 for
    the rows without keys."""
    monkeypatch.setattr(cb, "_EXECUTE", lambda plan, batch, views: cb._operands(plan, batch, views))
    launcher = _CountingLaunch()
    if triton_path:
        monkeypatch.setattr(cb, "_prepare_kernel", launcher)
    else:
        monkeypatch.setattr(cb, "_prepare", lambda batch, plan, views: False)
    counts = {}
    for bsz in (1, 5, 40):
        lens_kv = [17 + 3 * b for b in range(bsz)]
        case = make_case(
            bsz, lens_q=[4] * bsz, lens_kv=lens_kv, hq=4, hkv=2, dqk=64, page_size=16, dtype=BF16
        )
        plan = _emulated_plan(_batch(case))
        batch = _prepared(case, plan, device_path)
        batch.extras["cudnn_plan"] = plan
        plan.consts = cb._make_consts(plan.spec, plan.layout, batch.device)
        counts[bsz] = _kernel_ops(lambda batch=batch: cb.run(batch))
    assert len({c[0] for c in counts.values()}) == 1, counts
    assert len({len(c[1]) for c in counts.values()}) == 1, counts
    kernels, names = counts[40]
    if triton_path:
        assert kernels == 0, names
        assert len(launcher.launches) == 3  # one per call
        fixes = {kw["FIX"] for _grid, kw in launcher.launches}
        assert fixes == {device_path}  # host lengths, every row sees a key: no fix-up work
    elif device_path:
        assert kernels <= 21 and len(names) <= 80, names
    else:
        assert kernels <= 5 and len(names) <= 30, names


def test_empty_rows_fixup_only_when_needed_with_host_lengths():
    case = make_case(0, lens_q=[3, 4], lens_kv=[9, 20], hq=4, hkv=2, dqk=64, page_size=16, dtype=BF16)
    plan = _emulated_plan(_batch(case))
    batch = _prepared(case, plan, device_path=False)
    assert cb._write_host_metadata(batch, plan, cb._views(batch, plan)) is None
    case = make_case(0, lens_q=[3, 4], lens_kv=[0, 2], hq=4, hkv=2, dqk=64, page_size=16, dtype=BF16)
    batch = _prepared(case, plan, device_path=False)
    assert cb._write_host_metadata(batch, plan, cb._views(batch, plan)) is not None


def test_call_key_determines_the_spec():
    """Calls with equal cheap keys have equal GraphSpecs (the key may only be finer)."""
    by_key = {}
    for seed in range(150):
        case = _random_case(2000 + seed)
        batch = _batch(case)
        spec = cb.graph_spec(batch)
        assert by_key.setdefault(cb._call_key(batch), spec) == spec


def test_serving_loop_bucketing_builds_few_graphs():
    """One KV cache (fixed num_pages, strides), random batch 1..64, q 16..2048, prefix 0..8192,
    page 16, max_* = the batch maxima, block table as wide as the longest sequence needs: after
    warm-up, 1000 calls need at most 20 new graphs."""
    rng = random.Random(0)
    cache = torch.empty(4096, 2, 16, 64, dtype=BF16).permute(0, 2, 1, 3)
    q = torch.empty(1, 4, 64, dtype=BF16)

    def spec():
        bsz = rng.randint(1, 64)
        lq = [rng.randint(16, 2048) for _ in range(bsz)]
        lkv = [x + rng.randint(0, 8192) for x in lq]
        width = -(-max(lkv) // 16)
        batch = api.PrefillBatch(
            q=q.expand(sum(lq), 4, 64),
            k=cache,
            v=cache,
            out=q.expand(sum(lq), 4, 64),
            lse=torch.empty(1),
            meta=torch.empty(0),
            block_tables=torch.empty(bsz, width, dtype=torch.int32),
            scratch=torch.empty(0),
            batch_size=bsz,
            max_q=max(lq),
            max_kv=max(lkv),
            num_qo_heads=4,
            num_kv_heads=2,
            head_dim_qk=64,
            head_dim_vo=64,
            page_size=16,
            scale=0.125,
            causal=True,
            out_dtype=BF16,
        )
        return cb.graph_spec(batch)

    seen = {spec() for _ in range(200)}
    before = len(seen)
    seen |= {spec() for _ in range(1000)}
    assert len(seen) - before <= 20, sorted(s.describe() for s in seen)


# --------------------------------------------------------------------------------------------
# GPU: numerics against the oracle
# --------------------------------------------------------------------------------------------


def _run(case, **extra):
    return pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="cudnn", **extra)


def _check(case, dtype, result):
    out, lse = result
    check(case, out, lse, **TOL[dtype])


def _gpu_case(seed, **kw):
    kw.setdefault("device", "cuda")
    kw.setdefault("workspace_bytes", 64 << 20)
    return make_case(seed, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(24))
def test_random_against_oracle(seed):
    rng = random.Random(seed)
    dtype = rng.choice([BF16, FP16])
    dqk, dvo = rng.choice([(64, 64), (128, 128), (192, 128)])
    page_size = rng.choice([0, 1, 16, 64])
    kv_layout = "interleaved" if dqk == dvo and rng.random() < 0.3 else rng.choice(["nhd", "hnd"])
    hkv = rng.choice([1, 2, 4])
    hq = hkv * rng.choice([1, 2, 4])
    bsz = rng.randint(1, 5)
    lens_q = [rng.randint(0, 40) for _ in range(bsz)]
    lens_kv = [rng.randint(0, 120) for _ in range(bsz)]
    offsets = rng.choice(["none", "elements", "tokens"])
    case = _gpu_case(
        seed,
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=hq,
        hkv=hkv,
        dqk=dqk,
        dvo=dvo,
        page_size=page_size,
        kv_layout=kv_layout,
        dtype=dtype,
        causal=rng.random() < 0.7,
        offsets=offsets,
        gaps=offsets != "none" and rng.random() < 0.5,
        lse_layout=rng.choice(["padded", "packed"]),
        return_lse=rng.random() < 0.85,
        max_q=max(lens_q + [1]) + rng.randint(0, 5),
        max_kv=max(lens_kv + [1]) + rng.randint(0, 5),
        extra_table_cols=rng.randint(0, 4),
        scale=rng.choice([None, 0.1, 1.0]),
        lens_on_device=rng.random() < 0.5,
    )
    _check(case, dtype, _run(case))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_grid(dtype, dims, page_size):
    case = _gpu_case(
        1,
        lens_q=[17, 1, 30],
        lens_kv=[70, 33, 30],
        hq=8,
        hkv=2,
        dqk=dims[0],
        dvo=dims[1],
        page_size=page_size,
        dtype=dtype,
    )
    _check(case, dtype, _run(case))


@pytest.mark.gpu
def test_anchor_contiguous_then_interleaved_kv():
    before = cb.graph_builds()
    for layout in ("hnd", "interleaved", "nhd"):
        case = _gpu_case(
            2,
            lens_q=[9, 4],
            lens_kv=[50, 20],
            hq=4,
            hkv=2,
            dqk=128,
            page_size=16,
            kv_layout=layout,
            dtype=BF16,
        )
        _check(case, BF16, _run(case))
    assert cb.graph_builds() - before <= 3


@pytest.mark.gpu
def test_anchor_same_shapes_other_scale():
    for scale in (0.05, 1 / math.sqrt(128), 0.5):
        case = _gpu_case(
            3, lens_q=[9, 4], lens_kv=[50, 20], hq=4, hkv=2, dqk=128, page_size=16, dtype=BF16, scale=scale
        )
        _check(case, BF16, _run(case))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 16])
def test_anchor_batch_without_offsets(page_size):
    case = _gpu_case(
        4,
        lens_q=[7, 12, 3, 9],
        lens_kv=[30, 12, 64, 9],
        hq=4,
        hkv=4,
        dqk=128,
        page_size=page_size,
        dtype=BF16,
    )
    _check(case, BF16, _run(case))


@pytest.mark.gpu
def test_anchor_block_table_wider_than_max_kv():
    case = _gpu_case(
        5,
        lens_q=[6, 5, 8],
        lens_kv=[33, 7, 48],
        hq=4,
        hkv=1,
        dqk=128,
        page_size=16,
        dtype=BF16,
        extra_table_cols=9,
    )
    assert case.kwargs["block_tables"].shape[1] > -(-48 // 16)
    _check(case, BF16, _run(case))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_anchor_lse_padding_rows_untouched(layout):
    # max_q well above the real lengths: rows i >= q_len of the padded lse must keep their NaN poison
    case = _gpu_case(
        6,
        lens_q=[3, 7, 1],
        lens_kv=[20, 40, 9],
        hq=4,
        hkv=2,
        dqk=64,
        page_size=16,
        dtype=BF16,
        lse_layout=layout,
        max_q=16,
    )
    _check(case, BF16, _run(case))


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [False, True])
def test_rows_without_visible_keys(on_device):
    case = _gpu_case(
        7,
        lens_q=[5, 9, 0, 4],
        lens_kv=[0, 4, 6, 20],
        hq=4,
        hkv=2,
        dqk=128,
        page_size=16,
        dtype=BF16,
        lens_on_device=on_device,
    )
    out, lse = _run(case, is_cuda_graph_compatible=on_device)
    _check(case, BF16, (out, lse))
    assert (out[:5].float() == 0).all()  # kv_len 0
    assert torch.isneginf(lse[0, :5]).all()
    assert torch.isneginf(lse[1, :5]).all() and torch.isfinite(lse[1, 5:9]).all()  # causal q_len > kv_len


def _last_page_tails(case):
    """(page, first unused slot) of each sequence's last page, for sequences with a partial page."""
    ps, table = case.info["page_size"], case.info["block_tables"]
    return [
        (int(table[b, (n - 1) // ps]), n % ps)
        for b, n in enumerate(case.lens_kv)
        if n % ps and case.lens_q[b]
    ]


@pytest.mark.gpu
def test_finite_garbage_past_kv_len_is_harmless():
    """cuDNN reads whole pages; slots past kv_len in the last page hold garbage in a real cache.
    Any FINITE garbage (here +-3e4) must not change the result."""
    case = _gpu_case(8, lens_q=[5, 9, 3], lens_kv=[21, 35, 7], dqk=128, page_size=16, dtype=BF16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for page, slot in _last_page_tails(case):
        for name in ("k_cache", "v_cache"):
            tail = case.kwargs[name][page, :, slot:]
            sign = torch.randint(0, 2, tail.shape, generator=gen, device="cuda") * 2 - 1
            tail.copy_((sign * 3e4).to(BF16))
    _check(case, BF16, _run(case))


@pytest.mark.gpu
def test_nan_in_pages_listed_past_the_last_page_does_not_leak():
    """block_tables entries past ceil(kv_len / page_size) are ignored (spec): pages they name may be
    freed and hold NaN. Our page-table copy never hands them to cuDNN."""
    case = _gpu_case(
        9,
        lens_q=[5, 9, 3],
        lens_kv=[21, 35, 7],
        hq=4,
        hkv=2,
        dqk=128,
        page_size=16,
        dtype=BF16,
        extra_table_cols=4,
    )
    table = case.info["block_tables"]
    used = {int(x) for x in table[table >= 0]}
    spare = [p for p in range(case.kwargs["k_cache"].shape[0]) if p not in used]
    for p in spare:
        case.kwargs["k_cache"][p] = float("nan")
        case.kwargs["v_cache"][p] = float("nan")
    for b, n in enumerate(case.lens_kv):
        table[b, -(-n // 16) :] = spare[b % len(spare)]
    case.kwargs["block_tables"].copy_(table)
    _check(case, BF16, _run(case))


@pytest.mark.gpu
def test_nan_past_kv_len_in_a_last_page_stays_in_that_sequence():
    """The documented cuDNN limitation (NaN/Inf in the unused slots of a sequence's last page
    reach that sequence's output through 0 * NaN) touches no other sequence."""
    from oracle import reference

    case = _gpu_case(
        14, lens_q=[5, 9, 3], lens_kv=[21, 35, 7], hq=4, hkv=2, dqk=128, page_size=16, dtype=BF16
    )
    page, slot = _last_page_tails(case)[0]  # sequence 0's last page
    case.kwargs["k_cache"][page, :, slot:] = float("nan")
    case.kwargs["v_cache"][page, :, slot:] = float("nan")
    out, _ = _run(case)
    ref, _ = reference(case)
    first_other = case.o_start[1]
    for row, expected in ref.items():
        if row >= first_other:
            assert (out[row].double().cpu() - expected).abs().max() <= TOL[BF16]["atol"], row


def _graph_scenario(kw, lens_q, lens_kv, seed, page_size=16):
    """Write new lengths, data and a new block table into the live tensors ``kw`` (shapes fixed) and
    return the oracle Case describing them."""
    from oracle import Case

    gen = torch.Generator().manual_seed(seed)
    for name in ("q", "k_cache", "v_cache"):
        t = kw[name]
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    kw["actual_seq_lens_q"].copy_(torch.tensor(lens_q, dtype=torch.int32))
    kw["actual_seq_lens_kv"].copy_(torch.tensor(lens_kv, dtype=torch.int32))
    num_pages, width = kw["k_cache"].shape[0], kw["block_tables"].shape[1]
    table = torch.full((len(lens_q), width), -7, dtype=torch.int32)
    pages = iter(torch.randperm(num_pages, generator=gen).tolist())
    for b, n in enumerate(lens_kv):
        for j in range(-(-n // page_size)):
            table[b, j] = next(pages)
    kw["block_tables"].copy_(table)
    starts = [sum(lens_q[:b]) for b in range(len(lens_q))]
    info = {"page_size": page_size, "block_tables": table}
    return Case(kw, list(lens_q), list(lens_kv), starts, starts, None, info)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Capture once, replay with other lengths (kv_len 0, q_len 0, causal q_len > kv_len, the
    captured maxima), other block tables and other data: every replay is right."""
    live = _gpu_case(
        10,
        lens_q=[16] * 4,
        lens_kv=[64] * 4,
        hq=8,
        hkv=2,
        dqk=128,
        page_size=16,
        dtype=BF16,
        max_q=16,
        max_kv=64,
        lens_on_device=True,
    )
    kw = dict(live.kwargs, backend="cudnn", is_cuda_graph_compatible=True)
    scenarios = [
        ([5, 3, 8, 16], [20, 7, 33, 64]),
        ([16, 1, 0, 9], [64, 0, 5, 9]),  # kv_len 0 with q rows, q_len 0, q_len > kv_len
        ([12, 16, 4, 2], [3, 64, 0, 40]),  # causal overhang, kv_len 0
        ([16, 16, 16, 16], [64, 64, 64, 64]),  # the captured maxima
        ([1, 7, 1, 13], [1, 17, 0, 2]),
    ]
    _graph_scenario(kw, *scenarios[0], seed=0)
    pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)  # warm-up: builds the graph
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)
    torch.cuda.current_stream().wait_stream(s)
    builds = cb.graph_builds()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)
    assert cb.graph_builds() == builds
    for i, (lens_q, lens_kv) in enumerate(scenarios[1:] + scenarios[:1] + scenarios[1:3]):
        case = _graph_scenario(kw, lens_q, lens_kv, seed=100 + i)
        poison(out)
        poison(lse)
        g.replay()
        torch.cuda.synchronize()
        check(case, out, lse, **TOL[BF16])


@pytest.mark.gpu
def test_bucketing_limits_graph_builds():
    """A serving loop: ONE KV cache tensor (fixed num_pages), random batch 1..64, q 16..2048,
    prefix 0..8192, page 16, max_* = the batch maxima, a fresh block table per call as wide as the
    batch needs. After warm-up, 1000 calls build at most 20 graphs."""
    rng = random.Random(12)
    hq, hkv, d, ps, max_b = 4, 2, 64, 16, 64
    num_pages = max_b * -(-(2048 + 8192) // ps)
    cache = torch.randn(2, num_pages, ps, hkv, d, device="cuda").to(BF16).permute(0, 1, 3, 2, 4)
    q_buf = torch.randn(max_b * 2048, hq, d, device="cuda").to(BF16)
    out_buf = torch.empty_like(q_buf)
    lse_buf = torch.empty(max_b * 2048 * hq, device="cuda")
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    def call(small=False):
        bsz = rng.randint(1, 2) if small else rng.randint(1, max_b)
        lq = [rng.randint(16, 40 if small else 2048) for _ in range(bsz)]
        lkv = [x + rng.randint(0, 100 if small else 8192) for x in lq]
        need = [-(-n // ps) for n in lkv]
        perm = torch.randperm(num_pages)[: sum(need)].tolist()
        table = torch.zeros(bsz, max(need), dtype=torch.int32)
        at = 0
        for b, n in enumerate(need):
            table[b, :n] = torch.tensor(perm[at : at + n], dtype=torch.int32)
            at += n
        rows, max_q = sum(lq), max(lq)
        kwargs = dict(
            q=q_buf[:rows],
            k_cache=cache[0],
            v_cache=cache[1],
            scale=d**-0.5,
            workspace_buffer=ws,
            max_token_per_sequence=max_q,
            max_sequence_kv=max(lkv),
            actual_seq_lens_q=torch.tensor(lq, dtype=torch.int32),
            actual_seq_lens_kv=torch.tensor(lkv, dtype=torch.int32),
            block_tables=table.cuda(),
            causal=True,
            return_lse=True,
            out=out_buf[:rows],
            lse=lse_buf[: bsz * max_q * hq].view(bsz, max_q, hq),
        )
        if small:
            poison(kwargs["lse"])  # padded rows past each q_len must stay untouched
        out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**kwargs, backend="cudnn")
        if small:  # check against the oracle on a compact copy of the pages this call reads
            from oracle import Case

            used = sorted({int(p) for b, n in enumerate(need) for p in table[b, :n]})
            remap = {p: i for i, p in enumerate(used)}
            compact = table.clone().apply_(lambda p: remap.get(p, 0))
            idx = torch.tensor(used, device="cuda")
            kwargs.update(k_cache=cache[0][idx], v_cache=cache[1][idx])
            starts = [sum(lq[:b]) for b in range(bsz)]
            case = Case(kwargs, lq, lkv, starts, starts, None, {"page_size": ps, "block_tables": compact})
            check(case, out, lse, **TOL[BF16])

    for _ in range(300):
        call()
    before = cb.graph_builds()
    for i in range(1000):
        call(small=i % 250 == 0)
    assert cb.graph_builds() - before <= 20


@pytest.mark.gpu
def test_fp8_refusal_or_result():
    case = _gpu_case(
        13, lens_q=[5, 3], lens_kv=[20, 9], hq=4, hkv=2, dqk=128, page_size=16, dtype=torch.float8_e4m3fn
    )
    major, _ = torch.cuda.get_device_capability()
    if major < 10:
        with pytest.raises((ValueError, NotImplementedError)) as info:
            _run(case)
        assert "cuDNN refuses fp8 attention on this GPU" in str(info.value)
        assert torch.isnan(case.kwargs["out"].float()).all()  # nothing written
    else:
        out, lse = _run(case)
        check(case, out, lse, atol=6e-2, lse_atol=5e-2)


def test_covering_plan_is_the_smallest_built_graph_within_the_ratios(monkeypatch):
    """A spec whose exact bucket was never built runs on a built graph that differs only in batch /
    max_q / max_kv buckets, each at least the needed one and at most COVER_RATIOS times it."""
    base = _spec(lens_q=[5, 3], lens_kv=[40, 17])
    rest = (0, 123, "auto")

    def spec(b, q, kv, **kw):
        return dataclasses.replace(base, batch=b, max_q=q, max_kv=kv, table_width=-(-kv // 16), **kw)

    def plan(sp):
        return cb._Plan(sp, None, {}, cb.scratch_layout(sp, 0), "fake", 0.0)

    monkeypatch.setattr(cb, "COVER_RATIOS", (2, 4, 4))
    need = spec(2, 64, 64)
    built = {
        "too big": spec(2, 64, 1024),
        "covers": spec(4, 256, 256),
        "smaller cover": spec(2, 64, 256),
        "batch too big": spec(8, 64, 64),
        "too small": spec(2, 64, 16),
        "other causal": spec(2, 64, 64, causal=not base.causal),
    }
    cache = {(sp, *rest): plan(sp) for sp in built.values()}
    monkeypatch.setattr(cb, "_CACHE", cache)
    got = cb._covering_plan((need, *rest))
    assert got is not None and got.spec == built["smaller cover"]
    assert cb._covering_plan((need, 1, 123, "auto")) is None  # another device
    monkeypatch.setattr(cb, "COVER_RATIOS", (1, 1, 1))
    assert cb._covering_plan((need, *rest)) is None


def test_a_plan_built_for_another_threads_handle_is_resolved_again(monkeypatch):
    """batch.extras may carry a plan from a call cached by a thread that has since ended: a plan
    keyed by another cuDNN handle is never executed with this thread's handle."""
    batch = _batch(make_case(0, lens_q=[3], lens_kv=[9], hq=4, hkv=2, dqk=64, page_size=16, dtype=BF16))
    spec = cb.graph_spec(batch)
    old = cb._Plan(spec, None, {}, cb.scratch_layout(spec, 0), "fake", 0.0, key=(spec, 0, 111, "auto"))
    new = cb._Plan(spec, None, {}, cb.scratch_layout(spec, 0), "fake", 0.0, key=(spec, 0, 222, "auto"))
    monkeypatch.setattr(cb, "_device_index", lambda device: 0)
    monkeypatch.setattr(cb, "_handle", lambda dev: types.SimpleNamespace(backend_handle=222))
    monkeypatch.setattr(cb, "_plan_for_spec", lambda spec, dev: new)
    monkeypatch.setattr(cb, "_FAST", {})
    batch.extras["cudnn_plan"] = old
    assert cb._plan_for(batch) is new
    assert cb._plan_for(batch) is new  # and kept
