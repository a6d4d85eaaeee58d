"""The Triton backend (``pagedprefill.backends.triton``) against the independent float64 oracle.

CPU: the portable kernel in Triton's interpreter (fp16 / fp32), its configuration, the compile keys
and an sm_90 compile. GPU (``gpu`` mark): both kernels over random grids, head dims x dtypes, long
sequences, CUDA-graph replays, no recompilation and no host sync.
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
from helpers import (
    DEVICE,
    FP8,
    HAS_CUDA,
    atol_for,
    batch_of,
    call,
    call_tensors,
    check_sampled,
    planned,
    random_params,
    run_and_check,
)
from oracle import check, make_case, poison

import pagedprefill
from pagedprefill import tuning
from pagedprefill.backends import triton as tb
from pagedprefill.backends.triton import fa2
from pagedprefill.kernels import launch

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16

# --------------------------------------------------------------------------------------------
# Random grid (CPU interpreter: fp16 / fp32, variants included)
# --------------------------------------------------------------------------------------------

CPU_GRID = range(40)


@pytest.mark.parametrize("seed", CPU_GRID)
def test_random_grid(seed):
    params = random_params(seed, (F16, F32))
    case = make_case(seed, **params)
    run_and_check(case, atol_for(params["dtype"]))


def test_grid_covers_features():
    """The random grid above really exercises every feature it claims to."""
    keys = ("page_size", "kv_layout", "offsets", "lse_layout", "return_lse", "causal", "with_out", "dtype")
    seen = {k: set() for k in keys}
    seen.update(group=set(), q_gt_kv=set(), q0=set(), kv0=set(), window=set(), cap=set(), sinks=set())
    for seed in CPU_GRID:
        p = random_params(seed, (F16, F32))
        for k in keys:
            seen[k].add(p[k])
        seen["group"].add(p["hq"] // p["hkv"])
        seen["q_gt_kv"].add(any(0 < kv < q for q, kv in zip(p["lens_q"], p["lens_kv"])))
        seen["q0"].add(0 in p["lens_q"])
        seen["kv0"].add(any(kv == 0 < q for q, kv in zip(p["lens_q"], p["lens_kv"])))
        seen["window"].add("window_left" in p)
        seen["cap"].add("logits_soft_cap" in p)
        seen["sinks"].add("sinks" in p)
    assert seen["page_size"] == {0, 1, 3, 16}
    assert seen["kv_layout"] == {"nhd", "hnd", "interleaved"}
    assert seen["offsets"] == {"none", "elements", "tokens"}
    assert seen["lse_layout"] == {"padded", "packed"}
    for k in ("return_lse", "causal", "with_out", "q_gt_kv", "q0", "kv0", "window", "cap", "sinks"):
        assert seen[k] == {True, False}, k
    assert {1, 2, 3, 4, 5, 6, 7} <= seen["group"], seen["group"]
    assert seen["dtype"] == {F16, F32}


# --------------------------------------------------------------------------------------------
# Targeted CPU/GPU tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dqk,dvo,page_size",
    [(96, 96, 3), (192, 128, 16), (112, 80, 1), (80, 112, 0), (16, 32, 0)],
    ids=["96", "192-128", "112-80-padded-qk", "80-112-padded-vo", "16-32"],
)
def test_head_dims(dqk, dvo, page_size):
    case = make_case(
        7,
        lens_q=[9, 17],
        lens_kv=[30, 17],
        hq=6,
        hkv=2,
        dqk=dqk,
        dvo=dvo,
        page_size=page_size,
        dtype=F16,
        device=DEVICE,
    )
    run_and_check(case, atol_for(F16))


@pytest.mark.parametrize(
    "block_m,block_n,page_size",
    [(16, 32, 16), (64, 16, 32), (16, 16, 1), (32, 32, 0)],
    ids=["M16-N32-page16", "M64-N16-page32-onepagepertile", "M16-N16-page1", "M32-N32-ragged"],
)
@pytest.mark.parametrize("group", [1, 3, 5])
def test_tile_shapes(block_m, block_n, page_size, group):
    """Other tile shapes: G not dividing BLOCK_M, BLOCK_N > BLOCK_M, whole tiles inside one page."""
    case = make_case(
        11 + group,
        lens_q=[19, 5, 26],
        lens_kv=[45, 2, 26],
        hq=2 * group,
        hkv=2,
        page_size=page_size,
        kv_layout="hnd",
        dtype=F32,
        causal=True,
        device=DEVICE,
    )
    run_and_check(case, 1e-4, BLOCK_M=block_m, BLOCK_N=block_n)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_fp8", [False, True], ids=["q16", "q-fp8"])
@pytest.mark.parametrize("dqk", [64, 96])
def test_fp8(kv_dtype, q_fp8, dqk):
    """fp8 K/V with a 16-bit q (scales folded in-kernel) and fully fp8 q/k/v (bf16 out), at a power-of-
    two head dim and at 96 (one padded part, see fa2.split_head_dim)."""
    q_dtype = kv_dtype if q_fp8 else (BF16 if HAS_CUDA else F16)
    case = make_case(
        21,
        lens_q=[13, 7],
        lens_kv=[33, 7],
        hq=6,
        hkv=2,
        dqk=dqk,
        page_size=3,
        dtype=q_dtype,
        kv_dtype=kv_dtype,
        device=DEVICE,
    )
    out_dtype = (BF16 if HAS_CUDA else F16) if q_fp8 else q_dtype
    if out_dtype != case.kwargs["out"].dtype:  # (the interpreter cannot round to bf16: an fp16 out on the CPU)
        case.kwargs["out"] = torch.full_like(case.kwargs["out"], float("nan"), dtype=out_dtype)
    out, _ = run_and_check(case, 2.5e-2)
    assert out.dtype == out_dtype


def test_head_dim_split():
    """Two power-of-two parts, except 8-bit K/V with a second part under 64 columns: one padded part."""
    assert fa2.split_head_dim(64) == (64, 64, 0, 0)
    assert fa2.split_head_dim(96) == (64, 64, 32, 32)
    assert fa2.split_head_dim(192) == (128, 128, 64, 64)
    assert fa2.split_head_dim(112) == (64, 64, 64, 48)
    assert fa2.split_head_dim(256) == (256, 256, 0, 0)
    assert fa2.split_head_dim(96, eight_bit=True) == (128, 96, 0, 0)
    assert fa2.split_head_dim(80, eight_bit=True) == (128, 80, 0, 0)
    assert fa2.split_head_dim(192, eight_bit=True) == (128, 128, 64, 64)
    assert fa2.split_head_dim(112, eight_bit=True) == (128, 112, 0, 0)


@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.5])
def test_unusual_scales(scale):
    """Negative and zero softmax scales (the kernel keeps qk_scale >= 0 by negating q)."""
    case = make_case(31, lens_q=[6, 11], lens_kv=[9, 20], page_size=1, dtype=F32, scale=scale, device=DEVICE)
    run_and_check(case, 1e-4)


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the kernels take tanh.approx.f32, as FlashInfer's do")
@pytest.mark.parametrize("cap", [1e3, 1e5])
def test_large_soft_cap_keeps_float32_precision(cap):
    """cap * tanh(s / cap) with s / cap near 0: the interpreter's tanh must not lose s's digits there
    (2 / (1 + e^-2x) - 1 alone: an absolute error of ~6e-8 x cap in every logit, 6e-3 in out at 1e5)."""
    case = make_case(33, lens_q=[6, 11], lens_kv=[9, 20], page_size=3, dtype=F32, scale=3.0, logits_soft_cap=cap)
    run_and_check(case, 2e-5)


@pytest.mark.parametrize("window", [2**31 - 1, 2**31 + 5, 30])
@pytest.mark.parametrize("causal", [True, False])
def test_window_as_wide_as_every_key(window, causal):
    """A window_left that reaches every key (30 here is the longest sequence) hides none, rows of a
    sequence with more queries than keys included: no int32 bound arithmetic of a huge window."""
    case = make_case(
        52,
        lens_q=[10, 4, 7],
        lens_kv=[5, 30, 7],
        hq=6,
        hkv=2,
        page_size=4,
        dtype=F16,
        causal=causal,
        window_left=window,
        device=DEVICE,
    )
    run_and_check(case, atol_for(F16))


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["none", "window", "sinks"])
def test_split_kv(splits, causal, variant):
    """Forced split-KV: partials in the workspace, then the merge kernel (incl. empty splits); a
    window cuts each split's range, sinks join in the merge."""
    extra = {"window": dict(window_left=9), "sinks": dict(sinks=True)}.get(variant, {})
    case = make_case(
        41 + splits,
        lens_q=[3, 0, 9, 4],
        lens_kv=[70, 5, 9, 0],
        hq=4,
        hkv=2,
        page_size=3,
        dtype=F16,
        causal=causal,
        lse_layout="packed",
        offsets="tokens",
        gaps=True,
        device=DEVICE,
        **extra,
    )
    with tuning.override("triton", num_splits=splits):
        assert planned(case)[1].backend.workspace_bytes > 0
    run_and_check(case, atol_for(F16), num_splits=splits)


