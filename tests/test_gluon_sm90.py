"""The Hopper Gluon kernel (``pagedprefill.backends.gluon_sm90``), reached through ``backend="triton"``.

CPU: knob validation, routing, and an sm_90 compile of the kernel (shared memory, spills, and the
PTX features the design relies on: a wgmma group left in flight, per-partition register counts).
GPU (H200): the kernel forced on for a random grid against the float64 oracle, CUDA-graph replays
with new lengths, and the default routing.
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from oracle import check, make_case, poison
from test_triton_backend import atol_for, call, check_sampled, direct_batch, random_params

import pagedprefill
from pagedprefill.backends import gluon_sm90 as gs
from pagedprefill.backends import triton_backend as tb

ROOT = Path(__file__).resolve().parents[1]


def test_config_env_knobs(monkeypatch):
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", "stages=4,consumers=2")
    cfg = gs.config()
    assert (cfg.stages, cfg.consumers, cfg.BLOCK_M) == (4, 2, 128)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", "stagez=4")
    with pytest.raises(ValueError, match="unknown knob 'stagez'"):
        gs.config()
    for bad, msg in (
        ("consumers=4", "consumers must be 2 or 3"),
        ("stages=1", "stages must be >= 2"),
        ("BLOCK_N=48", "BLOCK_N must be"),
        ("load_warps=3", "load_warps must be"),
        ("consumer_regs=150", "multiples of 8"),
        ("consumer_regs=160,load_regs=96", "registers over budget"),
        ("chunk=-1", "chunk must be >= 0"),
        ("own_rows=2", "own_rows must be 0 or 1"),
        ("dynamic=2", "dynamic must be 0 or 1"),
        ("q_tma=2", "q_tma must be 0 or 1"),
        ("o_stage=2", "o_stage must be 0 or 1"),
        ("dqk192=2", "dqk192 must be 0 or 1"),
        ("o_buf=2", "o_buf must be 0 or 1"),
        ("pingpong=-1", "pingpong must be 0 or 1"),
        ("tile_fence=2", "tile_fence must be 0 or 1"),
        ("v_ring=3", "v_ring must be 0 or 1"),
        ("tma=2", "tma must be 0 or 1"),
        ("+q_tma=2", "q_tma must be 0 or 1"),
        ("chunk=x", "knob 'chunk' takes an integer, got 'x'"),
        ("stages", "knob 'stages' takes an integer"),
    ):
        monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", bad)
        with pytest.raises(ValueError, match=msg):
            gs.config()
    with pytest.raises(ValueError, match="gluon must be 0 or 1"):
        with tb.config_override(gluon=2):
            pass


def test_not_used_off_the_gpu():
    case = make_case(1, lens_q=[5], lens_kv=[9], hq=4, hkv=2, dqk=128, page_size=16, dtype=torch.float16)
    batch = direct_batch(case)
    assert gs.unavailable_reason(batch) == "not a CUDA device"
    assert not tb.use_gluon(batch, 1)


@pytest.mark.parametrize(
    "dims, served",
    [((64, 64), True), ((128, 128), True), ((192, 128), True), ((96, 96), False), ((256, 256), False)],
)
def test_head_dims_served(dims, served):
    case = make_case(1, lens_q=[5], lens_kv=[9], hq=4, hkv=2, dqk=dims[0], dvo=dims[1], dtype=torch.float16)
    why = gs.unavailable_reason(direct_batch(case))
    assert why == "not a CUDA device" if served else "head dims" in why


def test_config_picks_wide_tiles_by_shape(monkeypatch):
    """128 x 128 tiles on two consumers (``WIDE``) exactly where they measured faster: D = 128 with
    TMA-eligible K/V, and non-causal, pages of >= 64 tokens or max_kv >= 4 * max_q; items off the
    work counter except for max_q <= 1024 and chunked prefill (max_kv >= 4 * max_q); an explicit
    PAGEDPREFILL_GLUON_CONFIG replaces the choice."""
    monkeypatch.delenv("PAGEDPREFILL_GLUON_CONFIG", raising=False)
    assert gs.DEFAULT.dynamic == 1
    static = dataclasses.replace(gs.DEFAULT, dynamic=0)
    wide = dataclasses.replace(static, **gs.WIDE)

    def cfg(**kw):
        base = dict(lens_q=[5, 7], lens_kv=[9, 20], hq=8, hkv=2, dqk=128, page_size=16, dtype=torch.float16)
        return gs.config(direct_batch(make_case(1, **{**base, **kw})))

    assert cfg() == static  # causal, pages of 16, max_kv = 20 < 4 * 7, max_q <= 1024
    assert cfg(causal=False) == wide
    assert cfg(page_size=64) == wide
    assert cfg(page_size=0, causal=False) == wide
    assert cfg(max_q=7, max_kv=28) == wide and cfg(max_q=8, max_kv=31) == static
    assert cfg(max_q=2048, max_kv=8191) == gs.DEFAULT and cfg(max_q=2048, max_kv=8192) == wide
    assert cfg(max_q=1025, max_kv=2048, dqk=64) == gs.DEFAULT and cfg(max_q=1024, max_kv=1024) == static
    assert cfg(max_q=2048, max_kv=2048, causal=False) == dataclasses.replace(gs.DEFAULT, **gs.WIDE)
    assert cfg(causal=False, dqk=64) == static and cfg(causal=False, page_size=8) == static
    assert cfg(causal=False, dqk=192, dvo=128) == static
    assert gs.config() == gs.DEFAULT
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", "chunk=2")
    assert cfg(causal=False) == dataclasses.replace(gs.DEFAULT, chunk=2)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", "+chunk=2")  # on top of the choice
    assert cfg(causal=False) == dataclasses.replace(gs.DEFAULT, **gs.WIDE, dynamic=0, chunk=2)
    assert cfg() == dataclasses.replace(static, chunk=2)
    assert gs.config() == dataclasses.replace(gs.DEFAULT, chunk=2)


def test_stages_fit_shared_memory():
    """Q and the K/V ring fit sm_90's 227 KB: 5 stages at D 128, 3 at Dqk 192 / Dvo 128."""
    cfg = gs.DEFAULT
    for (dqk, dvo), want in (((128, 128), 5), ((64, 64), 5), ((192, 128), 3)):
        case = make_case(1, lens_q=[5], lens_kv=[9], hq=4, hkv=2, dqk=dqk, dvo=dvo, dtype=torch.bfloat16)
        batch = direct_batch(case)
        n = gs.stages(batch, cfg)
        assert n == want
        assert 2 * (cfg.BLOCK_M * dqk + n * cfg.BLOCK_N * (dqk + dvo)) <= gs.SMEM_BYTES


