"""The cuDNN backend (``pagedprefill.backends.cudnn``) against the independent float64 oracle.

CPU: bucketing, the graph cache key (:class:`GraphSpec`), static limits, the scratch layout,
availability messages, the covering-plan choice, and the whole per-run path (metadata rows, page
table, rows without keys, the torch fallback and the one-launch Triton preparation in the
interpreter) with a pure-torch stand-in for the cuDNN graph. GPU (``gpu`` mark): real graphs
against the oracle, the anchor's known failure modes, empty operands, sliding windows and sinks,
CUDA-graph replays and the number of graph builds.
"""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys
import threading
import types

import pytest
import torch
from helpers import DEVICE, batch_of, call_tensors, planned
from oracle import Case, check, make_case, poison, reference

import pagedprefill
from pagedprefill import api, workspace
from pagedprefill.backends import cudnn as cb
from pagedprefill.backends.cudnn import graph, prepare
from pagedprefill.batch import DeviceVectors, Layout
from pagedprefill.kernels import launch
from pagedprefill.kernels.metadata import device_table_torch
from pagedprefill.normalise import OFFSET_NAMES

BF16, FP16 = torch.bfloat16, torch.float16
TOL = {BF16: dict(atol=3e-2, lse_atol=2e-2), FP16: dict(atol=1e-2, lse_atol=5e-3)}
# the one-launch preparation runs natively on a GPU and in Triton's interpreter on the CPU
TRITON_RUNS = launch.unavailable_reason(torch.device(DEVICE)) is None
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="the Triton preparation kernel cannot run here")


def _case(seed: int = 0, **kw) -> Case:
    base = dict(lens_q=[5, 3], lens_kv=[40, 17], hq=8, hkv=2, dqk=128, page_size=16, dtype=BF16)
    return make_case(seed, **{**base, **kw})


def _spec(**kw) -> graph.GraphSpec:
    return graph.graph_spec(batch_of(_case(**kw)))


def _device_batch(batch):
    """``batch`` as normalise describes it when the lengths live on the device: no host metadata,
    and the kernels' work bounded by the caller's bounds (the table's reach for paged K/V)."""
    work_kv = min(batch.max_kv, batch.table_width * batch.page_size) if batch.pages == "table" else batch.max_kv
    return dataclasses.replace(batch, host=None, work_q=batch.max_q, work_kv=work_kv)


def _device_meta(case: Case, batch) -> torch.Tensor:
    """The metadata table computed by device ops from the case's length / offset vectors, as a run
    with device lengths computes it (here on the case's device, whatever that is)."""
    kw = case.kwargs
    dev = batch.device
    offs = {
        n: kw[f"batch_offsets_{n}"].reshape(-1).to(dev)
        for n in OFFSET_NAMES
        if kw.get(f"batch_offsets_{n}") is not None
    }
    units = kw.get("batch_offsets_units", "elements")
    lens_q, lens_kv = (
        kw["actual_seq_lens_q"].reshape(-1).to(dev),
        kw["actual_seq_lens_kv"].reshape(-1).to(dev),
    )
    vecs = DeviceVectors(lens_q, lens_kv, offs, None, None, units)
    n_idx = kw["block_tables"].numel() if batch.paged else 0
    meta = torch.empty((8, batch.batch_size), dtype=torch.int32, device=dev)
    device_table_torch(workspace.bounds(batch, vecs, n_idx), lens_q, lens_kv, offs, None, None, meta)
    return meta


# --------------------------------------------------------------------------------------------
# CPU: bucketing, cache key, availability, static limits, graph declaration
# --------------------------------------------------------------------------------------------


