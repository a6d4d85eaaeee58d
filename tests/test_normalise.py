"""Argument forms and validation (``pagedprefill.normalise``), through the public function (CPU).

Every bad-input test checks the exception type, that the message names the argument (and says what
was expected and what was given), and that the caller's ``out`` / ``lse`` are byte-for-byte
untouched after the raise.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re

import pytest
import torch
from oracle import check, make_case, poison

import pagedprefill
from pagedprefill import (
    BackendUnavailableError,
    batch_prefill_with_kv_cache,
    cudnn_batch_prefill_with_kv_cache,
    dispatch,
    normalise,
    tuning,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

B, HQ, HKV, D, PS = 2, 4, 2, 16, 4
LENS_Q, LENS_KV = [3, 5], [6, 9]  # q rows 0..7, kv pages 2 + 3


def random_bits_(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.view(-1).view(torch.uint8).copy_(raw)
    return t


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(-1).view(torch.uint8).tolist())


def base_case(page_size: int = PS, bits: bool = True, **kw):
    """The standard small case; ``bits``: poison out / lse with random bytes (else NaN, as the oracle's
    check expects)."""
    opts = dict(lens_q=LENS_Q, lens_kv=LENS_KV, hq=HQ, hkv=HKV, dqk=D, page_size=page_size, extra_table_cols=0)
    opts.update(kw)
    case = make_case(77, **opts)
    if bits and "out" in case.kwargs:
        random_bits_(case.kwargs["out"], 1)
    if bits and case.kwargs.get("lse") is not None:
        random_bits_(case.kwargs["lse"], 2)
    return case


def expect_error(kwargs: dict, match: str, exc=ValueError):
    """Call with ``kwargs``; assert ``exc`` whose message matches and that out / lse are untouched."""
    kwargs = dict(kwargs)
    kwargs.setdefault("backend", "torch")
    watched = {n: kwargs[n] for n in ("out", "lse") if isinstance(kwargs.get(n), torch.Tensor)}
    before = {n: as_bytes(t) for n, t in watched.items()}
    with pytest.raises(exc, match=match) as info:
        cudnn_batch_prefill_with_kv_cache(**kwargs)
    for n, t in watched.items():
        assert as_bytes(t) == before[n], f"{n} was written by a call that raised"
    return str(info.value)


def expect_value_error(kwargs: dict, arg: str, detail: str = ""):
    msg = expect_error(kwargs, rf"^{re.escape(arg)}: expected {detail}")
    assert ", got " in msg, msg  # says what was given
    return msg


def paged(**kw):
    return base_case(PS, **kw).kwargs


def ragged(**kw):
    return base_case(0, **kw).kwargs


def with_(kwargs: dict, **over) -> dict:
    kwargs = dict(kwargs)
    kwargs.update(over)
    return kwargs


def strided(shape, dtype=F32):
    """A tensor of ``shape`` whose last dimension has stride 2."""
    return torch.randn(*shape[:-1], shape[-1] * 2).to(dtype)[..., ::2]


# --------------------------------------------------------------------------------------------
# Signature and exports
# --------------------------------------------------------------------------------------------


def test_signature_is_drop_in_compatible_with_the_seed():
    sig = inspect.signature(cudnn_batch_prefill_with_kv_cache)
    params = list(sig.parameters.values())
    positional = ["q", "k_cache", "v_cache", "scale", "workspace_buffer"]
    assert [p.name for p in params[:5]] == positional
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params[:5])
    expected_kwonly = {
        "max_token_per_sequence": inspect.Parameter.empty,
        "max_sequence_kv": inspect.Parameter.empty,
        "actual_seq_lens_q": None,
        "actual_seq_lens_kv": None,
        "block_tables": None,
        "causal": inspect.Parameter.empty,
        "return_lse": inspect.Parameter.empty,
        "q_scale": None,
        "k_scale": None,
        "v_scale": None,
        "batch_offsets_q": None,
        "batch_offsets_o": None,
        "batch_offsets_k": None,
        "batch_offsets_v": None,
        "batch_offsets_stats": None,
        "batch_offsets_units": "elements",
        "out": None,
        "lse": None,
        "is_cuda_graph_compatible": False,
        "backend": None,
        "o_data_type": None,
        "window_left": -1,
        "logits_soft_cap": 0.0,
        "sinks": None,
    }
    kwonly = {p.name: p.default for p in params[5:]}
    assert all(p.kind is p.KEYWORD_ONLY for p in params[5:])
    assert kwonly == expected_kwonly


def test_exports():
    assert pagedprefill.BACKENDS == ("auto", "cudnn", "triton", "torch")
    assert issubclass(BackendUnavailableError, Exception)
    assert pagedprefill.batch_prefill_with_kv_cache is batch_prefill_with_kv_cache


def test_batch_prefill_defaults_to_auto_and_auto_is_torch_on_cpu(monkeypatch):
    case = base_case(bits=False)
    chosen = []
    real = dispatch.choose

    def spy(batch, backend, workspace_bytes=None):
        module = real(batch, backend, workspace_bytes)
        chosen.append((backend, module.NAME))
        return module

    monkeypatch.setattr(dispatch, "choose", spy)
    pagedprefill.clear_caches()
    out, lse = batch_prefill_with_kv_cache(**case.kwargs)
    cudnn_batch_prefill_with_kv_cache(**with_(case.kwargs, out=None, lse=None))
    assert chosen == [("auto", "torch"), ("auto", "torch")]
    check(case, out, lse, atol=2e-5)


# --------------------------------------------------------------------------------------------
# Bad input: ranks, dtypes, heads, head dims, strides
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arg,make",
    [
        ("q", lambda kw: with_(kw, q=kw["q"][:, 0])),
        ("q", lambda kw: with_(kw, q=kw["q"][None])),
        ("k_cache", lambda kw: with_(kw, k_cache=kw["k_cache"][:, 0])),
        ("v_cache", lambda kw: with_(kw, v_cache=kw["v_cache"][None])),
    ],
    ids=["q-rank2", "q-rank4", "paged-k-rank3", "paged-v-rank5"],
)
def test_wrong_rank_paged(arg, make):
    expect_value_error(make(paged()), arg, "rank")


@pytest.mark.parametrize("arg", ["k_cache", "v_cache"])
def test_wrong_rank_ragged(arg):
    kw = ragged()
    msg = expect_value_error(with_(kw, **{arg: kw[arg][None]}), arg, "rank 3")
    assert "no page table is given" in msg  # says why rank 3 is expected


def test_q_not_a_tensor():
    expect_value_error(with_(paged(), q=[[1.0]]), "q", "a torch.Tensor")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.float64])
def test_q_wrong_dtype(dtype):
    kw = paged()
    expect_value_error(with_(kw, q=(kw["q"] * 4).to(dtype)), "q", "dtype")


def test_k_dtype_differs_from_q():
    kw = paged()
    expect_value_error(with_(kw, k_cache=kw["k_cache"].half(), v_cache=kw["v_cache"].half()), "k_cache", "dtype")


def test_v_dtype_differs_from_k():
    kw = paged()
    expect_value_error(with_(kw, v_cache=kw["v_cache"].half()), "v_cache", "dtype")


def test_fp8_q_needs_fp8_cache():
    kw = paged()
    q8 = kw["q"].to(E4M3)
    expect_value_error(with_(kw, q=q8, q_scale=torch.ones(1), out=None), "k_cache", "an fp8 cache")


def test_query_heads_not_divisible_by_kv_heads():
    kw = paged()
    msg = expect_value_error(with_(kw, q=torch.randn(8, 3, D)), "q", ".*divisible")
    assert "3" in msg and "2" in msg


def test_head_dim_q_vs_k():
    kw = paged()
    expect_value_error(with_(kw, q=torch.randn(8, HQ, D * 2)), "k_cache", f"head dim {2 * D}")


def test_v_head_count_differs_from_k():
    kw = paged()
    expect_value_error(with_(kw, v_cache=kw["v_cache"][:, :1]), "v_cache", f"{HKV} KV heads")


@pytest.mark.parametrize(
    "make",
    [lambda v: v[:-1], lambda v: v[:, :, :2]],
    ids=["page-count", "page-size"],
)
def test_paged_k_v_pages_differ(make):
    kw = paged()
    expect_value_error(with_(kw, v_cache=make(kw["v_cache"])), "v_cache", r"\(num_pages, page_size\)")


@pytest.mark.parametrize("arg", ["q", "k_cache", "v_cache", "out"])
def test_non_unit_last_dim_stride(arg):
    kw = paged()
    t = kw[arg]
    bad = strided(tuple(t.shape), t.dtype)
    if arg == "out":
        poison(bad)
    expect_value_error(with_(kw, **{arg: bad}), arg, "unit stride")


def test_ragged_k_non_unit_stride():
    kw = ragged()
    expect_value_error(with_(kw, k_cache=strided(tuple(kw["k_cache"].shape))), "k_cache", "unit stride")


# --------------------------------------------------------------------------------------------
# Bad input: lengths, block tables, offsets, row counts
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arg", ["actual_seq_lens_q", "actual_seq_lens_kv"])
def test_missing_lengths(arg):
    expect_value_error(with_(paged(), **{arg: None}), arg)


def test_lengths_of_wrong_batch_size():
    expect_value_error(with_(paged(), actual_seq_lens_kv=torch.tensor([6, 9, 1])), "actual_seq_lens_kv", "2 entries")


@pytest.mark.parametrize("arg", ["actual_seq_lens_q", "actual_seq_lens_kv"])
def test_lengths_float_dtype(arg):
    kw = paged()
    expect_value_error(with_(kw, **{arg: kw[arg].float()}), arg, "dtype int32 or int64")


@pytest.mark.parametrize("shape", [(2, 2), (2, 1, 1), (1, 2)])
def test_lengths_wrong_shape(shape):
    kw = paged()
    expect_value_error(with_(kw, actual_seq_lens_q=torch.ones(shape, dtype=torch.int32)), "actual_seq_lens_q", "shape")


@pytest.mark.parametrize("arg", ["actual_seq_lens_q", "actual_seq_lens_kv"])
@pytest.mark.parametrize("graph", [False, True])
def test_negative_lengths(arg, graph):
    kw = paged()
    bad = kw[arg].clone()
    bad[1] = -1
    expect_value_error(with_(kw, **{arg: bad}, is_cuda_graph_compatible=graph), arg, "non-negative")


@pytest.mark.parametrize(
    "arg,limit",
    [("actual_seq_lens_q", "max_token_per_sequence"), ("actual_seq_lens_kv", "max_sequence_kv")],
)
@pytest.mark.parametrize("graph", [False, True])
def test_lengths_above_max(arg, limit, graph):
    kw = paged(extra_table_cols=3)
    bad = kw[arg].clone()
    bad[0] = kw[limit] + 1  # q: 5 + 1 (the table has room for it); kv: 9 + 1
    msg = expect_value_error(
        with_(kw, **{arg: bad}, is_cuda_graph_compatible=graph), arg, f"lengths <= {limit} = {kw[limit]}"
    )
    assert f"{int(bad[0])} at index 0" in msg


@pytest.mark.parametrize(
    "arg,limit",
    [("actual_seq_lens_q", "max_token_per_sequence"), ("actual_seq_lens_kv", "max_sequence_kv")],
)
def test_lengths_past_int32_within_their_bound(arg, limit):
    """A host length of 2**31 with a bound that allows it: refused by name (the metadata is int32),
    not an OverflowError from packing the table."""
    kw = paged()
    bad = kw[arg].clone().to(torch.int64)
    bad[1] = 2**31
    detail = re.escape("lengths <= 2147483647 (int32 metadata)")
    msg = expect_value_error(with_(kw, **{arg: bad, limit: 2**31}), arg, detail)
    assert f"{2**31} at index 1" in msg


def test_kv_length_beyond_block_table_reach():
    kw = paged()  # table width 3 (ceil(9 / 4)), page size 4
    assert kw["block_tables"].shape[1] == 3
    kw = with_(kw, max_sequence_kv=20, actual_seq_lens_kv=torch.tensor([6, 13], dtype=torch.int32))
    msg = expect_value_error(kw, "actual_seq_lens_kv", "at most block_tables width")
    assert "12" in msg and "13" in msg


def test_paged_cache_without_pages():
    kw = paged()
    empty = {n: kw[n][:0] for n in ("k_cache", "v_cache")}
    expect_value_error(with_(kw, **empty), "k_cache", "at least one page")


def test_block_table_rows_differ_from_batch():
    kw = paged()
    expect_value_error(with_(kw, block_tables=kw["block_tables"][:1]), "block_tables", "2 rows")


@pytest.mark.parametrize("bad", [-1, "num_pages", 2**31 - 1])
def test_block_table_entry_out_of_range(bad):
    kw = paged()
    table = kw["block_tables"].clone()
    table[1, 2] = kw["k_cache"].shape[0] if bad == "num_pages" else bad
    msg = expect_value_error(with_(kw, block_tables=table), "block_tables", "page ids in")
    assert f"{int(table[1, 2])} at [1, 2]" in msg, msg


def test_block_table_entries_past_a_sequences_pages_are_not_read():
    """An entry past the pages a sequence's kv_len needs may hold anything (engines pad with -1)."""
    case = base_case(PS, bits=False)
    kw = case.kwargs
    table = kw["block_tables"].clone()
    lens = kw["actual_seq_lens_kv"].reshape(-1).tolist()
    b = min(range(len(lens)), key=lambda i: lens[i])
    need = -(-lens[b] // PS)
    assert need < table.shape[1]
    table[b, need:] = -1
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**with_(kw, block_tables=table), backend="torch")
    check(case, out, lse, atol=2e-5)


