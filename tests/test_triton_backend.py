"""Tests of the Triton backend against the independent float64 oracle (tests/oracle.py).

On a machine without CUDA the kernels run in Triton's CPU interpreter. Triton decides at
*decoration* time (when ``pagedprefill.backends.triton_backend`` is first imported) whether its
kernels are interpreted, so this module sets ``TRITON_INTERPRET=1`` (``setdefault``: an explicit
value wins) at import, i.e. at collection time, before any test runs and before pagedprefill
imports the backend (pagedprefill imports backends lazily). The variable stays set for the rest of
the pytest process: other test modules that import the Triton backend later get the interpreted
kernels too, and ``unavailable_reason`` on the CPU then reports the backend as available. A module
that needs the "no CUDA GPU" answer must clear the variable itself (``monkeypatch.delenv``).
Under the interpreter bf16 dots are wrong (raw bits are multiplied), so CPU tests use fp16 / fp32;
bf16 runs only in the GPU tests (``@pytest.mark.gpu``, skipped by the conftest without CUDA).
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from oracle import check, make_case  # noqa: E402

import pagedprefill  # noqa: E402
from pagedprefill import api  # noqa: E402
from pagedprefill.backends import torch_backend  # noqa: E402
from pagedprefill.backends import triton_backend as tb  # noqa: E402

triton = pytest.importorskip("triton")

DEVICE = "cuda" if HAS_CUDA else "cpu"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ROOT = Path(__file__).resolve().parents[1]

if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET is set, but not to 1, on a CPU-only machine", allow_module_level=True)


def atol_for(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> float:
    if dtype == torch.float32 and kv_dtype in (None, torch.float32):
        return 1e-4
    if dtype == torch.bfloat16 or dtype in FP8:
        return 2e-2
    return 5e-3


def call(case, **override):
    with tb.config_override(**override):
        return pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="triton")


def run_and_check(case, atol, lse_atol=None, **override):
    out, lse = call(case, **override)
    check(case, out, lse, atol=atol, lse_atol=lse_atol if lse_atol is not None else max(atol, 1e-3))
    return out, lse


def check_sampled(case, out, lse, *, atol, lse_atol=None, per_seq=6, seed=0):
    """Long cases: the oracle on sampled rows (first, last and random rows of every sequence), plus
    every covered row finite and every uncovered row of a given (NaN-poisoned) out/lse untouched."""
    from oracle import reference_rows

    r = random.Random(seed)
    rows = []
    for b, lq in enumerate(case.lens_q):
        if lq:
            picks = {0, lq - 1} | {r.randrange(lq) for _ in range(per_seq)}
            rows += [(b, i) for i in sorted(picks)]
    ref = reference_rows(case, rows)
    out_c = out.detach().cpu().to(torch.float64)
    hq = out.shape[1]
    max_q = case.kwargs["max_token_per_sequence"]
    flat = lse.detach().cpu().reshape(-1).to(torch.float64) if lse is not None else None
    latol = lse_atol if lse_atol is not None else max(atol, 1e-3)

    def lse_off(b, i):
        return (case.lse_start[b] if case.lse_start is not None else b * max_q * hq) + i * hq

    for (b, i), (o_ref, l_ref) in ref.items():
        err = (out_c[case.o_start[b] + i] - o_ref).abs().max().item()
        assert err <= atol, f"out of sequence {b} row {i}: max error {err:.3g} > {atol}"
        if flat is not None:
            got = flat[lse_off(b, i) : lse_off(b, i) + hq]
            inf = torch.isinf(l_ref)
            assert (torch.isinf(got) == inf).all(), f"lse of sequence {b} row {i}: -inf mismatch"
            assert ((got[~inf] - l_ref[~inf]).abs() <= latol).all(), f"lse of sequence {b} row {i}"
    covered = torch.zeros(out.shape[0], dtype=torch.bool)
    touched = torch.zeros(flat.numel() if flat is not None else 0, dtype=torch.bool)
    for b, lq in enumerate(case.lens_q):
        covered[case.o_start[b] : case.o_start[b] + lq] = True
        if flat is not None and lq:
            touched[lse_off(b, 0) : lse_off(b, 0) + lq * hq] = True
    assert torch.isfinite(out_c[covered]).all(), "a covered out row is not finite (unwritten?)"
    if case.kwargs.get("out") is not None:
        assert torch.isnan(out_c[~covered]).all(), "an uncovered out row was written"
    if flat is not None:
        assert not torch.isnan(flat[touched]).any(), "a covered lse entry was not written"
        if case.kwargs.get("lse") is not None:
            assert torch.isnan(flat[~touched]).all(), "an uncovered lse entry was written"


def direct_batch(case, backend_module=tb):
    """Normalise a case's arguments into a PrefillBatch without running it (for direct backend calls)."""
    batch = api._normalise(**case.kwargs)
    api._fill_metadata(batch, backend_module)
    return batch