def test_v_ring_gives_k_a_stage_where_it_fits():
    """v_ring: V keeps stages() slots, K one more where Q and both rings fit (D 128 6 / 5, Dqk 192
    4 / 3, WIDE 3 / 3, o_buf at D 128 4 / 4); without it one ring of stages() slots."""
    on = dataclasses.replace(gs.DEFAULT, v_ring=1)
    wide = dataclasses.replace(on, **gs.WIDE)
    for (dqk, dvo), cfg, want in (
        ((128, 128), on, (6, 5)),
        ((192, 128), on, (4, 3)),
        ((64, 64), on, (6, 5)),
        ((128, 128), wide, (3, 3)),
        ((128, 128), dataclasses.replace(on, o_buf=1), (4, 4)),
        ((128, 128), gs.DEFAULT, (5, 5)),
        ((192, 128), gs.DEFAULT, (3, 3)),
    ):
        case = make_case(1, lens_q=[5], lens_kv=[9], hq=4, hkv=2, dqk=dqk, dvo=dvo, dtype=torch.bfloat16)
        batch = direct_batch(case)
        k, v = gs.ring_stages(batch, cfg)
        assert (k, v) == want, (dqk, cfg)
        q_bytes = cfg.BLOCK_M * (dqk + (dvo if cfg.o_buf else 0))
        assert 2 * (q_bytes + cfg.BLOCK_N * (k * dqk + v * dvo)) <= gs.SMEM_BYTES


def test_o_buf_takes_room_from_the_ring_and_needs_staging():
    """o_buf: O's own buffers (BLOCK_M x Dvo) come out of the K/V ring (D 128: 5 -> 4 stages, D 64
    keeps 5); O_STAGE 2 only where staging applies at all (out in q's dtype, Dqk = Dvo)."""
    on = dataclasses.replace(gs.DEFAULT, o_buf=1)
    for d, want in ((128, 4), (64, 5)):
        case = make_case(1, lens_q=[5], lens_kv=[9], hq=4, hkv=2, dqk=d, dvo=d, dtype=torch.bfloat16)
        batch = direct_batch(case)
        modes = gs.o_stage_mode(batch, on), gs.o_stage_mode(batch, gs.DEFAULT)
        assert (gs.stages(batch, on), *modes) == (want, 2, 1)
        assert 2 * (on.BLOCK_M * 2 * d + want * on.BLOCK_N * 2 * d) <= gs.SMEM_BYTES
    case = make_case(1, lens_q=[5], lens_kv=[9], hq=4, hkv=2, dqk=192, dvo=128, dtype=torch.bfloat16)
    assert gs.o_stage_mode(direct_batch(case), dataclasses.replace(on, dqk192=0)) == 0
    assert gs.o_stage_mode(direct_batch(case), on) == 2  # (Dqk 192 stages O with knob dqk192)
    assert gs.o_stage_mode(direct_batch(case), dataclasses.replace(on, q_tma=0)) == 0  # (and Q by TMA)
    case = make_case(1, lens_q=[5], lens_kv=[9], hq=6, hkv=2, dqk=192, dvo=128, dtype=torch.bfloat16)
    assert gs.o_stage_mode(direct_batch(case), on) == 0  # G = 3: no Q by TMA, so no staging either
    case = make_case(1, lens_q=[5], lens_kv=[9], hq=4, hkv=2, dqk=128, dtype=torch.bfloat16, with_out=True)
    case.kwargs["out"] = torch.empty_like(case.kwargs["out"], dtype=torch.float32)
    assert gs.o_stage_mode(direct_batch(case), on) == 0  # out in another dtype: the direct store


def test_tma_plan_mla_boxes_key_columns_in_two_parts():
    """Dqk 192: K's 2-D view spans all 192 columns of every head, boxed as 128 + 64 columns."""
    for layout in ("nhd", "hnd"):
        case = make_case(
            2,
            lens_q=[3],
            lens_kv=[70],
            hq=4,
            hkv=2,
            dqk=192,
            dvo=128,
            page_size=16,
            kv_layout=layout,
            dtype=torch.bfloat16,
        )
        box, (k0, _, k_head_off, k_rows), (v0, *_), k1 = gs._tma_plan(direct_batch(case), gs.DEFAULT)
        assert list(k0.block_shape) == [box, 128] and list(k1.block_shape) == [box, 64]
        assert list(v0.block_shape) == [box, 128]
        assert (k1.shape, k1.strides) == (k0.shape, k0.strides)
        last_col = (0 if k_rows else (case.kwargs["k_cache"].shape[1] - 1) * k_head_off) + 192
        assert last_col <= k0.shape[1]


def test_runs_gluon_follows_the_split_choice(monkeypatch):
    """runs_gluon (asked by backend="auto") answers as run() decides: a call that run() would split
    over KV takes the Triton kernel, whatever the Gluon kernel could serve."""
    monkeypatch.setattr(tb, "INTERPRETED", False)
    monkeypatch.setattr(gs, "unavailable_reason", lambda batch: None)
    short = make_case(1, lens_q=[4], lens_kv=[4000], hq=8, hkv=2, dqk=64, page_size=16, dtype=torch.float16)
    wide = make_case(
        1, lens_q=[900] * 8, lens_kv=[900] * 8, hq=8, hkv=2, dqk=64, page_size=16, dtype=torch.float16
    )
    for case, splits_expected in ((short, True), (wide, False)):
        batch = direct_batch(case)
        split = tb.choose_splits(batch, tb.choose_config(batch)) > 1
        assert split == splits_expected
        assert tb.runs_gluon(batch) == (not split)