def test_block_table_float_dtype():
    kw = paged()
    expect_value_error(with_(kw, block_tables=kw["block_tables"].float()), "block_tables", "dtype")


@pytest.mark.parametrize("name", ["q", "o", "stats"])
def test_offsets_of_wrong_length(name):
    kw = paged(offsets="tokens", lse_layout="packed")
    key = f"batch_offsets_{name}"
    expect_value_error(with_(kw, **{key: kw[key][:-1]}), key, f"{B + 1} entries")


@pytest.mark.parametrize("name", ["k", "v"])
def test_ragged_kv_offsets_of_wrong_length(name):
    kw = ragged(offsets="tokens")
    key = f"batch_offsets_{name}"
    expect_value_error(with_(kw, **{key: kw[key][:-1]}), key, f"{B + 1} entries")


@pytest.mark.parametrize("name,unit", [("q", HQ * D), ("o", HQ * D), ("k", HKV * D), ("v", HKV * D), ("stats", HQ)])
def test_element_offsets_not_whole_tokens(name, unit):
    kw = ragged(offsets="elements", gaps=True, lse_layout="packed")
    key = f"batch_offsets_{name}"
    bad = kw[key].clone()
    bad[1] += 1
    msg = expect_value_error(with_(kw, **{key: bad}), key, "element offsets that are whole tokens")
    assert str(unit) in msg


