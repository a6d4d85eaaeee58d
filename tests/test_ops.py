"""The custom-op entry point: same results as the oracle, eager and under torch.compile(fullgraph)."""

import pytest
import torch
from helpers import plan_of
from oracle import check, make_case

from pagedprefill import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
ATOL = 2e-2 if DEVICE == "cuda" else 1e-4


def _case(seed, **kw):
    base = dict(lens_q=[5, 0, 7, 3], lens_kv=[9, 3, 7, 11], hq=4, hkv=2, dqk=64, dtype=DTYPE, device=DEVICE)
    return make_case(seed, **{**base, **kw})


@pytest.mark.parametrize("page_size,lse_layout,offsets", [(4, "padded", "none"), (0, "packed", "tokens")])
def test_compiled_fullgraph_matches_oracle(page_size, lse_layout, offsets):
    case = _case(11 + page_size, page_size=page_size, lse_layout=lse_layout, offsets=offsets, gaps=True)
    kw = dict(case.kwargs)
    q = kw.pop("q")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def layer(q):
        out, lse = ops.batch_prefill_with_kv_cache(q, **kw)
        return out, lse

    out, lse = layer(q)
    check(case, out, lse, atol=ATOL, lse_atol=ATOL)


def test_allocates_outputs_like_the_eager_function():
    case = _case(21, page_size=3, with_out=False)
    out, lse = ops.batch_prefill_with_kv_cache(**case.kwargs)
    check(case, out, lse, atol=ATOL, lse_atol=ATOL)  # uncovered rows: 0 / -inf


def test_errors_name_the_argument_and_write_nothing():
    case = _case(31, page_size=4)
    kw = dict(case.kwargs, max_sequence_kv=2)  # KV lengths above it
    before = kw["out"].clone()
    with pytest.raises(ValueError, match="^actual_seq_lens_kv: expected lengths <= max_sequence_kv"):
        ops.batch_prefill_with_kv_cache(**kw)
    assert torch.equal(kw["out"].view(torch.uint8), before.view(torch.uint8))
    with pytest.raises(ValueError, match="^out: expected dtype"):
        ops.batch_prefill_with_kv_cache(**dict(case.kwargs, o_data_type=torch.float16))
    with pytest.raises(ValueError, match="^lse: expected None when return_lse=False"):  # (as the eager call)
        ops.batch_prefill_with_kv_cache(**dict(case.kwargs, return_lse=False))


def test_opcheck():
    case = _case(41, page_size=4, lens_q=[3, 2], lens_kv=[5, 4])
    kw = case.kwargs
    args = (
        kw["q"],
        kw["k_cache"],
        kw["v_cache"],
        kw["scale"],
        kw["workspace_buffer"],
        kw["max_token_per_sequence"],
        kw["max_sequence_kv"],
        kw["actual_seq_lens_q"],
        kw["actual_seq_lens_kv"],
        kw["block_tables"],
        kw["causal"],
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        "elements",
        kw["out"],
        kw["lse"],
        False,
        "auto",
        -1,
        0.0,
        None,
    )
    torch.library.opcheck(torch.ops.pagedprefill.batch_prefill.default, args)


def test_bad_arguments_are_named_before_allocating():
    """A non-tensor q, list lengths, an int o_data_type: the library's errors, never AttributeError."""
    case = _case(51, page_size=4)
    kw = dict(case.kwargs)
    with pytest.raises(ValueError, match="^q: expected a torch.Tensor"):
        ops.batch_prefill_with_kv_cache(**dict(kw, q=kw["q"].tolist()))
    with pytest.raises(ValueError, match="^actual_seq_lens_q: expected"):
        ops.batch_prefill_with_kv_cache(**dict(kw, actual_seq_lens_q=[5, 0, 7, 3], lse=None))
    with pytest.raises(ValueError, match="^o_data_type: expected"):
        ops.batch_prefill_with_kv_cache(**dict(kw, out=None, o_data_type=torch.int32))


def test_plan_run_compiled_fullgraph_matches_oracle():
    """The per-layer run of a plan traces as one custom op."""
    case = _case(61, page_size=4, lse_layout="padded")
    kw = case.kwargs
    p = plan_of(case, "torch" if DEVICE == "cpu" else "auto")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def layer(q, k, v, out, lse):
        return ops.plan_run(p, q, k, v, out, lse)

    out, lse = layer(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
    check(case, out, lse, atol=ATOL, lse_atol=ATOL)


def test_compiled_fullgraph_with_changing_float_arguments():
    """A soft-cap (one-shot) or v_scale (plan.run) that changes between calls: torch.compile leaves
    such a float unspecialised, and the checks before the op must still trace; a non-finite one is
    still refused, never passed on."""
    kw0 = _case(71, page_size=3, lse_layout="padded").kwargs
    q = kw0["q"]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def capped(q, out, lse, cap):
        return ops.batch_prefill_with_kv_cache(**dict(kw0, q=q, out=out, lse=lse, logits_soft_cap=cap))

    for cap in (3.0, 1.0, 0.5):
        case = _case(71, page_size=3, lse_layout="padded", logits_soft_cap=cap)  # (same data, fresh buffers)
        out, lse = capped(q, case.kwargs["out"], case.kwargs["lse"], cap)
        check(case, out, lse, atol=ATOL, lse_atol=ATOL)
    with pytest.raises(Exception, match="logits_soft_cap"):
        capped(q, case.kwargs["out"], case.kwargs["lse"], float("inf"))

    case = _case(72, page_size=4, lse_layout="padded")
    kw = case.kwargs
    p = plan_of(case, "torch" if DEVICE == "cpu" else "auto")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def scaled(q, k, v, vs):
        return ops.plan_run(p, q, k, v, v_scale=vs)[0]

    for vs in (1.0, 2.0, 0.5):
        out = scaled(kw["q"], kw["k_cache"], kw["v_cache"], vs)
        ref = p.run(kw["q"], kw["k_cache"], kw["v_cache"], v_scale=vs)[0]
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        assert out.abs().max() > 0
    with pytest.raises(Exception, match="v_scale"):
        scaled(kw["q"], kw["k_cache"], kw["v_cache"], float("nan"))


def test_ops_take_the_eager_functions_arguments():
    """Float scales (as the eager one-shot call and plan.run take them), and the eager checks of
    causal / window_left ahead of the op's schema (which would turn causal=1 into True)."""
    case = _case(71, page_size=4, lens_q=[3, 2], lens_kv=[6, 4])
    kw = dict(case.kwargs)
    out, lse = ops.batch_prefill_with_kv_cache(**dict(kw, k_scale=1.0, v_scale=1.0))
    check(case, out, lse, atol=ATOL, lse_atol=ATOL)
    p = plan_of(case, "torch" if DEVICE == "cpu" else "auto")
    out, lse = ops.plan_run(p, kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"], k_scale=1.0)
    check(case, out, lse, atol=ATOL, lse_atol=ATOL)
    with pytest.raises(ValueError, match="^causal: expected a bool"):
        ops.batch_prefill_with_kv_cache(**dict(kw, causal=1))
    with pytest.raises(ValueError, match="^window_left: expected an int"):
        ops.batch_prefill_with_kv_cache(**dict(kw, window_left=2.5))
    with pytest.raises(ValueError, match="^k_scale: expected a finite scale"):
        ops.batch_prefill_with_kv_cache(**dict(kw, k_scale=float("inf")))