@pytest.mark.parametrize("api", ["plan", "wrapper"])
def test_disable_split_kv_keeps_one_pass_over_the_keys(api):
    """A small grid over long keys takes split-KV by default; ``disable_split_kv=True`` (plan, or
    FlashInfer's wrapper plan) keeps every sequence in one program: right both ways."""
    from helpers import csr_pages, plan_of

    case = make_case(
        61,
        lens_q=[4, 3],
        lens_kv=[1100, 700],
        hq=2,
        hkv=1,
        dqk=32,
        page_size=16,
        dtype=F16,
        return_lse=api == "plan",
        device=DEVICE,
    )
    kw = case.kwargs
    for disable in (False, True):
        if api == "plan":
            p = plan_of(case, "triton", disable_split_kv=disable)
            out, lse = p.run(
                kw["q"], kw["k_cache"], kw["v_cache"], poison(kw["out"]), poison(kw["lse"]), return_lse=True
            )
            check(case, out, lse, atol=atol_for(F16), lse_atol=1e-3)
        else:
            indptr, indices, last = (torch.tensor(x, dtype=torch.int32) for x in csr_pages(case))
            w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND", backend="triton")
            qo = torch.tensor([0, *torch.tensor(case.lens_q).cumsum(0).tolist()], dtype=torch.int32)
            w.plan(
                qo,
                indptr,
                indices,
                last,
                2,
                1,
                32,
                16,
                causal=kw["causal"],
                sm_scale=kw["scale"],
                q_data_type=F16,
                disable_split_kv=disable,
            )
            check(case, w.run(kw["q"], (kw["k_cache"], kw["v_cache"])), None, atol=atol_for(F16))
            p = w.plan_object
        splits = next(iter(p.layers.values())).backend.splits
        assert (splits == 1) if disable else (splits > 1)