# --------------------------------------------------------------------------------------------
# Random grid (CPU interpreter: fp16 / fp32; GPU: also bf16)
# --------------------------------------------------------------------------------------------


def random_params(seed: int, dtypes: tuple, long: bool = False) -> dict:
    r = random.Random(seed)
    bsz = r.randint(1, 3)
    max_len_q, max_len_kv = (1500, 3500) if long else (24, 48)
    lens_q, lens_kv = [], []
    for _ in range(bsz):
        kind = r.random()
        lq = r.randint(1, max_len_q)
        lkv = r.randint(lq, lq + max_len_kv // 2)
        if kind < 0.12:
            lq = 0
        elif kind < 0.24:
            lkv = 0
        elif kind < 0.40:
            lkv = r.randint(1, max(1, lq - 1))  # q_len > kv_len: causal rows without keys
        lens_q.append(lq)
        lens_kv.append(lkv)
    hq, hkv = r.choice([(4, 4), (4, 2), (4, 1), (6, 2), (8, 2)])
    page_size = r.choice([0, 1, 3, 16])
    params = dict(
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=hq,
        hkv=hkv,
        dqk=64,
        page_size=page_size,
        kv_layout=r.choice(["nhd", "hnd", "interleaved"]),
        dtype=r.choice(dtypes),
        causal=r.random() < 0.6,
        offsets=r.choice(["none", "elements", "tokens"]),
        gaps=r.random() < 0.5,
        lse_layout=r.choice(["padded", "packed"]),
        return_lse=r.random() < 0.8,
        extra_table_cols=r.randint(0, 2),
        with_out=r.random() < 0.8,
        device=DEVICE,
    )
    if r.random() < 0.3:  # max_* larger than the longest sequence
        params["max_q"] = max(lens_q + [1]) + r.randint(1, 5)
        params["max_kv"] = max(lens_kv + [1]) + r.randint(1, 9)
    return params


CPU_GRID = range(64)


@pytest.mark.parametrize("seed", CPU_GRID)
def test_random_grid(seed):
    params = random_params(seed, (torch.float16, torch.float32))
    case = make_case(seed, **params)
    run_and_check(case, atol_for(params["dtype"]))


def test_grid_covers_features():
    """The random grid above really exercises every feature the brief lists."""
    seen = {k: set() for k in ("page_size", "kv_layout", "offsets", "lse_layout", "return_lse", "causal")}
    seen.update(group=set(), dtype=set(), with_out=set(), q_gt_kv=set(), q0=set(), kv0=set())
    for seed in CPU_GRID:
        p = random_params(seed, (torch.float16, torch.float32))
        for k in seen:
            if k in p:
                seen[k].add(p[k])
        seen["group"].add(p["hq"] // p["hkv"])
        seen["q_gt_kv"].add(any(0 < kv < q for q, kv in zip(p["lens_q"], p["lens_kv"])))
        seen["q0"].add(0 in p["lens_q"])
        seen["kv0"].add(any(kv == 0 < q for q, kv in zip(p["lens_q"], p["lens_kv"])))
    assert seen["page_size"] == {0, 1, 3, 16}
    assert seen["kv_layout"] == {"nhd", "hnd", "interleaved"}
    assert seen["offsets"] == {"none", "elements", "tokens"}
    assert seen["lse_layout"] == {"padded", "packed"}
    for k in ("return_lse", "causal", "with_out", "q_gt_kv", "q0", "kv0"):
        assert seen[k] == {True, False}, k
    assert {1, 2, 3, 4} <= seen["group"]
    assert seen["dtype"] == {torch.float16, torch.float32}


# --------------------------------------------------------------------------------------------
# Targeted CPU/GPU tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dqk,dvo,page_size",
    [(96, 96, 3), (192, 128, 16), (112, 80, 1), (80, 112, 0), (16, 32, 0)],
    ids=["96", "192-128", "112-80-padded-qk", "80-112-padded-vo", "16-32"],
)
def test_head_dims(dqk, dvo, page_size):
    layout = "nhd"
    case = make_case(
        7,
        lens_q=[9, 17],
        lens_kv=[30, 17],
        hq=4,
        hkv=2,
        dqk=dqk,
        dvo=dvo,
        page_size=page_size,
        kv_layout=layout,
        dtype=torch.float16,
        device=DEVICE,
    )
    run_and_check(case, atol_for(torch.float16))


@pytest.mark.parametrize(
    "block_m,block_n,page_size",
    [(16, 32, 16), (64, 16, 32), (16, 16, 1), (32, 32, 0)],
    ids=["M16-N32-page16", "M64-N16-page32-onepagepertile", "M16-N16-page1", "M32-N32-ragged"],
)
@pytest.mark.parametrize("group", [1, 3, 4])
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
        dtype=torch.float32,
        causal=True,
        device=DEVICE,
    )
    run_and_check(case, 1e-4, BLOCK_M=block_m, BLOCK_N=block_n)


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_fp8", [False, True], ids=["q16", "q-fp8"])
def test_fp8(kv_dtype, q_fp8):
    """fp8 K/V with a 16-bit q (scales folded in-kernel), and fully fp8 q/k/v (bf16 out)."""
    q_dtype = kv_dtype if q_fp8 else (torch.bfloat16 if HAS_CUDA else torch.float16)
    case = make_case(
        21,
        lens_q=[13, 7],
        lens_kv=[33, 7],
        hq=4,
        hkv=2,
        page_size=3,
        dtype=q_dtype,
        kv_dtype=kv_dtype,
        device=DEVICE,
    )
    out, _ = run_and_check(case, 2e-2)
    assert out.dtype == (torch.bfloat16 if q_fp8 else q_dtype)