def test_strides_cp_async_cannot_prove_are_refused():
    """A stride of 8 (mod 16) elements is 16-byte aligned, but Triton can only prove 2 bytes: refused."""
    for name in ("q", "k_cache", "v_cache"):  # (q: its rows are cp.async copies too)
        case = make_case(1, lens_q=[5], lens_kv=[9], hq=4, hkv=2, dqk=128, page_size=0, dtype=torch.float16)
        assert gs.unavailable_reason(direct_batch(case)) in (None, "not a CUDA device")
        t = case.kwargs[name]
        wide = torch.zeros(t.shape[0], t.shape[1], 136, dtype=t.dtype)[:, :, :128]  # head stride 136
        wide.copy_(t)
        case.kwargs[name] = wide
        why = gs.unavailable_reason(direct_batch(case))
        assert "multiples of 16" in why and why.startswith(name[0]), why


def test_diagnostic_skip_warns():
    case = make_case(1, lens_q=[5], lens_kv=[9], hq=4, hkv=2, dqk=128, page_size=16, dtype=torch.float16)
    batch = direct_batch(case)
    gs.DIAGNOSTIC_SKIP = 1
    try:
        with pytest.warns(RuntimeWarning, match="results are wrong"):
            gs.launch_plan(batch)
    finally:
        gs.DIAGNOSTIC_SKIP = 0


_AOT = textwrap.dedent(
    """
    import re, subprocess, sys
    sys.path.insert(0, {tests!r})
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature
    from oracle import make_case
    from pagedprefill.backends import gluon_sm90 as gs
    from test_triton_backend import direct_batch

    target = GPUTarget("cuda", 90, 128)
    backend = make_backend(target)
    ptxas = triton.knobs.nvidia.ptxas.path
    for d, page, causal, dt, *dvo in {specs!r}:
        case = make_case(0, lens_q=[5, 7], lens_kv=[9, 30], hq=8, hkv=2, dqk=d, dvo=(dvo or [d])[0],
                         page_size=page, dtype=getattr(torch, dt), causal=causal)
        for kernel, grid, args, kwargs in gs.launch_plan(direct_batch(case)):
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            bound, sp, opts = binder(*args, **kwargs)
            options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, sp, opts)
            c = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                               options=options.__dict__)
            ptx = c.asm["ptx"]
            with open("/tmp/_pp_gluon.ptx", "w") as f:
                f.write(ptx)
            cmd = [ptxas, "-v", "--gpu-name", "sm_90a", "/tmp/_pp_gluon.ptx", "-o", "/dev/null"]
            log = subprocess.run(cmd, capture_output=True, text=True).stderr
            spill = max([int(x) for x in re.findall(r"(\\d+) bytes spill stores", log)] or [0])
            overlap = "wgmma.wait_group.sync.aligned 1" in ptx
            regs = sorted(set(re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)))
            bulk = ptx.count("cp.async.bulk.tensor")
            stsm = ptx.count("stmatrix")
            # o_stage with q_tma: O read back from the slot, a proxy fence, then the q_empty arrive
            handback = len(re.findall(
                r"ld\\.shared\\.v4(?:(?!st\\.global|stmatrix|wgmma)[\\s\\S])*?fence\\.proxy\\.async"
                r"(?:(?!st\\.global|ld\\.shared|wgmma)[\\s\\S])*?mbarrier\\.arrive", ptx))
            print("RESULT", d, page, c.metadata.shared, spill, overlap, ",".join(regs), bulk, stsm, handback,
                  flush=True)
    """
)


WIDE = "," + ",".join(f"{k}={v}" for k, v in gs.WIDE.items())  # 128 x 128 tiles, 2 consumers