@pytest.mark.parametrize("splits", [None, 2])
def test_a_minus_inf_sink_is_no_sink(splits):
    """A sink of -inf on one head ("no sink there"): its rows with no visible key get out 0 and lse
    -inf, not NaN (the sink and the row's max both -inf); its other rows as without a sink."""
    case = make_case(
        63,
        lens_q=[1, 2, 5],
        lens_kv=[0, 1, 9],
        hq=2,
        hkv=1,
        dqk=64,
        page_size=4,
        dtype=F16,
        causal=True,
        sinks=True,
        device=DEVICE,
    )
    case.kwargs["sinks"][0] = -math.inf
    knobs = dict(num_splits=splits) if splits else {}
    run_and_check(case, atol_for(F16), **knobs)


def test_split_kv_fp8_and_allocated_out():
    """Split-KV with fp8 K/V (v_scale applied in the merge) and a padded output head dim (112)."""
    case = make_case(
        51,
        lens_q=[2, 5],
        lens_kv=[60, 33],
        hq=4,
        hkv=1,
        dqk=80,
        dvo=112,
        page_size=16,
        dtype=F16,
        kv_dtype=torch.float8_e4m3fn,
        with_out=False,
        device=DEVICE,
    )
    run_and_check(case, 2.5e-2, num_splits=3)


def test_split_policy_from_host_ints_only():
    """Automatic split choice: short q over a long prefix splits, a big grid does not."""
    small = make_case(53, lens_q=[4], lens_kv=[40], page_size=1, dtype=F16, max_kv=8192)
    big = make_case(54, lens_q=[40] * 3, lens_kv=[40] * 3, page_size=1, dtype=F16, max_kv=64)
    gpu_cfg = fa2.Config(128, 64, 8, 3)
    # (host lengths: sized by the real maxima, so a max_kv of 8192 over 40 keys does not split)
    assert fa2.choose_splits(batch_of(small), gpu_cfg, None) == 1
    long = make_case(53, lens_q=[4], lens_kv=[4000], page_size=16, dtype=F16)
    assert fa2.choose_splits(batch_of(long), gpu_cfg, None) > 1
    assert fa2.choose_splits(batch_of(big), gpu_cfg, None) == 1
    assert fa2.choose_splits(batch_of(long), gpu_cfg, 8192) == 1  # partials would not fit: no split


def test_work_is_sized_by_the_real_lengths():
    """A huge max_token_per_sequence with host lengths costs nothing: grid and scratch follow the
    lengths, the LSE layout follows the bound."""
    case = make_case(59, lens_q=[6], lens_kv=[9], page_size=2, dtype=F16, max_q=65536, with_out=False, return_lse=False)
    p, lp, _ = planned(case)
    assert lp.batch.work_q == 6 and lp.batch.max_q == 65536
    assert lp.backend.n_m == 1
    run_and_check(case, atol_for(F16))


def test_ragged_v_offsets_independent_of_k():
    """Ragged K and V at different rows (batch_offsets_v != batch_offsets_k) give the same result."""
    case = make_case(58, lens_q=[6, 9], lens_kv=[11, 20], page_size=0, dtype=F32, offsets="tokens", device=DEVICE)
    out1, lse1 = call(case)
    out1, lse1 = out1.clone(), lse1.clone()
    check(case, out1, lse1, atol=1e-4)
    kw = case.kwargs
    shift = 5
    v = kw["v_cache"]
    kw["v_cache"] = torch.cat([torch.full_like(v[:shift], 1e4), v, torch.full_like(v[:2], -1e4)])
    kw["batch_offsets_v"] = kw["batch_offsets_k"] + shift
    out2, lse2 = call(case)
    torch.testing.assert_close(out2, out1, atol=1e-6, rtol=0, equal_nan=True)
    torch.testing.assert_close(lse2, lse1, atol=1e-6, rtol=0, equal_nan=True)