@pytest.mark.parametrize("scale", [-0.3, 0.0, 2.5])
def test_unusual_scales(scale):
    """Negative and zero softmax scales (the kernel keeps qk_scale >= 0 by negating q)."""
    case = make_case(
        31, lens_q=[6, 11], lens_kv=[9, 20], page_size=1, dtype=torch.float32, scale=scale, device=DEVICE
    )
    run_and_check(case, 1e-4)


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_split_kv(splits, causal):
    """Forced split-KV: partials in the workspace scratch, then the merge kernel (incl. empty splits)."""
    case = make_case(
        41 + splits,
        lens_q=[3, 0, 9, 4],
        lens_kv=[70, 5, 9, 0],
        hq=4,
        hkv=2,
        page_size=3,
        dtype=torch.float16,
        causal=causal,
        lse_layout="packed",
        offsets="tokens",
        gaps=True,
        device=DEVICE,
    )
    with tb.config_override(num_splits=splits):
        batch = direct_batch(case)
        assert tb.workspace_bytes(batch) > 0
    run_and_check(case, atol_for(torch.float16), num_splits=splits)


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
        dtype=torch.float16,
        kv_dtype=torch.float8_e4m3fn,
        with_out=False,
        device=DEVICE,
    )
    run_and_check(case, 2e-2, num_splits=3)


def test_split_kv_workspace_too_small():
    case = make_case(
        52, lens_q=[2], lens_kv=[40], page_size=1, dtype=torch.float16, workspace_bytes=512, device=DEVICE
    )
    with pytest.raises(ValueError, match="workspace_buffer.*bytes"):
        call(case, num_splits=2)


def test_split_policy_from_host_ints_only():
    """Automatic split choice: short q over a long prefix splits, a big grid does not."""
    small = make_case(53, lens_q=[4], lens_kv=[40], page_size=1, dtype=torch.float16, max_kv=8192)
    big = make_case(54, lens_q=[40] * 3, lens_kv=[40] * 3, page_size=1, dtype=torch.float16, max_kv=64)
    gpu_cfg = tb.Config(128, 64, 8, 3)
    assert tb.choose_splits(direct_batch(small), gpu_cfg) > 1
    assert tb.choose_splits(direct_batch(big), gpu_cfg) == 1


def test_split_kv_automatic_and_small_workspace():
    """Automatic split-KV through the public API (most splits empty), and a workspace too small for
    the partials reduces the split instead of failing."""
    kw = dict(lens_q=[4, 1], lens_kv=[40, 0], page_size=1, dtype=torch.float16, max_kv=8192, device=DEVICE)
    case = make_case(55, **kw)
    assert tb.choose_splits(direct_batch(case), tb.choose_config(direct_batch(case))) == 16
    run_and_check(case, atol_for(torch.float16))
    small = make_case(56, **kw, workspace_bytes=8192)
    batch = direct_batch(small)
    assert tb.choose_splits(batch, tb.choose_config(batch)) == 1
    assert tb.workspace_bytes(batch) == 0
    run_and_check(small, atol_for(torch.float16))


def test_check_sampled_detects_errors():
    """The sampled check used by the long GPU tests fails on wrong, unwritten and stray rows."""
    kw = dict(page_size=16, dtype=torch.float16, offsets="tokens", gaps=True, device=DEVICE)
    case = make_case(57, lens_q=[30, 9], lens_kv=[50, 9], **kw)
    out, lse = call(case)
    check_sampled(case, out, lse, atol=5e-3)
    covered = {case.o_start[b] + i for b, lq in enumerate(case.lens_q) for i in range(lq)}
    uncovered = [r for r in range(out.shape[0]) if r not in covered]
    assert uncovered, "the case should leave gap rows in out"
    for corrupt in ("wrong", "unwritten", "stray", "lse"):
        o, lz = out.clone(), lse.clone()
        if corrupt == "wrong":
            o[case.o_start[0]] += 0.1
        elif corrupt == "unwritten":
            o[case.o_start[1] + 4] = float("nan")
        elif corrupt == "stray":
            o[uncovered[0]] = 0.0
        else:
            lz.view(-1)[0] += 0.1
        with pytest.raises(AssertionError):
            check_sampled(case, o, lz, atol=5e-3)


