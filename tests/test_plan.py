"""``pagedprefill.plan`` and ``PrefillPlan.run``: plan once per batch, run per layer (CPU: torch and
the Triton interpreter; GPU: every backend, device lengths)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import DEVICE, atol_for, plan_of, to_csr
from oracle import check, make_case, poison

import pagedprefill

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "page_size,offsets,lse_layout", [(3, "none", "padded"), (0, "tokens", "packed"), (16, "elements", "padded")]
)
def test_plan_once_run_per_layer_matches_the_oracle(backend, page_size, offsets, lse_layout):
    dtype = F16 if backend == "triton" else F32
    case = make_case(
        5,
        lens_q=[7, 0, 12],
        lens_kv=[20, 3, 12],
        hq=6,
        hkv=2,
        dqk=32,
        page_size=page_size,
        dtype=dtype,
        offsets=offsets,
        gaps=True,
        lse_layout=lse_layout,
        device=DEVICE,
    )
    p = plan_of(case, backend)
    kw = case.kwargs
    for layer in range(3):
        for name in ("q", "k_cache", "v_cache"):  # a new layer: new data in place
            t = kw[name]
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(layer)).to(t.dtype))
        poison(kw["out"])
        poison(kw["lse"])
        out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
        assert out is kw["out"] and lse is kw["lse"]
        check(case, out, lse, atol=atol_for(dtype), lse_atol=max(atol_for(dtype), 1e-3))
    assert pagedprefill.last_backend() == backend and p.backend_name == backend


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_csr_pages_match_the_block_table(backend):
    """FlashInfer's kv_indptr / kv_indices / kv_last_page_len give the same result as the table."""
    dtype = F16 if backend == "triton" else F32
    case = make_case(
        6, lens_q=[7, 3, 12, 1], lens_kv=[20, 0, 12, 30], hq=4, hkv=2, dqk=32, page_size=4, dtype=dtype, device=DEVICE
    )
    p = plan_of(case, backend, csr=True)
    kw = case.kwargs
    out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
    check(case, out, lse, atol=atol_for(dtype), lse_atol=1e-3)


def test_csr_arguments_are_checked():
    case = make_case(6, lens_q=[7, 3], lens_kv=[20, 5], hq=4, hkv=2, dqk=32, page_size=4)
    csr = to_csr(case)
    with pytest.raises(ValueError, match="^kv_last_page_len: expected values in \\[1, page_size = 4\\]"):
        plan_of(case, csr=True, kv_last_page_len=torch.tensor([9, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="^kv_indptr: expected non-negative, non-decreasing"):
        plan_of(case, csr=True, kv_indptr=torch.tensor([0, 5, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="^kv_indptr: expected a last entry <="):
        plan_of(case, csr=True, kv_indices=csr["kv_indices"][:2])
    with pytest.raises(ValueError, match="^kv_indices: expected page ids in"):
        bad = csr["kv_indices"].clone()
        bad[1] = 10**6
        p = plan_of(case, csr=True, kv_indices=bad)
        p.run(case.kwargs["q"], case.kwargs["k_cache"], case.kwargs["v_cache"])
    with pytest.raises(ValueError, match="^block_tables: expected None when kv_indptr / kv_indices give the pages"):
        plan_of(case, csr=True, block_tables=case.kwargs["block_tables"])
    with pytest.raises(ValueError, match="^actual_seq_lens_kv: expected None with CSR pages"):
        plan_of(case, csr=True, actual_seq_lens_kv=case.kwargs["actual_seq_lens_kv"], max_sequence_kv=20)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("csr,view", [(False, "contiguous"), (False, "sliced"), (False, "repeated"), (True, "")])
def test_plan_keeps_its_own_copy_of_host_page_ids(backend, csr, view):
    """Page ids on the CPU are copied by plan(): the caller's tensor changed afterwards (one id out of
    range, one pointing at another page) changes no run and bypasses no check; a plan of the changed
    ids refuses them."""
    dtype = F16 if backend == "triton" else F32
    case = make_case(
        8, lens_q=[5, 9, 1], lens_kv=[13, 22, 7], hq=6, hkv=2, dqk=32, page_size=4, dtype=dtype, device=DEVICE
    )
    kw = case.kwargs
    if csr:
        pages = {k: v.cpu() for k, v in to_csr(case).items()}
        ids = pages["kv_indices"]
    else:
        table = ids = kw["block_tables"].cpu().clone()
        if view == "sliced":  # (a view into a wider buffer: rows with gaps)
            ids = torch.cat([table, torch.full_like(table, -7)], 1)
            table = ids[:, : table.shape[1]]
        elif view == "repeated":  # (one row for every sequence: stride 0)
            case = make_case(
                8, lens_q=[5, 9, 1], lens_kv=[13, 13, 13], hq=6, hkv=2, dqk=32, page_size=4, dtype=dtype, device=DEVICE
            )
            kw = case.kwargs
            ids = kw["block_tables"].cpu()[:1].clone()
            table = ids.expand(3, -1)
            kw["block_tables"].copy_(table)
            case.info["block_tables"] = table.clone()
        pages = {"block_tables": table}
    p = plan_of(case, backend, csr=csr, **pages)
    for _ in range(2):
        poison(kw["out"])
        poison(kw["lse"])
        out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
        check(case, out, lse, atol=atol_for(dtype), lse_atol=1e-3)
        flat = ids.view(-1)
        flat[0] = 10**6  # (used by sequence 0 either way)
        flat[1] = int(flat[2])
    name = "kv_indices" if csr else "block_tables"
    with pytest.raises(ValueError, match=f"^{name}: expected page ids in"):
        plan_of(case, backend, csr=csr, **pages).run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])


def test_run_checks_a_float_scale_at_every_run():
    """A float scale's value is not part of the layout: a non-finite one is refused on every run, not
    only on the layout's first."""
    case = make_case(9, lens_q=[5, 2], lens_kv=[9, 4], hq=4, hkv=2, dqk=32, page_size=4, kv_dtype=torch.float8_e4m3fn)
    kw = case.kwargs
    p = plan_of(case)
    p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], k_scale=1.0, v_scale=1.0)
    before = kw["out"].clone()
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="^k_scale: expected a finite scale"):
            p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], k_scale=bad, v_scale=1.0)
    assert torch.equal(kw["out"].view(torch.uint8), before.view(torch.uint8))


