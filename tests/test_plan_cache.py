"""The one-shot call's cache (``pagedprefill.plan_cache``): a call whose signature matches an earlier
one skips every check and the backend's planning. Every result is still checked against the float64
oracle, on fresh data; the cache keeps no caller tensor alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from oracle import check, make_case

import pagedprefill
from pagedprefill import api, cudnn_batch_prefill_with_kv_cache, plan_cache, tuning

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture
def normalise_calls(monkeypatch):
    """Count the full-path calls (a cache miss checks everything; a hit does not)."""
    pagedprefill.clear_caches()
    calls = []
    real = api._plan_call

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "_plan_call", counted)
    yield calls
    pagedprefill.clear_caches()


def _same_layout_cases(n, shared, **opts):
    """``n`` cases of one layout with fresh random data, and ``bind(case)``: the case's kwargs where
    the tensors named in ``shared`` (lengths, offsets, workspace, block table) are the FIRST case's
    objects, given this case's values in place just before its call, as a serving engine updates
    its buffers between steps."""
    cases = [make_case(100 + i, **opts) for i in range(n)]
    first = dict(cases[0].kwargs)

    def bind(c):
        kw = dict(c.kwargs)
        for name in shared:
            if name in kw:
                if name != "workspace_buffer":
                    first[name].copy_(kw[name])
                kw[name] = first[name]
        return kw

    return cases, bind


RAGGED = dict(
    lens_q=[3, 5, 1],
    lens_kv=[7, 5, 9],
    max_q=6,
    max_kv=12,
    hq=4,
    hkv=2,
    dqk=32,
    page_size=0,
    dtype=torch.float32,
)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_repeated_calls_hit_the_cache_and_stay_correct(normalise_calls, backend):
    opts = dict(RAGGED, dtype=F16 if backend == "triton" else torch.float32)
    shared = ("actual_seq_lens_q", "actual_seq_lens_kv", "workspace_buffer")
    cases, bind = _same_layout_cases(4, shared, **opts)
    other = make_case(9, **dict(opts, lens_q=[6, 2], lens_kv=[6, 11]))  # same workspace, other plan
    other.kwargs["workspace_buffer"] = cases[0].kwargs["workspace_buffer"]
    tol = 2e-3 if backend == "triton" else 2e-5
    for c in cases:
        out, lse = cudnn_batch_prefill_with_kv_cache(**bind(c), backend=backend)
        check(c, out, lse, atol=tol)
        other.kwargs["out"].fill_(float("nan"))
        other.kwargs["lse"].fill_(float("nan"))
        out, lse = cudnn_batch_prefill_with_kv_cache(**other.kwargs, backend=backend)
        check(other, out, lse, atol=tol)
    assert len(normalise_calls) == 2
    assert api.last_backend() == backend


def test_lengths_changed_in_place_are_seen(normalise_calls):
    """Host lengths are part of the signature by value: new values re-plan (and stay correct)."""
    a = make_case(1, **RAGGED)
    b = make_case(2, **dict(RAGGED, lens_q=[4, 4, 1], lens_kv=[7, 6, 8]))  # same totals: same layout
    cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
    for name in ("actual_seq_lens_q", "actual_seq_lens_kv"):
        a.kwargs[name].copy_(b.kwargs[name])
        b.kwargs[name] = a.kwargs[name]
    b.kwargs["workspace_buffer"] = a.kwargs["workspace_buffer"]
    out, lse = cudnn_batch_prefill_with_kv_cache(**b.kwargs, backend="torch")
    check(b, out, lse, atol=2e-5)
    assert len(normalise_calls) == 2


def test_bad_lengths_after_a_cached_call_still_raise(normalise_calls):
    a = make_case(3, **RAGGED)
    cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
    cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
    assert len(normalise_calls) == 1
    a.kwargs["actual_seq_lens_q"][1] = a.kwargs["max_token_per_sequence"] + 1
    before = a.kwargs["out"].clone()
    with pytest.raises(ValueError, match="actual_seq_lens_q"):
        cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
    assert torch.equal(before.view(torch.int32), a.kwargs["out"].view(torch.int32))


def test_bad_page_ids_after_a_cached_call_still_raise(normalise_calls):
    """A CPU block table is read at every call: a page id made out of range in place after a cached
    call is refused by name on the next one (never clamped), and nothing is written."""
    a = make_case(4, **dict(RAGGED, page_size=4))
    cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
    cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
    assert len(normalise_calls) == 1
    table = a.kwargs["block_tables"]
    assert table.device.type == "cpu"
    table[1, 0] = 10**6
    a.kwargs["out"].fill_(float("nan"))
    before = a.kwargs["out"].clone()
    with pytest.raises(ValueError, match=r"^block_tables: expected page ids in \[0, "):
        cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
    assert torch.equal(before.view(torch.int32), a.kwargs["out"].view(torch.int32))


@pytest.mark.parametrize("name", ["causal", "return_lse", "max_token_per_sequence", "scale"])
def test_misuse_after_a_cached_call_still_raises(normalise_calls, name):
    """The cache's key holds the scalars' types: True == 1 == 1.0, yet a call refused on a cold cache
    is refused on a warm one."""
    a = make_case(3, **RAGGED)
    kw = dict(a.kwargs, backend="torch", scale=1.0)
    bad = {"causal": int, "return_lse": int, "max_token_per_sequence": float, "scale": lambda x: x == 1.0}[name]
    cudnn_batch_prefill_with_kv_cache(**kw)
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        cudnn_batch_prefill_with_kv_cache(**dict(kw, **{name: bad(kw[name])}))


def test_other_layouts_and_arguments_miss(normalise_calls):
    a = make_case(4, **RAGGED)
    kw = dict(a.kwargs, backend="torch")
    cudnn_batch_prefill_with_kv_cache(**kw)
    cudnn_batch_prefill_with_kv_cache(**dict(kw, scale=0.125))
    cudnn_batch_prefill_with_kv_cache(**dict(kw, causal=not kw["causal"]))
    cudnn_batch_prefill_with_kv_cache(**dict(kw, return_lse=False, lse=None))
    cudnn_batch_prefill_with_kv_cache(**dict(kw, out=None))
    cudnn_batch_prefill_with_kv_cache(**dict(kw, q=kw["q"].clone().transpose(0, 1).contiguous().transpose(0, 1)))
    assert len(normalise_calls) == 6


def test_allocated_outputs_are_new_for_every_call(normalise_calls):
    a = make_case(5, **dict(RAGGED, with_out=False))
    out1, lse1 = cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
    out2, lse2 = cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
    assert len(normalise_calls) == 1
    assert out1.data_ptr() != out2.data_ptr() and lse1.data_ptr() != lse2.data_ptr()
    check(a, out2, lse2, atol=2e-5)


def test_cached_plan_keeps_no_call_tensor_alive(normalise_calls):
    a = make_case(6, **RAGGED)
    refs = [weakref.ref(a.kwargs[n]) for n in ("q", "k_cache", "v_cache", "out", "lse")]
    cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
    assert len(plan_cache._PLANS) == 1
    for n in ("q", "k_cache", "v_cache", "out", "lse"):
        del a.kwargs[n]
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "triton"])
@pytest.mark.parametrize("graph_mode", [False, True])
def test_gpu_paged_repeated_calls_with_a_table_updated_in_place(normalise_calls, backend, graph_mode):
    """The engine pattern: one block table / lengths / workspace, contents rewritten between calls,
    new q / K / V / out every call. Lengths on the device in CUDA-graph mode."""
    opts = dict(
        lens_q=[5, 33, 17],
        lens_kv=[40, 33, 90],
        hq=8,
        hkv=2,
        dqk=128,
        page_size=16,
        dtype=BF16,
        device="cuda",
        max_q=64,
        max_kv=128,
        lens_on_device=graph_mode,
    )
    shared = ("actual_seq_lens_q", "actual_seq_lens_kv", "workspace_buffer", "block_tables")
    cases, bind = _same_layout_cases(4, shared, **opts)
    for c in cases:
        kw = dict(bind(c), backend=backend, is_cuda_graph_compatible=graph_mode)
        out, lse = cudnn_batch_prefill_with_kv_cache(**kw)
        torch.cuda.synchronize()
        check(c, out, lse, atol=3e-2, lse_atol=2e-2)
    assert len(normalise_calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cudnn", "triton"])
def test_gpu_queued_calls_with_new_host_lengths_each(backend):
    """More distinct host-length calls than the call cache holds, all queued behind a long GPU
    sleep: each call's staged (pinned) metadata must still hold its own values when the GPU reaches
    it, after the call returned and its plan was evicted."""
    pagedprefill.clear_caches()
    n = plan_cache.MAX_PLANS + 8
    gen = torch.Generator().manual_seed(5)
    opts = dict(hq=8, hkv=2, dqk=64, page_size=16, dtype=BF16, device="cuda", max_q=32, max_kv=72)
    cases = []
    for i in range(n):
        lens_q = torch.randint(1, 33, (3,), generator=gen).tolist()
        lens_kv = [q + int(torch.randint(0, 40, (1,), generator=gen)) for q in lens_q]
        cases.append(make_case(400 + i, lens_q=lens_q, lens_kv=lens_kv, **opts))
    try:
        cudnn_batch_prefill_with_kv_cache(**cases[0].kwargs, backend=backend)  # build / compile first
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4e8))  # ~0.2 s: every call below is queued before the GPU runs any
        results = [cudnn_batch_prefill_with_kv_cache(**c.kwargs, backend=backend) for c in cases]
        torch.cuda.synchronize()
        for c, (out, lse) in zip(cases, results):
            check(c, out, lse, atol=3e-2, lse_atol=2e-2)
    finally:
        pagedprefill.clear_caches()


@pytest.mark.gpu
def test_gpu_cudnn_misaligned_q_after_a_cached_call_is_refused():
    """cuDNN needs 16-byte aligned tensors: the alignment is in the signature, so a misaligned q after
    a cached call is checked again and refused."""
    pagedprefill.clear_caches()
    opts = dict(lens_q=[5, 3], lens_kv=[9, 4], hq=8, hkv=2, dqk=64, page_size=16, dtype=BF16, device="cuda")
    a = make_case(7, **opts)
    cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="cudnn")
    q = a.kwargs["q"]
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    shifted = flat[1:].view(q.shape).copy_(q)
    before = a.kwargs["out"].clone()
    with pytest.raises(ValueError, match="16-byte"):
        cudnn_batch_prefill_with_kv_cache(**dict(a.kwargs, q=shifted), backend="cudnn")
    assert torch.equal(before.view(torch.int16), a.kwargs["out"].view(torch.int16))
    out, lse = cudnn_batch_prefill_with_kv_cache(**dict(a.kwargs, q=shifted), backend="auto")
    assert api.last_backend() != "cudnn"
    check(a, out, lse, atol=3e-2, lse_atol=2e-2)


def test_unhashable_arguments_still_get_the_named_error(normalise_calls):
    a = make_case(11, **RAGGED)
    for kw, name in (
        (dict(batch_offsets_units=["elements"]), "batch_offsets_units"),
        (dict(backend=["torch"]), "backend"),
        (dict(o_data_type=[torch.float32]), "o_data_type"),
    ):
        call = dict(a.kwargs, backend="torch")
        call.update(kw)
        with pytest.raises(ValueError, match=name):
            cudnn_batch_prefill_with_kv_cache(**call)


@pytest.mark.parametrize("page_size", [0, 3])
def test_cached_plans_pin_no_caller_buffer(normalise_calls, page_size):
    """A cached plan holds none of the call's tensors (workspace, lengths, offsets, block table,
    scales, sinks): a caller who allocates a fresh workspace per call does not accumulate them."""
    a = make_case(12, **dict(RAGGED, page_size=page_size, offsets="tokens", sinks=True))
    names = [n for n, t in a.kwargs.items() if isinstance(t, torch.Tensor)]
    refs = [weakref.ref(a.kwargs[n]) for n in names]
    for _ in range(3):
        a.kwargs["workspace_buffer"] = torch.empty_like(a.kwargs["workspace_buffer"])
        refs.append(weakref.ref(a.kwargs["workspace_buffer"]))
        out, lse = cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")
        check(a, out, lse, atol=2e-5)
    assert len(plan_cache._PLANS) == 1 and len(normalise_calls) == 1
    del out, lse
    a.kwargs.clear()
    a.info.clear()  # (the oracle's own copy of the block table)
    gc.collect()
    assert [r for r in refs if r() is not None] == []


@pytest.mark.needs_triton
def test_triton_knob_overrides_invalidate_cached_calls(normalise_calls):
    a = make_case(13, **dict(RAGGED, dtype=F16))
    cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="triton")
    a.kwargs["out"].fill_(float("nan"))
    a.kwargs["lse"].fill_(float("nan"))
    with tuning.override("triton", num_splits=2):
        out, lse = cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="triton")
    check(a, out, lse, atol=2e-3)
    assert len(normalise_calls) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cudnn", "auto"])
def test_gpu_serving_loop_device_memory_is_flat(backend):
    """A serving loop: one paged cache, a new random batch of chunked prefills every call (new
    lengths, new block table, new q), results dropped. After warm-up, device memory must not grow
    (no gc.collect: whatever the library keeps must be bounded by itself)."""
    pagedprefill.clear_caches()
    gen = torch.Generator().manual_seed(17)
    hq, hkv, d, page, pages = 8, 2, 64, 16, 4096
    k_cache = torch.randn(pages, hkv, page, d, device="cuda", dtype=BF16)
    v_cache = torch.randn(pages, hkv, page, d, device="cuda", dtype=BF16)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    def step():
        b = int(torch.randint(1, 33, (1,), generator=gen))
        q_lens = torch.randint(1, 97, (b,), generator=gen, dtype=torch.int32)
        kv_lens = q_lens + torch.randint(0, 300, (b,), generator=gen, dtype=torch.int32)
        per = (kv_lens + page - 1) // page
        table = torch.randperm(pages, generator=gen, dtype=torch.int32)[: b * int(per.max())].view(b, -1)
        q = torch.randn(int(q_lens.sum()), hq, d, device="cuda", dtype=BF16)
        cudnn_batch_prefill_with_kv_cache(
            q,
            k_cache,
            v_cache,
            d**-0.5,
            ws,
            max_token_per_sequence=int(q_lens.max()),
            max_sequence_kv=int(kv_lens.max()),
            actual_seq_lens_q=q_lens,
            actual_seq_lens_kv=kv_lens,
            block_tables=table.cuda(),
            causal=True,
            return_lse=True,
            backend=backend,
        )

    try:
        for _ in range(150):
            step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(600):
            step()
        torch.cuda.synchronize()
        growth = torch.cuda.memory_allocated() - before
        assert growth <= 1 << 20, f"{backend}: device memory grew {growth / 2**20:.2f} MiB over 600 calls"
    finally:
        pagedprefill.clear_caches()


def _key(vectors: tuple, scalars: tuple = (1.0, "elements")) -> tuple:
    """The signature of a call with these length / offset vectors (its other tensors fixed)."""
    t = torch.empty((7, 2, 16), device="meta")
    return plan_cache.signature((t,) * 8, vectors, (None, None, None), scalars, tuple(map(type, scalars)))


@pytest.mark.gpu
def test_gpu_device_offsets_that_alias_q_are_in_the_key():
    """Whether device o / stats offsets are q's own vector decides whether the call may allocate out /
    a packed LSE (``normalise.alloc_rows``): two calls whose offsets have equal layouts but differ in
    that get different keys, so a refused allocation is never served by a cached plan. (Meta tensors
    all have address 0: the CPU test below models addresses.)"""
    base = torch.empty(64, dtype=torch.int32, device="cuda")
    q, other = base[:4], base[8:12]
    lens = base[16:19]
    same = _key((lens, lens, q, q, None, None, None))
    apart = _key((lens, lens, q, other, None, None, None))
    assert same is not None and apart is not None and same != apart
    assert _key((lens, lens, q, q, None, None, None)) == same


def test_aliases_of_device_offsets():
    """``plan_cache._aliases``: o and stats compared with q by address, on the device only."""

    class Dev(torch.Tensor):  # (a CPU tensor that reports itself off the CPU, at a chosen address)
        pass

    def dev(ptr: int):
        t = torch.empty(4, dtype=torch.int32).as_subclass(Dev)
        t.is_cpu_override, t.ptr = False, ptr
        return t

    Dev.is_cpu = property(lambda self: getattr(self, "is_cpu_override", True))
    Dev.data_ptr = lambda self: self.ptr
    q, o = dev(4096), dev(8192)
    assert plan_cache._aliases((None, None, q, q, None, None, q)) == (True, True)
    assert plan_cache._aliases((None, None, q, o, None, None, None)) == (False, False)
    assert plan_cache._aliases((None, None, None, o, None, None, None)) == ()
    host = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert plan_cache._aliases((None, None, host, host, None, None, None)) == ()


def test_cached_plan_keeps_no_view_of_a_caller_vector():
    """``api._plan_owned`` drops a device vector that is a caller's tensor or a view of what a
    caller's view views (``reshape(-1)`` of ``buf[:b]`` has ``buf`` as its base), and keeps the
    plan's own copies."""
    from pagedprefill.batch import DeviceVectors

    buf = torch.empty(1 << 20, dtype=torch.int32, device="meta")
    lens = buf[:3]  # the caller's argument: a view of its buffer
    offs = buf[100:104]
    mine = torch.empty(4, dtype=torch.int32, device="meta")  # (a copy the plan made of a host vector)
    vecs = DeviceVectors(lens.reshape(-1), mine, {"q": offs.view(-1), "k": mine}, None, None, "tokens")
    got = api._plan_owned(vecs, (lens, None, offs, None, None, None, None))
    assert got.lens_q is None and got.offsets["q"] is None
    assert got.lens_kv is mine and got.offsets["k"] is mine