def test_ragged_v_offsets_independent_of_k():
    """Ragged K and V at different rows (batch_offsets_v != batch_offsets_k) give the same result."""
    case = make_case(
        58, lens_q=[6, 9], lens_kv=[11, 20], page_size=0, dtype=torch.float32, offsets="tokens", device=DEVICE
    )
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


def test_untrusted_block_table_entries_are_clamped():
    """Out-of-range page ids inside the used part of a table are clamped, as the torch backend does."""
    case = make_case(61, lens_q=[5, 8], lens_kv=[10, 13], page_size=3, dtype=torch.float32, device=DEVICE)
    ref = direct_batch(case, torch_backend)
    got = direct_batch(case)
    for batch in (ref, got):
        table = batch.block_tables.clone()
        table[0, 1] = 10**6
        table[1, 0] = -5
        table[1, 3] = 2**31 - 1
        batch.block_tables = table
    ref.out = torch.full_like(ref.out, float("nan"))
    ref.lse = torch.full_like(ref.lse, float("nan"))
    torch_backend.run(ref)
    tb.run(got)
    torch.testing.assert_close(got.out, ref.out, atol=1e-4, rtol=0, equal_nan=True)
    torch.testing.assert_close(got.lse, ref.lse, atol=1e-4, rtol=0, equal_nan=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_grid_chunking(monkeypatch, splits):
    """Grids above the CUDA y/z limit are launched in chunks (b_offset / m_offset); simulated with
    a limit of 2 so that batch and row-block chunks both occur."""
    monkeypatch.setattr(tb, "GRID_LIMIT", 2)
    case = make_case(
        73,
        lens_q=[40, 3, 0, 17, 9],
        lens_kv=[30, 3, 4, 17, 40],
        hq=4,
        hkv=2,
        page_size=3,
        dtype=torch.float16,
        device=DEVICE,
    )
    batch = direct_batch(case)
    with tb.config_override(num_splits=splits):
        assert len([p for p in tb.launch_plan(batch) if p[0] is tb._prefill_kernel]) >= 6
    run_and_check(case, atol_for(torch.float16), num_splits=splits)


def test_empty_batches():
    for lens_q, lens_kv in (([0, 0], [5, 0]), ([], [])):
        case = make_case(71, lens_q=lens_q, lens_kv=lens_kv, page_size=2, dtype=torch.float16, device=DEVICE)
        run_and_check(case, 5e-3)


def test_reasons(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "no CUDA GPU; set TRITON_INTERPRET=1" in tb.unavailable_reason(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tb, "INTERPRETED", False)
    assert "before the import" in tb.unavailable_reason(cpu)
    monkeypatch.setattr(tb, "INTERPRETED", True)
    assert tb.unavailable_reason(cpu) is None
    monkeypatch.setattr(tb, "triton", None)
    assert "triton is not importable" in tb.unavailable_reason(cpu)


def test_unsupported_head_dim_message():
    case = make_case(72, lens_q=[3], lens_kv=[5], dqk=72, page_size=2, dtype=torch.float16, device=DEVICE)
    batch = direct_batch(case, torch_backend)
    reason = tb.unsupported_reason(batch)
    assert reason is not None and "72" in reason and "multiples of 16" in reason and "192" in reason
    with pytest.raises(ValueError, match="cannot serve this call.*Dqk=72"):
        call(case)


def test_knob_overrides(monkeypatch):
    case = make_case(74, lens_q=[3], lens_kv=[5], page_size=2, dtype=torch.float16)
    batch = direct_batch(case)
    with tb.config_override(BLOCK_M=64, num_stages=2):
        cfg = tb.choose_config(batch)
        assert (cfg.BLOCK_M, cfg.num_stages) == (64, 2)
    monkeypatch.setenv("PAGEDPREFILL_TRITON_CONFIG", "BLOCK_N=32, num_splits=3")
    assert tb.choose_config(batch).BLOCK_N == 32
    assert tb.choose_splits(batch, tb.choose_config(batch)) == 3
    with pytest.raises(ValueError, match="unknown Triton knob 'BLOCKM'"):
        with tb.config_override(BLOCKM=64):
            pass
    with pytest.raises(ValueError, match="power of two"):
        with tb.config_override(BLOCK_N=48):
            pass


def test_head_dim_split():
    assert tb.split_head_dim(64) == (64, 0, 0)
    assert tb.split_head_dim(96) == (64, 32, 32)
    assert tb.split_head_dim(192) == (128, 64, 64)
    assert tb.split_head_dim(112) == (64, 64, 48)
    assert tb.split_head_dim(256) == (256, 0, 0)


# --------------------------------------------------------------------------------------------
# No recompilation: the specialisation key must not depend on anything that varies per call
# --------------------------------------------------------------------------------------------


def _kernel_keys(batch) -> list:
    """Triton's cache key of every launch of ``batch``, computed exactly as JITFunction.run does
    (binder + compute_cache_key) against an sm_90 target; needs no GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys = []
    for kernel, _grid, args, kwargs in tb.launch_plan(batch):
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
            kv_layout="nhd",
            dtype=torch.float16,
            offsets=r.choice(["none", "tokens"]),
            gaps=True,
            lse_layout=r.choice(["padded", "packed"]),
            max_q=max(lens_q + [1]) + r.randint(0, 9),
            max_kv=max(lens_kv + [1]) + r.randint(0, 99),
            extra_table_cols=r.randint(0, 5),
            with_out=r.random() < 0.5,
        )
        with tb.config_override(num_splits=1, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3):
            keys.update(_kernel_keys(direct_batch(case)))
    assert len(keys) == 1, f"{len(keys)} different compile keys over 30 calls"


def test_specialisation_key_tracks_constexprs():
    """Sanity of the check above: a change that needs a new kernel does change the key."""
    base = dict(lens_q=[5], lens_kv=[9], hq=8, hkv=2, page_size=16, dtype=torch.float16)
    with tb.config_override(num_splits=1):
        k1 = _kernel_keys(direct_batch(make_case(1, **base)))
        k2 = _kernel_keys(direct_batch(make_case(1, **{**base, "causal": False})))
        k3 = _kernel_keys(direct_batch(make_case(1, **{**base, "page_size": 8})))
    assert k1 != k2 and k1 != k3


# --------------------------------------------------------------------------------------------
# GPU code generation without a GPU: compile the real launches for sm_90 with Triton's bundled ptxas
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
    from pagedprefill import api
    from pagedprefill.backends import triton_backend as tb
    from test_triton_backend import direct_batch

    target = GPUTarget("cuda", 90, 128)
    backend = make_backend(target)
    ptxas = triton.knobs.nvidia.ptxas.path
    dtypes = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32,
                  e4m3=torch.float8_e4m3fn, e5m2=torch.float8_e5m2)
    for spec in {specs!r}:
        dqk, dvo, q_dt, kv_dt, page_size, causal, splits = spec
        case = make_case(0, lens_q=[5, 7], lens_kv=[9, 30], hq=8, hkv=2, dqk=dqk, dvo=dvo,
                         page_size=page_size, dtype=dtypes[q_dt], kv_dtype=dtypes[kv_dt], causal=causal)
        batch = direct_batch(case)
        cfg = tb.default_config(dqk, dvo, 4 if q_dt == "fp32" else 2, 4, causal, (9, 0))
        for kernel, grid, args, kwargs in tb.launch_plan(batch, cfg, splits):
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
    (128, 128, "bf16", "bf16", 16, True, 1),
    (128, 128, "fp16", "fp16", 1, False, 1),
    (64, 64, "bf16", "bf16", 0, True, 1),
    (96, 96, "bf16", "bf16", 3, True, 1),
    (192, 128, "bf16", "bf16", 16, True, 1),
    (256, 256, "bf16", "bf16", 16, True, 1),
    (128, 128, "bf16", "e4m3", 16, True, 1),
    (128, 128, "e5m2", "e5m2", 1, True, 1),
    (128, 128, "fp32", "fp32", 16, True, 1),
    (128, 128, "bf16", "bf16", 16, True, 4),
]


# The fastest configs measured on the H200 trade a few register spills for 256-row tiles (52 bytes
# for D128, 380 for D192/128; the spill-free alternatives ran 5-15% slower: docs/triton_kernel.md).
# The bound catches a config change that would spill heavily, not the measured trade-off.
MAX_SPILL_BYTES = 512


def test_compiles_for_sm90_without_heavy_spills(tmp_path):
    """The real launches compile for an H100/H200 (sm_90), fit in shared memory and spill at most
    MAX_SPILL_BYTES."""
    pytest.importorskip("triton.backends.nvidia")
    script = _AOT_SCRIPT.format(tests=str(ROOT / "tests"), specs=AOT_SPECS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    cmd = [sys.executable, "-c", script]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT / "tests", timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    results = [line for line in res.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == len(AOT_SPECS) + 1, res.stdout  # + the merge kernel of the split case
    for line in results:
        *_, shared, spill = line.split()
        assert int(shared) <= 227 * 1024, line
        assert int(spill) <= MAX_SPILL_BYTES, line


# --------------------------------------------------------------------------------------------
# GPU-only tests (skipped by the conftest without CUDA)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(200, 260))
def test_gpu_random_grid_bf16_fp16(seed):
    params = random_params(seed, (torch.bfloat16, torch.float16))
    case = make_case(seed, **params)
    run_and_check(case, atol_for(params["dtype"]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
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
        kv_layout="nhd",
        dtype=dtype,
        causal=causal,
        device="cuda",
        workspace_bytes=1 << 26,
    )
    out, lse = call(case)
    check_sampled(case, out, lse, atol=atol_for(dtype), per_seq=40)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256), (80, 112)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 0])
def test_gpu_head_dims(dims, dtype, page_size):
    dqk, dvo = dims
    case = make_case(
        310,
        lens_q=[130, 1, 77],
        lens_kv=[400, 300, 77],
        hq=8,
        hkv=2,
        dqk=dqk,
        dvo=dvo,
        page_size=page_size,
        kv_layout="hnd",
        dtype=dtype,
        device="cuda",
    )
    run_and_check(case, atol_for(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_kind", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)])
def test_gpu_fp8(kv_dtype, q_kind, dims):
    q_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": kv_dtype}[q_kind]
    case = make_case(
        320,
        lens_q=[300, 5, 64],
        lens_kv=[900, 700, 64],
        hq=8,
        hkv=2,
        dqk=dims[0],
        dvo=dims[1],
        page_size=16,
        dtype=q_dtype,
        kv_dtype=kv_dtype,
        device="cuda",
    )
    run_and_check(case, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
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
    assert tb.choose_splits(direct_batch(case), tb.choose_config(direct_batch(case))) > 1
    run_and_check(case, atol_for(dtype))


def _graph_case(seed, lens_q, lens_kv, max_q, max_kv, page_size, dtype, hq=8, hkv=2):
    """A CUDA-graph-mode case whose tensor shapes depend only on (B, max_q, max_kv, page_size)."""
    bsz = len(lens_q)
    case = make_case(
        seed,
        lens_q=[max_q] * bsz,  # size every buffer for the maxima ...
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
    )
    case.lens_q, case.lens_kv = list(lens_q), list(lens_kv)  # ... then use shorter lengths inside
    case.kwargs["actual_seq_lens_q"].copy_(torch.tensor(lens_q, dtype=torch.int32))
    case.kwargs["actual_seq_lens_kv"].copy_(torch.tensor(lens_kv, dtype=torch.int32))
    case.kwargs["is_cuda_graph_compatible"] = True
    return case


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 1, 0])
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_cuda_graph_replay(page_size, splits):
    """Capture once, then change lengths, offsets, tables and data in place and replay."""
    r = random.Random(page_size * 10 + splits)
    bsz, max_q, max_kv, dtype = 4, 96, 640, torch.bfloat16

    def new_case(seed):
        lq = [r.randint(0, max_q) for _ in range(bsz)]
        lkv = [r.randint(0, max_kv) for _ in range(bsz)]
        return _graph_case(seed, lq, lkv, max_q, max_kv, page_size, dtype)

    base = new_case(400)
    static = {k: v for k, v in base.kwargs.items() if isinstance(v, torch.Tensor)}
    with tb.config_override(num_splits=splits):
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**base.kwargs, backend="triton")  # warm-up compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**base.kwargs, backend="triton")
    assert out.data_ptr() == static["out"].data_ptr()
    for i in range(5):
        new = new_case(401 + i)
        for name, t in static.items():
            if name in ("out", "lse"):
                t.fill_(float("nan"))
            elif name != "workspace_buffer":
                t.copy_(new.kwargs[name])  # same shapes: lengths, tables, offsets and data change
        graph.replay()
        torch.cuda.synchronize()
        check(new, out, lse, atol=atol_for(dtype), lse_atol=2e-2)


@pytest.mark.gpu
def test_gpu_no_recompilation():
    """Warm up (one split-KV call, one plain call), then 30 calls with random batch sizes, lengths,
    offsets, max_q / max_kv, table widths and row counts: no new compilation."""
    r = random.Random(5)
    compiled = []

    def one_call(seed, split):
        # split: short queries over a long prefix, few programs; else a big grid (max_q >= 1200)
        bsz = r.randint(1, 3) if split else r.randint(4, 12)
        lens_q = [r.randint(0, 8 if split else 300) for _ in range(bsz)]
        lens_kv = [q + r.randint(0, 2000) for q in lens_q]
        case = make_case(
            seed,
            lens_q=lens_q,
            lens_kv=lens_kv,
            hq=8,
            hkv=2,
            dqk=128,
            page_size=16,
            dtype=torch.bfloat16,
            offsets=r.choice(["none", "tokens"]),
            gaps=True,
            lse_layout=r.choice(["padded", "packed"]),
            max_q=max(lens_q + [1]) + (r.randint(0, 50) if split else 1200),
            max_kv=max(lens_kv + [1]) + r.randint(1024, 1500),
            extra_table_cols=r.randint(0, 4),
            device="cuda",
            workspace_bytes=1 << 26,
        )
        batch = direct_batch(case)
        assert (tb.choose_splits(batch, tb.choose_config(batch)) > 1) == split
        out, lse = call(case)
        return case, out, lse

    old_hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(k.get("repr")) or False
    try:
        one_call(500, split=True)
        one_call(501, split=False)
        before = tb.compile_count()
        compiled.clear()
        for s in range(30):
            case, out, lse = one_call(600 + s, split=s % 2 == 0)
            if s % 10 == 0:
                check_sampled(case, out, lse, atol=2e-2, seed=s)
        torch.cuda.synchronize()
        assert tb.compile_count() == before, "a kernel was recompiled for a call that differs only in data"
        assert not compiled, f"compilations after warm-up: {compiled}"
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old_hook


@pytest.mark.gpu
def test_gpu_no_host_sync_in_run():
    """run() in graph mode does no device-to-host sync (torch's sync debug mode raises on one)."""
    case = _graph_case(700, [33, 5], [200, 90], 40, 256, 16, torch.bfloat16)
    pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="triton")  # compile
    batch = direct_batch(case)
    assert batch.host is None
    batch.out.fill_(float("nan"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tb.run(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    check(case, batch.extras["out_user_view"], batch.extras["lse_user_view"], atol=2e-2)


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
        dtype=torch.float16 if HAS_CUDA else torch.float32,
        device=DEVICE,
        scale=scale,
    )
    with tb.config_override(lazy=lazy):
        out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="triton")
    check(case, out, lse, atol=2e-2 if HAS_CUDA else 1e-4, lse_atol=2e-2)


# --------------------------------------------------------------------------------------------
# The api's CUDA-graph-mode metadata as one Triton launch (triton_backend.device_metadata)
# --------------------------------------------------------------------------------------------


def _adversarial_vector(rng: random.Random, n: int, scale: int, dtype: torch.dtype) -> torch.Tensor:
    """Device-held values are untrusted: negatives, zeros, in-range, huge, non-multiples."""
    pool = [-(2**40), -7, -1, 0, 0, 1, 3, scale, scale * 2 + 1, 2**31 + 5, 2**40]
    vals = [rng.choice(pool) if rng.random() < 0.4 else rng.randint(0, 2 * scale) for _ in range(n)]
    if dtype == torch.int32:
        vals = [max(min(x, 2**31 - 1), -(2**31)) for x in vals]
    t = torch.tensor(vals, dtype=dtype)
    if rng.random() < 0.3:  # a strided view, as (B,1,1,1) or a slice may give
        t = torch.stack([t, torch.full_like(t, -99)], 1)[:, 0]
    return t


@pytest.mark.parametrize("seed", range(40))
def test_device_metadata_kernel_matches_the_torch_ops(seed):
    """triton_backend.device_metadata writes exactly what api._device_metadata writes, for any
    device-held lengths and offsets (clamps included): same 7 x B int32 table."""
    rng = random.Random(seed)
    bsz = rng.choice([1, 3, 7, 1100])  # 1100: more than one 1024-wide chunk (carried prefix sums)
    small = bsz < 50
    lens_q = [rng.randint(0, 6) for _ in range(bsz)]
    lens_kv = [rng.randint(0, 12) for _ in range(bsz)]
    ps = rng.choice([0, 1, 4])
    offsets = rng.choice(["none", "elements", "tokens"])
    case = make_case(
        seed,
        lens_q=lens_q if small else [1] * bsz,
        lens_kv=lens_kv if small else [2] * bsz,
        page_size=ps,
        offsets=offsets,
        gaps=offsets != "none" and rng.random() < 0.5,
        lse_layout=rng.choice(["padded", "packed"]),
        return_lse=rng.random() < 0.8,
        dtype=torch.float16,
        max_q=8,
        max_kv=14,
    )
    batch = api._normalise(**case.kwargs)
    api._fill_metadata(batch, torch_backend)
    dt = rng.choice([torch.int32, torch.int64])
    if rng.random() < 0.7:
        batch.extras["raw_lens"] = (
            _adversarial_vector(rng, bsz, 6, dt),
            _adversarial_vector(rng, bsz, 12, dt),
        )
    offs = batch.extras["raw_offsets"]
    for name in list(offs):
        if offs[name] is not None and rng.random() < 0.7:
            offs[name] = _adversarial_vector(rng, bsz + 1, 40 * 64, dt)
    want = torch.full_like(batch.meta, -5)
    api._device_metadata(batch, want)
    batch.meta.fill_(-5)
    batch.work_counter.fill_(-5)
    assert tb.device_metadata(batch)
    assert torch.equal(batch.meta, want), (batch.meta, want)
    assert batch.work_counter.tolist() == [0]


# --------------------------------------------------------------------------------------------
# fast_launch: Triton's binding skipped for a launch whose specialisation was seen before
# --------------------------------------------------------------------------------------------


class _FakeParam:
    def __init__(self, name, default=None, is_constexpr=True):
        self.name, self.default, self.is_constexpr = name, default, is_constexpr


class _FakeCompiled:
    function = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("compiled", grid, args))


class _FakeKernel:
    """Records launches; params: two runtime arguments, then constexprs A (passed) and B (default)."""

    pre_run_hooks: list = []

    def __init__(self):
        self.log = []
        runtime = [_FakeParam("X", is_constexpr=False), _FakeParam("n", is_constexpr=False)]
        self.params = [*runtime, _FakeParam("A"), _FakeParam("B", default=7)]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return _FakeCompiled(self.log)

        return launch


def test_fast_launch_reuses_only_an_identical_specialisation(monkeypatch):
    """Hits replay the compiled kernel with the constexpr tail in parameter order; any change Triton
    specialises on (16-byte alignment, dtype, an int becoming 1 or a multiple of 16, width) goes
    through Triton again, and a kernel with pre-run hooks always does."""
    monkeypatch.setattr(tb, "INTERPRETED", False)
    monkeypatch.setattr(tb, "_current_device", lambda: 0)
    tb._LAUNCHES.clear()
    k = _FakeKernel()
    buf = torch.zeros(64, dtype=torch.int8)
    aligned = buf[16:32] if buf[16:].data_ptr() % 16 == 0 else buf[(-buf.data_ptr()) % 16 :][:16]
    kw = dict(A=3, num_warps=4)

    tb.fast_launch(k, (2,), (aligned, 5), kw)
    tb.fast_launch(k, (3, 2), (aligned, 5), kw)
    assert [e[0] for e in k.log] == ["triton", "compiled"]
    assert k.log[1][1:] == ((3, 2, 1), (aligned, 5, 3, 7))

    misaligned = buf[aligned.data_ptr() - buf.data_ptr() + 1 :][:16]
    as_uint8 = aligned.view(torch.uint8)
    other_specs = [(misaligned, 5), (as_uint8, 5), (aligned, 1), (aligned, 32), (aligned, 2**31)]
    for args in other_specs:
        k.log.clear()
        tb.fast_launch(k, (1,), args, kw)
        assert [e[0] for e in k.log] == ["triton"], args
    k.log.clear()
    tb.fast_launch(k, (1,), (aligned, 6), kw)  # same specialisation as (aligned, 5)
    tb.fast_launch(k, (1,), (aligned, 5), dict(A=4, num_warps=4))  # another constexpr
    assert [e[0] for e in k.log] == ["compiled", "triton"]

    # never cached: arguments it cannot key exactly, float or unhashable options, a runtime
    # parameter passed by keyword, a callable grid
    for args, kwargs in [
        ((aligned, (1, 2)), kw),
        ((aligned, 5), dict(A=0.5, num_warps=4)),
        ((aligned, 5), dict(A=3, num_warps=4, extern_libs={"x": "y"})),
        ((aligned,), dict(n=5, A=3, num_warps=4)),
    ]:
        k.log.clear()
        tb.fast_launch(k, (1,), args, kwargs)
        tb.fast_launch(k, (1,), args, kwargs)
        assert [e[0] for e in k.log] == ["triton", "triton"], (args, kwargs)
    k.log.clear()
    tb.fast_launch(k, lambda meta: (1,), (aligned, 5), kw)
    assert [e[0] for e in k.log] == ["triton"]

    monkeypatch.setattr(k, "pre_run_hooks", [lambda *a, **kw: None])
    k.log.clear()
    tb.fast_launch(k, (2,), (aligned, 5), kw)
    assert [e[0] for e in k.log] == ["triton"]
    tb._LAUNCHES.clear()


def test_fast_launch_key_is_finer_than_tritons():
    """Against Triton's real binder (sm_90 target, no GPU): over randomly varied runtime arguments of
    the real attention launch (edge ints, misaligned and re-typed tensors, None), launches with one
    fast_launch key always have one Triton cache key."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    case = make_case(5, lens_q=[5, 9], lens_kv=[40, 70], hq=8, hkv=2, page_size=16, dtype=torch.float16)
    (kernel, _grid, args, kwargs), *_ = tb.launch_plan(direct_batch(case))
    if not isinstance(kernel, JITFunction):
        kernel = JITFunction(kernel.fn, **kernel.kwargs)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    r = random.Random(0)
    ints = [0, 1, -1, 2, 15, 16, 17, 32, 2**31 - 16, 2**31, -(2**31), -(2**31) - 1, 2**40, 2**63 - 16, 2**63]
    buf = torch.zeros(4096, dtype=torch.uint8)
    base = (-buf.data_ptr()) % 16
    seen: dict = {}
    for _ in range(3000):
        new = []
        for a in args:
            if type(a) is int and r.random() < 0.3:
                a = r.choice(ints)
            elif isinstance(a, torch.Tensor) and r.random() < 0.3:
                dt = r.choice([torch.float16, torch.int32, torch.float32])
                off = base + r.choice([s for s in (0, 16, 2, 4, 8) if s % dt.itemsize == 0])
                a = buf[off : off + 256].view(dt)
            new.append(a)
        ours = (tb._kwargs_key(kwargs), tuple(tb._spec_of(a) for a in new))
        _bound, spec, options = binder(*new, **kwargs)
        theirs = compute_cache_key({}, spec, options)
        assert seen.setdefault(ours, theirs) == theirs


@pytest.mark.gpu
def test_gpu_calls_alternating_alignment_stay_correct():
    """Repeated calls whose q / out move between 16-byte aligned and misaligned addresses: each
    launch must run the kernel variant compiled for its alignment."""
    opts = dict(lens_q=[5, 33], lens_kv=[40, 70], hq=8, hkv=2, dqk=128, page_size=16, dtype=torch.float16)
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