@pytest.mark.parametrize(
    "tma, knobs",
    [
        (0, ""),
        (1, ""),
        (0, ",own_rows=1"),
        (1, ",own_rows=1"),
        (1, WIDE),
        (1, ",q_tma=0,o_stage=0"),  # the epilogue and Q copies before o_stage / q_tma
        (1, ",o_stage=0"),
        (0, ",q_tma=0"),  # O staged through a Q slot the consumers refill themselves
        (1, ",dqk192=0"),  # Dqk 192: Q by the consumers' cp.async, O stored directly
        (1, ",o_buf=1,pingpong=1"),  # O staged through its own buffer; GEMMs issued in turn
        (0, ",pingpong=1,own_rows=0"),
        (1, ",tile_fence=0"),  # no proxy fence after TMA tiles
        (1, ",v_ring=1"),  # V in a ring of its own (K released after its QK GEMM)
        (0, ",v_ring=1,own_rows=1"),
        (1, WIDE + ",v_ring=1,tile_fence=0"),
    ],
)
def test_compiles_for_sm90(tmp_path, tma, knobs):
    specs = [
        (128, 16, True, "bfloat16"),
        (128, 0, False, "float16"),
        (64, 1 if not tma else 32, True, "bfloat16"),
        (192, 0 if tma else 1, True, "bfloat16", 128),  # Dqk 192 / Dvo 128: K in 128 + 64 columns
    ]
    script = _AOT.format(tests=str(ROOT / "tests"), specs=specs)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PAGEDPREFILL_GLUON_CONFIG"] = f"tma={tma}{knobs}"
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    results = [line.split() for line in res.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == len(specs), res.stdout
    knob_values = dict(kv.split("=") for kv in knobs.split(",") if kv)
    cfg = dataclasses.replace(gs.DEFAULT, **{k: int(v) for k, v in knob_values.items()})
    for _, d, page, shared, spill, overlap, regs, bulk, stsm, handback in results:
        # TMA copies exactly when asked for: K/V tiles (tma), Q (q_tma: Dqk 64 / 128, G = 4 here)
        staged = d != "192" or bool(cfg.dqk192)  # (Dqk 192 only with knob dqk192)
        assert (int(bulk) > 0) == bool(tma or (cfg.q_tma and staged)), (d, page, bulk)
        # O staged through the Q slots (stmatrix) exactly with o_stage and Dqk = Dvo (or dqk192 with
        # q_tma); with q_tma each consumer hands its slot back after reading O and a proxy fence
        staged = staged and (d != "192" or bool(cfg.q_tma))
        assert (int(stsm) > 0) == bool(cfg.o_stage and staged), (d, page, stsm)
        handing_back = cfg.o_stage and cfg.q_tma and staged and not cfg.o_buf
        assert int(handback) == (cfg.consumers if handing_back else 0), handback
        assert int(shared) <= 227 * 1024, (d, page, shared)
        # the load warps (56 registers) spill hoisted gather addresses on their cp.async path; the
        # consumers do not spill in the key loop (checked in the SASS by hand: docs/triton_kernel.md;
        # o_stage without q_tma: 384 bytes around each item's start, 404 with own_rows, none in the loop)
        assert int(spill) <= (416 if cfg.o_stage and not cfg.q_tma else 256), (d, page, spill)
        assert overlap == "True", "no wgmma group left in flight across the softmax"
        assert str(cfg.consumer_regs) in regs.split(",") and str(cfg.load_regs) in regs.split(","), regs


@pytest.mark.parametrize("layout", ["nhd", "hnd", "interleaved"])
@pytest.mark.parametrize("page_size", [16, 64, 0])
def test_tma_view_addresses_every_key_row(layout, page_size):
    """The 2-D TMA view's (row, column) of every (page, head, slot) is that key row's address."""
    case = make_case(
        2,
        lens_q=[3],
        lens_kv=[150],
        hq=8,
        hkv=4,
        dqk=64,
        page_size=page_size,
        kv_layout=layout,
        dtype=torch.bfloat16,
    )
    batch = direct_batch(case)
    cfg = gs.Config(tma=1)
    plan = gs._tma_plan(batch, cfg)
    if page_size == 0 and layout != "nhd":
        pytest.skip("ragged caches have one layout")
    assert plan is not None
    box = plan[0]
    assert box == (min(page_size, cfg.BLOCK_N) if page_size else cfg.BLOCK_N)
    for t, (desc, page_rows, head_off, head_rows) in zip((batch.k, batch.v), plan[1:]):
        rows, cols = desc.shape
        st = desc.strides[0]
        esz = t.element_size()
        slots = t.shape[2] if batch.paged else 1
        for page in range(t.shape[0]):
            for h in range(t.shape[1]):
                for slot in range(slots):
                    if batch.paged:
                        row, want = page * page_rows + slot, t[page, h, slot]
                    else:
                        row, want = page, t[page, h]
                    col = 0
                    if head_rows:
                        row += h * head_off
                    else:
                        col = h * head_off
                    assert 0 <= row < rows and col + batch.head_dim_qk <= cols
                    assert t.data_ptr() + (row * st + col) * esz == want.data_ptr()


def test_tma_plan_empty_ragged_cache_uses_cp_async():
    case = make_case(2, lens_q=[0, 4], lens_kv=[0, 0], hq=8, hkv=4, dqk=64, page_size=0, dtype=torch.bfloat16)
    batch = direct_batch(case)
    assert batch.k.shape[0] == 0
    assert gs._tma_plan(batch, gs.Config(tma=1)) is None


def test_tma_plan_refuses_small_pages_and_obeys_the_knob():
    case = make_case(2, lens_q=[3], lens_kv=[40], hq=8, hkv=4, dqk=64, page_size=8, dtype=torch.bfloat16)
    assert gs._tma_plan(direct_batch(case), gs.Config(tma=1)) is None
    case16 = make_case(2, lens_q=[3], lens_kv=[40], hq=8, hkv=4, dqk=64, page_size=16, dtype=torch.bfloat16)
    assert gs._tma_plan(direct_batch(case16), gs.DEFAULT) is not None  # on by default
    assert gs._tma_plan(direct_batch(case16), gs.Config(tma=0)) is None


def test_fast_launch_key_is_finer_than_tritons_with_descriptors(monkeypatch):
    """TMA mode's launches (tensor descriptors among the arguments) go through fast_launch: over
    randomly varied descriptors (shape, strides, base alignment) and runtime ints, one fast_launch
    key always means one Triton cache key (Triton's real binder, sm_90 target, no GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", "tma=1")
    backend = make_backend(GPUTarget("cuda", 90, 128))
    case = make_case(
        5, lens_q=[5, 9], lens_kv=[40, 70], hq=8, hkv=2, dqk=128, page_size=16, dtype=torch.float16
    )
    (kernel, _grid, args, kwargs), *_ = gs.launch_plan(direct_batch(case))
    assert kwargs["USE_TMA"] and any(type(a) is gs.TensorDescriptor for a in args)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    r = random.Random(0)
    ints = [0, 1, 2, 16, 17, 2**31 - 16, 2**31]
    buf = torch.zeros(1 << 16, dtype=torch.float16)
    seen: dict = {}
    for _ in range(400):
        new = []
        for a in args:
            if type(a) is int and r.random() < 0.3:
                a = r.choice(ints)
            elif type(a) is gs.TensorDescriptor and r.random() < 0.5:
                cols = r.choice([128, 256, 1024])
                rows = r.randint(1, (1 << 16) // cols)
                stride = cols + r.choice([0, 8, 64])
                rows = max(1, min(rows, ((1 << 16) - cols) // stride))
                if len(a.block_shape) == 3:  # q's view [tokens, heads, Dqk] (q_tma)
                    heads = r.choice([4, 8, 16])
                    cols = r.choice([64, 128])
                    stride = heads * cols + r.choice([0, 8, 64])
                    rows = r.randint(1, ((1 << 16) - heads * cols) // stride)
                    shape, strides = [rows, heads, cols], [stride, cols, 1]
                else:
                    shape, strides = [rows, cols], [stride, 1]
                a = gs.TensorDescriptor(buf, shape, strides, a.block_shape, a.layout)
            new.append(a)
        ours = (tb._kwargs_key(kwargs), tuple(tb._spec_of(a) for a in new))
        _bound, spec, options = binder(*new, **kwargs)
        theirs = compute_cache_key({}, spec, options)
        assert seen.setdefault(ours, theirs) == theirs
    assert len(seen) > 1


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


def gluon_params(seed: int, long: bool | None = None) -> dict:
    r = random.Random(seed)
    long_draw = r.random() < 0.3
    params = random_params(seed, (torch.bfloat16, torch.float16), long=long_draw if long is None else long)
    params["dqk"] = r.choice([64, 128, 128])
    params["page_size"] = r.choice([0, 1, 3, 8, 16, 16, 64])
    hq, hkv = r.choice([(4, 4), (8, 2), (12, 4), (16, 2), (32, 8), (6, 1)])
    params.update(hq=hq, hkv=hkv)
    return params


def check_forced(seed: int, params: dict, case=None) -> None:
    """A random case of ``params`` (or ``case``, built from them) run on the Gluon kernel (knob
    gluon=1, no split-KV), against the fp64 oracle."""
    case = make_case(seed, **params) if case is None else case
    assert gs.unavailable_reason(direct_batch(case)) is None
    out, lse = call(case, gluon=1, num_splits=1)
    check(case, out, lse, atol=atol_for(params["dtype"]), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(500, 540))
def test_gpu_random_grid_forced(seed, monkeypatch):
    """Forced onto the Gluon kernel; odd seeds shrink the persistent grid to 1-3 programs so that
    every program walks many work items (the ring's phases carried across items); the items are
    dealt in chunks of 0 (all), 1, 2, 3 or the default 4 (sequence, KV head) pairs, in static rounds
    or off the work counter."""
    if seed % 2:
        monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", f"chunk={seed % 5},dynamic={seed // 2 % 2}")
    check_forced(seed, gluon_params(seed))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(800, 816))
def test_gpu_random_grid_own_rows(seed, monkeypatch):
    """Knob own_rows=1 (each consumer walks and masks causal tiles by its own rows' diagonal and
    releases the rest unread): the forced grid's cases made causal, on 1-3-program grids."""
    monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", "own_rows=1")
    params = gluon_params(seed)
    params.update(causal=True)
    check_forced(seed, params)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "group, dqk, knobs",
    [
        (3, 128, ""),
        (4, 128, ",consumers=2,consumer_regs=216"),
        (6, 128, ",stages=2"),
        (4, 128, ",BLOCK_N=32"),
        (4, 128, ",BLOCK_N=128,stages=2"),
        (4, 192, ""),
    ],
)
def test_gpu_own_rows_tile_boundaries(group, dqk, knobs, monkeypatch):
    """own_rows=1 where consumers' own ranges end one key either side of tile boundaries (lengths
    picked so that an off-by-one in a consumer's tile count or unmasked range changes the output),
    with 2 or 3 consumers, 2-stage rings, 32/64/128-key tiles and Dqk 192."""
    monkeypatch.setattr(gs, "_num_sms", lambda device: 2)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", "own_rows=1" + knobs)
    check_boundaries(51, [40, 41, 150, 90], [65, 84, 100, 2000], group, dqk, torch.float16)


def check_boundaries(seed: int, lens_q: list, lens_kv: list, group: int, dqk: int, dtype) -> None:
    """A causal case on pages of 16 whose lengths put the consumers' own key ranges one key either
    side of tile boundaries, forced onto the Gluon kernel, against the oracle."""
    case = make_case(
        seed,
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=2 * group,
        hkv=2,
        dqk=dqk,
        dvo=128,
        page_size=16,
        dtype=dtype,
        causal=True,
        return_lse=True,
        device="cuda",
    )
    assert gs.unavailable_reason(direct_batch(case)) is None
    out, lse = call(case, gluon=1, num_splits=1)
    check(case, out, lse, atol=atol_for(dtype), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(900, 918))
def test_gpu_random_grid_wide_tiles(seed, monkeypatch):
    """128 x 128 tiles on 2 consumers (``gs.WIDE``, 3-stage ring): the forced grid's cases on
    1-3-program grids, so that the ring's phases carry across many work items, some of them empty."""
    monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", WIDE[1:])
    params = gluon_params(seed)
    check_forced(seed, params)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1000, 1012))