def test_negative_offsets():
    kw = ragged(offsets="tokens")
    bad = kw["batch_offsets_q"].clone()
    bad[0] = -2
    expect_value_error(with_(kw, batch_offsets_q=bad), "batch_offsets_q", "non-negative")


@pytest.mark.parametrize("name,what", [("o", "output rows"), ("q", "output rows"), ("stats", "LSE rows")])
def test_offsets_that_make_two_sequences_write_one_row(name, what):
    """Output (or, without batch_offsets_o, q: out follows q's rows) and LSE offsets on the host whose
    sequences' rows overlap are refused: the row would keep whichever sequence wrote it last."""
    kw = paged(offsets="tokens", lse_layout="packed")
    key = f"batch_offsets_{name}"
    if name == "q":
        kw = with_(kw, batch_offsets_o=None)
    bad = kw[key].clone()
    bad[1] = bad[0] + LENS_Q[0] - 1  # (sequence 1 starts at sequence 0's last row)
    msg = expect_value_error(with_(kw, **{key: bad}), key, f"offsets whose sequences' {what} do not overlap")
    assert f"sequences 0 and 1 both at row {int(bad[1])}" in msg
    bad[1] = bad[0] + LENS_Q[0]  # (adjacent: fine)
    kw["out"].fill_(float("nan"))
    kw["lse"].fill_(float("nan"))
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**with_(kw, **{key: bad}), backend="torch")
    rows = bad if name != "stats" else kw["batch_offsets_o"]
    for b in range(2):  # (both sequences' rows written where the adjacent offsets put them)
        assert torch.isfinite(out[int(rows[b]) : int(rows[b]) + LENS_Q[b]]).all(), (name, b)