def test_untrusted_page_ids_are_clamped_like_the_reference():
    """Out-of-range page ids inside the used part of a device table are clamped, as the torch backend
    does (a CPU table with such ids is refused: test_normalise)."""
    case = make_case(61, lens_q=[5, 8], lens_kv=[10, 13], page_size=3, dtype=F32, device=DEVICE)
    table = case.kwargs["block_tables"].clone()
    table[0, 1], table[1, 0], table[1, 3] = 10**6, -5, 2**31 - 1
    outs = []
    for backend in ("torch", "triton"):
        p, lp, ws = planned(case, backend)
        t = call_tensors(case, p, lp, ws)
        t.pages = table.to(DEVICE)
        t.out = torch.full_like(t.out, float("nan"))
        t.lse = torch.full_like(t.lse, float("nan"))
        lp.backend.run(t)
        outs.append((t.out, t.lse))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-4, rtol=0, equal_nan=True)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-4, rtol=0, equal_nan=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_grid_chunking(monkeypatch, splits):
    """Grids above the CUDA y/z limit are launched in chunks (b_offset / m_offset); simulated with a
    limit of 2 so that batch and row-block chunks both occur."""
    monkeypatch.setattr(launch, "GRID_LIMIT", 2)
    case = make_case(
        73, lens_q=[40, 3, 0, 17, 9], lens_kv=[30, 3, 4, 17, 40], hq=4, hkv=2, page_size=3, dtype=F16, device=DEVICE
    )
    with tuning.override("triton", num_splits=splits):
        p, lp, ws = planned(case)
        kernels = [x[0] for x in lp.backend.launches(call_tensors(case, p, lp, ws))]
        assert kernels.count(fa2.fk.prefill_kernel) >= 6
    run_and_check(case, atol_for(F16), num_splits=splits)


def test_empty_batches():
    for lens_q, lens_kv in (([0, 0], [5, 0]), ([], [])):
        case = make_case(71, lens_q=lens_q, lens_kv=lens_kv, page_size=2, dtype=F16, device=DEVICE)
        run_and_check(case, 5e-3)