def test_gpu_random_grid_large_scores(seed, monkeypatch):
    """Softmax scales up to 2.0 (scores of std ~11-22 at D 128), so that later key tiles often raise
    a row's running max and O's rescale (issued beside the next QK GEMM) carries real weight: the
    forced grid's cases on 1-3-program grids, with 64-key, WIDE and 32-key tiles."""
    monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", ("chunk=4", WIDE[1:], "BLOCK_N=32")[seed % 3])
    params = gluon_params(seed)
    params["scale"] = (None, 0.3, 1.0, 2.0)[seed % 4]
    check_forced(seed, params)


def test_q_tma_descriptor_only_where_its_boxes_fit():
    """Knob q_tma: a 3-D view [tokens, heads, Dqk] of q with boxes of [64 / G, G, 64] (a 64-row
    slot's 64-column tile) for Dqk 64 / 128 and GQA groups dividing 64; None elsewhere."""
    on = gs.DEFAULT
    assert on.q_tma == 1

    def desc(cfg=on, **kw):
        base = dict(lens_q=[5, 7], lens_kv=[9, 20], hq=8, hkv=2, dqk=128, page_size=16, dtype=torch.float16)
        case = make_case(1, **{**base, **kw})
        return gs._q_tma_desc(direct_batch(case), cfg), case

    d, case = desc()
    q = case.kwargs["q"]
    assert (
        d.block_shape == [16, 4, 64]
        and list(d.shape) == list(q.shape)
        and list(d.strides) == list(q.stride())
    )
    assert desc(hq=8, hkv=8, dqk=64)[0].block_shape == [64, 1, 64]
    assert desc(hq=16, hkv=2)[0].block_shape == [8, 8, 64]
    assert desc(cfg=dataclasses.replace(gs.DEFAULT, q_tma=0))[0] is None  # knob off
    assert desc(hq=6, hkv=2)[0] is None  # G = 3 does not divide 64
    assert desc(cfg=dataclasses.replace(on, dqk192=0), dqk=192, dvo=128)[0] is None  # knob off
    assert desc(dqk=192, dvo=128)[0].block_shape == [16, 4, 64]  # two column parts (knob dqk192)
    assert desc(lens_q=[0, 0])[0] is None  # no query tokens: a TMA view needs a positive extent


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1200, 1216))
def test_gpu_random_grid_q_tma(seed, monkeypatch):
    """Knob q_tma=1 (the load warps copy each item's Q by TMA once the consumers are past the last
    item's last QK GEMM): the forced grid's cases (G = 1, 3, 4, 6, 8; groups 3 and 6 keep the
    consumers' cp.async) on 1-3-program grids, static rounds or the work counter, 64-key or WIDE
    tiles, so that Q slots are refilled across many items, some empty."""
    monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    tiles = ("", WIDE)[seed // 3 % 2]
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", f"q_tma=1,dynamic={seed % 2}{tiles}")
    check_forced(seed, gluon_params(seed))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1300, 1316))