def test_q_with_too_few_rows_for_the_lengths():
    kw = paged()
    msg = expect_value_error(with_(kw, q=kw["q"][:7]), "q", "a q with at least 8 rows")
    assert "7 rows" in msg


def test_q_with_too_few_rows_for_the_offsets():
    kw = paged(offsets="tokens")
    offs = torch.tensor([0, 4, 9], dtype=torch.int32)  # sequence 1 at rows 4..8, q has 8 rows
    expect_value_error(with_(kw, batch_offsets_q=offs), "q", "a q with at least 9 rows")


def test_out_with_too_few_rows():
    kw = paged()
    expect_value_error(with_(kw, out=poison(torch.empty(7, HQ, D))), "out", "an out with at least 8 rows")


@pytest.mark.parametrize("arg", ["k_cache", "v_cache"])
def test_ragged_kv_with_too_few_rows(arg):
    kw = ragged()
    expect_value_error(with_(kw, **{arg: kw[arg][:14]}), arg, "a ragged")


# --------------------------------------------------------------------------------------------
# Bad input: out / lse buffers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(B, 5, HQ + 1), (B, 6, HQ), (B + 1, 5, HQ), (B * 5, HQ)])
def test_lse_wrong_shape(shape):
    kw = paged()
    expect_value_error(with_(kw, lse=poison(torch.empty(shape))), "lse", "shape")


@pytest.mark.parametrize("dtype", [F16, torch.float64, BF16])
def test_lse_wrong_dtype(dtype):
    expect_value_error(with_(paged(), lse=poison(torch.empty(B, 5, HQ, dtype=dtype))), "lse", "dtype float32")


def test_lse_not_contiguous():
    lse = poison(torch.empty(B, HQ, 5)).transpose(1, 2)
    assert lse.shape == (B, 5, HQ)
    expect_value_error(with_(paged(), lse=lse), "lse", "a contiguous")


def test_packed_lse_too_small():
    kw = paged(lse_layout="packed")
    small = poison(torch.empty(kw["lse"].shape[0] - 1, HQ))
    expect_value_error(with_(kw, lse=small), "lse", "a buffer of at least")


def test_lse_not_a_tensor():
    expect_value_error(with_(paged(), lse=[0.0]), "lse", "a float32 torch.Tensor")


@pytest.mark.parametrize("shape", [(8, HQ, D + 1), (8, HQ + 1, D), (8, HQ * D)])
def test_out_wrong_shape(shape):
    expect_value_error(with_(paged(), out=poison(torch.empty(shape))), "out")


def test_out_dtype_differs_from_o_data_type():
    kw = paged()  # out is float32
    expect_value_error(with_(kw, o_data_type=F16), "out", "dtype torch.float16")


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64])
def test_out_of_an_unsupported_dtype(dtype):
    kw = paged()
    out = torch.full((8, HQ, D), 7, dtype=dtype)
    expect_value_error(with_(kw, out=out), "out", "dtype")


def test_o_data_type_unsupported():
    expect_value_error(with_(paged(), out=None, o_data_type=torch.int32), "o_data_type")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("where", ["o_data_type", "out"])
def test_an_8bit_output_is_not_implemented(dtype, where):
    """A FlashInfer value this library does not implement: NotImplementedError naming the argument,
    and the caller's out left as it was."""
    kw = paged()
    if where == "out":
        out = torch.full(kw["out"].shape, 1.5).to(dtype)
        kw = with_(kw, out=out)
    else:
        kw = with_(kw, out=None, o_data_type=dtype)
    with pytest.raises(NotImplementedError, match=where):
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)
    if where == "out":
        assert (out.float() == 1.5).all()


# --------------------------------------------------------------------------------------------
# Bad input: fp8 scales, scalars, workspace, backend, units
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["q_scale", "k_scale", "v_scale"])
def test_fp8_without_scales(missing):
    kw = paged(dtype=E4M3)
    assert all(isinstance(kw[n], torch.Tensor) for n in ("q_scale", "k_scale", "v_scale"))
    msg = expect_value_error(with_(kw, **{missing: None}), missing, "a float32 scale tensor")
    assert "float8_e4m3fn" in msg