def test_reasons(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "no CUDA GPU; set TRITON_INTERPRET=1" in tb.unavailable_reason(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(launch, "INTERPRETED", False)
    assert "before the import" in tb.unavailable_reason(cpu)
    monkeypatch.setattr(launch, "INTERPRETED", True)
    assert tb.unavailable_reason(cpu) is None
    monkeypatch.setattr(launch, "triton", None)
    assert "triton is not importable" in tb.unavailable_reason(cpu)


def test_unsupported_head_dim_message():
    case = make_case(72, lens_q=[3], lens_kv=[5], dqk=72, page_size=2, dtype=F16, device=DEVICE)
    reason = tb.unsupported_reason(batch_of(case, "torch"))
    assert reason is not None and "72" in reason and "multiples of 16" in reason and "192" in reason
    with pytest.raises(ValueError, match="cannot serve this call.*Dqk=72"):
        call(case)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without a GPU")
def test_interpreter_refuses_bf16_dots():
    """The interpreter computes bf16 dots wrongly: never a wrong answer, a clear refusal instead."""
    for kv in (BF16, torch.float8_e4m3fn):
        case = make_case(75, lens_q=[3], lens_kv=[5], page_size=2, dtype=BF16, kv_dtype=kv)
        before = case.kwargs["out"].clone()
        with pytest.raises(ValueError, match="interpreter.*bfloat16"):
            call(case)
        assert torch.equal(before.view(torch.int16), case.kwargs["out"].view(torch.int16))
    # a bfloat16 output of float16 or 8-bit inputs: the interpreter's cast truncates, so it is refused too
    for q_dt, kv in ((F16, F16), (torch.float8_e4m3fn, torch.float8_e4m3fn)):
        case = make_case(76, lens_q=[3], lens_kv=[5], page_size=2, dtype=q_dt, kv_dtype=kv)
        case.kwargs["out"] = torch.full_like(case.kwargs["out"], float("nan"), dtype=BF16)
        before = case.kwargs["out"].clone()
        with pytest.raises(ValueError, match="interpreter.*round to a bfloat16 output.*o_data_type"):
            call(case)
        assert torch.equal(before.view(torch.int16), case.kwargs["out"].view(torch.int16))


def test_knob_overrides():
    case = make_case(74, lens_q=[3], lens_kv=[5], page_size=2, dtype=F16)
    batch = batch_of(case)
    with tuning.override("triton", BLOCK_M=64, num_stages=2):
        cfg = fa2.choose_config(batch)
        assert (cfg.BLOCK_M, cfg.num_stages) == (64, 2)
    with tuning.override("triton", BLOCK_N=32, num_splits=3):
        assert fa2.choose_config(batch).BLOCK_N == 32
        assert fa2.choose_splits(batch, fa2.choose_config(batch), None) == 3
    with pytest.raises(ValueError, match="unknown Triton knob 'BLOCKM'"):
        with tuning.override("triton", BLOCKM=64):
            fa2.choose_config(batch)
    with pytest.raises(ValueError, match="power of two"):
        with tuning.override("triton", BLOCK_N=48):
            fa2.choose_config(batch)


@pytest.mark.parametrize("lazy", [0, 1])
@pytest.mark.parametrize("scale", [0.02, 50.0])
def test_lazy_rescale_with_growing_maxima(lazy, scale):
    """Large logits make the running row max jump across KV tiles: the lazy-rescale path must
    rescale exactly when needed (a stale max > 2^8 below the true one would overflow or lose mass)."""
    case = make_case(
        900 + lazy,
        lens_q=[37, 5],
        lens_kv=[90, 70],
        hq=4,
        hkv=2,
        dqk=64,
        page_size=16,
        dtype=F16 if HAS_CUDA else F32,
        device=DEVICE,
        scale=scale,
    )
    out, lse = call(case, knobs=dict(lazy=lazy))
    # (float32 on the CPU: a logit of scale x q.k carries scale x q.k x 2^-24 of rounding, which the
    # softmax passes on to the output; a wrong rescale is off by O(1))
    check(case, out, lse, atol=2e-2 if HAS_CUDA else 1e-4 * max(1.0, scale / 5), lse_atol=2e-2)


# --------------------------------------------------------------------------------------------
# No recompilation: the specialisation key must not depend on anything that varies per call
# --------------------------------------------------------------------------------------------


def _kernel_keys(case) -> list:
    """Triton's cache key of every launch of ``case``, computed exactly as JITFunction.run does
    (binder + compute_cache_key) against an sm_90 target; needs no GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    p, lp, ws = planned(case)
    keys = []
    for kernel, _grid, args, kwargs in lp.backend.launches(call_tensors(case, p, lp, ws)):
        if not isinstance(kernel, JITFunction):  # interpreted: rebuild the JIT view of the same function
            kernel = JITFunction(kernel.fn, **kernel.kwargs)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        _bound, spec, options = binder(*args, **kwargs)
        keys.append((kernel.fn.__name__, compute_cache_key({}, spec, options)))
    return keys


@pytest.mark.parametrize("page_size", [0, 16])
def test_specialisation_key_is_stable(page_size):
    r = random.Random(page_size)
    keys = set()
    with tuning.override("triton", num_splits=1, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3):
        for i in range(30):
            bsz = r.randint(1, 40)
            lens_q = [r.randint(0, 70) for _ in range(bsz)]
            lens_kv = [q + r.randint(0, 300) for q in lens_q]
            case = make_case(
                100 + i,
                lens_q=lens_q,
                lens_kv=lens_kv,
                hq=8,
                hkv=2,
                page_size=page_size,
                dtype=F16,
                offsets=r.choice(["none", "tokens"]),
                gaps=True,
                lse_layout=r.choice(["padded", "packed"]),
                max_q=max(lens_q + [1]) + r.randint(0, 9),
                max_kv=max(lens_kv + [1]) + r.randint(0, 99),
                extra_table_cols=r.randint(0, 5),
                with_out=r.random() < 0.5,
                window_left=r.choice([5, 70]) if i % 2 else -1,  # (its width is a runtime argument)
            )
            keys.update(_kernel_keys(case))
    assert len(keys) == 2, f"{len(keys)} different compile keys over 30 calls (expected: window or not)"


def test_specialisation_key_tracks_constexprs():
    """Sanity of the check above: a change that needs a new kernel does change the key."""
    base = dict(lens_q=[5], lens_kv=[9], hq=8, hkv=2, page_size=16, dtype=F16)
    with tuning.override("triton", num_splits=1):
        k1 = _kernel_keys(make_case(1, **base))
        k2 = _kernel_keys(make_case(1, **{**base, "causal": False}))
        k3 = _kernel_keys(make_case(1, **{**base, "page_size": 8}))
        k4 = _kernel_keys(make_case(1, **base, logits_soft_cap=5.0))
    assert len({str(k) for k in (k1, k2, k3, k4)}) == 4


# --------------------------------------------------------------------------------------------
# GPU code generation without a GPU: the real launches compiled for sm_90 with Triton's ptxas
# --------------------------------------------------------------------------------------------

_AOT_SCRIPT = textwrap.dedent(
    """
    import re, subprocess, sys
    sys.path.insert(0, {tests!r})
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    from oracle import make_case
    from helpers import planned, call_tensors
    from pagedprefill.backends.triton import fa2

    target = GPUTarget("cuda", 90, 128)
    backend = make_backend(target)
    ptxas = triton.knobs.nvidia.ptxas.path
    dtypes = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32,
                  e4m3=torch.float8_e4m3fn, e5m2=torch.float8_e5m2)
    for spec in {specs!r}:
        dqk, dvo, q_dt, kv_dt, page_size, causal, splits, extra = spec
        case = make_case(0, lens_q=[5, 7], lens_kv=[9, 30], hq=8, hkv=2, dqk=dqk, dvo=dvo,
                         page_size=page_size, dtype=dtypes[q_dt], kv_dtype=dtypes[kv_dt], causal=causal, **extra)
        p, lp, ws = planned(case, "torch")  # (the batch: no GPU, no interpreter here)
        plan = fa2.Fa2Plan(lp.batch, None, splits)
        eight = q_dt in ("e4m3", "e5m2") or kv_dt in ("e4m3", "e5m2")
        plan._set_config(fa2.default_config(dqk, dvo, 4 if q_dt == "fp32" else 2, eight, (9, 0)))
        plan.kwargs["FAST_TANH"] = True
        for kernel, grid, args, kwargs in plan.launches(call_tensors(case, p, lp, ws)):
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            bound, sp, opts = binder(*args, **kwargs)
            options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, sp, opts)
            c = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                               options=options.__dict__)
            with open("/tmp/_pp_aot.ptx", "w") as f:
                f.write(c.asm["ptx"])
            log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", "/tmp/_pp_aot.ptx", "-o", "/dev/null"],
                                 capture_output=True, text=True).stderr
            spill = max([int(x) for x in re.findall(r"(\\d+) bytes spill stores", log)] or [0])
            print("RESULT", spec, kernel.fn.__name__, c.metadata.shared, spill, flush=True)
    """
)

AOT_SPECS = [
    (128, 128, "bf16", "bf16", 16, True, 1, {}),
    (64, 64, "bf16", "bf16", 0, True, 1, dict(window_left=33)),
    (96, 96, "bf16", "bf16", 3, True, 1, dict(logits_soft_cap=30.0, sinks=True)),
    (192, 128, "bf16", "bf16", 16, True, 1, {}),
    (256, 256, "bf16", "bf16", 16, True, 1, {}),
    (96, 96, "bf16", "e4m3", 16, True, 1, {}),
    (128, 128, "e5m2", "e5m2", 1, True, 1, {}),
    (128, 128, "fp32", "fp32", 16, True, 1, {}),
    (128, 128, "bf16", "bf16", 16, True, 4, dict(sinks=True)),
]
# The fastest configs measured on the H200 trade a few register spills for 256-row tiles (52 bytes
# for D128, 380 for D192/128; the spill-free alternatives ran 5-15% slower). The bound catches a
# config change that would spill heavily, not the measured trade-off.
MAX_SPILL_BYTES = 600


def test_compiles_for_sm90_without_heavy_spills(tmp_path):
    """The real launches compile for an H100/H200 (sm_90), fit in shared memory and spill at most
    MAX_SPILL_BYTES."""
    pytest.importorskip("triton.backends.nvidia")
    script = _AOT_SCRIPT.format(tests=str(ROOT / "tests"), specs=AOT_SPECS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT / "tests", timeout=900
    )
    assert res.returncode == 0, res.stderr[-4000:]
    results = [line for line in res.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == len(AOT_SPECS) + 1, res.stdout  # + the merge kernel of the split case
    for line in results:
        *_, shared, spill = line.split()
        assert int(shared) <= 227 * 1024, line
        assert int(spill) <= MAX_SPILL_BYTES, line


# --------------------------------------------------------------------------------------------
# GPU (skipped by the conftest without CUDA)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(200, 240))
def test_gpu_random_grid(seed):
    """Both kernels (the Hopper one serves the 16-bit D 64 / 128 / 192 cases without variants)."""
    params = random_params(seed, (BF16, F16), dims=(64, 96, 128, 192, 256))
    case = make_case(seed, **params)
    run_and_check(case, atol_for(params["dtype"]))


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256), (80, 112)])
@pytest.mark.parametrize("kind", ["bf16", "fp16", "fp8kv", "fp8"])
@pytest.mark.parametrize("page_size", [16, 0])
def test_gpu_head_dims_and_dtypes(dims, kind, page_size):
    """Every head dim x dtype x paged/ragged, GQA 7 over 8 KV heads."""
    dqk, dvo = dims
    q_dt = {"bf16": BF16, "fp16": F16, "fp8kv": BF16, "fp8": torch.float8_e4m3fn}[kind]
    kv_dt = torch.float8_e4m3fn if kind.startswith("fp8") else q_dt
    case = make_case(
        310,
        lens_q=[130, 1, 77],
        lens_kv=[400, 300, 77],
        hq=56,
        hkv=8,
        dqk=dqk,
        dvo=dvo,
        page_size=page_size,
        dtype=q_dt,
        kv_dtype=kv_dt,
        device="cuda",
    )
    run_and_check(case, atol_for(q_dt, kv_dt))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_long_sequences(dtype, causal):
    case = make_case(
        300,
        lens_q=[1100, 37, 1500],
        lens_kv=[3300, 37, 3900],
        hq=16,
        hkv=4,
        dqk=128,
        page_size=16,
        dtype=dtype,
        causal=causal,
        device="cuda",
        workspace_bytes=1 << 26,
    )
    out, lse = call(case)
    check_sampled(case, out, lse, atol=atol_for(dtype), per_seq=40)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_gpu_split_kv_auto(dtype):
    """Short queries over a long prefix: the automatic policy splits the KV range."""
    case = make_case(
        330,
        lens_q=[7, 1],
        lens_kv=[8000, 5000],
        hq=8,
        hkv=1,
        dqk=128,
        page_size=16,
        dtype=dtype,
        device="cuda",
        workspace_bytes=1 << 26,
    )
    assert fa2.choose_splits(batch_of(case), fa2.choose_config(batch_of(case)), 1 << 26) > 1
    run_and_check(case, atol_for(dtype))


def graph_case(seed, lens_q, lens_kv, max_q, max_kv, page_size, dtype, hq=8, hkv=2, **kw):
    """A CUDA-graph-mode case whose tensor shapes depend only on (B, max_q, max_kv, page_size)."""
    bsz = len(lens_q)
    case = make_case(
        seed,
        lens_q=[max_q] * bsz,
        lens_kv=[max_kv] * bsz,
        hq=hq,
        hkv=hkv,
        dqk=128,
        page_size=page_size,
        dtype=dtype,
        max_q=max_q,
        max_kv=max_kv,
        lens_on_device=True,
        device="cuda",
        offsets="tokens",
        lse_layout="padded",
        extra_table_cols=0,
        workspace_bytes=1 << 26,
        **kw,
    )
    case.lens_q, case.lens_kv = list(lens_q), list(lens_kv)  # sized for the maxima, shorter inside
    case.kwargs["actual_seq_lens_q"].copy_(torch.tensor(lens_q, dtype=torch.int32))
    case.kwargs["actual_seq_lens_kv"].copy_(torch.tensor(lens_kv, dtype=torch.int32))
    case.kwargs["is_cuda_graph_compatible"] = True
    return case


@pytest.mark.gpu
@pytest.mark.parametrize(
    "page_size,splits,variant", [(16, 1, "none"), (1, 4, "none"), (0, 1, "none"), (16, 1, "window"), (16, 4, "sinks")]
)
def test_gpu_cuda_graph_replay(page_size, splits, variant):
    """Capture once, then change lengths, offsets, tables and data in place and replay."""
    r = random.Random(page_size * 10 + splits)
    bsz, max_q, max_kv, dtype = 4, 96, 640, BF16
    extra = {"window": dict(window_left=70), "sinks": dict(sinks=True)}.get(variant, {})

    def new_case(seed):
        lq = [r.randint(0, max_q) for _ in range(bsz)]
        lkv = [r.randint(0, max_kv) for _ in range(bsz)]
        return graph_case(seed, lq, lkv, max_q, max_kv, page_size, dtype, **extra)

    base = new_case(400)
    static = {k: v for k, v in base.kwargs.items() if isinstance(v, torch.Tensor)}
    with tuning.override("triton", num_splits=splits):
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**base.kwargs, backend="triton")  # warm-up compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**base.kwargs, backend="triton")
    assert out.data_ptr() == static["out"].data_ptr()
    for i in range(4):
        new = new_case(401 + i)
        for name, t in static.items():
            if name in ("out", "lse"):
                t.fill_(float("nan"))
            elif name != "workspace_buffer":
                t.copy_(new.kwargs[name])  # same shapes: lengths, tables, offsets and data change
        graph.replay()
        torch.cuda.synchronize()
        check(new, out, lse, atol=atol_for(dtype), lse_atol=2e-2)


def variants_by_kernel() -> dict:
    return {k.fn.__name__: launch.compiled_variants(k) for k in tb.compiled_kernels()}


@pytest.mark.gpu
def test_gpu_no_recompilation():
    """Warm up (one split-KV call, one plain call), then 30 calls with random batch sizes, lengths,
    offsets, max_q / max_kv, table widths and row counts: no new compilation."""
    r = random.Random(5)
    compiled = []

    def one_call(seed, split):
        # split: short queries over a long prefix, few programs; else a big grid
        bsz = r.randint(1, 3) if split else r.randint(4, 12)
        lens_q = [r.randint(1, 8) if split else r.randint(1100, 1300) for _ in range(bsz)]
        lens_kv = [q + r.randint(1500, 2000) for q in lens_q]
        case = make_case(
            seed,
            lens_q=lens_q,
            lens_kv=lens_kv,
            hq=8,
            hkv=2,
            dqk=128,
            page_size=16,
            dtype=BF16,
            offsets=r.choice(["none", "tokens"]),
            gaps=True,
            lse_layout=r.choice(["padded", "packed"]),
            max_q=max(lens_q) + r.randint(0, 50),
            max_kv=max(lens_kv) + r.randint(1024, 1500),
            extra_table_cols=r.randint(0, 4),
            device="cuda",
            workspace_bytes=1 << 26,
        )
        batch = batch_of(case)
        assert (fa2.choose_splits(batch, fa2.choose_config(batch), 1 << 26) > 1) == split
        out, lse = call(case)
        return case, out, lse

    old_hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(k.get("repr")) or False
    try:
        one_call(500, split=True)
        one_call(501, split=False)
        before = variants_by_kernel()
        compiled.clear()
        for s in range(30):
            case, out, lse = one_call(600 + s, split=s % 2 == 0)
            if s % 10 == 0:
                check_sampled(case, out, lse, atol=2.5e-2, seed=s)
        torch.cuda.synchronize()
        after = variants_by_kernel()
        grown = {k: (before.get(k, 0), n) for k, n in after.items() if n != before.get(k, 0)}
        # (which kernel, variants before -> after, and the compile hook's record of each)
        assert not grown and not compiled, f"compiled after warm-up: {grown}; {compiled}"
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old_hook


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["graph", "device-lengths", "plan-run"])
def test_gpu_no_host_sync(mode):
    """Device lengths never sync: a graph-mode call, a plain call with device lengths and offsets, and a
    plan's run (torch's sync debug mode raises on any device-to-host sync)."""
    case = graph_case(700, [33, 5], [200, 90], 40, 256, 16, BF16)
    if mode != "graph":
        case.kwargs["is_cuda_graph_compatible"] = False
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="triton")  # compile
    kw = case.kwargs
    p = pagedprefill.plan(
        kw["workspace_buffer"],
        num_qo_heads=8,
        num_kv_heads=2,
        head_dim_qk=128,
        page_size=16,
        actual_seq_lens_q=kw["actual_seq_lens_q"],
        actual_seq_lens_kv=kw["actual_seq_lens_kv"],
        max_token_per_sequence=40,
        max_sequence_kv=256,
        block_tables=kw["block_tables"],
        causal=True,
        scale=kw["scale"],
        batch_offsets_q=kw["batch_offsets_q"],
        batch_offsets_o=kw["batch_offsets_o"],
        batch_offsets_units="tokens",
        return_lse=True,
        backend="triton",
    )
    p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
    kw["out"].fill_(float("nan"))
    kw["lse"].fill_(float("nan"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if mode == "plan-run":
            out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"])
        else:
            out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    check(case, out, lse, atol=2.5e-2)


@pytest.mark.gpu
def test_gpu_calls_alternating_alignment_stay_correct():
    """Repeated calls whose q / out move between 16-byte aligned and misaligned addresses: each launch
    must run the kernel compiled for its alignment."""
    opts = dict(lens_q=[5, 33], lens_kv=[40, 70], hq=8, hkv=2, dqk=128, page_size=16, dtype=F16)
    for i, shift in enumerate([0, 1, 0, 1, 0]):
        case = make_case(980 + i, device="cuda", **opts)
        kw = dict(case.kwargs)
        if shift:
            for name in ("q", "out"):
                t = kw[name]
                flat = torch.empty(t.numel() + shift, dtype=t.dtype, device="cuda")
                kw[name] = flat[shift:].view(t.shape).copy_(t)
        out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend="triton")
        torch.cuda.synchronize()
        assert out.data_ptr() == kw["out"].data_ptr()
        check(case, out, lse, atol=5e-3, lse_atol=5e-3)


@pytest.mark.gpu
def test_gpu_random_grid_long_variants():
    """Long sequences with windows, soft-capping and sinks (sampled rows)."""
    for seed in range(3):
        params = random_params(800 + seed, (BF16,), long=True, dims=(128,))
        params.update(window_left=[128, 1000, 37][seed], logits_soft_cap=[0.0, 50.0, 30.0][seed], sinks=seed != 1)
        case = make_case(800 + seed, **params, workspace_bytes=1 << 26)
        out, lse = call(case)
        check_sampled(case, out, lse, atol=2.5e-2, per_seq=20)