def test_gpu_random_grid_o_stage(seed, monkeypatch):
    """Knob o_stage=1 (the epilogue stages O through the warpgroup's Q slot): the forced grid's cases
    on 1-3-program grids; even seeds with q_tma on a GQA group dividing 64 (the slot handed back to
    the load warps only after O is read back), odd seeds with the consumers' own Q copies; static
    rounds or the work counter, 64-key or WIDE tiles, own_rows on a quarter (causal); out in fp32 on
    two seeds (no staging: the direct store)."""
    monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    q_tma, own_rows, fp32_out = seed % 2 == 0, seed % 4 == 3, seed % 8 == 6
    tiles = ("", WIDE)[seed // 4 % 2]
    knobs = f"o_stage=1,q_tma={int(q_tma)},dynamic={seed // 2 % 2},own_rows={int(own_rows)}{tiles}"
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", knobs)
    params = gluon_params(seed)
    if q_tma:
        params.update(zip(("hq", "hkv"), random.Random(seed).choice([(4, 4), (8, 2), (16, 2), (32, 8)])))
    if own_rows:
        params.update(causal=True)
    if fp32_out:
        params.update(with_out=True)
    case = make_case(seed, **params)
    if fp32_out:
        case.kwargs["out"] = poison(torch.empty_like(case.kwargs["out"], dtype=torch.float32))
    batch = direct_batch(case)
    kwargs = gs.launch_plan(batch)[0][3]
    assert kwargs["O_STAGE"] == (not fp32_out)
    assert kwargs["Q_TMA"] == (q_tma and batch.q.shape[0] > 0), (q_tma, batch.group_size)
    check_forced(seed, params, case)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1500, 1516))
def test_gpu_random_grid_pingpong_o_buf(seed, monkeypatch):
    """Knobs pingpong (the consumers take turns issuing each tile's GEMMs; with own_rows one takes
    an empty turn for each tile it releases unread) and o_buf (O staged through a buffer of each
    consumer's own, Q handed back after the last QK GEMM): all four combinations, own_rows on and
    off, 64-key or WIDE tiles, Q by TMA, on 1-3-program grids, both schedules; with own_rows the
    cases are causal with long sequences (many tiles released unread: empty turns)."""
    monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    pingpong, o_buf, own_rows = seed % 2, seed // 2 % 2, seed // 4 % 2
    tiles = ("", WIDE)[seed // 8 % 2]
    knobs = f"pingpong={pingpong},o_buf={o_buf},own_rows={own_rows},dynamic={seed // 3 % 2}{tiles}"
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", knobs)
    r = random.Random(seed)
    params = gluon_params(seed, long=True if own_rows else None)
    params.update(zip(("hq", "hkv"), r.choice([(4, 4), (8, 2), (16, 2), (32, 8)])))
    params.update(causal=bool(own_rows) or r.random() < 0.8)
    case = make_case(seed, **params)
    batch = direct_batch(case)
    kwargs = gs.launch_plan(batch)[0][3]
    assert kwargs["PINGPONG"] == bool(pingpong) and kwargs["O_STAGE"] == 1 + o_buf
    assert kwargs["Q_TMA"] == (batch.q.shape[0] > 0)
    check_forced(seed, params, case)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1100, 1110))