def test_fp8_kv_with_bf16_q_without_k_scale():
    kw = paged(dtype=BF16, kv_dtype=E5M2)
    expect_value_error(with_(kw, k_scale=None), "k_scale", "a float32 scale tensor")


@pytest.mark.parametrize("name", ["q_scale", "k_scale", "v_scale"])
def test_scale_tensor_with_two_elements(name):
    kw = paged(dtype=E4M3)
    expect_value_error(with_(kw, **{name: torch.tensor([0.5, 0.5])}), name, "a tensor of one element")


@pytest.mark.parametrize("dtype", [F16, torch.float64, torch.int32])
def test_scale_tensor_wrong_dtype(dtype):
    kw = paged(dtype=E4M3)
    expect_value_error(with_(kw, k_scale=torch.ones(1, dtype=dtype)), "k_scale", "dtype float32")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 3e38, 1e-40, -1e-39])
def test_softmax_scale_must_be_finite_and_representable(bad):
    expect_value_error(with_(paged(), scale=bad), "scale", "a finite float, 0 or with")


@pytest.mark.parametrize("bad", ["0.1", True, torch.tensor(0.1), None])
def test_softmax_scale_of_the_wrong_type_names_the_type(bad):
    msg = expect_value_error(with_(paged(), scale=bad), "scale", "a Python float")
    assert type(bad).__name__ in msg


def test_causal_must_be_bool():
    expect_value_error(with_(paged(), causal=None), "causal", "a bool")


@pytest.mark.parametrize("arg", ["max_token_per_sequence", "max_sequence_kv"])
@pytest.mark.parametrize("bad", [-1, 2.5])
def test_max_values(arg, bad):
    expect_value_error(with_(paged(), **{arg: bad}), arg)


@pytest.mark.needs_triton
def test_workspace_too_small_says_how_many_bytes():
    """Split-KV partials (forced) need scratch; the error says how many bytes, and that number works."""
    case = base_case(bits=False, dtype=F16)
    kw = with_(case.kwargs, backend="triton")
    with tuning.override("triton", num_splits=2):
        msg = expect_value_error(with_(kw, workspace_buffer=torch.empty(16, dtype=torch.uint8)), "workspace_buffer")
        need = int(re.search(r"at least (\d+) bytes", msg).group(1))
        assert need > 16 and "got 16 bytes" in msg
        # the number is the truth: one byte less fails, exactly that many works
        expect_value_error(with_(kw, workspace_buffer=torch.empty(need - 1, dtype=torch.uint8)), "workspace_buffer")
        out, lse = cudnn_batch_prefill_with_kv_cache(**with_(kw, workspace_buffer=torch.empty(need, dtype=torch.uint8)))
    check(case, out, lse, atol=2e-2)


def test_workspace_not_contiguous():
    buf = torch.empty(1 << 22, dtype=torch.uint8)
    expect_value_error(with_(paged(), workspace_buffer=buf[::2]), "workspace_buffer", "a contiguous")


@pytest.mark.parametrize(
    "sinks, detail",
    [
        ([0.0] * HQ, "a float32 tensor of shape"),
        (torch.zeros(HQ + 1), "a float32 tensor of shape"),
        (torch.zeros(HQ, dtype=torch.float16), "a float32 tensor of shape"),
        (torch.zeros(HQ, device="meta"), "a tensor on q's device"),
    ],
)
def test_bad_sinks_are_named(sinks, detail):
    expect_value_error(with_(paged(), sinks=sinks), "sinks", detail)


@pytest.mark.parametrize("cap", [-1.0, True, "x", float("nan")])
def test_bad_logits_soft_cap_is_named(cap):
    expect_value_error(with_(paged(), logits_soft_cap=cap), "logits_soft_cap", "a finite float >= 0")


def test_workspace_not_a_tensor():
    expect_value_error(with_(paged(), workspace_buffer=bytearray(1 << 20)), "workspace_buffer")


def test_workspace_off_a_16_byte_boundary_is_refused():
    """The workspace holds int32 / float32 views (metadata, work counter, partials): a byte view that
    starts off a 16-byte boundary is refused by name, before anything is written."""
    case = base_case(bits=False)
    buf = torch.empty((1 << 20) + 16, dtype=torch.uint8)
    before = case.kwargs["out"].clone()
    kw = with_(case.kwargs, workspace_buffer=buf[3:])
    msg = expect_value_error(kw, "workspace_buffer", "a buffer starting at a 16-byte aligned address")
    assert "got address 0x" in msg
    assert torch.allclose(case.kwargs["out"], before, equal_nan=True)  # (nothing written)
    good, lse = cudnn_batch_prefill_with_kv_cache(**with_(case.kwargs, workspace_buffer=buf[16:]), backend="torch")
    check(case, good, lse, atol=2e-5)