def test_bucket_functions():
    assert [graph.bucket_batch(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    got = [graph.bucket_len(n) for n in (0, 1, 64, 65, 256, 257, 4096, 4097, 9000)]
    assert got == [64, 64, 64, 256, 256, 1024, 4096, 8192, 16384]
    for n in range(1, 20000, 37):
        assert graph.bucket_len(n) >= n and graph.bucket_batch(n) >= n


def test_bucketing_keeps_distinct_graphs_few():
    """A serving-like loop (random batch 1..64, random lengths, max_* = the batch maxima) maps to
    few (batch, max_q, max_kv) buckets: after warm-up, 200 calls add at most ~20 new ones."""
    rng = random.Random(0)

    def key():
        b = rng.randint(1, 64)
        lq = [rng.randint(1, 300) for _ in range(b)]
        lkv = [q + rng.randint(0, 3000) for q in lq]
        return graph.bucket_batch(b), graph.bucket_len(max(lq)), graph.bucket_len(max(lkv))

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
        "long_q": _spec(lens_q=[500, 3]),
        "long_kv": _spec(lens_kv=[5000, 17], extra_table_cols=400),
        "window": _spec(window_left=8),
        "sinks": _spec(sinks=True),
    }
    for name, spec in variants.items():
        assert spec != base, name
    assert base.k_strides != variants["hnd"].k_strides != variants["interleaved"].k_strides
    assert variants["scale"].scale == 0.3
    # everything the graph reads from the tensors is in the spec
    b = batch_of(_case())
    s = graph.graph_spec(b)
    assert s.q_strides == b.q.stride[:2] and s.o_strides == b.out.stride[:2]
    assert s.k_strides == b.k.stride and s.v_strides == b.v.stride
    assert (s.num_pages, s.page_size) == (b.k.shape[0], 16)
    assert (s.q_dtype, s.kv_dtype, s.o_dtype) == ("bfloat16", "bfloat16", "bfloat16")
    assert s.lse and not s.lse_packed and s.causal and s.paged
    assert s.window_left == -1 and not s.sinks


def test_spec_keys_the_window_and_sinks():
    """A sliding window and sinks go into the graph (the band's left bound, the sink token): each
    window, and sinks on or off, is another GraphSpec and so another cache key."""
    base, w0, w8, w9 = _spec(), _spec(window_left=0), _spec(window_left=8), _spec(window_left=9)
    sinks, both = _spec(sinks=True), _spec(window_left=8, sinks=True)
    specs = [base, w0, w8, w9, sinks, both]
    assert len(set(specs)) == len(specs)
    assert (w0.window_left, w8.window_left, both.window_left) == (0, 8, 8) and base.window_left == -1
    assert sinks.sinks and both.sinks and not base.sinks and not w8.sinks
    for s in specs[1:]:  # only the variant differs
        assert dataclasses.replace(s, window_left=-1, sinks=False) == base
    keys = {(s, 0, 123, "auto") for s in specs}
    assert len(keys) == len(specs)
    assert "window=8" in w8.describe() and "sinks=True" in sinks.describe()
    # the sink values are data, not part of the graph: other values, one graph
    assert graph.graph_spec(batch_of(_case(seed=1, sinks=True))) == sinks


def test_spec_out_dtype_in_key():
    case = _case()
    case.kwargs["out"] = torch.empty(case.kwargs["out"].shape, dtype=torch.float32)
    assert graph.graph_spec(batch_of(case)).o_dtype == "float32"
    assert graph.graph_spec(batch_of(case)) != _spec()


def test_spec_is_shared_inside_a_bucket():
    a = _spec(lens_q=[5, 3], lens_kv=[40, 17])
    b = _spec(lens_q=[7, 1], lens_kv=[50, 2], max_q=9, max_kv=60)
    assert a == b  # other lengths, same buckets: one graph
    assert a.batch == 2 and a.max_q == 64 and a.max_kv == 64


def test_spec_of_host_lengths_follows_the_lengths_not_the_bounds():
    """With host lengths the buckets follow the real maxima: huge max_* bounds cost nothing."""
    assert _spec(max_q=5000, max_kv=100_000, extra_table_cols=10_000) == _spec()


def test_table_width_comes_from_our_bucket_not_the_callers_table():
    narrow = _spec(extra_table_cols=0)
    wide = _spec(extra_table_cols=37)  # table much wider than max_sequence_kv / page_size
    assert narrow == wide
    assert wide.table_width == -(-wide.max_kv // wide.page_size)
    # the page-table copy covers every key the lengths can reach
    assert wide.table_width * wide.page_size >= wide.max_kv >= 40


def test_max_kv_is_capped_by_table_reach():
    """Device lengths: the kv bucket follows max_sequence_kv, capped by what the block table reaches."""
    batch = batch_of(_case(max_kv=100_000, extra_table_cols=0))  # the table reaches 3 pages of 16 keys
    assert batch.table_width == 3
    dev = dataclasses.replace(batch, host=None, work_q=batch.max_q, work_kv=batch.max_kv)
    assert graph.kv_cap(dev) == 48
    assert graph.graph_spec(dev).max_kv == graph.bucket_len(3 * 16) == 64
    assert graph.graph_spec(_device_batch(batch)).max_kv == 64


def _csr_batch(**kw):
    """A batch with FlashInfer's CSR pages (kv_indptr / kv_indices / kv_last_page_len)."""
    ps, hq, hkv, d = 16, 4, 2, 64
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    p = pagedprefill.plan(
        ws,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim_qk=d,
        page_size=ps,
        actual_seq_lens_q=torch.tensor([3, 2], dtype=torch.int32),
        kv_indptr=torch.tensor([0, 2, 3], dtype=torch.int32),
        kv_indices=torch.tensor([4, 1, 0], dtype=torch.int32),
        kv_last_page_len=torch.tensor([5, 16], dtype=torch.int32),
        causal=True,
        backend="torch",
        **kw,
    )
    q = torch.randn(5, hq, d).to(BF16)
    kv = torch.randn(6, hkv, ps, d).to(BF16)
    return p.layer(q, kv, kv.clone(), None, None, (None, None, None), None, False, ws).batch


def test_static_limits():
    assert graph.static_reason(batch_of(_case(lens_q=[3], lens_kv=[5]))) is None
    r = graph.static_reason(batch_of(_case(lens_q=[3], lens_kv=[5], dtype=torch.float32)))
    assert "float32" in r
    r = graph.static_reason(batch_of(_case(lens_q=[3], lens_kv=[5], dqk=192, dvo=64)))
    assert "Dqk=192" in r and "Dvo=64" in r
    r = graph.static_reason(batch_of(_case(lens_q=[3], lens_kv=[5], page_size=3)))
    assert "power-of-two page size" in r
    r = graph.static_reason(batch_of(_case(lens_q=[3], lens_kv=[5], kv_dtype=torch.float8_e4m3fn)))
    assert "one dtype" in r
    r = graph.static_reason(batch_of(_case(lens_q=[3], lens_kv=[5], dqk=72)))
    assert r is None  # 72 is a multiple of 8: cuDNN decides
    # a window and sinks are declared in the graph: cuDNN decides (at build time) whether it serves them
    assert graph.static_reason(batch_of(_case(window_left=4))) is None
    assert graph.static_reason(batch_of(_case(sinks=True))) is None


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("extra", [{}, dict(window_left=4), dict(sinks=True)], ids=["plain", "window", "sinks"])
def test_soft_cap_is_always_refused(page_size, extra):
    """cuDNN SDPA has no logit soft-capping: refused from the description alone, whatever else the
    call has, so that "auto" never asks cuDNN and backend='cudnn' says why."""
    for cap in (0.5, 30.0):
        batch = batch_of(_case(page_size=page_size, logits_soft_cap=cap, **extra))
        r = graph.static_reason(batch)
        assert r is not None and "logits_soft_cap" in r
        assert cb.unsupported_reason(batch) == r


def test_csr_pages_are_always_refused():
    batch = _csr_batch()
    assert batch.pages == "csr"
    for b in (batch, dataclasses.replace(batch, window_left=3), dataclasses.replace(batch, has_sinks=True)):
        r = graph.static_reason(b)
        assert r is not None and "CSR" in r
        assert cb.unsupported_reason(b) == r


def test_fp8_with_a_window_or_sinks_is_refused():
    """cuDNN's fp8 graph is declared without the band's left bound and without the sink token: such a
    call must be refused (never served without its window or its sinks)."""
    fp8 = dict(dtype=torch.float8_e4m3fn, lens_q=[3, 2], lens_kv=[20, 9])
    assert graph.static_reason(batch_of(_case(**fp8))) is None
    for extra in (dict(window_left=5), dict(sinks=True)):
        r = graph.static_reason(batch_of(_case(**fp8, **extra)))
        assert r is not None and "fp8" in r, extra


def test_scratch_layout_is_aligned_and_sized():
    spec = _spec()
    lay = graph.scratch_layout(spec, 12345)
    for off in (lay.ints, lay.table, lay.floats, lay.workspace):
        assert off % graph.ALIGN == 0
    assert lay.row >= spec.batch + 1 and lay.row % 16 == 0
    assert lay.table >= lay.ints + graph.ROWS * lay.row * 4
    assert lay.floats >= lay.table + spec.batch * spec.table_width * 4
    assert lay.total >= lay.workspace + 12345 + graph.ALIGN
    assert graph.ROWS == prepare.R_FIX + 4


def test_unavailable_without_gpu():
    assert cb.unavailable_reason(torch.device("cpu")) == "needs a CUDA GPU"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_requesting_cudnn_on_cpu_raises_helpfully():
    case = _case(lens_q=[3, 2], lens_kv=[5, 9])
    with pytest.raises(pagedprefill.BackendUnavailableError) as info:
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="cudnn")
    msg = str(info.value)
    assert "backend='cudnn'" in msg and "needs a CUDA GPU" in msg
    assert torch.isnan(case.kwargs["out"].float()).all()  # nothing written


def test_missing_package_message(monkeypatch):
    monkeypatch.setattr(graph, "_CUDNN", None)
    monkeypatch.setattr(graph, "_CUDNN_ERROR", None)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # makes `import cudnn` raise ImportError
    with pytest.raises(ImportError) as info:
        graph.cudnn_module()
    assert "pip install nvidia-cudnn-frontend" in str(info.value)
    assert graph.backend_version() is None


def test_package_imports_without_cudnn():
    code = (
        "import sys; sys.modules['cudnn'] = None\n"
        "import pagedprefill, pagedprefill.backends.cudnn as cb\n"
        "assert cb.graph_builds() == 0\n"
        "print(cb.unavailable_reason(__import__('torch').device('cpu')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "needs a CUDA GPU" in out.stdout


def test_build_counter_and_clear():
    n = cb.graph_builds()
    cb.clear_caches()
    assert cb.graph_builds() == n  # a count of builds, not of cached graphs
    assert graph.CACHE == {} and graph.FAILED == {}


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
@pytest.mark.parametrize("variant", ["plain", "fp8", "window", "sinks"])
def test_graph_declaration_matches_the_binding(paged, variant):
    """Declare the graph with the real frontend (pure-Python IR, no GPU needed) and check every
    attribute against the batch and every sdpa keyword against the C++ binding's signature."""
    cudnn = pytest.importorskip("cudnn")
    fp8 = variant == "fp8"
    extra = {"window": dict(window_left=6), "sinks": dict(sinks=True)}.get(variant, {})
    dtype = torch.float8_e4m3fn if fp8 else BF16
    case = _case(lens_q=[5, 3, 4], lens_kv=[40, 17, 3], page_size=16 if paged else 0, dtype=dtype, **extra)
    batch = batch_of(case)
    spec = graph.graph_spec(batch)
    op = "sdpa_fp8" if fp8 else "sdpa"
    allowed = _signature_kwargs(getattr(cudnn._pybind_module.backend_graph, op).__doc__)
    needs = {"window": "diagonal_band_left_bound", "sinks": "sink_token"}.get(variant)
    if needs is not None and needs not in allowed:  # (then the build fails: cuDNN refuses the call)
        pytest.skip(f"this cudnn frontend's {op} has no {needs}")
    g, t = graph.make_graph(spec, cudnn)
    (node,) = g.nodes
    captured = set(node.params) | set(node.inputs)
    assert captured <= allowed, captured - allowed
    bb, sq, skv = spec.batch, spec.max_q, spec.max_kv
    assert (bb, sq) == (4, 64)
    q = t["q"]
    s0, s1 = batch.q.stride[:2]
    assert list(q.dim) == [bb, 8, sq, 128] and list(q.stride) == [sq * s0, s1, s0, 1]
    assert q.ragged_offset is t["off_q"] and list(t["off_q"].dim) == [bb + 1, 1, 1, 1]
    o = t["o"]
    so0, so1 = batch.out.stride[:2]
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
    if variant == "window":
        assert node.params["diagonal_band_left_bound"] == 6 + 1  # a band of window_left + 1 keys
    else:
        assert "diagonal_band_left_bound" not in node.params
    if variant == "sinks":
        assert "sink_token" in captured and t["sinks"] is not None
        assert list(t["sinks"].dim) == [1, 8, 1, 1]
    else:
        assert "sink_token" not in captured and "sinks" not in t
    if paged:
        assert list(t["k"].dim) == list(batch.k.shape) and list(t["k"].stride) == list(batch.k.stride)
        assert list(t["v"].stride) == list(batch.v.stride)
        w = spec.table_width
        assert list(t["table_k"].dim) == [bb, 1, w, 1] and w == -(-skv // 16)
        assert node.params["paged_attention_max_seq_len_kv"] == skv
        assert node.inputs["paged_attention_k_table"] is t["table_k"]
    else:
        k0, k1 = batch.k.stride[:2]
        assert list(t["k"].stride) == [skv * k0, k1, k0, 1] and t["k"].ragged_offset is t["off_k"]
        assert "paged_attention_max_seq_len_kv" not in node.params


# --------------------------------------------------------------------------------------------
# CPU: the covering plan, and graphs of another thread's handle
# --------------------------------------------------------------------------------------------


def _fake_plan(spec, key=(), device="cpu"):
    """A "built" plan of ``spec`` without cuDNN (no graph; its scratch layout and constants)."""
    lay = graph.scratch_layout(spec, 4096)
    consts = prepare.make_consts(spec, lay, torch.device(device))
    return graph.Plan(spec, None, {}, lay, key=key, consts=consts)


def test_covering_plan_is_the_smallest_built_graph_within_the_ratios(monkeypatch):
    """A spec whose exact bucket was never built runs on a built graph that differs only in batch /
    max_q / max_kv buckets, each at least the needed one and at most COVER_RATIOS times it."""
    base = _spec(lens_q=[5, 3], lens_kv=[40, 17])
    rest = (0, 123, "auto")

    def spec(b, q, kv, **kw):
        return dataclasses.replace(base, batch=b, max_q=q, max_kv=kv, table_width=-(-kv // 16), **kw)

    monkeypatch.setattr(graph, "COVER_RATIOS", (2, 4, 4))
    need = spec(2, 64, 64)
    built = {
        "too big": spec(2, 64, 1024),
        "covers": spec(4, 256, 256),
        "smaller cover": spec(2, 64, 256),
        "batch too big": spec(8, 64, 64),
        "too small": spec(2, 64, 16),
        "other causal": spec(2, 64, 64, causal=not base.causal),
        "a window": spec(2, 64, 64, window_left=3),
        "sinks": spec(2, 64, 64, sinks=True),
    }
    monkeypatch.setattr(graph, "CACHE", {(sp, *rest): _fake_plan(sp) for sp in built.values()})
    got = graph.covering_plan((need, *rest))
    assert got is not None and got.spec == built["smaller cover"]
    assert graph.covering_plan((need, 1, 123, "auto")) is None  # another device
    assert graph.covering_plan((need, 0, 124, "auto")) is None  # another handle (thread)
    # a graph with a window or sinks never serves a call without them, nor the other way round
    assert graph.covering_plan((dataclasses.replace(need, window_left=5), *rest)) is None
    got = graph.covering_plan((dataclasses.replace(need, window_left=3), *rest))
    assert got is not None and got.spec == built["a window"]
    got = graph.covering_plan((dataclasses.replace(need, sinks=True), *rest))
    assert got is not None and got.spec == built["sinks"]
    monkeypatch.setattr(graph, "COVER_RATIOS", (1, 1, 1))
    assert graph.covering_plan((need, *rest)) is None


def test_a_graph_built_for_another_threads_handle_is_resolved_again(monkeypatch, emulated):
    """A plan may run on another thread than the one that made it (a shared plan, or a cached call
    plan whose thread ended and whose thread id was recycled): a graph keyed by another cuDNN handle
    is never executed with this thread's handle; the run resolves the graph for its own handle."""
    case = _case(lens_q=[3, 4], lens_kv=[9, 20], hq=4, hkv=2, dqk=64, device=DEVICE)
    spec = graph.graph_spec(batch_of(case))
    old = _fake_plan(spec, key=(spec, 0, 111, "auto"), device=DEVICE)
    new = _fake_plan(spec, key=(spec, 0, 222, "auto"), device=DEVICE)
    handed = [old]
    monkeypatch.setattr(cb, "_built", lambda batch: handed[-1])
    monkeypatch.setattr(graph, "device_index", lambda device: 0)
    monkeypatch.setattr(graph, "handle", lambda dev: types.SimpleNamespace(backend_handle=222))
    p, lp, ws = planned(case, "cudnn")
    assert lp.backend.graph is old
    handed.append(new)
    t = call_tensors(case, p, lp, ws)
    lp.backend.run(t)
    assert emulated.graphs == [new]
    assert lp.backend.graph is new  # and kept
    lp.backend.run(t)
    assert emulated.graphs == [new, new]
    check(case, t.out, t.lse, **TOL[BF16])


# --------------------------------------------------------------------------------------------
# CPU: the whole run() path with a pure-torch stand-in for the cuDNN graph
# --------------------------------------------------------------------------------------------


def _emulated_cudnn(spec: graph.GraphSpec, t, views) -> None:
    """Do what the cuDNN graph is documented to do, reading ONLY the scratch this backend wrote:
    per-sequence lengths (padding mask), ragged offsets in elements, the page-table copy, the
    bottom-right causal mask, the band's left bound (window) and the sink token; write O (and Stats)
    rows i < seq_len_q only. Rows with no visible key must never reach it (the backend skips them),
    and neither may an operand without elements (cuDNN refuses a null pointer)."""
    bb, hq, hkv = spec.batch, spec.num_qo_heads, spec.num_kv_heads
    ints = views.ints.to(torch.int64).cpu()
    seq_q, seq_kv, off_q, off_o, off_k, off_v, off_s = (ints[r] for r in range(7))
    q, k, v, out = t.q, t.k, t.v, t.out
    ops = (q, k, v, out) + ((t.lse,) if spec.lse else ())
    assert all(x.numel() for x in ops), "an operand without elements reached cuDNN"
    assert (ints[:7, bb:] == 0).all(), "metadata past the graph's batch is not zero"
    for b in range(bb):
        lq, lkv = int(seq_q[b]), int(seq_kv[b])
        if lq == 0:
            continue
        assert 0 < lkv <= spec.max_kv and lq <= spec.max_q, (lq, lkv, spec.max_q, spec.max_kv)
        assert not spec.causal or lq <= lkv, "a causal row without visible keys reached cuDNN"
        qb = torch.as_strided(q, (lq, hq, spec.head_dim_qk), (*spec.q_strides, 1), q.storage_offset() + int(off_q[b]))
        if spec.paged:
            j = torch.arange(lkv, device=k.device)
            assert lkv <= spec.table_width * spec.page_size
            pages = views.table[b].to(torch.int64)[j // spec.page_size]
            assert 0 <= int(pages.min()) and int(pages.max()) < spec.num_pages
            kb, vb = k[pages, :, j % spec.page_size], v[pages, :, j % spec.page_size]
        else:
            kb = torch.as_strided(
                k, (lkv, hkv, spec.head_dim_qk), (*spec.k_strides, 1), k.storage_offset() + int(off_k[b])
            )
            vb = torch.as_strided(
                v, (lkv, hkv, spec.head_dim_vo), (*spec.v_strides, 1), v.storage_offset() + int(off_v[b])
            )
        kh = kb.double().repeat_interleave(hq // hkv, dim=1)
        vh = vb.double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("ihd,jhd->hij", qb.double(), kh) * spec.scale
        pos = torch.arange(lq, device=s.device)[:, None] + lkv - lq  # bottom-right aligned
        keys = torch.arange(lkv, device=s.device)[None, :]
        hidden = torch.zeros(lq, lkv, dtype=torch.bool, device=s.device)
        if spec.causal:
            hidden |= keys > pos
        if spec.window_left >= 0:
            hidden |= keys < pos - spec.window_left
        s = s.masked_fill(hidden, float("-inf"))
        if spec.sinks:
            sink = t.sinks.double().view(hq, 1, 1).expand(hq, lq, 1)
            lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
        else:
            lse = torch.logsumexp(s, dim=-1)  # (Hq, lq)
        assert torch.isfinite(lse).all(), "a row without visible keys reached cuDNN"
        o = torch.einsum("hij,jhd->ihd", torch.exp(s - lse[..., None]), vh)
        ob = torch.as_strided(
            out, (lq, hq, spec.head_dim_vo), (*spec.o_strides, 1), out.storage_offset() + int(off_o[b])
        )
        ob.copy_(o.to(out.dtype))
        if spec.lse:
            lb = torch.as_strided(t.lse, (lq, hq), (hq, 1), t.lse.storage_offset() + int(off_s[b]))
            lb.copy_(lse.T.float())


class Emulator:
    """What the ``emulated`` fixture routes cuDNN through; ``graphs`` lists the graphs executed."""

    def __init__(self):
        self.cover = False  # a larger covering graph serves every call
        self.triton: bool | None = None  # force the Triton (True) or torch (False) preparation
        self.graphs: list[graph.Plan] = []
        self.plans: dict[tuple, graph.Plan] = {}

    def built(self, batch) -> graph.Plan:
        spec = graph.graph_spec(batch)
        if self.cover:
            big_kv = spec.max_kv * 4
            width = -(-big_kv // spec.page_size) if spec.paged else 0
            spec = dataclasses.replace(
                spec, batch=spec.batch * 4, max_q=spec.max_q * 4, max_kv=big_kv, table_width=width
            )
        key = (spec, batch.device)
        if key not in self.plans:
            lay = graph.scratch_layout(spec, 4096)
            consts = prepare.make_consts(spec, lay, batch.device)
            self.plans[key] = graph.Plan(spec, None, {}, lay, consts=consts)
        return self.plans[key]


@pytest.fixture
def emulated(monkeypatch):
    """backend='cudnn' through the real plan and run(), with a pure-torch graph (``CudnnPlan.execute``
    replaced): availability granted, graphs "built" by :class:`Emulator` (no cuDNN, no GPU)."""
    emu = Emulator()
    real_plan = cb.plan

    def plan(batch, workspace_bytes):
        bp = real_plan(batch, workspace_bytes)
        if emu.triton is not None:
            bp.triton = emu.triton
        return bp

    def execute(self, t, views):
        emu.graphs.append(self.graph)
        _emulated_cudnn(self.graph.spec, t, views)

    monkeypatch.setattr(cb, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(cb, "_built", emu.built)
    monkeypatch.setattr(cb, "plan", plan)
    monkeypatch.setattr(cb.CudnnPlan, "execute", execute)
    api.clear_caches()  # no call plan made under other stand-ins
    yield emu
    api.clear_caches()


def _run_direct(case: Case, *, device_path: bool = False, triton: bool | None = None):
    """Plan ``case`` for cuDNN and run its backend plan directly. ``device_path``: as with lengths on
    the device (no host metadata; the metadata table computed by device ops)."""
    p, lp, ws = planned(case, "cudnn")
    t = call_tensors(case, p, lp, ws)
    batch = lp.batch
    if device_path:
        batch = _device_batch(batch)
        t.meta = _device_meta(case, batch)
    bp = cb.plan(batch, ws.numel())
    if triton is not None:
        bp.triton = triton
    if not batch.empty:
        bp.run(t)
    return bp, t


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
        hq=hkv * rng.choice([1, 2, 3, 4, 5, 6, 7]),
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
        window_left=rng.choice([-1, -1, -1, 0, 3, 11]),
        sinks=rng.random() < 0.25,
        device=DEVICE,
    )
    kw.update(over)
    return make_case(seed, **kw)


@pytest.mark.parametrize("seed", range(32))
def test_run_pipeline_emulated(emulated, seed):
    """The public call with backend='cudnn' end to end (host lengths): metadata rows, page table,
    rows without keys, window and sinks, against the oracle; a quarter of the calls on a larger
    covering graph, half with the one-launch preparation where Triton runs."""
    emulated.cover = seed % 4 == 3
    emulated.triton = TRITON_RUNS and seed % 2 == 1
    case = _random_case(seed)
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="cudnn")
    check(case, out, lse, **TOL[BF16])
    assert pagedprefill.last_backend() == "cudnn"
    for plan in emulated.graphs:
        assert plan.spec.batch >= len(case.lens_q)


@pytest.mark.parametrize("seed", range(24))
def test_device_lengths_pipeline_emulated(emulated, seed):
    """The run with lengths on the device (no host metadata: every sequence may have rows without
    keys, so the fix-up always runs; buckets from the caller's bounds), both preparations."""
    triton = TRITON_RUNS and seed % 2 == 1
    emulated.cover = seed % 4 >= 2
    case = _random_case(500 + seed)
    bp, t = _run_direct(case, device_path=True, triton=triton)
    assert bp.fix and not bp.skip_graph
    check(case, t.out, t.lse, **TOL[BF16])


def test_strided_block_table(emulated):
    """A block table that is a column slice of a wider one (row stride > width), as serving engines
    slice a preallocated table: every sequence reads its own row."""
    case = _case(lens_q=[4, 6, 3], lens_kv=[40, 17, 33], hq=4, hkv=2, dqk=64, extra_table_cols=0, device=DEVICE)
    bt = case.kwargs["block_tables"]
    wide = torch.full((bt.shape[0], bt.shape[1] + 5), 10_000, dtype=torch.int32, device=bt.device)
    wide[:, : bt.shape[1]] = bt
    case.kwargs["block_tables"] = wide[:, : bt.shape[1]]
    assert case.kwargs["block_tables"].stride(0) == bt.shape[1] + 5
    for triton in [False] + [True] * TRITON_RUNS:
        emulated.triton = triton
        api.clear_caches()
        for name in ("out", "lse"):
            poison(case.kwargs[name])
        out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="cudnn")
        check(case, out, lse, **TOL[BF16])
        bp, t = _run_direct(case, device_path=True, triton=triton)
        check(case, t.out, t.lse, **TOL[BF16])


# Operands without elements: cuDNN raises "varPackPtrs[io_uid_idx] == nullptr" for a null pointer in its
# variant pack, so the graph must not run; the preparation still writes out 0 / lse -inf.
EMPTY_OPERANDS = {
    "ragged-b1-kv0": dict(lens_q=[5], lens_kv=[0], page_size=0),
    "ragged-b2-all-kv0": dict(lens_q=[3, 6], lens_kv=[0, 0], page_size=0, causal=False),
    "ragged-q0": dict(lens_q=[0], lens_kv=[7], page_size=0),
    "ragged-b2-all-q0": dict(lens_q=[0, 0], lens_kv=[4, 9], page_size=0, causal=False),
    "paged-q0": dict(lens_q=[0], lens_kv=[7], page_size=16),
}
# (host lengths, device lengths): does the graph run?
NONEMPTY_OPERANDS = {
    "ragged-b2-one-kv0": (dict(lens_q=[3, 6], lens_kv=[0, 5], page_size=0), (True, True)),
    "paged-all-kv0": (dict(lens_q=[3, 6], lens_kv=[0, 0], page_size=16), (False, True)),
    "paged-causal-no-key": (dict(lens_q=[5, 2], lens_kv=[0, 1], page_size=16), (True, True)),
    "paged-causal-q-gt-kv": (dict(lens_q=[5], lens_kv=[2], page_size=16), (True, True)),
}


@pytest.mark.parametrize("triton", [False, True], ids=["torch-prep", "triton-prep"])
@pytest.mark.parametrize("device_path", [False, True], ids=["host-lengths", "device-lengths"])
@pytest.mark.parametrize("dims", [(192, 128), (128, 128)], ids=["192-128", "128"])
@pytest.mark.parametrize("name", list(EMPTY_OPERANDS) + list(NONEMPTY_OPERANDS))
def test_empty_operands_never_reach_the_graph(emulated, name, dims, device_path, triton):
    """Regression (H200: cuDNN's ``varPackPtrs[io_uid_idx] == nullptr``): with q, out, K or V without
    elements the graph is not executed (host and device lengths alike), and the rows without keys
    still get out 0 / lse -inf; any other batch executes it (with host lengths only when some row is
    handed to cuDNN)."""
    if triton and not TRITON_RUNS:
        pytest.skip("the Triton preparation kernel cannot run here")
    if name in EMPTY_OPERANDS:
        kw, runs = EMPTY_OPERANDS[name], (False, False)
    else:
        kw, runs = NONEMPTY_OPERANDS[name]
    case = _case(seed=9, **kw, hq=8, hkv=2, dqk=dims[0], dvo=dims[1], dtype=FP16, device=DEVICE)
    bp, t = _run_direct(case, device_path=device_path, triton=triton)
    assert len(emulated.graphs) == int(runs[device_path])
    if bp.graph is not None:  # (host lengths, every q_len 0: not even a plan of a graph)
        assert bp.has_rows(t) == runs[device_path]
    check(case, t.out, t.lse, **TOL[FP16])
    # and through the public call (host lengths)
    emulated.graphs.clear()
    for buf in ("out", "lse"):
        poison(case.kwargs[buf])
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="cudnn")
    check(case, out, lse, **TOL[FP16])
    assert len(emulated.graphs) == int(runs[False])


def test_has_rows_checks_every_operand(emulated):
    case = _case(lens_q=[3], lens_kv=[5], page_size=0, device=DEVICE)
    p, lp, ws = planned(case, "cudnn")
    t = call_tensors(case, p, lp, ws)
    bp = lp.backend
    assert bp.has_rows(t)
    for name in ("q", "k", "v", "out", "lse"):
        u = call_tensors(case, p, lp, ws)
        setattr(u, name, getattr(u, name)[:0])
        assert not bp.has_rows(u), name
    dev = cb.plan(_device_batch(lp.batch), ws.numel())
    assert dev.has_rows(t) and not dev.skip_graph


def _prepared(case: Case, device_path: bool):
    """(backend plan, call tensors, views) of a case planned for the emulated cuDNN backend, with
    out / lse holding random bytes and the scratch holding garbage."""
    p, lp, ws = planned(case, "cudnn")
    t = call_tensors(case, p, lp, ws)
    batch = lp.batch
    if device_path:
        batch = _device_batch(batch)
        t.meta = _device_meta(case, batch)
    bp = cb.plan(batch, ws.numel())
    gen = torch.Generator().manual_seed(len(case.lens_q))
    t.out.copy_(torch.randn(t.out.shape, generator=gen).to(t.out.dtype))
    if t.lse is not None:
        t.lse.copy_(torch.randn(t.lse.shape, generator=gen))
    return bp, t, _garbage_views(bp, t)


def _garbage_views(bp, t):
    views = bp.views(t.scratch)
    views.ints.fill_(-3)
    if views.table is not None:
        views.table.fill_(-3)
    return views


def _prepare(bp, t, views, triton: bool) -> None:
    """The preparation of ``bp``'s run of ``t``: the one Triton launch, or the torch ops and (where
    some row may see no key) the fix-up after the graph."""
    plan, batch = bp.graph, bp.batch
    spec, lay = plan.spec, plan.layout
    n_idx = prepare.table_span(t.pages) if spec.paged else 0
    args = (views.ints, views.table, t.meta, t.pages)
    if triton:
        prepare.prepare_triton(spec, lay, *args, t.out, t.lse, t.sinks, batch.batch_size, n_idx, bp.fix, batch.work_q)
        return
    fx = prepare.prepare_torch(spec, lay, plan.consts, *args, batch.batch_size, n_idx)
    if bp.fix:
        prepare.fill_empty_rows(spec, plan.consts, t.out, t.lse, t.sinks, fx)


@pytest.mark.parametrize("seed", range(30))
def test_host_and_device_metadata_agree(emulated, seed):
    """One graph, the metadata table from host lengths (normalise) or computed by device ops: the same
    cuDNN metadata rows, page table and fix-up ranges."""
    case = _random_case(1000 + seed, page_size=random.Random(seed).choice([0, 1, 4, 16]))
    bp, t, _ = _prepared(case, device_path=False)
    if bp.graph is None:
        pytest.skip("no query rows")
    got = []
    for meta in (t.meta, _device_meta(case, _device_batch(bp.batch))):
        t.meta = meta
        views = _garbage_views(bp, t)
        _prepare(bp, t, views, triton=False)
        got.append((views.ints.clone(), views.table.clone() if views.table is not None else None))
    (ih, th), (idv, td) = got
    assert torch.equal(ih, idv)
    if th is not None:
        assert torch.equal(th, td)


@needs_triton
@pytest.mark.parametrize("seed", range(24))
def test_prepare_kernel_matches_the_torch_path(emulated, seed):
    """The one-launch Triton preparation (run() uses it wherever Triton runs on a GPU) writes the same
    cuDNN metadata rows 0..6 and page table as the torch-ops path, and the same out / lse bytes
    (0 / -inf, or the sink, on exactly the rows without keys, every other byte untouched)."""
    case = _random_case(3000 + seed, page_size=random.Random(seed).choice([0, 1, 4, 16]))
    device_path = seed % 2 == 1
    got = []
    for use_kernel in (False, True):
        bp, t, views = _prepared(case, device_path)
        if bp.graph is None:
            pytest.skip("no query rows")
        spec = bp.graph.spec
        _prepare(bp, t, views, triton=use_kernel)
        lse = t.lse.clone() if t.lse is not None else None
        table = views.table.clone() if spec.paged else None
        got.append((views.ints[: prepare.R_LAST].clone(), table, t.out.clone(), lse))
    (it, tt, ot, lt), (ik, tk, ok, lk) = got
    assert torch.equal(it, ik), (it, ik)
    if tt is not None:
        assert torch.equal(tt, tk)
    assert torch.equal(ot.view(torch.int16), ok.view(torch.int16))
    if lt is not None:
        assert torch.equal(lt, lk)


@pytest.mark.parametrize("seed", range(20))
def test_page_table_copy_reads_only_listed_pages(emulated, seed):
    """Entry (b, j) of our table is block_tables[b, min(j, last page of b)]: entries the caller lists
    past a sequence's last page (garbage, or freed pages) are never handed to cuDNN."""
    rng = random.Random(seed)
    ps = rng.choice([1, 4, 16])
    bsz = rng.randint(1, 7)
    lens_kv = [rng.choice([0, rng.randint(1, 70)]) for _ in range(bsz)]
    lens_q = [rng.randint(1, 5) for _ in range(bsz)]
    case = make_case(
        seed,
        lens_q=lens_q,
        lens_kv=lens_kv,
        page_size=ps,
        extra_table_cols=rng.randint(0, 5),
        dtype=BF16,
        device=DEVICE,
    )
    bt = case.kwargs["block_tables"]
    bt[bt < 0] = 10_000 + seed  # unused entries: out-of-range ids (still clamped if ever read)
    bp, t, views = _prepared(case, device_path=seed % 2 == 1)
    spec = bp.graph.spec
    _prepare(bp, t, views, triton=TRITON_RUNS and seed % 3 == 0)
    table, npages = views.table.cpu(), spec.num_pages
    bt = bt.cpu()
    for b in range(spec.batch):
        need = -(-lens_kv[b] // ps) if b < bsz else 0
        for j in range(spec.table_width):
            if need and lens_q[b]:
                assert int(table[b, j]) == int(bt[b, min(j, need - 1)])
            else:
                assert 0 <= int(table[b, j]) < npages


def test_page_table_of_a_zero_width_block_table(emulated):
    """Every kv_len 0 and a block table without columns: nothing to gather, any valid page will do."""
    case = _case(lens_q=[3, 2], lens_kv=[0, 0], extra_table_cols=0, device=DEVICE)
    assert case.kwargs["block_tables"].shape[1] == 0
    for triton in [False] + [True] * TRITON_RUNS:
        for device_path in (False, True):
            poison(case.kwargs["out"]), poison(case.kwargs["lse"])
            bp, t = _run_direct(case, device_path=device_path, triton=triton)
            check(case, t.out, t.lse, **TOL[BF16])
            bp, t, views = _prepared(case, device_path)
            assert prepare.table_span(t.pages) == 0
            _prepare(bp, t, views, triton)
            assert (views.table == 0).all()


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
    """Stand-in for ``prepare._prepare_kernel``: records launches (grid, constexprs), runs nothing."""

    pre_run_hooks: list = []
    params: list = []

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, kw))


@pytest.mark.parametrize(
    "triton_path", [pytest.param(True, marks=pytest.mark.needs_triton), False], ids=["triton", "torch-ops"]
)
@pytest.mark.parametrize("device_path", [False, True], ids=["host-lengths", "device-lengths"])
def test_per_run_device_work_is_fixed_and_independent_of_batch(emulated, device_path, triton_path, monkeypatch):
    """The host cost of a run is dominated by its launches: run() issues a fixed handful, none per
    sequence, whatever the batch size. Where Triton runs: ONE launch (metadata, page table and the
    rows without keys) and no torch op but views. Without Triton: a fixed number of torch ops for the
    metadata and the table, and (device lengths) a fixed number for the rows without keys."""
    monkeypatch.setattr(cb.CudnnPlan, "execute", lambda self, t, views: self._operands(t, views))
    launcher = _CountingLaunch()
    monkeypatch.setattr(prepare, "_prepare_kernel", launcher)
    counts = {}
    for bsz in (1, 5, 40):
        lens_kv = [17 + 3 * b for b in range(bsz)]
        case = make_case(bsz, lens_q=[4] * bsz, lens_kv=lens_kv, hq=4, hkv=2, dqk=64, page_size=16, dtype=BF16)
        p, lp, ws = planned(case, "cudnn")
        t = call_tensors(case, p, lp, ws)
        batch = _device_batch(lp.batch) if device_path else lp.batch
        bp = cb.plan(batch, ws.numel())
        bp.triton = triton_path
        counts[bsz] = _kernel_ops(lambda bp=bp, t=t: bp.run(t))
    assert len({c[0] for c in counts.values()}) == 1, counts
    assert len({len(c[1]) for c in counts.values()}) == 1, counts
    kernels, names = counts[40]
    if triton_path:
        assert kernels == 0, names
        assert len(launcher.launches) == 3  # one per run
        fixes = {kw["FIX"] for _grid, kw in launcher.launches}
        assert fixes == {device_path}  # host lengths, every row sees a key: no fix-up work
    elif device_path:  # (measured: 47 ops that compute, 79 in all)
        assert kernels <= 55 and len(names) <= 90, names
    else:  # (measured: 39 and 61)
        assert kernels <= 45 and len(names) <= 70, names


def test_empty_rows_fixup_only_when_needed_with_host_lengths(emulated):
    def backend_plan(**kw):
        return planned(_case(hq=4, hkv=2, dqk=64, **kw), "cudnn")[1].backend

    bp = backend_plan(lens_q=[3, 4], lens_kv=[9, 20])
    assert not bp.fix and not bp.skip_graph
    bp = backend_plan(lens_q=[3, 4], lens_kv=[0, 2])  # kv_len 0, and causal q_len > kv_len
    assert bp.fix and not bp.skip_graph
    bp = backend_plan(lens_q=[3, 4], lens_kv=[2, 9], causal=False)  # non-causal: every row sees a key
    assert not bp.fix
    bp = backend_plan(lens_q=[3, 4], lens_kv=[0, 0])  # no row for cuDNN at all
    assert bp.fix and bp.skip_graph
    dev = cb.plan(_device_batch(planned(_case(lens_q=[3, 4], lens_kv=[9, 20]), "cudnn")[1].batch), None)
    assert dev.fix and not dev.skip_graph  # device lengths: unknown, so always


def test_soft_cap_refused_through_the_call(emulated):
    """backend='cudnn' with logits_soft_cap > 0 (even where cuDNN is available) is a ValueError that says
    why, and writes nothing; "auto" serves the call elsewhere."""
    case = _case(lens_q=[3, 2], lens_kv=[9, 5], logits_soft_cap=20.0, dqk=64, dtype=FP16)
    with pytest.raises(ValueError, match="backend='cudnn' cannot serve this call: .*logits_soft_cap"):
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="cudnn")
    assert torch.isnan(case.kwargs["out"].float()).all() and torch.isnan(case.kwargs["lse"]).all()
    out, lse = pagedprefill.batch_prefill_with_kv_cache(**case.kwargs)
    assert pagedprefill.last_backend() != "cudnn"
    check(case, out, lse, **TOL[FP16])


def test_serving_loop_bucketing_builds_few_graphs():
    """One KV cache (fixed num_pages, strides), random batch 1..64, q 16..2048, prefix 0..8192,
    page 16, max_* = the batch maxima, block table as wide as the longest sequence needs: after
    warm-up, 1000 calls need at most 20 new graphs."""
    rng = random.Random(0)
    base = batch_of(_case(hq=4, hkv=2, dqk=64))
    cache = torch.empty(4096, 2, 16, 64, dtype=BF16).permute(0, 2, 1, 3)

    def spec():
        bsz = rng.randint(1, 64)
        lq = [rng.randint(16, 2048) for _ in range(bsz)]
        lkv = [x + rng.randint(0, 8192) for x in lq]
        width = -(-max(lkv) // 16)
        rows = sum(lq)
        batch = dataclasses.replace(
            base,
            batch_size=bsz,
            max_q=max(lq),
            max_kv=max(lkv),
            work_q=max(lq),
            work_kv=max(lkv),
            table_width=width,
            table_stride=width,
            num_pages=cache.shape[0],
            k=Layout.of(cache),
            v=Layout.of(cache),
            q=Layout((rows, 4, 64), (256, 64, 1), BF16),
            out=Layout((rows, 4, 64), (256, 64, 1), BF16),
            lse_numel=bsz * max(lq) * 4,
            host=None,
        )
        return graph.graph_spec(batch)

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
    hq = hkv * rng.choice([1, 2, 3, 4, 5, 6, 7])
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
@pytest.mark.parametrize("on_device", [False, True], ids=["host-lengths", "device-lengths"])
@pytest.mark.parametrize("dtype", [FP16, BF16])
@pytest.mark.parametrize("dims", [(192, 128), (128, 128)], ids=["192-128", "128"])
@pytest.mark.parametrize("name", list(EMPTY_OPERANDS))
def test_empty_operands(name, dims, dtype, on_device):
    """Regression (H200): an operand without elements (ragged K/V of 0 rows with kv_len 0, q of 0 rows)
    made cuDNN raise ``execute(...) failed ... varPackPtrs[io_uid_idx] == nullptr``. The graph is
    skipped; out rows without keys are 0 and their lse -inf; nothing else is written."""
    case = _gpu_case(
        30, **EMPTY_OPERANDS[name], hq=8, hkv=2, dqk=dims[0], dvo=dims[1], dtype=dtype, lens_on_device=on_device
    )
    out, lse = _run(case, is_cuda_graph_compatible=on_device)
    torch.cuda.synchronize()
    assert pagedprefill.last_backend() == "cudnn"
    _check(case, dtype, (out, lse))
    # allocated out / lse: deterministic where no row is
    case.kwargs.pop("out"), case.kwargs.pop("lse")
    out, lse = _run(case, is_cuda_graph_compatible=on_device)
    torch.cuda.synchronize()
    _check(case, dtype, (out, lse))


WINDOW_AND_SINKS = {
    "window0": dict(window_left=0),
    "window5": dict(window_left=5),
    "window40": dict(window_left=40),
    "sinks": dict(sinks=True),
    "window7-sinks": dict(window_left=7, sinks=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", list(WINDOW_AND_SINKS))
def test_window_and_sinks_served_exactly_or_refused(variant, causal, page_size):
    """A sliding window (the band's left bound, window_left + 1) and sinks (the sink token) go into
    the cuDNN graph. cuDNN may refuse them: then backend='cudnn' says so (ValueError, nothing written)
    and "auto" serves the call on another backend, right. When cuDNN serves them, the result matches
    the oracle like any other call."""
    for dims in ((128, 128), (192, 128)):
        case = _gpu_case(
            40,
            lens_q=[9, 30, 4, 0, 12],
            lens_kv=[70, 30, 0, 5, 3],
            hq=8,
            hkv=2,
            dqk=dims[0],
            dvo=dims[1],
            page_size=page_size,
            dtype=BF16,
            causal=causal,
            **WINDOW_AND_SINKS[variant],
        )
        try:
            result = _run(case)
        except ValueError as exc:
            if "cannot serve this call" not in str(exc):
                raise
            assert torch.isnan(case.kwargs["out"].float()).all() and torch.isnan(case.kwargs["lse"]).all()
            result = pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="auto")
            torch.cuda.synchronize()
            assert pagedprefill.last_backend() not in (None, "cudnn")
        else:
            torch.cuda.synchronize()
            assert pagedprefill.last_backend() == "cudnn"
        _check(case, BF16, result)


@pytest.mark.gpu
def test_plan_made_on_one_thread_runs_on_another():
    """cuDNN handles are per thread and graphs are cached per handle: a plan made (and run) on one
    thread and run on another resolves its graph for that thread's handle, and is right on both."""
    case = _gpu_case(16, lens_q=[9, 4, 13], lens_kv=[50, 20, 13], hq=4, hkv=2, dqk=128, page_size=16, dtype=BF16)
    kw = case.kwargs
    p = pagedprefill.plan(
        kw["workspace_buffer"],
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim_qk=128,
        page_size=16,
        actual_seq_lens_q=kw["actual_seq_lens_q"],
        actual_seq_lens_kv=kw["actual_seq_lens_kv"],
        max_token_per_sequence=kw["max_token_per_sequence"],
        max_sequence_kv=kw["max_sequence_kv"],
        block_tables=kw["block_tables"],
        causal=True,
        scale=kw["scale"],
        return_lse=True,
        backend="cudnn",
    )
    errors = []

    def run():
        try:
            poison(kw["out"]), poison(kw["lse"])
            out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
            torch.cuda.synchronize()
            _check(case, BF16, (out, lse))
        except BaseException as exc:  # (a thread's exception would be lost)
            errors.append(exc)

    run()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    run()  # and back on this thread
    if errors:
        raise errors[0]
    assert p.backend_name == "cudnn"


@pytest.mark.gpu
def test_anchor_contiguous_then_interleaved_kv():
    before = cb.graph_builds()
    for layout in ("hnd", "interleaved", "nhd"):
        case = _gpu_case(
            2, lens_q=[9, 4], lens_kv=[50, 20], hq=4, hkv=2, dqk=128, page_size=16, kv_layout=layout, dtype=BF16
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
        4, lens_q=[7, 12, 3, 9], lens_kv=[30, 12, 64, 9], hq=4, hkv=4, dqk=128, page_size=page_size, dtype=BF16
    )
    _check(case, BF16, _run(case))


@pytest.mark.gpu
def test_anchor_block_table_wider_than_max_kv():
    case = _gpu_case(
        5, lens_q=[6, 5, 8], lens_kv=[33, 7, 48], hq=4, hkv=1, dqk=128, page_size=16, dtype=BF16, extra_table_cols=9
    )
    assert case.kwargs["block_tables"].shape[1] > -(-48 // 16)
    _check(case, BF16, _run(case))


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [False, True], ids=["host-lengths", "device-lengths"])
def test_strided_block_table_on_gpu(on_device):
    """A column slice of a wider block table (row stride > width)."""
    case = _gpu_case(
        15,
        lens_q=[6, 5, 8],
        lens_kv=[33, 7, 48],
        hq=4,
        hkv=2,
        dqk=128,
        page_size=16,
        dtype=BF16,
        extra_table_cols=0,
        lens_on_device=on_device,
    )
    bt = case.kwargs["block_tables"]
    wide = torch.full((bt.shape[0], bt.shape[1] + 7), 10_000, dtype=torch.int32, device="cuda")
    wide[:, : bt.shape[1]] = bt
    case.kwargs["block_tables"] = wide[:, : bt.shape[1]]
    _check(case, BF16, _run(case, is_cuda_graph_compatible=on_device))


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
    return [(int(table[b, (n - 1) // ps]), n % ps) for b, n in enumerate(case.lens_kv) if n % ps and case.lens_q[b]]


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
        9, lens_q=[5, 9, 3], lens_kv=[21, 35, 7], hq=4, hkv=2, dqk=128, page_size=16, dtype=BF16, extra_table_cols=4
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
    case = _gpu_case(14, lens_q=[5, 9, 3], lens_kv=[21, 35, 7], hq=4, hkv=2, dqk=128, page_size=16, dtype=BF16)
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
    case = _gpu_case(13, lens_q=[5, 3], lens_kv=[20, 9], hq=4, hkv=2, dqk=128, page_size=16, dtype=torch.float8_e4m3fn)
    major, _ = torch.cuda.get_device_capability()
    if major < 10:
        with pytest.raises((ValueError, NotImplementedError)) as info:
            _run(case)
        assert "cuDNN refuses fp8 attention on this GPU" in str(info.value)
        assert torch.isnan(case.kwargs["out"].float()).all()  # nothing written
    else:
        out, lse = _run(case)
        check(case, out, lse, atol=6e-2, lse_atol=5e-2)


# --------------------------------------------------------------------------------------------
# Raw execution (graph.RawExecute): the addresses it hands the frontend
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("paged, lse, sinks, fp8", [(True, True, False, False), (False, False, True, True)])
def test_raw_addresses_are_the_public_operands(paged, lse, sinks, fp8):
    """The raw execution's addresses are exactly the operands the public execute binds, each in its
    slot, at its address: the scratch's from a template kept per views, the call's read again on
    every run (new tensors each call)."""
    plan = object.__new__(cb.CudnnPlan)
    plan.graph = types.SimpleNamespace(spec=types.SimpleNamespace(paged=paged, lse=lse, sinks=sinks, fp8=fp8))
    ints = torch.zeros(graph.ROWS, 8, dtype=torch.int32)
    table = torch.zeros(3, 4, dtype=torch.int32) if paged else None
    floats = torch.zeros(8) if fp8 else None
    views = cb._Views(ints, table, floats, torch.zeros(16, dtype=torch.uint8))

    def call():
        names = ("q", "k", "v", "out", "lse", "sinks", "q_scale", "k_scale", "v_scale")
        return types.SimpleNamespace(**{n: torch.randn(5) for n in names})

    names = list(plan._operands(call(), views))
    random.Random(3).shuffle(names)
    slots = (*names[:2], 4242, *names[2:])  # (an address the graph binds itself among them)
    raw = graph.RawExecute(None, tuple(slots), -1)
    kept = []
    for t in (call(), call()):
        ops = plan._operands(t, views)
        want = [ops[x].data_ptr() if type(x) is str else x for x in slots]
        assert list(plan._raw_addresses(raw, t, views)) == want
        kept.append(views.raw)
    assert kept[0] is kept[1] and kept[0][0] is raw  # (the template made once for this scratch)
    assert ("table_k" in ops) == paged and ("off_k" in ops) == (not paged)
    assert ("stats" in ops) == lse and ("sinks" in ops) == sinks and ("descale_q" in ops) == fp8


def test_raw_execute_orders_addresses_by_the_graphs_slots(monkeypatch):
    """RawExecute puts each operand's address in its uid's slot of the frontend's variant-pack order
    and the graph's own bindings in theirs; another frontend version, a python engine or an unnamed
    slot keeps the public execute."""
    import ctypes

    got = []

    def execute_with_raw_ptrs(address, n, ws, handle, index):
        got.append((list(ctypes.cast(address, ctypes.POINTER(ctypes.c_int64))[:n]), ws, handle, index))

    uids = {"q": 7, "k": 3, "o": 9}
    tensors = {n: types.SimpleNamespace(get_uid=lambda u=u: u) for n, u in uids.items()}

    def frontend(order, bindings=None, engine=None):
        g = types.SimpleNamespace(
            selected_engine=engine,
            _is_built=True,
            _variant_pack_uids=lambda: order,
            _lowered_graph=types.SimpleNamespace(_execute_with_raw_ptrs=execute_with_raw_ptrs),
            _plans=[],
            _data_bindings=bindings or {},
        )
        return graph.Plan(None, g, tensors, None)

    module = types.SimpleNamespace(__version__="1.32.0")
    monkeypatch.setattr(graph, "cudnn_module", lambda: module)
    raw = graph.RawExecute.of(frontend([3, 5, 7, 9], bindings={5: 4242}))
    addrs, holes = raw.template({"q": 100, "k": 200})
    assert holes == ((3, "o"),)
    addrs[3] = 300
    raw(addrs, 77, types.SimpleNamespace(backend_handle=11))
    assert got == [([200, 4242, 100, 300], 77, 11, -1)]
    assert graph.RawExecute.of(frontend([3, 5, 7, 9])) is None  # (slot 5: neither named nor bound)
    assert graph.RawExecute.of(frontend([3, 7, 9], engine=object())) is None
    module.__version__ = "1.33.0"
    assert graph.RawExecute.of(frontend([3, 7, 9])) is None