def test_gpu_random_grid_dynamic(seed, monkeypatch):
    """Knob dynamic=1 (items off the call's work counter): the forced grid's cases on 1-3-program
    grids (each program takes many items, the ring of item ids wraps), with 64-key and WIDE tiles
    and chunks of 1-4 pairs; then the same call again on the same workspace, its out / lse poisoned
    again: the counter must start from zero at every call."""
    monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    tiles = ("", WIDE)[seed % 2]
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", f"dynamic=1,chunk={1 + seed % 4}{tiles}")
    params = gluon_params(seed)
    case = make_case(seed, **params)
    assert gs.unavailable_reason(direct_batch(case)) is None
    for _ in range(2):  # (the first call is check_forced's; the second reuses the workspace)
        for name in ("out", "lse"):
            if isinstance(case.kwargs.get(name), torch.Tensor):
                case.kwargs[name].fill_(float("nan"))
        out, lse = call(case, gluon=1, num_splits=1)
        check(case, out, lse, atol=atol_for(params["dtype"]), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, dynamic", [(True, 0), (False, 0), (True, 1), (False, 1)])
def test_gpu_chunked_dealing_short_last_chunk(causal, dynamic, monkeypatch):
    """Many row blocks per (sequence, KV head) pair, 6 pairs dealt in chunks of 4 (the last one
    short) on a 3-program grid, in static rounds or off the work counter: every item is computed
    once, whatever order it comes in."""
    monkeypatch.setattr(gs, "_num_sms", lambda device: 3)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", f"chunk=4,dynamic={dynamic}")
    case = make_case(
        41,
        lens_q=[700, 300, 520],
        lens_kv=[900, 300, 1000],
        hq=12,
        hkv=2,
        dqk=128,
        page_size=16,
        dtype=torch.bfloat16,
        causal=causal,
        return_lse=True,
        device="cuda",
    )
    batch = direct_batch(case)
    assert gs.unavailable_reason(batch) is None and gs.num_m_blocks(batch, gs.config()) > 4
    out, lse = call(case, gluon=1, num_splits=1)
    check(case, out, lse, atol=atol_for(torch.bfloat16), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(700, 724))
def test_gpu_random_grid_tma(seed, monkeypatch):
    """TMA copies for whole tiles: pages of 16/32/64 tokens and ragged K/V, every layout; even seeds
    on a 2-program persistent grid, odd seeds with one program per work item."""
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", "tma=1" if seed % 2 == 0 else "tma=1,persistent=0")
    monkeypatch.setattr(gs, "_num_sms", lambda device: 2)
    params = gluon_params(seed)
    params["page_size"] = random.Random(seed).choice([0, 16, 32, 64])
    case = make_case(seed, **params)
    batch = direct_batch(case)
    assert gs._tma_plan(batch, gs.config()) is not None or batch.k.shape[0] == 0  # empty ragged cache
    out, lse = call(case, gluon=1, num_splits=1)
    check(case, out, lse, atol=atol_for(params["dtype"]), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1600, 1612))
def test_gpu_random_grid_tile_fence_off(seed, monkeypatch):
    """Knob tile_fence=0 (the consumers fence the async proxy only after tiles gathered by cp.async,
    not after TMA tiles): TMA-eligible caches (pages of 16/32/64 tokens, ragged) where each
    sequence's last tile is gathered, on the shape rule's tiles, 1-3-program grids, Dqk 64 / 128 /
    192."""
    monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", "+tile_fence=0")
    r = random.Random(seed)
    params = gluon_params(seed)
    params["page_size"] = r.choice([0, 16, 32, 64])
    if seed % 4 == 3:
        params.update(dqk=192, dvo=128)
        if params["kv_layout"] == "interleaved":  # (one K/V buffer needs Dqk = Dvo)
            params["kv_layout"] = r.choice(["nhd", "hnd"])
    case = make_case(seed, **params)
    kwargs = gs.launch_plan(direct_batch(case))[0][3]
    assert kwargs["TILE_FENCE"] == (not kwargs["USE_TMA"])
    check_forced(seed, params, case)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1700, 1720))
def test_gpu_random_grid_v_ring(seed, monkeypatch):
    """Knob v_ring=1 (V in a ring of its own; a K stage released after its QK GEMM): on the shape
    rule's tiles (64-key or WIDE), half the cases with long sequences (many tiles, both rings wrap
    across items), pages of 0/1/3/16/64 (gather and TMA; a gathered last tile), Dqk 64 / 128 / 192,
    1-3-program grids, both schedules; every fourth seed with ping-pong, every fifth without
    own_rows, every third with tile_fence=0. The launch's rings are asserted."""
    monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    knobs = f"+v_ring=1,dynamic={seed // 2 % 2}"
    knobs += ",pingpong=1" if seed % 4 == 0 else ""
    knobs += ",own_rows=0" if seed % 5 == 0 else ""
    knobs += ",tile_fence=0" if seed % 3 == 0 else ""
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", knobs)
    r = random.Random(seed)
    params = gluon_params(seed, long=seed % 2 == 1)
    params["page_size"] = r.choice([0, 1, 3, 16, 16, 64])
    if seed % 4 == 3:
        params.update(dqk=192, dvo=128)
        if params["kv_layout"] == "interleaved":  # (one K/V buffer needs Dqk = Dvo)
            params["kv_layout"] = r.choice(["nhd", "hnd"])
    case = make_case(seed, **params)
    batch = direct_batch(case)
    kwargs = gs.launch_plan(batch)[0][3] if batch.max_q else {"V_RING": True}
    assert kwargs["V_RING"]
    if batch.max_q:
        assert (kwargs["STAGES"], kwargs["V_STAGES"]) == gs.ring_stages(batch, gs.config(batch))
    check_forced(seed, params, case)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "group, dqk, knobs", [(4, 128, ""), (4, 192, ""), (4, 128, WIDE), (3, 128, ",stages=2")]
)
def test_gpu_v_ring_tile_boundaries(group, dqk, knobs, monkeypatch):
    """v_ring=1 with own_rows where consumers' ranges end one key either side of tile boundaries, on
    a 2-program grid (the rings' phases carried across items): 64-key tiles (6 K / 5 V stages at
    D 128, 4 / 3 at Dqk 192), WIDE tiles (3 / 3), and 2-stage rings."""
    monkeypatch.setattr(gs, "_num_sms", lambda device: 2)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", "v_ring=1" + knobs)
    check_boundaries(52, [40, 41, 150, 90, 700], [65, 84, 100, 2000, 1300], group, dqk, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(760, 776))