@pytest.mark.parametrize("shape,dtype", [((1 << 18,), torch.float32), ((1 << 10, 1 << 10), torch.uint8)])
def test_workspace_of_another_dtype_is_counted_in_bytes(shape, dtype):
    """A workspace of any dtype or shape is its bytes, on the first call and on a repeat that reuses
    the first's plan (the repeat takes its own byte view of the buffer)."""
    case = base_case(bits=False)
    ws = torch.empty(shape, dtype=dtype)  # 1 MiB
    for _ in range(2):
        for name in ("out", "lse"):
            if case.kwargs.get(name) is not None:
                poison(case.kwargs[name])
        out, lse = cudnn_batch_prefill_with_kv_cache(**with_(case.kwargs, workspace_buffer=ws), backend="torch")
        check(case, out, lse, atol=2e-5)


@pytest.mark.parametrize("bad", ["cuda", "flash", "TORCH", ""])
def test_unknown_backend_lists_the_choices(bad):
    msg = expect_value_error(with_(paged(), backend=bad), "backend", "one of")
    for name in ("auto", "cudnn", "triton", "torch"):
        assert repr(name) in msg
    assert repr(bad) in msg


def test_unknown_batch_offsets_units():
    msg = expect_value_error(with_(paged(offsets="tokens"), batch_offsets_units="bytes"), "batch_offsets_units")
    assert "elements" in msg and "tokens" in msg and "bytes" in msg


@pytest.mark.parametrize("name", ["triton", "cudnn"])
def test_gpu_backend_on_cpu_is_unavailable_and_says_why(name, monkeypatch):
    assert importlib.util.find_spec(f"pagedprefill.backends.{name}") is not None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    msg = expect_error(with_(paged(), backend=name), rf"backend={name!r} is unavailable: \S", BackendUnavailableError)
    reason = msg.split("unavailable:", 1)[1].lower()
    assert any(w in reason for w in ("gpu", "cuda", "not importable", "not installed", "pip install")), msg


@pytest.mark.gpu
def test_device_mismatch_on_gpu():
    case = base_case(bits=False)
    kw = dict(case.kwargs)
    kw["q"] = kw["q"].cuda()
    kw["workspace_buffer"] = kw["workspace_buffer"].cuda()
    kw["out"] = poison(torch.empty(kw["out"].shape, device="cuda"))
    kw["lse"] = poison(torch.empty(kw["lse"].shape, device="cuda"))
    expect_value_error(kw, "k_cache", ".*device")
    kw["k_cache"], kw["v_cache"] = kw["k_cache"].cuda(), kw["v_cache"].cuda()
    kw["block_tables"] = kw["block_tables"].cuda()
    expect_value_error(with_(kw, out=poison(torch.empty(kw["out"].shape))), "out", ".*device")


# --------------------------------------------------------------------------------------------
# Accepted argument forms (results checked against the oracle)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["float", "tensor(1)", "tensor(1,1,1,1)"])
def test_scale_argument_forms(form):
    case = base_case(bits=False, dtype=BF16, kv_dtype=E4M3)
    kw = dict(case.kwargs)  # the oracle reads the original tensor scales from case.kwargs
    for name in ("k_scale", "v_scale"):
        value = float(kw[name])
        if form == "float":
            kw[name] = value
        elif form == "tensor(1,1,1,1)":
            kw[name] = torch.tensor([value]).view(1, 1, 1, 1)
    out, lse = cudnn_batch_prefill_with_kv_cache(**kw, backend="torch")
    check(case, out, lse, atol=2e-3, rtol=8e-3, lse_atol=1e-4)


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("value", [torch.tensor([0, 999, 5000], dtype=torch.int32), "oops", torch.zeros(7)])
def test_paged_batch_offsets_k_v_are_refused(name, value):
    """They have no meaning with a paged cache: never silently ignored, whatever they are."""
    kw = with_(base_case().kwargs, **{f"batch_offsets_{name}": value}, batch_offsets_units="tokens")
    expect_value_error(kw, f"batch_offsets_{name}", "None with a paged cache")


def test_stats_offsets_or_lse_without_return_lse_are_refused():
    case = base_case(lse_layout="packed")
    expect_value_error(
        with_(case.kwargs, return_lse=False, lse=None), "batch_offsets_stats", "None when return_lse=False"
    )
    case = base_case()
    expect_value_error(with_(case.kwargs, return_lse=False), "lse", "None when return_lse=False")


def test_max_values_as_scalar_tensors():
    case = base_case(bits=False)
    kw = with_(
        case.kwargs,
        max_token_per_sequence=torch.tensor(case.kwargs["max_token_per_sequence"]),
        max_sequence_kv=torch.tensor(case.kwargs["max_sequence_kv"]),
    )
    out, lse = cudnn_batch_prefill_with_kv_cache(**kw, backend="torch")
    check(case, out, lse, atol=2e-5)


def test_numpy_scalars_for_max_values_and_scale():
    """Lengths and scales computed with numpy (np.int64 maxima, an np.float32 scale) are taken as
    their Python values, and such calls reach the one-shot cache like Python-typed ones."""
    np = pytest.importorskip("numpy")
    from pagedprefill import plan_cache

    case = base_case(bits=False)
    kw = with_(
        case.kwargs,
        max_token_per_sequence=np.int64(case.kwargs["max_token_per_sequence"]),
        max_sequence_kv=np.int32(case.kwargs["max_sequence_kv"]),
        scale=np.float32(case.kwargs["scale"]),
    )
    plan_cache.clear()
    for _ in range(2):
        out, lse = cudnn_batch_prefill_with_kv_cache(**kw, backend="torch")
        check(case, out, lse, atol=2e-5)
    assert len(plan_cache._PLANS) == 1