@pytest.mark.needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the portable kernel's split count, in the CPU interpreter")
def test_a_knob_override_replans_a_layout():
    """A layout planned under other backend knobs (``pagedprefill.tuning``) is planned again."""
    case = make_case(10, lens_q=[5, 2], lens_kv=[90, 40], hq=4, hkv=2, dqk=32, page_size=4, dtype=F16)
    kw = case.kwargs
    p = plan_of(case, "triton")
    p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
    with pagedprefill.tuning.override("triton", num_splits=3):
        out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
        assert [lp.backend.splits for lp in p.layers.values()][-1] == 3
    check(case, out, lse, atol=atol_for(F16), lse_atol=1e-3)


def test_run_checks_the_layer_against_the_plan():
    case = make_case(7, lens_q=[5, 2], lens_kv=[9, 4], hq=4, hkv=2, dqk=32, page_size=4)
    p = plan_of(case)
    kw = case.kwargs
    q, k, v = kw["q"], kw["k_cache"], kw["v_cache"]
    before = kw["out"].clone()
    with pytest.raises(ValueError, match="^q: expected 4 heads"):
        p.run(torch.randn(q.shape[0], 8, 32), k, v, kw["out"])
    with pytest.raises(ValueError, match="^q: expected head dim 32 \\(the plan's head_dim_qk\\), got 16"):
        p.run(torch.randn(q.shape[0], 4, 16), k[..., :16], v[..., :16])
    with pytest.raises(ValueError, match="^q: expected head dim 32"):  # (not k_cache, which is as planned)
        p.run(torch.randn(q.shape[0], 4, 16), k, v)
    with pytest.raises(ValueError, match="head dims"):
        p.run(q, k, v[..., :16])
    with pytest.raises(ValueError, match="^k_cache: expected page size 4"):
        p.run(q, k.reshape(-1, 2, 2, 32)[: k.shape[0]], v.reshape(-1, 2, 2, 32)[: v.shape[0]])
    with pytest.raises(ValueError, match="^q: expected a q with at least"):
        p.run(q[:3], k, v)
    with pytest.raises(ValueError, match="^q: expected a tensor on the plan's device"):  # (not k_cache: q moved)
        p.run(q.to("meta"), k, v)
    with pytest.raises(ValueError, match="^return_lse: expected a bool, got 'no'"):  # (as plan() says)
        p.run(q, k, v, kw["out"], return_lse="no")
    assert torch.equal(before, kw["out"]) or torch.isnan(before).all() and torch.isnan(kw["out"]).all()