def test_gpu_random_grid_mla(seed, monkeypatch):
    """Dqk 192 / Dvo 128 forced onto the Gluon kernel (knob gluon=1): K in 128 + 64 columns, 3
    stages; TMA for pages of 16/64 and ragged K/V, the gather for page size 1; odd seeds on a
    2-program persistent grid."""
    if seed % 2:
        monkeypatch.setattr(gs, "_num_sms", lambda device: 2)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", f"+dqk192={seed // 2 % 2}")  # (Q copies, O stores)
    params = gluon_params(seed)
    params.update(dqk=192, dvo=128, page_size=random.Random(seed).choice([0, 1, 16, 64]))
    if params["kv_layout"] == "interleaved":  # (one K/V buffer needs Dqk = Dvo)
        params["kv_layout"] = random.Random(seed + 1).choice(["nhd", "hnd"])  # (apart from page_size)
    check_forced(seed, params)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1400, 1412))
def test_gpu_random_grid_mla_staged(seed, monkeypatch):
    """Knob dqk192=1: Dqk 192 / Dvo 128 with Q copied by TMA in 128 + 64 columns (GQA groups dividing
    64) and O staged through the first part of the Q slot; 1-3-program grids, both schedules."""
    monkeypatch.setattr(gs, "_num_sms", lambda device, n=1 + seed % 3: n)
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", f"dqk192=1,dynamic={seed % 2}")
    r = random.Random(seed)
    params = gluon_params(seed)
    params.update(dqk=192, dvo=128, page_size=r.choice([0, 1, 16, 64]), with_out=True)
    params.update(zip(("hq", "hkv"), r.choice([(4, 4), (8, 2), (16, 2), (32, 8)])))
    if params["kv_layout"] == "interleaved":  # (one K/V buffer needs Dqk = Dvo)
        params["kv_layout"] = r.choice(["nhd", "hnd"])
    case = make_case(seed, **params)
    batch = direct_batch(case)
    kwargs = gs.launch_plan(batch)[0][3]
    assert bool(kwargs["O_STAGE"]) == kwargs["Q_TMA"] == (batch.q.shape[0] > 0)
    check_forced(seed, params, case)


@pytest.mark.gpu
def test_gpu_default_routing():
    """Every call the Gluon kernel can serve goes to it (measured faster than the Triton kernel on
    every shape tried), unless split-KV is chosen or the knob gluon=0 is set; backend="auto" sends
    long prefills (causal Dqk 192 too) and D = 64 to the Triton backend, a short D = 128 prefill to
    cuDNN."""

    def case(dqk=128, page_size=16, lens_q=(30,), lens_kv=(90,), dvo=None):
        return make_case(
            3,
            lens_q=list(lens_q),
            lens_kv=list(lens_kv),
            hq=8,
            hkv=2,
            dqk=dqk,
            dvo=dvo,
            page_size=page_size,
            dtype=torch.bfloat16,
            device="cuda",
        )

    for c in (case(), case(page_size=1), case(page_size=8), case(page_size=0), case(dqk=64)):
        assert tb.use_gluon(direct_batch(c), 1)
    assert not tb.use_gluon(direct_batch(case()), 2)  # split-KV: the Triton kernel merges splits
    assert not tb.use_gluon(direct_batch(case(dqk=96)), 1)
    assert tb.use_gluon(direct_batch(case(dqk=192, dvo=128, page_size=4)), 1)
    with tb.config_override(gluon=0):
        assert not tb.use_gluon(direct_batch(case()), 1)

    for c, expect in (
        (case(lens_q=(4096,), lens_kv=(4096,)), "triton"),
        (case(dqk=64), "triton"),
        (case(dqk=192, dvo=128, lens_q=(600,), lens_kv=(700,)), "triton"),  # causal MLA, >= 512 tokens
        (case(), "cudnn"),
    ):
        out, _ = pagedprefill.cudnn_batch_prefill_with_kv_cache(**c.kwargs, backend="auto")
        assert pagedprefill.last_backend() == expect
        check_sampled(c, out, None, atol=atol_for(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, dynamic", [(16, 0), (0, 0), (1, 0), (16, 1), (0, 1)])
def test_gpu_cuda_graph_replay_forced(page_size, dynamic, monkeypatch):
    from test_triton_backend import _graph_case

    monkeypatch.setattr(gs, "_num_sms", lambda device: 3)  # programs walk several work items
    monkeypatch.setenv("PAGEDPREFILL_GLUON_CONFIG", f"dynamic={dynamic}")  # (1: counter zeroed per replay)

    r = random.Random(page_size)
    bsz, max_q, max_kv, dtype = 4, 200, 700, torch.bfloat16

    def new_case(seed):
        return _graph_case(
            seed,
            [r.randint(0, max_q) for _ in range(bsz)],
            [r.randint(0, max_kv) for _ in range(bsz)],
            max_q,
            max_kv,
            page_size,
            dtype,
            16,
            4,
        )

    base = new_case(600)
    static = {k: v for k, v in base.kwargs.items() if isinstance(v, torch.Tensor)}
    with tb.config_override(gluon=1, num_splits=1):
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**base.kwargs, backend="triton")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**base.kwargs, backend="triton")
    for i in range(4):
        new = new_case(601 + i)
        for name, t in static.items():
            if name in ("out", "lse"):
                t.fill_(float("nan"))
            elif name != "workspace_buffer":
                t.copy_(new.kwargs[name])
        graph.replay()
        torch.cuda.synchronize()
        check(new, out, lse, atol=atol_for(dtype), lse_atol=2e-2)


@pytest.mark.gpu
def test_gpu_misaligned_cache_falls_back():
    """cp.async needs 16-byte rows: a K/V view at an odd element offset takes the Triton kernel."""
    case = make_case(
        7, lens_q=[33], lens_kv=[70], hq=8, hkv=2, dqk=128, page_size=0, dtype=torch.float16, device="cuda"
    )
    k = case.kwargs["k_cache"]
    shifted = torch.empty(k.numel() + 1, dtype=k.dtype, device="cuda")[1:].view(k.shape)
    shifted.copy_(k)
    case.kwargs["k_cache"] = shifted
    assert gs.unavailable_reason(direct_batch(case)) is not None
    out, lse = call(case, gluon=1)
    check(case, out, lse, atol=atol_for(torch.float16), lse_atol=2e-2)