def test_int64_block_table():
    case = base_case(bits=False)
    kw = with_(case.kwargs, block_tables=case.kwargs["block_tables"].long())
    out, lse = cudnn_batch_prefill_with_kv_cache(**kw, backend="torch")
    check(case, out, lse, atol=2e-5)


# --------------------------------------------------------------------------------------------
# The normalised metadata (README: one PrefillBatch; checked against the oracle's own starts)
# --------------------------------------------------------------------------------------------


def _sequences(case):
    kw = case.kwargs
    q, k, v, shape = normalise.layer_tensors(kw["q"], kw["k_cache"], kw["v_cache"], kw.get("block_tables") is not None)
    offsets = {n: kw.get(f"batch_offsets_{n}") for n in normalise.OFFSET_NAMES}
    seq, _, pages = normalise.sequences(
        device=q.device,
        num_qo_heads=shape.num_qo_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim_qk=shape.head_dim_qk,
        head_dim_vo=shape.head_dim_vo,
        page_size=shape.page_size,
        actual_seq_lens_q=kw["actual_seq_lens_q"],
        actual_seq_lens_kv=kw["actual_seq_lens_kv"],
        max_token_per_sequence=kw["max_token_per_sequence"],
        max_sequence_kv=kw["max_sequence_kv"],
        block_tables=kw.get("block_tables"),
        offsets=offsets,
        batch_offsets_units=kw.get("batch_offsets_units", "elements"),
        scale=kw["scale"],
        causal=kw["causal"],
        return_lse=kw["return_lse"],
    )
    return seq, pages


@pytest.mark.parametrize(
    "opts",
    [
        dict(page_size=0),
        dict(page_size=0, offsets="elements", gaps=True, dqk=48, dvo=16, lse_layout="packed"),
        dict(page_size=3, offsets="tokens", gaps=True, lse_layout="packed"),
        dict(page_size=3),
    ],
    ids=["ragged-prefix", "ragged-elements", "paged-tokens-packed", "paged-prefix"],
)
def test_host_metadata_matches_the_layout(opts):
    case = make_case(88, lens_q=[3, 0, 4], lens_kv=[5, 2, 7], hq=4, hkv=2, **opts)
    seq, pages = _sequences(case)
    h = seq.host
    assert list(h.lens_q) == case.lens_q and list(h.lens_kv) == case.lens_kv
    assert list(h.q_start) == case.q_start and list(h.o_start) == case.o_start
    if opts["page_size"] == 0:
        assert list(h.k_start) == case.info["k_start"] and list(h.v_start) == case.info["k_start"]
        assert seq.page_size == 0 and seq.pages == "none"
    else:
        assert seq.page_size == 3 and seq.pages == "table"
        assert torch.equal(pages["block_tables"], case.info["block_tables"])
        width = case.info["block_tables"].shape[1]
        assert list(h.bt_start) == [b * width for b in range(3)]
    if case.lse_start is not None:
        assert seq.lse == "packed" and list(h.lse_start) == case.lse_start
    else:
        assert seq.lse == "padded" and list(h.lse_start) == [
            b * case.kwargs["max_token_per_sequence"] * 4 for b in range(3)
        ]
    assert (seq.num_qo_heads, seq.num_kv_heads) == (4, 2)


def test_absurd_output_offsets_without_out_raise_instead_of_allocating():
    kw = paged(offsets="tokens")
    offs = torch.tensor([0, 2**30, 2**30 + 5], dtype=torch.int32)
    expect_value_error(with_(kw, out=None, batch_offsets_o=offs), "batch_offsets_o", "offsets that place")


def test_empty_batch():
    e = torch.zeros(0, dtype=torch.int32)
    out, lse = cudnn_batch_prefill_with_kv_cache(
        torch.randn(0, HQ, D),
        torch.randn(3, HKV, PS, D),
        torch.randn(3, HKV, PS, D),
        0.25,
        torch.empty(1 << 12, dtype=torch.uint8),
        max_token_per_sequence=4,
        max_sequence_kv=8,
        actual_seq_lens_q=e,
        actual_seq_lens_kv=e,
        block_tables=torch.zeros(0, 2, dtype=torch.int32),
        causal=True,
        return_lse=True,
        backend="torch",
    )
    assert out.shape == (0, HQ, D) and lse.shape == (0, 4, HQ)


@pytest.mark.gpu
def test_capture_with_host_lengths_is_refused():
    """Host lengths would be baked into a captured graph: the call must refuse, naming the flag."""
    case = make_case(3, lens_q=[5, 2], lens_kv=[9, 4], device="cuda", dtype=torch.float16)
    before = case.kwargs["out"].clone()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="is_cuda_graph_compatible"):
        with torch.cuda.graph(graph):
            cudnn_batch_prefill_with_kv_cache(**case.kwargs)
    assert torch.equal(case.kwargs["out"].view(torch.int16), before.view(torch.int16))


# --------------------------------------------------------------------------------------------
# Buffers that overlap (refused before anything is written)
# --------------------------------------------------------------------------------------------