def test_run_allocates_outputs_and_follows_return_lse():
    case = make_case(8, lens_q=[5, 2], lens_kv=[9, 4], hq=4, hkv=2, dqk=32, page_size=4, with_out=False)
    p = plan_of(case)
    kw = case.kwargs
    out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"])
    check(case, out, lse, atol=2e-5)
    out2, none = p.run(kw["q"], kw["k_cache"], kw["v_cache"], return_lse=False)
    assert none is None and torch.equal(out2, out)
    p2 = plan_of(case, return_lse=False)
    assert p2.run(kw["q"], kw["k_cache"], kw["v_cache"])[1] is None


def test_run_alternating_layouts_each_get_their_own_plan():
    """A layer whose K/V layout differs from the last run's (HND storage against the case's NHD, then
    back) is planned for its own layout every time: the last layout's shortcut never serves another."""
    case = make_case(9, lens_q=[6, 3, 9], lens_kv=[17, 3, 30], hq=6, hkv=2, dqk=32, page_size=4, dtype=F32)
    p = plan_of(case)
    kw = case.kwargs
    k, v = kw["k_cache"], kw["v_cache"]
    hnd = [t.contiguous() for t in (k, v)]  # same values, other strides
    assert hnd[0].stride() != k.stride()
    for kc, vc in [(k, v), hnd, (k, v), hnd]:
        poison(kw["out"])
        poison(kw["lse"])
        out, lse = p.run(kw["q"], kc, vc, kw["out"], kw["lse"])
        check(case, out, lse, atol=2e-5)
    assert len(p.layers) == 2


def test_plan_arguments_are_checked():
    case = make_case(9, lens_q=[5, 2], lens_kv=[9, 4], hq=4, hkv=2, dqk=32, page_size=4)
    with pytest.raises(ValueError, match="^num_qo_heads: expected a multiple of num_kv_heads"):
        plan_of(case, num_qo_heads=5)
    with pytest.raises(ValueError, match="^page_size: expected the page size"):
        plan_of(case, page_size=0)
    with pytest.raises(ValueError, match="^backend: expected one of"):
        plan_of(case, backend="flash")
    with pytest.raises(ValueError, match="^actual_seq_lens_kv: expected lengths <= max_sequence_kv"):
        plan_of(case, max_sequence_kv=3)
    with pytest.raises(ValueError, match="^workspace_buffer: expected a torch.Tensor"):
        pagedprefill.plan(
            bytearray(8), num_qo_heads=4, num_kv_heads=2, head_dim_qk=32, actual_seq_lens_q=torch.tensor([1])
        )
    with pytest.raises(ValueError, match="^workspace_buffer: expected a buffer on the CPU or a CUDA device"):
        pagedprefill.plan(
            torch.empty(64, dtype=torch.uint8, device="meta"),
            num_qo_heads=4,
            num_kv_heads=2,
            head_dim_qk=32,
            actual_seq_lens_q=torch.tensor([1]),
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(actual_seq_lens_q=None), "^actual_seq_lens_q: expected a .B,. int32/int64 tensor of lengths, got None"),
        (dict(actual_seq_lens_q=[5, 2]), "^actual_seq_lens_q: expected an int32/int64 torch.Tensor"),
        (dict(actual_seq_lens_q=torch.tensor([-1, -2])), "^actual_seq_lens_q: expected non-negative lengths"),
        (dict(actual_seq_lens_kv=torch.tensor([9.0, 4.0])), "^actual_seq_lens_kv: expected dtype int32 or int64"),
        (dict(kv_last_page_len=torch.tensor([1, 4, 2])), "^kv_last_page_len: expected 2 entries"),
        (dict(kv_last_page_len=torch.tensor([[1, 4]])), "^kv_last_page_len: expected shape"),
        (dict(kv_indptr=[0, 3, 4]), "^kv_indptr: expected an int32/int64 torch.Tensor"),
        (dict(kv_last_page_len=None), "^kv_last_page_len: expected a tensor"),
    ],
)
def test_plan_names_a_bad_length_vector_without_maxima(kwargs, message):
    """Without max_token_per_sequence / max_sequence_kv, plan() takes the maxima from the host vectors:
    a missing or bad vector is named itself (never the maximum the caller did not pass)."""
    case = make_case(9, lens_q=[5, 2], lens_kv=[9, 4], hq=4, hkv=2, dqk=32, page_size=4)
    csr = "kv_indptr" in kwargs or "kv_last_page_len" in kwargs
    base = dict(max_token_per_sequence=None, max_sequence_kv=None)
    if csr:
        base.update(block_tables=None, **to_csr(case))
    with pytest.raises(ValueError, match=message):
        plan_of(case, **{**base, **kwargs})