def _ragged_f32(seed=81, **kw):
    return make_case(seed, lens_q=[3, 4], lens_kv=[5, 6], hq=2, hkv=1, dqk=16, page_size=0, with_out=False, **kw)


def _expect_overlap(kwargs, first, second, backend="torch"):
    """The call raises a ValueError naming both arguments, and writes none of the caller's buffers."""
    watched = {n: kwargs[n] for n in ("q", "out", "lse", "workspace_buffer") if isinstance(kwargs.get(n), torch.Tensor)}
    before = {n: as_bytes(t) for n, t in watched.items()}
    with pytest.raises(ValueError) as err:
        cudnn_batch_prefill_with_kv_cache(**kwargs, backend=backend)
    msg = str(err.value)
    assert first in msg and second in msg and "overlap" in msg, msg
    for n, t in watched.items():
        assert as_bytes(t) == before[n], f"{n} was written before the error"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("victim", ["out", "lse", "q"])
def test_workspace_overlapping_a_tensor_is_refused(backend, victim):
    case = _ragged_f32(dtype=F16 if backend == "triton" else F32)
    kw = dict(case.kwargs)
    rows = 7
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    if victim == "out":
        kw["out"] = buf[: rows * 2 * 16 * kw["q"].element_size()].view(kw["q"].dtype).view(rows, 2, 16)
    elif victim == "lse":
        kw["lse"] = buf[: 2 * 4 * 2 * 4].view(torch.float32).view(2, 4, 2)
    else:
        q = kw["q"]
        kw["q"] = buf[: q.numel() * q.element_size()].view(q.dtype).view(q.shape).copy_(q)
    kw["workspace_buffer"] = buf
    _expect_overlap(kw, "workspace_buffer", victim, backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_partly_overlapping_q_is_refused(backend):
    case = _ragged_f32(dtype=F16 if backend == "triton" else F32)
    kw = dict(case.kwargs)
    q = kw["q"]
    buf = torch.randn(q.shape[0] + 3, *q.shape[1:]).to(q.dtype)
    kw["q"], kw["out"] = buf[: q.shape[0]], buf[3:]
    _expect_overlap(kw, "out", "q", backend)
    kw["q"], kw["out"] = buf, buf  # exactly q: refused too (not proven safe on every backend)
    kw["lse"] = None
    kw["return_lse"] = False
    _expect_overlap(kw, "out", "q", backend)


def test_lse_overlapping_out_is_refused():
    case = _ragged_f32()
    kw = dict(case.kwargs)
    buf = torch.zeros(4096)
    kw["out"] = buf[:224].view(7, 2, 16)
    kw["lse"] = buf[200:216].view(2, 4, 2)
    _expect_overlap(kw, "out", "lse")


def test_out_overlapping_the_cache_is_refused():
    case = base_case(bits=False, kv_layout="hnd")
    kw = dict(case.kwargs)
    k, out = kw["k_cache"], kw["out"]
    storage = torch.cat([k.reshape(-1), torch.zeros(out.numel())])
    kw["k_cache"] = storage[: k.numel()].view(k.shape)
    kw["out"] = storage[k.numel() - 16 :][: out.numel()].view(out.shape)  # shares k's last 16 elements
    _expect_overlap(kw, "out", "k_cache")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_with_a_zero_stride_is_refused_before_any_write(backend):
    case = _ragged_f32(dtype=F16 if backend == "triton" else F32)
    kw = dict(case.kwargs)
    kw["out"] = torch.zeros(1, 2, 16, dtype=kw["q"].dtype).expand(7, 2, 16)
    msg = expect_value_error(with_(kw, backend=backend), "out", "a tensor without overlapping elements")
    assert "strides" in msg


def test_k_and_v_views_of_one_interleaved_buffer_are_fine():
    case = base_case(bits=False, kv_layout="interleaved")
    out, lse = cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="torch")
    check(case, out, lse, atol=2e-5)


def test_offsets_that_place_rows_as_q_does():
    """An out / packed LSE the call allocates has q's rows; with device offsets that is safe only for
    q's own vector read in q's tokens (``normalise._rows_of_q``), never for a vector of its own."""
    q = torch.tensor([0, 5, 9], dtype=torch.int32)
    copy = q.clone()
    assert normalise._rows_of_q({"q": q, "o": q}, "o", "tokens", 64, 32)
    assert normalise._rows_of_q({"q": q, "o": q.view(-1)}, "o", "elements", 64, 64)  # (a view: the same rows)
    assert not normalise._rows_of_q({"q": q, "o": q}, "o", "elements", 64, 32)  # (elements of another width)
    assert not normalise._rows_of_q({"q": q, "o": copy}, "o", "tokens", 64, 64)  # (equal now, not later)
    assert not normalise._rows_of_q({"o": q}, "o", "tokens", 64, 64)  # (q's rows from prefix sums)
    assert normalise._rows_of_q({"q": q, "stats": q}, "stats", "tokens", 64, 64)
    assert not normalise._rows_of_q({"q": q, "stats": q}, "stats", "elements", 64, 64)
    assert not normalise._rows_of_q({"q": q, "o": q[:2]}, "o", "tokens", 64, 64)