def test_plan_defaults_scale_and_maxima_from_host_lengths():
    case = make_case(10, lens_q=[5, 2], lens_kv=[9, 4], hq=4, hkv=2, dqk=32, page_size=4, max_q=5, max_kv=9)
    kw = case.kwargs
    p = plan_of(case, max_token_per_sequence=None, max_sequence_kv=None, scale=None)
    assert p.seq.max_q == 5 and p.seq.max_kv == 9 and math.isclose(p.seq.scale, 1 / math.sqrt(32))
    out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
    check(case, out, lse, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cudnn"])
@pytest.mark.parametrize("device_lengths", [False, True])
def test_gpu_plan_run_every_backend(backend, device_lengths):
    case = make_case(
        11,
        lens_q=[300, 0, 77, 5],
        lens_kv=[900, 30, 77, 500],
        hq=28,
        hkv=4,
        dqk=128,
        page_size=16,
        dtype=BF16,
        device="cuda",
        lens_on_device=device_lengths,
    )
    p = plan_of(case, backend)
    kw = case.kwargs
    for _ in range(3):
        poison(kw["out"])
        poison(kw["lse"])
        out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
        check(case, out, lse, atol=atol_for(BF16), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["o", "stats"])
@pytest.mark.parametrize("api", ["one-shot", "plan.run"])
def test_gpu_an_allocated_buffer_device_offsets_place_is_refused(which, api):
    """With device offsets of out's (or the packed LSE's) own, the buffer the call would allocate
    (q's rows) may not hold the rows they place, and the device metadata would drop those rows
    unseen: the call names the buffer instead, writes nothing, and runs once it is given."""
    case = make_case(
        23,
        lens_q=[13, 12, 9],
        lens_kv=[4, 0, 10],
        hq=16,
        hkv=2,
        dqk=128,
        page_size=16,
        dtype=BF16,
        device="cuda",
        lens_on_device=True,
        offsets="tokens",
        gaps=True,
        lse_layout="packed",
    )
    kw = case.kwargs
    given = {"o": "out", "stats": "lse"}[which]
    other = "lse" if given == "out" else "out"
    bare = {k: v for k, v in kw.items() if k != given}
    poison(kw[other])

    def run(args):
        if api == "one-shot":
            return pagedprefill.cudnn_batch_prefill_with_kv_cache(**args, backend="triton")
        p = plan_of(case, "triton")
        return p.run(args["q"], args["k_cache"], args["v_cache"], args.get("out"), args.get("lse"))

    with pytest.raises(ValueError, match=f"{given}: expected a buffer of the caller's when batch_offsets_{which}"):
        run(bare)
    torch.cuda.synchronize()
    assert torch.isnan(kw[other]).all(), "the refused call wrote"
    poison(kw["out"])
    poison(kw["lse"])
    out, lse = run(kw)
    check(case, out, lse, atol=atol_for(BF16), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("device_lengths", [True, False])
@pytest.mark.parametrize("page_size,offsets", [(16, "none"), (0, "elements")])
@pytest.mark.parametrize(
    "lens_q,lens_kv",
    [([1500, 0, 1100, 33], [1600, 30, 1100, 600]), ([700, 0, 41, 500, 16, 3], [900, 30, 41, 800, 16, 1000])],
)
def test_gpu_the_work_counter_is_left_at_zero(page_size, offsets, lens_q, lens_kv, device_lengths, monkeypatch):
    """A Hopper launch off its work counter (max_q > 1024, or uneven prompts of <= 1024 tokens) leaves
    the stream's counter at zero, with no zeroing launch before it: runs of two plans interleaved on
    one stream, and one on a side stream (its own counter), each match the oracle, and every counter
    reads zero after them. A counter left above zero would hand out no work item (out would keep
    its poison). The workspace is filled with 0x7f bytes before each run: no counter lives there."""
    cases = [
        make_case(
            12 + i,
            lens_q=lq,
            lens_kv=lk,
            hq=12,
            hkv=4 - 2 * i,
            dqk=128,
            page_size=page_size,
            offsets=offsets,
            dtype=BF16,
            device="cuda",
            lens_on_device=device_lengths,
        )
        for i, (lq, lk) in enumerate([(lens_q, lens_kv), (lens_q[::-1], lens_kv[::-1])])
    ]
    plans = [plan_of(c, "triton") for c in cases]
    zeroed = []
    real = torch.Tensor.zero_
    monkeypatch.setattr(torch.Tensor, "zero_", lambda self: zeroed.append(self.numel()) or real(self))
    side = torch.cuda.Stream()
    for step in range(5):
        i = step % 2
        case, p, kw = cases[i], plans[i], cases[i].kwargs
        p.workspace.fill_(0x7F)
        poison(kw["out"])
        poison(kw["lse"])
        stream = side if step == 3 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
        torch.cuda.current_stream().wait_stream(stream)
        check(case, out, lse, atol=atol_for(BF16), lse_atol=2e-2)
    for p in plans:
        (lp,) = p.layers.values()
        if lp.name != "triton" or type(lp.backend).__name__ != "HopperPlan" or not lp.backend.dynamic:
            pytest.skip(f"not the Hopper kernel off its work counter here ({lp.name}, {type(lp.backend).__name__})")
    torch.cuda.synchronize()
    from pagedprefill.backends.triton import hopper

    assert len(hopper._COUNTERS) >= 2 and not zeroed, (len(hopper._COUNTERS), zeroed)
    for key, counter in hopper._COUNTERS.items():
        assert not counter.any(), (key, counter[:4].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("device_lengths", [True, False])
def test_gpu_a_captured_launch_brings_its_own_work_counter(device_lengths):
    """A launch off the work counter captured in a CUDA graph on a stream that no eager launch has used
    (warm-up on the main stream, capture on a side stream, as engines do): an eager run on that side
    stream before the first replay, and replays on the main stream, each match the oracle. The captured
    launch's counter is its own (a graph replays on the stream current then, and a counter made during
    capture holds no zero until the first replay), and every counter reads zero afterwards."""
    from pagedprefill.backends.triton import hopper

    case = make_case(
        41,
        lens_q=[1500, 0, 1100, 33],
        lens_kv=[1600, 30, 1100, 600],
        hq=15,
        hkv=3,
        dqk=128,
        page_size=16,
        dtype=BF16,
        device="cuda",
        lens_on_device=device_lengths,
    )
    p = plan_of(case, "triton")
    kw = case.kwargs
    main = torch.cuda.current_stream()

    def run_into(out, lse):
        poison(out)
        poison(lse)
        return p.run(kw["q"], kw["k_cache"], kw["v_cache"], out, lse)

    check(case, *run_into(kw["out"], kw["lse"]), atol=atol_for(BF16), lse_atol=2e-2)
    (lp,) = p.layers.values()
    if type(lp.backend).__name__ != "HopperPlan" or not lp.backend.dynamic:
        pytest.skip(f"not the Hopper kernel off its work counter here ({lp.name}, {type(lp.backend).__name__})")
    side = torch.cuda.Stream()
    side.wait_stream(main)
    graph = torch.cuda.CUDAGraph()
    captured_before = len(hopper._CAPTURED_COUNTERS)
    graph_out, graph_lse = torch.empty_like(kw["out"]), torch.empty_like(kw["lse"])
    with torch.cuda.graph(graph, stream=side):
        p.run(kw["q"], kw["k_cache"], kw["v_cache"], graph_out, graph_lse)
    assert len(hopper._CAPTURED_COUNTERS) == captured_before + 1
    side.wait_stream(main)
    with torch.cuda.stream(side):
        eager = run_into(torch.empty_like(kw["out"]), torch.empty_like(kw["lse"]))
    main.wait_stream(side)
    check(case, *eager, atol=atol_for(BF16), lse_atol=2e-2)
    for _ in range(2):
        poison(graph_out)
        poison(graph_lse)
        graph.replay()
        check(case, graph_out, graph_lse, atol=atol_for(BF16), lse_atol=2e-2)
    torch.cuda.synchronize()
    for counter in [*hopper._COUNTERS.values(), hopper._CAPTURED_COUNTERS[-1]]:
        assert not counter.any(), counter[:4].tolist()


@pytest.mark.gpu
def test_gpu_plan_captured_in_a_cuda_graph_follows_device_lengths():
    """A plan over device lengths / table, captured once, replayed after their contents change."""
    from test_backend_triton import graph_case

    base = graph_case(50, [30, 7], [200, 90], 40, 256, 16, BF16)
    p = plan_of(base, "triton")
    kw = base.kwargs
    p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
    for i, (lq, lkv) in enumerate((([12, 40], [100, 256]), ([0, 3], [5, 4]), ([40, 40], [40, 256]))):
        new = graph_case(51 + i, lq, lkv, 40, 256, 16, BF16)
        for name, t in kw.items():
            if isinstance(t, torch.Tensor) and name != "workspace_buffer":
                t.copy_(new.kwargs[name]) if name not in ("out", "lse") else t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(new, kw["out"], kw["lse"], atol=atol_for(BF16), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cudnn"])
@pytest.mark.parametrize("page_size", [16, 0])
@pytest.mark.parametrize("dqk", [128, 256])
def test_gpu_plan_run_layers_with_their_own_tensors(page_size, dqk, backend, monkeypatch):
    """Each layer's q, K, V, out and lse at new addresses (Triton's bound launch keeps descriptors per
    base address; cuDNN's raw execution takes addresses per call), the first layer's tensors again,
    and a layer whose tensors reuse freed addresses with new contents: each run against the oracle.
    On cuDNN every run after the first goes through the raw execution."""
    from pagedprefill.backends.cudnn import graph as cg

    raw_calls = []
    if backend == "cudnn":
        real = cg.RawExecute.__call__
        monkeypatch.setattr(cg.RawExecute, "__call__", lambda self, *a: raw_calls.append(1) or real(self, *a))
    case = make_case(
        21,
        lens_q=[70, 1, 200],
        lens_kv=[300, 64, 200],
        hq=8,
        hkv=2,
        dqk=dqk,
        page_size=page_size,
        dtype=BF16,
        device="cuda",
    )
    p = plan_of(case, backend)
    kw = case.kwargs
    names = ("q", "k_cache", "v_cache", "out", "lse")

    def new_layer(seed):  # (in the first layer's strides: the same layout, so the same cuDNN graph)
        g = torch.Generator(device="cuda").manual_seed(seed)
        out = {}
        for n in names:
            x = torch.empty_strided(kw[n].shape, kw[n].stride(), dtype=kw[n].dtype, device="cuda")
            out[n] = x.copy_(torch.randn(kw[n].shape, generator=g, device="cuda"))
        return out

    first = {n: kw[n] for n in names}
    layers = [first, new_layer(1), first, None]
    for i in range(len(layers)):
        tensors = layers[i]
        if tensors is None:  # (layer 1's addresses, freed, come back with other contents)
            layers[1] = None
            torch.cuda.synchronize()
            tensors = new_layer(7)
        kw.update(tensors)
        poison(kw["out"])
        poison(kw["lse"])
        out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
        check(case, out, lse, atol=atol_for(BF16), lse_atol=2e-2)
    if backend == "cudnn":
        assert len(raw_calls) >= len(layers) - 1  # (all of them when an earlier test ran this graph)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("backend", ["triton", "cudnn"])
def test_gpu_plan_runs_on_its_tensors_device_not_the_current_one(backend):
    """Tensors on the second GPU while the first is current: the kernels run on the tensors' GPU (Triton
    launches on the current device unless it is set)."""
    case = make_case(23, lens_q=[70, 9], lens_kv=[300, 9], hq=8, hkv=2, dqk=128, page_size=16, device="cuda:1")
    p = plan_of(case, backend)
    kw = case.kwargs
    with torch.cuda.device(0):
        for _ in range(2):
            poison(kw["out"])
            poison(kw["lse"])
            out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
            check(case, out, lse, atol=atol_for(kw["q"].dtype), lse_atol=2e-2)
