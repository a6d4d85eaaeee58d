"""The Hopper kernel (``pagedprefill.backends.triton.hopper``), reached through ``backend="triton"``.

CPU: its configuration, routing, TMA views, and an sm_90 compile (shared memory, spills, and the PTX
features the design relies on). GPU (H200): the kernel forced on for a random grid against the
float64 oracle (small persistent grids, so each program walks many work items), tile boundaries,
CUDA-graph replays with new lengths, and the default routing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import atol_for, batch_of, call, call_tensors, check_sampled, planned, random_params
from oracle import check, make_case

import pagedprefill
from pagedprefill import tuning
from pagedprefill.backends import triton as tb
from pagedprefill.backends.triton import hopper as hp
from pagedprefill.kernels import launch

ROOT = Path(__file__).resolve().parents[1]
# 128 x 128 tiles on two consumers (FA3's causal D 128 tile): knob-only, kept correct on every path
TILES_128 = dict(consumers=2, BLOCK_N=128, consumer_regs=224)
BF16, F16 = torch.bfloat16, torch.float16
E4M3 = torch.float8_e4m3fn


def _case(**kw):
    base = dict(lens_q=[5, 7], lens_kv=[9, 20], hq=8, hkv=2, dqk=128, page_size=16, dtype=F16)
    return make_case(1, **{**base, **kw})


def test_config_knobs_are_validated():
    batch = batch_of(_case())
    with tuning.override("hopper", stages=4, consumers=2):
        cfg = hp.config(batch)
        assert (cfg.stages, cfg.consumers, cfg.BLOCK_M) == (4, 2, 128)
    with tuning.override("hopper", consumers=3):  # (a consumer count alone: its register split)
        cfg = hp.config(batch)
        assert (cfg.consumers, cfg.consumer_regs) == (3, hp.CONSUMER_REGS[3]) == (3, hp.DEFAULT.consumer_regs)
    for bad, msg in (
        (dict(stagez=4), "unknown Hopper knob 'stagez'"),
        (dict(consumers=4), "consumers must be 2 or 3"),
        (dict(stages=1), "stages must be >= 2"),
        (dict(BLOCK_N=48), "BLOCK_N must be"),
        (dict(load_warps=3), "load_warps must be"),
        (dict(consumer_regs=150), "multiples of 8"),
        (dict(consumers=3, consumer_regs=160, load_regs=96), "registers over budget"),
        (dict(chunk=-1), "chunk must be >= 0"),
        (dict(dynamic=2), "dynamic must be 0 or 1"),
        (dict(shares=65), "shares must be in"),
        (dict(rowsum=2), "rowsum must be -1, 0 or 1"),
    ):
        with tuning.override("hopper", **bad), pytest.raises(ValueError, match=msg):
            hp.config(batch)
    mid = batch_of(_case(lens_q=[500, 400], lens_kv=[500, 400]))  # (the static-rounds rule's fill count)
    with tuning.override("hopper", consumers=0), pytest.raises(ValueError, match="consumers must be 2 or 3"):
        hp.config(mid)


def test_one_warp_issues_the_copies_only_where_they_are_tma_copies_of_16_bit_tiles():
    """The load warps' warpgroup is one issuing warp and two gather warps where K/V tiles of <= 64 keys
    come by TMA in q's dtype, or as 8-bit tiles widened at D 64 / 96; 128-key tiles, the other 8-bit paths
    (widened or transposed by every load warp) and the cp.async gather keep their load warps."""
    plan = hp.HopperPlan(batch_of(_case(dtype=BF16)))
    tma = plan._kernel_constexprs(plan.cfg, False, False, True, True)
    assert tma["ISSUER"] and tma["LOAD_WARPS"] == hp.ISSUER_GATHER_WARPS
    gather = plan._kernel_constexprs(plan.cfg, False, False, False, False)
    assert not gather["ISSUER"] and gather["LOAD_WARPS"] == plan.cfg.load_warps
    with tuning.override("hopper", **TILES_128):  # (128-key tiles: the load warps in step)
        wide = hp.HopperPlan(batch_of(_case(dtype=BF16)))
        assert wide.cfg.BLOCK_N == 128 and not wide._kernel_constexprs(wide.cfg, False, False, True, True)["ISSUER"]
    for kv, q, dqk, dvo in ((E4M3, BF16, 128, 128), (E4M3, BF16, 192, 128), (E4M3, BF16, 256, 256)):
        p8 = hp.HopperPlan(batch_of(_case(dtype=q, kv_dtype=kv, dqk=dqk, dvo=dvo)))
        eight = p8._kernel_constexprs(p8.cfg, False, False, True, True)
        assert not eight["ISSUER"] and eight["LOAD_WARPS"] == p8.cfg.load_warps
    for d in (64, 128):  # (e4m3 q: V transposed by every load warp)
        p8 = hp.HopperPlan(batch_of(_case(dtype=E4M3, kv_dtype=E4M3, dqk=d, dvo=d)))
        assert not p8._kernel_constexprs(p8.cfg, False, False, True, True)["ISSUER"]
    for d in (64, 96):
        p8 = hp.HopperPlan(batch_of(_case(dtype=BF16, kv_dtype=E4M3, dqk=d, dvo=d)))
        widened = p8._kernel_constexprs(p8.cfg, False, False, True, True)
        assert widened["ISSUER"] and widened["LOAD_WARPS"] == hp.ISSUER_GATHER_WARPS and widened["STAGING"] > 0
        assert not p8._kernel_constexprs(p8.cfg, False, False, False, False)["ISSUER"]  # (cp.async: every warp)


def test_row_sums_on_the_tensor_cores_where_measured_faster():
    """The consumers sum P's rows by a wgmma at D 64 with 16-bit K/V and no LSE asked for only (where it
    measured faster, and where the LSE's precision is not at stake); the knob forces it either way, but
    never with e4m3 P (refused by name); the block of ones comes out of the ring's room."""
    assert hp.tensor_row_sums(batch_of(_case(dqk=64, return_lse=False)), hp.DEFAULT)
    assert not hp.tensor_row_sums(batch_of(_case(dqk=64)), hp.DEFAULT)  # (an LSE: the float32 sums)
    others = (dict(), dict(dqk=96), dict(dqk=256), dict(dqk=192, dvo=128), dict(dqk=64, kv_dtype=torch.float8_e4m3fn))
    for kw in others:
        assert not hp.tensor_row_sums(batch_of(_case(**kw, return_lse=False)), hp.DEFAULT), kw
    assert not hp.tensor_row_sums(batch_of(_case(dqk=64, dtype=E4M3, return_lse=False)), hp.DEFAULT)
    d128 = batch_of(_case())
    with tuning.override("hopper", rowsum=1):
        assert hp.tensor_row_sums(d128, hp.config(d128))
        with pytest.raises(ValueError, match="rowsum=1 with fp8 q"):
            hp.config(batch_of(_case(dtype=E4M3)))
    d64 = batch_of(_case(dqk=64, return_lse=False))
    with tuning.override("hopper", rowsum=0):
        assert not hp.tensor_row_sums(d64, hp.config(d64))
    plan = hp.HopperPlan(d64)
    assert plan._constexprs(None, False)["ROWSUM"] and not hp.HopperPlan(d128)._constexprs(None, False)["ROWSUM"]
    stage = 2 * hp.DEFAULT.BLOCK_N * 128
    x = (hp.SMEM_BYTES - 2 * plan.cfg.BLOCK_M * 64) % stage - 512  # (room for the stages but for 512 bytes)
    with tuning.override("hopper", rowsum=0):
        without = hp._ring_stages(d64, hp.config(d64), x)
    assert hp._ring_stages(d64, plan.cfg, x) == without - 1  # (the ones' 1 KiB costs a stage here)


def test_not_used_off_the_gpu():
    batch = batch_of(_case())
    assert hp.unavailable_reason(batch) == "not a CUDA device"
    assert not tb.uses_hopper_kernel(batch)


@pytest.mark.parametrize(
    "kw, served",
    [
        (dict(dqk=64), True),
        (dict(dqk=128), True),
        (dict(dqk=192, dvo=128), True),
        (dict(dqk=96), True),
        (dict(dqk=80), False),
        (dict(dqk=256), True),
        (dict(dqk=256, dvo=128), False),
        (dict(window_left=8), True),
        (dict(sinks=True), True),
        (dict(logits_soft_cap=5.0), True),
        (dict(dtype=F16, kv_dtype=torch.float8_e4m3fn), True),
        (dict(dtype=BF16, kv_dtype=torch.float8_e5m2, dqk=96), True),
        (dict(dtype=E4M3), True),  # (fp8 q, k and v: 8-bit wgmmas)
        (dict(dtype=E4M3, dqk=128), True),
        (dict(dtype=E4M3, dqk=96), False),  # (fp8 q off D 64 / 128: the portable kernel)
        (dict(dtype=E4M3, dqk=256), False),
        (dict(dtype=torch.float8_e5m2), False),
        (dict(dtype=F16, kv_dtype=torch.float8_e4m3fn, dqk=80), False),
    ],
)
def test_what_it_serves(kw, served):
    """16-bit q with K/V in its dtype or fp8 (widened in the kernel), Dqk = Dvo in {64, 96, 128, 256} or
    192 / 128 (variants included), and e4m3 q, k and v at D 64 / 128: the rest takes the portable
    kernel."""
    why = hp.unavailable_reason(batch_of(_case(**kw)))
    assert (why == "not a CUDA device") == served, why


@pytest.mark.parametrize("chunk,want", [(0, 6), (4, 4), (10**6, 6)])
def test_plan_caps_the_chunk_at_every_pair(chunk, want):
    """A chunk of at least every (sequence, KV head) pair is one chunk of all of them: the kernel's
    chunk x row-block products then stay within the work items' count (int32)."""
    case = make_case(1, lens_q=[5, 48, 3], lens_kv=[9, 60, 7], hq=8, hkv=2, dqk=128, page_size=16, dtype=F16)
    with tuning.override("hopper", chunk=chunk):
        assert hp.HopperPlan(batch_of(case)).chunk == want  # (3 sequences x 2 KV heads)


def test_merged_consumers_where_q_k_and_v_rows_are_one_part():
    """The first two of three consumers run as one 8-warp partition at D 64 and at D 128 with 8-bit K/V
    (16-bit q or e4m3 q/k/v); not at D 128 with 16-bit K/V, with a second part (D 96, Dqk 192, D 256) or
    on two consumers; a knob decides where it is set."""

    def merged(**kw):
        base = dict(lens_q=[700, 900], lens_kv=[1500, 2000], hq=8, hkv=2, dqk=128, page_size=16, dtype=F16)
        return hp.config(batch_of(make_case(2, **{**base, **kw}))).merged

    e4m3 = torch.float8_e4m3fn
    assert merged() == 0 and merged(dtype=torch.bfloat16) == 0
    assert merged(dqk=64) == 1 and merged(dqk=64, kv_dtype=e4m3) == 1
    assert merged(kv_dtype=e4m3) == 1 and merged(dtype=e4m3, kv_dtype=e4m3) == 1
    assert merged(dqk=96) == 0 and merged(dqk=192, dvo=128) == 0 and merged(dqk=256) == 0
    with tuning.override("hopper", consumers=2):
        assert merged(dqk=64) == 0
    with tuning.override("hopper", merged=0):
        assert merged(dqk=64) == 0
    with tuning.override("hopper", merged=1):
        assert merged(dqk=96) == 1


def test_config_picks_the_schedule_by_shape():
    """64-key tiles on three consumers at every page size (128 x 128 tiles on two consumers measured
    slower, or level, on pages of 64 and 128 too); static rounds for prompts of <= 1024 tokens and
    chunked prefill (max_kv >= 4 * max_q), the work counter elsewhere; a knob replaces the choice."""
    # (D 128 with 16-bit K/V: three 4-warp consumer partitions, see merged_consumers)
    static = dataclasses.replace(hp.DEFAULT, dynamic=0, merged=0)
    counter = dataclasses.replace(hp.DEFAULT, chunk=hp.DYNAMIC_CHUNK, merged=0)  # (off the work counter)

    def cfg(**kw):
        base = dict(lens_q=[5, 48], lens_kv=[9, 60], hq=8, hkv=2, dqk=128, page_size=16, dtype=F16)
        return hp.config(batch_of(make_case(1, **{**base, **kw})))

    assert cfg() == static  # causal, pages of 16, max_kv = 60 < 4 * 48, max_q <= 1024, 192 rows
    assert cfg(causal=False) == static
    assert cfg(page_size=64) == static and cfg(page_size=64, causal=False) == static
    assert cfg(page_size=128, lens_q=[2048], lens_kv=[2048]) == counter
    assert cfg(page_size=0, causal=False) == static and cfg(page_size=0, lens_kv=[9, 200]) == static
    assert cfg(lens_q=[48], lens_kv=[192]) == static and cfg(lens_q=[48], lens_kv=[191]) == static
    assert cfg(lens_q=[2048], lens_kv=[8191]) == counter and cfg(lens_q=[2048], lens_kv=[8192]) == static
    assert cfg(lens_q=[1025], lens_kv=[2048], dqk=64) == dataclasses.replace(counter, merged=1)
    assert static.chunk == 4
    with tuning.override("hopper", chunk=2):
        assert cfg(lens_q=[1025], lens_kv=[2048]).chunk == 2
    # (the chunk follows the final schedule, a `dynamic` knob included)
    with tuning.override("hopper", dynamic=0):
        assert cfg(lens_q=[1025], lens_kv=[2048]) == dataclasses.replace(hp.DEFAULT, dynamic=0, merged=0)
    with tuning.override("hopper", dynamic=1):
        assert cfg().chunk == hp.DYNAMIC_CHUNK and cfg().dynamic == 1
    fp8 = cfg(page_size=64, kv_dtype=torch.float8_e4m3fn)
    assert fp8.BLOCK_N == static.BLOCK_N and fp8.consumers == static.consumers
    d256 = dataclasses.replace(static, merged=0, **{**hp.D256, **hp.D256_SPLIT})  # (TMA-boxed pages: K apart)
    assert cfg(dqk=256) == d256 and cfg(causal=False, dqk=256) == d256 and cfg(page_size=64, dqk=256) == d256
    assert cfg(page_size=8, dqk=256) == dataclasses.replace(static, merged=0, **hp.D256)
    with tuning.override("hopper", chunk=2):
        assert cfg(page_size=64) == dataclasses.replace(static, chunk=2)
    with tuning.override("hopper", **TILES_128):
        assert cfg(causal=False) == dataclasses.replace(static, merged=0, **TILES_128)
    with tuning.override("hopper", wide=1), pytest.raises(ValueError, match="unknown Hopper knob 'wide'"):
        cfg()


def test_config_takes_two_consumers_where_192_row_blocks_would_be_padding():
    """``NARROW`` (two consumers, 128-row blocks) when a sequence's max_q * group rows padded to
    192-row blocks are >= 1.2x those padded to 128 (64-token queries at GQA 4: 384 vs 256): 16-bit
    K/V at D 64, 96, 128 and Dqk 192, 8-bit K/V at D 96 and 128, ragged or in pages of >= 16 tokens (64
    and 128 included); never for D 256 (two consumers anyway), 8-bit K/V at other head dims, fp8 q, pages
    under 16 tokens, or under a ``consumers`` knob."""
    static = dataclasses.replace(hp.DEFAULT, dynamic=0, merged=0)  # (D 128, 16-bit K/V: see merged_consumers)
    merged = dataclasses.replace(static, merged=1)  # (D 64, and D 128 with 8-bit K/V)
    narrow = dataclasses.replace(static, **hp.NARROW)

    def cfg(lq, **kw):
        base = dict(lens_q=[3, lq], lens_kv=[9, lq + 500], hq=8, hkv=2, dqk=128, page_size=16, dtype=F16)
        return hp.config(batch_of(make_case(1, **{**base, **kw})))

    # rows = 4 * max_q: 256 -> 384 vs 256; 128 -> 192 vs 128; 448 -> 576 vs 512 (1.125); 480 -> 576 vs 512
    assert cfg(64) == narrow and cfg(32) == narrow and cfg(16) == narrow and cfg(64, page_size=0) == narrow
    assert cfg(112) == static and cfg(120) == static and cfg(48) == static and cfg(96) == static
    assert cfg(64, dqk=64) == narrow and cfg(96, dqk=64) == merged
    d96 = cfg(64, dqk=96)
    assert (d96.consumers, d96.consumer_regs, d96.stages) == (2, hp.NARROW["consumer_regs"], hp.D96_STAGES)
    assert cfg(64, dqk=192, dvo=128) == narrow and cfg(96, dqk=192, dvo=128) == static
    assert cfg(64, kv_dtype=torch.float8_e4m3fn) == narrow and cfg(96, kv_dtype=torch.float8_e4m3fn) == merged
    assert cfg(64, kv_dtype=torch.float8_e4m3fn, dqk=96).consumers == 2  # (8-bit K/V at D 96: measured)
    assert cfg(64, kv_dtype=torch.float8_e4m3fn, dqk=64).consumers == 3  # (8-bit K/V at D 64: level)
    assert cfg(64, dqk=256).consumers == 2 and cfg(64, dqk=256).BLOCK_N == hp.D256_SPLIT["BLOCK_N"]
    e4m3 = torch.float8_e4m3fn
    assert cfg(64, dtype=e4m3, kv_dtype=e4m3).consumers == 3  # (fp8 q/k/v: not measured)
    assert cfg(64, page_size=8) == static  # (pages under 16 tokens: the cp.async gather, not measured)
    assert cfg(64, page_size=64) == narrow and cfg(64, page_size=128) == narrow
    with tuning.override("hopper", consumers=3):
        assert cfg(64) == static


def test_sibling_is_the_other_consumer_count_where_lengths_may_pick_it():
    """Where `config` may pick either ``DEFAULT`` or ``NARROW`` as only lengths and batch size change
    (16-bit K/V at D <= 128 and Dqk 192, 8-bit K/V at D 128, ragged or pages of >= 16 tokens, no knobs),
    `sibling` is the other one (the plan compiles it at its first launch); elsewhere there is none."""

    def batch(**kw):
        base = dict(lens_q=[3, 700], lens_kv=[9, 900], hq=8, hkv=2, dqk=128, page_size=16, dtype=F16)
        return batch_of(make_case(2, **{**base, **kw}))

    b = batch()
    cfg = hp.config(b)
    sib = hp.sibling(b, cfg)
    assert cfg.consumers == 3 and (sib.consumers, sib.consumer_regs) == (2, hp.NARROW["consumer_regs"])
    # (nothing else)
    assert dataclasses.replace(sib, consumers=3, consumer_regs=cfg.consumer_regs, merged=cfg.merged) == cfg
    back = hp.sibling(b, sib)
    assert back == cfg
    for other in (dict(page_size=0), dict(page_size=32), dict(page_size=64), dict(page_size=128), dict(dqk=64)):
        ob = batch(**other)
        assert hp.sibling(ob, hp.config(ob)).consumers == 2, other
    for other in (dict(dqk=96), dict(dqk=192, dvo=128), dict(kv_dtype=torch.float8_e4m3fn)):
        ob = batch(**other)
        assert hp.sibling(ob, hp.config(ob)).consumers == 2, other
    e4m3 = torch.float8_e4m3fn
    for other in (dict(page_size=8), dict(dqk=256), dict(dqk=64, kv_dtype=e4m3), dict(dtype=e4m3, kv_dtype=e4m3)):
        ob = batch(**other)
        assert hp.sibling(ob, hp.config(ob)) is None, other
    with tuning.override("hopper", stages=4):
        assert hp.sibling(b, hp.config(b)) is None


def test_stages_fit_shared_memory():
    """Q and the K/V ring fit sm_90's 227 KB: 5 stages at D 128, 6 at D 96, 3 at Dqk 192 / Dvo 128 (4 on
    two consumers, whose Q is smaller); at D 256 2 of 64 keys with K released apart from V where tiles
    come by TMA (pages of >= 16 tokens, ragged), else 5 of 32 keys (pages under 16 tokens, 8-bit K/V)."""
    cases = [((128, 128), 16, 5, 0), ((96, 96), 16, 6, 0), ((64, 64), 16, 5, 0), ((192, 128), 16, 3, 0)]
    cases += [((256, 256), 16, 2, 1), ((256, 256), 0, 2, 1), ((256, 256), 8, 5, 0)]
    for (dqk, dvo), page, want, split in cases:
        # (48-token queries at GQA 4: 192 rows, three consumers)
        batch = batch_of(_case(dqk=dqk, dvo=dvo, page_size=page, dtype=BF16, lens_q=[5, 48], lens_kv=[9, 60]))
        cfg = hp.config(batch)
        n = hp.stages(batch, cfg)
        assert (n, cfg.split) == (want, split), (dqk, page)
        assert 2 * (cfg.BLOCK_M * dqk + n * cfg.BLOCK_N * (dqk + dvo)) <= hp.SMEM_BYTES
        assert hp.staging_slots(batch, cfg) == 0
    mla = batch_of(_case(dqk=192, dvo=128, dtype=BF16))  # (7-token queries: two consumers)
    assert hp.config(mla).consumers == 2 and hp.stages(mla, hp.config(mla)) == 4
    fp8 = batch_of(_case(dqk=256, dvo=256, dtype=BF16, kv_dtype=torch.float8_e4m3fn))
    assert (hp.config(fp8).BLOCK_N, hp.config(fp8).split) == (32, 0)


def test_d256_without_tma_boxes_takes_five_32_key_stages():
    """D 256 plans two 64-key stages with K released apart from V, which needs TMA; a call whose strides
    the TMA cannot box launches five 32-key stages instead (the split's stages would leave its
    cp.async loads exposed)."""
    plan = hp.HopperPlan(batch_of(_case(dqk=256, dvo=256, dtype=BF16)))
    assert (plan.cfg.BLOCK_N, plan.cfg.stages, plan.cfg.split) == (64, 2, 1)
    boxed = plan._constexprs((("k", 0, 0, False), ("v", 0, 0, False)), False)
    assert (boxed["BLOCK_N"], boxed["STAGES"], boxed["SPLIT"]) == (64, 2, True)
    gathered = plan._constexprs(None, False)
    assert (gathered["BLOCK_N"], gathered["STAGES"], gathered["SPLIT"]) == (32, 5, False)
    for knobs in (dict(BLOCK_N=32), dict(split=0), dict(stages=4)):  # (set by hand: D256 and the knobs)
        with tuning.override("hopper", **knobs):
            cfg = hp.config(batch_of(_case(dqk=256, dvo=256, dtype=BF16)))
        assert cfg == dataclasses.replace(cfg, **{**hp.D256, **knobs}), knobs


def test_fp8_staging_fits_beside_the_ring():
    """8-bit K/V: three staging slots where the ring keeps three stages (two otherwise), and Q, the ring
    and the staging slots within shared memory, for every head dim and both tile widths."""
    for dqk, dvo in hp.HEAD_DIMS:
        for wide in (0, 1):
            batch = batch_of(_case(dqk=dqk, dvo=dvo, dtype=BF16, kv_dtype=torch.float8_e4m3fn))
            with tuning.override("hopper", **(TILES_128 if wide and dvo <= 128 else {})):
                if wide and dqk == 192:  # (Q, two 128-key stages and two staging slots: 288 KB)
                    with pytest.raises(ValueError, match="exceed shared memory"):
                        hp.config(batch)
                    continue
                cfg = hp.config(batch)
            n, n8 = hp.stages(batch, cfg), hp.staging_slots(batch, cfg)
            tile = cfg.BLOCK_N * (dqk + dvo)
            room = hp.SMEM_BYTES - 2 * cfg.BLOCK_M * dqk
            assert n8 == (3 if (room - 3 * tile) // (2 * tile) >= 3 else 2) and n >= 2, (dqk, wide, n, n8)
            assert 2 * cfg.BLOCK_M * dqk + 2 * n * tile + n8 * tile <= hp.SMEM_BYTES, (dqk, wide)
    fp8 = batch_of(_case(causal=False, dtype=BF16, kv_dtype=torch.float8_e4m3fn))
    assert hp.config(fp8).BLOCK_N == hp.DEFAULT.BLOCK_N  # (128-key tiles would leave the ring two stages)


def test_fp8_qkv_staging_holds_v_only():
    """e4m3 q, k and v: K goes straight into the ring, V's tiles alone are staged (to be transposed),
    and all of it fits; fewer than 32 keys a tile are refused (V's keys are reordered in blocks of
    32)."""
    for dqk in (64, 128):
        for knobs in ({}, TILES_128):
            batch = batch_of(_case(dqk=dqk, dtype=E4M3))
            with tuning.override("hopper", **knobs):
                cfg = hp.config(batch)
            n, n8 = hp.stages(batch, cfg), hp.staging_slots(batch, cfg)
            assert n8 in (2, 3) and n >= 3, (dqk, knobs, n, n8)
            if not knobs:  # (half the bytes a tile of 16-bit data takes: the deeper ring fits)
                assert cfg.stages == n == hp.F8_STAGES, (dqk, cfg.stages, n)
            used = cfg.BLOCK_M * dqk + n * cfg.BLOCK_N * 2 * dqk + n8 * cfg.BLOCK_N * dqk
            assert used <= hp.SMEM_BYTES, (dqk, knobs)
            assert hp.o_stage_mode(batch, True) == 0  # (out is bf16: O goes out from its accumulator)
    with tuning.override("hopper", BLOCK_N=16), pytest.raises(ValueError, match=">= 32 with fp8 q"):
        hp.config(batch_of(_case(dtype=E4M3)))
    # (V's transpose: 16 columns a load warp, then key 32 of a 64-key chunk)
    small = batch_of(_case(dqk=64, dtype=E4M3))
    with tuning.override("hopper", BLOCK_N=32, load_warps=8, consumer_regs=144, load_regs=40):
        with pytest.raises(ValueError, match="load_warps <= 4 with fp8 q"):
            hp.config(small)
    for knobs in (dict(load_warps=8, consumer_regs=144, load_regs=40), dict(BLOCK_N=32), dict(load_warps=2)):
        with tuning.override("hopper", **knobs):
            assert hp.config(small).load_warps == knobs.get("load_warps", 4)


def _xor_map(bases, idx):
    """A linear layout's (key, column) of register / lane / warp index ``idx`` (its bases XORed)."""
    key = col = 0
    for b, (bk, bc) in enumerate(bases):
        if idx >> b & 1:
            key, col = key ^ bk, col ^ bc
    return key, col


def _worst_store_ways(layout, ch, dv0, load_warps, block_n):
    """Bank conflicts of :func:`loads._transpose_v`'s 4-byte stores under ``layout``: the most distinct
    words any bank takes in one store (1: none). Each column row holds ``block_n`` keys in the PV
    operand's order (key 32a + 16h + 8i + 2j + e at 32a + 16h + 4j + 2i + e), NVMMA-swizzled over
    ``min(block_n, 128)`` bytes (16-byte chunk bits XOR address bits 7 on); after checking that the
    layout holds each element of the chunk once."""
    reg, lanes, warps = layout.reg_bases, layout.lane_bases, layout.warp_bases
    owners = {
        tuple(a ^ b ^ c for a, b, c in zip(_xor_map(reg, r), _xor_map(lanes, ln), _xor_map(warps, w)))
        for r in range(1 << len(reg))
        for ln in range(32)
        for w in range(load_warps)
    }
    assert len(owners) == ch * dv0 == (1 << len(reg)) * 32 * load_warps
    n_swz = (min(block_n, 128) // 16).bit_length() - 1
    word = [b for b, (bk, bc) in enumerate(reg) if bc == 0 and bk in (1, 8)]  # (keys e and i: one word)
    rest = [b for b in range(len(reg)) if b not in word]
    worst = 0
    for w in range(load_warps):
        for combo in range(1 << len(rest)):
            r = sum(1 << b for t, b in enumerate(rest) if combo >> t & 1)
            banks: dict[int, set] = {}
            for ln in range(32):
                key, col = (a ^ b ^ c for a, b, c in zip(_xor_map(reg, r), _xor_map(lanes, ln), _xor_map(warps, w)))
                pos = 32 * (key >> 5) + 16 * (key >> 4 & 1) + 4 * (key >> 1 & 3) + 2 * (key >> 3 & 1)
                addr = col * block_n + pos
                addr ^= ((addr >> 7) & ((1 << n_swz) - 1)) << 4
                banks.setdefault(addr // 4 % 32, set()).add(addr // 4)
            worst = max(worst, max(len(v) for v in banks.values()))
    return worst


def test_fp8_v_transpose_stores_2way():
    """V's transposing layout covers each element of a chunk once, and its 4-byte stores take 2 words
    per bank at 64- and 128-key tiles, against 4 for a blocked layout with 8 lanes along the columns
    (the ratio Nsight Compute measured: 1 excess wavefront per ideal one against 3)."""
    from types import SimpleNamespace

    from pagedprefill.backends.triton.hopper_kernel import loads

    for ch, dv0, warps, block_n in [(64, 128, 4, 64), (64, 64, 4, 64), (64, 128, 4, 128), (64, 64, 8, 64)]:
        assert _worst_store_ways(loads._transpose_layout(ch, dv0, warps), ch, dv0, warps, block_n) == 2
    assert _worst_store_ways(loads._transpose_layout(32, 128, 4), 32, 128, 4, 32) == 4  # (32-byte rows)
    blocked = SimpleNamespace(  # BlockedLayout([2, 4], [4, 8], [1, 4], [1, 0]) over [64 keys, 128 columns]
        reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[0, 4], [0, 8], [0, 16], [2, 0], [4, 0]],
        warp_bases=[[0, 32], [0, 64]],
    )
    assert _worst_store_ways(blocked, 64, 128, 4, 64) == 4


def test_o_stage_needs_out_in_qs_dtype_and_room():
    assert hp.o_stage_mode(batch_of(_case()), True) == 1
    assert hp.o_stage_mode(batch_of(_case(dqk=192, dvo=128)), True) == 1
    assert hp.o_stage_mode(batch_of(_case(dqk=192, dvo=128)), False) == 0
    assert hp.o_stage_mode(batch_of(_case(dqk=256)), True) == 0  # (O's 256 columns: wider than a slot)
    case = _case()
    case.kwargs["out"] = torch.empty_like(case.kwargs["out"], dtype=torch.float32)
    assert hp.o_stage_mode(batch_of(case), True) == 0


def test_routing_follows_the_split_choice(monkeypatch):
    """A call the portable kernel would split over KV takes it, whatever the Hopper kernel serves."""
    monkeypatch.setattr(hp, "unavailable_reason", lambda batch: None)
    short = _case(lens_q=[4], lens_kv=[4000], dqk=64)
    big = _case(lens_q=[900] * 8, lens_kv=[900] * 8, dqk=64)
    for case, split in ((short, True), (big, False)):
        batch = batch_of(case)
        assert (tb.fa2.choose_splits(batch, tb.fa2.choose_config(batch), None) > 1) == split
        assert tb.uses_hopper_kernel(batch) == (not split)
    with tuning.override("triton", hopper=0):
        assert not tb.uses_hopper_kernel(batch_of(big))


def test_strides_cp_async_cannot_prove_are_refused():
    """A stride of 8 (mod 16) elements is 16-byte aligned, but Triton can only prove 2 bytes: refused."""
    for name in ("q", "k_cache", "v_cache"):
        case = _case(page_size=0)
        t = case.kwargs[name]
        wide = torch.zeros(t.shape[0], t.shape[1], 136, dtype=t.dtype)[:, :, :128]  # head stride 136
        wide.copy_(t)
        case.kwargs[name] = wide
        why = hp.unavailable_reason(batch_of(case))
        assert "multiples of 16" in why and why.startswith(name[0]), why


@pytest.mark.parametrize("layout", ["nhd", "hnd", "interleaved"])
@pytest.mark.parametrize("page_size", [16, 64, 0])
def test_tma_view_addresses_every_key_row(layout, page_size):
    """The 2-D TMA view's (row, column) of every (page, head, slot) is that key row's address."""
    if page_size == 0 and layout != "nhd":
        pytest.skip("ragged caches have one layout")
    case = make_case(
        2, lens_q=[3], lens_kv=[150], hq=8, hkv=4, dqk=64, page_size=page_size, kv_layout=layout, dtype=BF16
    )
    p, lp, ws = planned(case, "torch")
    batch, t = lp.batch, call_tensors(case, p, lp, ws)
    box = hp._page_box(batch, hp.DEFAULT)
    assert box == (min(page_size, hp.DEFAULT.BLOCK_N) if page_size else hp.DEFAULT.BLOCK_N)
    views = hp._tma_plan(t, batch, box)
    assert views is not None
    for x, (desc, page_rows, head_off, head_rows) in zip((t.k, t.v), views[:2]):
        rows, cols = desc.shape
        st = desc.strides[0]
        esz = x.element_size()
        slots = x.shape[2] if batch.paged else 1
        for page in range(x.shape[0]):
            for h in range(x.shape[1]):
                for slot in range(slots):
                    if batch.paged:
                        row, want = page * page_rows + slot, x[page, h, slot]
                    else:
                        row, want = page, x[page, h]
                    col = 0
                    if head_rows:
                        row += h * head_off
                    else:
                        col = h * head_off
                    assert 0 <= row < rows and col + batch.head_dim_qk <= cols
                    assert x.data_ptr() + (row * st + col) * esz == want.data_ptr()


def test_tma_plan_for_mla_boxes_key_columns_in_two_parts():
    """Dqk 192: K's 2-D view spans all 192 columns of every head, boxed as 128 + 64 columns."""
    for layout in ("nhd", "hnd"):
        case = make_case(
            2, lens_q=[3], lens_kv=[70], hq=4, hkv=2, dqk=192, dvo=128, page_size=16, kv_layout=layout, dtype=BF16
        )
        p, lp, ws = planned(case, "torch")
        box = hp._page_box(lp.batch, hp.DEFAULT)
        (k0, _, k_head_off, k_rows), (v0, *_), k1, v1 = hp._tma_plan(call_tensors(case, p, lp, ws), lp.batch, box)
        assert list(k0.block_shape) == [box, 128] and list(k1.block_shape) == [box, 64]
        assert list(v0.block_shape) == [box, 128] and v1 is None
        assert (k1.shape, k1.strides) == (k0.shape, k0.strides)
        last_col = (0 if k_rows else (case.kwargs["k_cache"].shape[1] - 1) * k_head_off) + 192
        assert last_col <= k0.shape[1]


def test_tail_shares_split_only_a_last_round_that_leaves_programs_idle():
    """Static rounds: 704 items on 132 programs (five rounds and 44 items) split those 44 three ways;
    a last round that is a small share of many rounds, a full one, the work counter and sinks do not
    split; the knob forces a count (1: none)."""
    batch = batch_of(make_case(3, lens_q=[512] * 2, lens_kv=[8192] * 2, hq=8, hkv=2, dqk=128, dtype=F16))
    cfg = dataclasses.replace(hp.DEFAULT, dynamic=0)
    assert hp.tail_shares(batch, cfg, 704, 132) == (660, 3)
    assert hp.tail_shares(batch, cfg, 3072, 132) == (3072, 1)  # (24 rounds: a third of one saved is < 5%)
    assert hp.tail_shares(batch, cfg, 660, 132) == (660, 1)  # (the last round is full)
    assert hp.tail_shares(batch, cfg, 40, 132) == (0, 3)  # (one round: 40 items, 3 shares each)
    assert hp.tail_shares(batch, dataclasses.replace(cfg, dynamic=1), 704, 132) == (704, 1)
    assert hp.tail_shares(batch, dataclasses.replace(cfg, shares=5), 704, 132) == (660, 5)
    assert hp.tail_shares(batch, dataclasses.replace(cfg, shares=1), 704, 132) == (704, 1)
    short = batch_of(make_case(3, lens_q=[512] * 2, lens_kv=[512] * 2, hq=8, hkv=2, dqk=128, dtype=F16))
    assert hp.tail_shares(short, cfg, 704, 132) == (660, 2)  # (8 key tiles: two shares of 4)
    sinks = batch_of(make_case(3, lens_q=[64], lens_kv=[900], hq=8, hkv=2, dqk=128, dtype=F16, sinks=True))
    assert hp.tail_shares(sinks, cfg, 704, 132) == (704, 1)
    bytes_ = hp.share_bytes(batch, cfg, 44, 3)
    assert bytes_ == 4 * (64 + 44 * 3 * cfg.BLOCK_M * 129 + 44 * 8)


@pytest.mark.skipif(not launch.INTERPRETED, reason="the merge on CPU tensors: under Triton's interpreter")
@pytest.mark.parametrize("has_lse", [True, False])
def test_share_merge_combines_the_partials_it_is_given(has_lse):
    """The shares' merge on a scratch laid out as the kernel writes it (float32 O rows normalised per
    share, log2 LSEs, one header per split item), against float64 arithmetic: 2 split items of 3
    shares, GQA 3, Dvo 96 (a padded power of two), rows past q_len left alone, a row no share saw
    (all -inf) written as 0 / -inf, a share with no key of some row (-inf) carrying no weight."""
    from pagedprefill.backends.triton import hopper_kernel as hk

    g, block_m, dvo, shares, tail, hq = 3, 64, 96, 3, 2, 6
    gen = torch.Generator().manual_seed(5)
    n_rows = tail * shares * block_m
    po = torch.randn(n_rows, dvo, generator=gen)
    pl = torch.randn(n_rows, generator=gen) * 4
    pl[5] = float("-inf")  # (item 0, share 0, row 5: no key in that share)
    for sh in range(shares):  # (item 1, row 7: no key in any share)
        pl[(shares + sh) * block_m + 7] = float("-inf")
    # headers: o_start, lse_start, q_len, kv_head, row0 (item 0: rows 0..63 of head group 1, 20 tokens;
    # item 1: rows 64..127 of head group 0 of a sequence of 30 tokens starting at token 40)
    hd = torch.tensor([[0, 0, 20, 1, 0, 0, 0, 0], [40, 40 * hq, 30, 0, 64, 0, 0, 0]], dtype=torch.int32)
    off = hk.PART_OFFSET.value
    scratch = torch.cat([torch.zeros(off), po.flatten(), pl, hd.flatten().view(torch.float32)]).view(torch.uint8)
    out = torch.full((80, hq, dvo), float("nan"))
    lse = torch.full((80 * hq,), float("nan"))
    hk.share_merge_kernel[(tail, block_m // 32)](
        scratch,
        out,
        lse if has_lse else out,
        tail,
        shares,
        out.stride(0),
        out.stride(1),
        hq,
        GROUP=g,
        BLOCK_M=block_m,
        DVO=dvo,
        DV_P2=128,
        ROWS=32,
        HAS_LSE=has_lse,
    )
    want_rows, want_lse = set(), set()
    for i in range(tail):
        o_start, lse_start, q_len, kv_head, row0 = hd[i, :5].tolist()
        for r in range(block_m):
            tok, head = (row0 + r) // g, kv_head * g + (row0 + r) % g
            if tok >= q_len:
                continue
            want_rows.add((o_start + tok, head))
            want_lse.add(lse_start + tok * hq + head)
            rows = [(i * shares + sh) * block_m + r for sh in range(shares)]
            ls = pl[rows].double()
            if torch.isinf(ls).all():
                assert torch.equal(out[o_start + tok, head], torch.zeros(dvo))
                if has_lse:
                    assert lse[lse_start + tok * hq + head] == float("-inf")
                continue
            w = torch.exp2(ls - ls.max())
            ref = (w[:, None] * po[rows].double()).sum(0) / w.sum()
            torch.testing.assert_close(out[o_start + tok, head].double(), ref, atol=1e-5, rtol=1e-5)
            if has_lse:
                ref_lse = (ls.max() + torch.log2(w.sum())) * math.log(2)
                assert abs(float(lse[lse_start + tok * hq + head]) - float(ref_lse)) < 1e-5
    untouched = [(t, h) for t in range(80) for h in range(hq) if (t, h) not in want_rows]
    assert all(torch.isnan(out[t, h]).all() for t, h in untouched)
    if has_lse:
        assert all(torch.isnan(lse[j]) for j in range(lse.numel()) if j not in want_lse)


def test_static_rounds_unless_prompt_lengths_are_uneven():
    """Prompts of at most 1024 tokens take static rounds unless their lengths are uneven (the longest
    >= 384, row blocks under 80% filled; with device lengths estimated from q's rows); chunked
    prefill always; longer prompts take the work counter."""

    def static(lens_q, lens_kv, on_device=False):
        b = batch_of(make_case(5, lens_q=lens_q, lens_kv=lens_kv, hq=8, hkv=2, dqk=128, dtype=F16))
        return hp.static_rounds(dataclasses.replace(b, host=None) if on_device else b, 192)

    assert static([1024] * 4, [1024] * 4)
    assert not static([600, 40, 100, 900], [600, 40, 100, 900])
    assert static([256, 10, 30, 200], [256, 10, 30, 200])  # (the longest under 384)
    assert not static([505, 16, 30, 200], [505, 16, 300, 1200])
    assert not static([505, 60, 30, 200], [505, 60, 300, 1200], on_device=True)
    assert static([505, 16, 30, 200], [505, 16, 300, 1200], on_device=True)  # (averaging < 192 tokens)
    assert static([1024] * 4, [1024] * 4, on_device=True)
    assert static([600, 590, 610, 600], [700] * 4, on_device=True)
    assert static([256, 10, 30, 200], [256, 10, 30, 200], on_device=True)
    for seed in range(20):  # (the estimate agrees with the host lengths away from the 80% edge)
        rng = random.Random(seed)
        lens = [rng.randint(1, 1000) for _ in range(rng.randint(2, 40))]
        lens[0] = 1000
        exact = static(lens, lens)
        ratio = sum(-(-q * 4 // 192) for q in lens) / (len(lens) * -(-4000 // 192))
        if abs(ratio - 0.8) > 0.1 and sum(lens) >= 192 * len(lens):
            assert static(lens, lens, on_device=True) == exact, (lens, ratio)
    # device lengths under a loose bound: 128 short prompts (8-256 tokens) with max_q = 512 look
    # uneven, but average under 192 tokens: static rounds, as their host lengths (longest < 384) take
    rng = random.Random(3)
    lens = [rng.randint(8, 256) for _ in range(128)]
    b = batch_of(make_case(5, lens_q=lens, lens_kv=lens, hq=8, hkv=2, dqk=128, dtype=F16))
    assert hp.static_rounds(b, 192) and hp.static_rounds(dataclasses.replace(b, host=None, work_q=512), 192)
    assert static([600, 40, 100, 900], [9000] * 4)  # (chunked prefill: max_kv >= 4 max_q)
    assert not static([2000], [2000])
    assert static([600, 590, 610, 600], [700] * 4)  # (even)


def test_small_pages_and_empty_caches_take_cp_async():
    assert hp._page_box(batch_of(_case(page_size=8)), hp.DEFAULT) == 0
    case = make_case(2, lens_q=[0, 4], lens_kv=[0, 0], hq=8, hkv=4, dqk=64, page_size=0, dtype=BF16)
    p, lp, ws = planned(case, "torch")
    assert hp._tma_plan(call_tensors(case, p, lp, ws), lp.batch, hp._page_box(lp.batch, hp.DEFAULT)) is None


def test_q_tma_only_where_its_boxes_fit():
    assert hp.q_tma_applies(batch_of(_case()), _case().kwargs["q"])
    assert not hp.q_tma_applies(batch_of(_case(hq=6)), _case(hq=6).kwargs["q"])  # G = 3 does not divide 64
    empty = _case(lens_q=[0, 0])
    assert not hp.q_tma_applies(batch_of(empty), empty.kwargs["q"])


# --------------------------------------------------------------------------------------------
# sm_90 compile without a GPU
# --------------------------------------------------------------------------------------------


def _vectors_and_bounds(pages: int, offsets: tuple, lse_mode: int = 1, dtype=torch.int32):
    from pagedprefill.batch import DeviceVectors
    from pagedprefill.kernels.metadata import Bounds

    bsz = 5
    vec = torch.arange(bsz + 1, dtype=dtype)
    offs = {n: vec.clone() for n in offsets}
    vecs = DeviceVectors(
        vec[:bsz].clone(),
        None if pages == 2 else vec[:bsz].clone(),
        offs,
        vec.clone() if pages == 2 else None,
        vec[:bsz].clone() if pages == 2 else None,
        "tokens",
    )
    units = dict(q=512, o=512, k=128, v=128, stats=8)
    rows_kv = (0, 0) if pages else (900, 800)
    bd = Bounds(40, 300, 700, 650, *rows_kv, 8 * 650, lse_mode, pages, 6, 8, 90, 16, 8, units)
    return vecs, bd


@pytest.mark.parametrize(
    "pages, offsets, lse_mode, takes",
    [
        (0, ("q", "k"), 1, True),  # ragged: q's and K's starts given
        (0, ("q", "o", "k", "v"), 0, True),
        (0, ("q",), 1, False),  # K's starts would need a prefix sum
        (1, ("q",), 1, True),  # block table: page lists by row
        (1, (), 1, False),  # q's starts would need a prefix sum
        (2, ("q",), 2, False),  # packed LSE without its offsets
        (2, ("q", "stats"), 2, True),
    ],
)
def test_the_kernel_takes_device_vectors_only_without_prefix_sums(pages, offsets, lse_mode, takes):
    """The Hopper kernel reads device vectors in place of the metadata table only where every start is
    an offset given (its rows have no prefix sum); then its bounds follow the table's clamps, the
    packed LSE's row bound in rows of Hq, and the offsets' units arrive as constexprs."""
    vecs, bd = _vectors_and_bounds(pages, offsets, lse_mode)
    got = hp.vector_args(bd, vecs)
    assert (got is not None) == takes
    if not takes:
        return
    ints, modes = got
    assert len(ints) == len(hp.hk.BOUND_ARGS) and len(hp.vector_tensors(vecs)) == len(hp.hk.VECTOR_ARGS)
    named = dict(zip(hp.hk.BOUND_ARGS, ints))
    assert (named["max_q"], named["max_kv"], named["rows_q"], named["rows_o"]) == (40, 300, 700, 650)
    assert named["lse_rows"] == 650 and named["lse_b_stride"] == 40 * 8
    assert modes["CSR"] == (pages == 2) and modes["HAS_OO"] == ("o" in offsets) and modes["LSE_MODE"] == lse_mode
    assert modes["HAS_OV"] == (pages == 0 and "v" in offsets)
    assert (modes["UNIT_Q"], modes["UNIT_K"], modes["UNIT_S"]) == (512, 128, 8)
    # (absent vectors stand in as lens_q; present ones in VECTOR_ARGS order)
    tensors = dict(zip(hp.hk.VECTOR_ARGS, hp.vector_tensors(vecs)))
    assert tensors["OQ"] is vecs.offsets["q"] and tensors["LQ"] is vecs.lens_q
    assert tensors["OO"] is vecs.offsets.get("o", vecs.lens_q)
    assert tensors["IP"] is (vecs.kv_indptr if pages == 2 else vecs.lens_q)


def test_the_kernel_takes_only_dense_integer_vectors():
    """A strided or non-integer vector keeps the metadata table (the kernel reads each vector at
    element b, 32- or 64-bit)."""
    vecs, bd = _vectors_and_bounds(0, ("q", "k"))
    assert hp.vector_args(bd, vecs) is not None
    assert hp.vector_args(*_vectors_and_bounds(0, ("q", "k"), dtype=torch.int64)[::-1]) is not None
    vecs.offsets["k"] = torch.arange(12, dtype=torch.int32)[::2]
    assert hp.vector_args(bd, vecs) is None
    vecs, bd = _vectors_and_bounds(0, ("q", "k"), dtype=torch.int16)
    assert hp.vector_args(bd, vecs) is None


_AOT = textwrap.dedent(
    """
    import re, subprocess, sys
    sys.path.insert(0, {tests!r})
    sys.path.insert(0, {scripts!r})
    import torch, triton
    from sass_counts import compile_sm90
    from oracle import make_case
    from helpers import planned, call_tensors
    from pagedprefill import tuning
    from pagedprefill.backends.triton import hopper as hp

    ptxas = triton.knobs.nvidia.ptxas.path
    for d, page, causal, dt, dvo, knobs in {specs!r}:
        variants = {{k: knobs.pop(k) for k in ("window_left", "logits_soft_cap", "sinks", "return_lse") if k in knobs}}
        if "kv_dtype" in knobs:
            variants["kv_dtype"] = getattr(torch, knobs.pop("kv_dtype"))
        vectors = knobs.pop("vectors", False)
        case = make_case(0, lens_q=[5, 7], lens_kv=[9, 30], hq=8, hkv=2, dqk=d, dvo=dvo, page_size=page,
                         dtype=getattr(torch, dt), causal=causal, **variants)
        p, lp, ws = planned(case, "torch")
        with tuning.override("hopper", **knobs):
            plan = hp.HopperPlan(lp.batch)
        t = call_tensors(case, p, lp, ws)
        if vectors:  # (lengths and offsets as device vectors: the kernel reads them in place of the table)
            from pagedprefill import workspace
            from pagedprefill.batch import DeviceVectors
            i32 = dict(dtype=torch.int32)
            starts = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], **i32)
            offs = dict(q=starts(case.lens_q), stats=starts(case.lens_q))
            if not page:
                offs["k"] = starts(case.lens_kv)
            vecs = DeviceVectors(torch.tensor(case.lens_q, **i32), torch.tensor(case.lens_kv, dtype=torch.int64),
                                 offs, None, None, "tokens")
            n_idx = t.pages.numel() if t.pages is not None else 0
            assert plan.take_vectors(workspace.bounds(lp.batch, vecs, n_idx), vecs)
            t.vectors = vecs
        for kernel, grid, args, kwargs in plan.launches(t):
            c = compile_sm90(kernel, args, kwargs)
            ptx = c.asm["ptx"]
            with open("/tmp/_pp_gluon.ptx", "w") as f:
                f.write(ptx)
            cmd = [ptxas, "-v", "--gpu-name", "sm_90a", "/tmp/_pp_gluon.ptx", "-o", "/dev/null"]
            log = subprocess.run(cmd, capture_output=True, text=True).stderr
            spill = max([int(x) for x in re.findall(r"(\\d+) bytes spill stores", log)] or [0])
            serial = "are serialized" in log  # (ptxas C7512: every wgmma waited for at once)
            after_qk = (2 if d == 96 else 1) + (1 if kwargs["ROWSUM"] else 0)  # (PV GEMMs and the row sums')
            overlap = f"wgmma.wait_group.sync.aligned {{after_qk}}" in ptx
            regs = sorted(set(re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)))
            bulk = ptx.count("cp.async.bulk.tensor")
            stsm = ptx.count("stmatrix")
            lazy = ptx.count("vote.sync.any.pred") > 0 and ptx.count("bra.uni SKIP") > 0
            print("RESULT", d, page, c.metadata.shared, spill, serial, overlap, lazy, ",".join(regs), bulk, stsm,
                  kwargs["USE_TMA"], kwargs["Q_TMA"], kwargs["O_STAGE"], plan.cfg.consumer_regs, plan.cfg.load_regs,
                  flush=True)
    """
)

SPECS = [  # (the cases' 7-token queries at GQA 4 take NARROW where `_narrow_layout` allows, unless knobs say otherwise)
    (128, 16, True, "bfloat16", 128, dict(consumers=3, consumer_regs=152)),  # (DEFAULT)
    (128, 16, True, "bfloat16", 128, dict(window_left=100, logits_soft_cap=30.0, sinks=True)),  # (NARROW)
    (64, 0, False, "float16", 64, dict(window_left=40)),
    (128, 0, False, "float16", 128, dict(TILES_128)),  # (128-key tiles)
    (128, 0, True, "float16", 128, {}),  # (NARROW on ragged K/V)
    (64, 1, True, "bfloat16", 64, {}),  # (cp.async K/V)
    (64, 16, True, "bfloat16", 64, dict(rowsum=1)),  # (row sums by a wgmma, forced beside an LSE)
    (64, 16, True, "bfloat16", 64, dict(return_lse=False)),  # (... and by the rule)
    (64, 0, True, "float16", 64, dict(kv_dtype="float8_e4m3fn", rowsum=1)),  # (... over widened 8-bit K/V)
    (192, 0, True, "bfloat16", 128, {}),  # Dqk 192 / Dvo 128: K in 128 + 64 columns
    (192, 16, True, "bfloat16", 128, dict(consumers=3)),  # (... on three consumers, as long prompts run)
    (64, 16, True, "bfloat16", 64, dict(consumers=3, return_lse=False)),
    (256, 16, True, "bfloat16", 256, {}),  # D 256: K in 128 + 128 columns, V's boxes side by side
    (256, 0, False, "float16", 256, {}),
    (96, 16, True, "bfloat16", 96, {}),  # D 96: 64 + 32 columns, two PV GEMMs
    (96, 1, False, "float16", 96, dict(window_left=40)),
    (128, 64, True, "bfloat16", 128, dict(dynamic=1)),
    # 8-bit K/V: TMA (or cp.async) into staging slots, widened by the load warps
    (128, 16, True, "bfloat16", 128, dict(kv_dtype="float8_e4m3fn")),
    (128, 16, True, "bfloat16", 128, dict(kv_dtype="float8_e4m3fn", consumers=3)),
    (64, 1, False, "float16", 64, dict(kv_dtype="float8_e5m2")),
    (96, 16, True, "bfloat16", 96, dict(kv_dtype="float8_e4m3fn")),
    (256, 0, True, "bfloat16", 256, dict(kv_dtype="float8_e4m3fn")),
    (192, 16, True, "bfloat16", 128, dict(kv_dtype="float8_e4m3fn", logits_soft_cap=30.0)),
    (128, 16, True, "float8_e4m3fn", 128, {}),  # e4m3 q, k and v: 8-bit wgmmas, V transposed
    (64, 1, False, "float8_e4m3fn", 64, dict(window_left=40)),
    (64, 1, True, "float8_e4m3fn", 64, dict(TILES_128)),  # (K gathered whole)
    # device lengths and offsets read by the kernel in place of the metadata table
    (128, 0, True, "bfloat16", 128, dict(vectors=True, dynamic=1)),
    (128, 16, True, "bfloat16", 128, dict(vectors=True)),
    (96, 0, True, "float16", 96, dict(dynamic=1, vectors=True)),
]


def test_compiles_for_sm90(tmp_path):
    """The real launches compile for sm_90: within shared memory, spills bounded, a wgmma group left
    in flight across the softmax, O's rescale behind the warp vote, the register split applied, TMA
    copies exactly where planned, O staged (stmatrix) exactly where planned."""
    script = _AOT.format(tests=str(ROOT / "tests"), scripts=str(ROOT / "scripts"), specs=SPECS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    results = [line.split() for line in res.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == len(SPECS), res.stdout
    for row in results:
        _, d, page, shared, spill, serial, overlap, lazy, regs, bulk, stsm, use_tma, q_tma, o_stage, cregs, lregs = row
        assert int(shared) <= 227 * 1024, (d, page, shared)
        # the load warps (56 registers) spill hoisted gather addresses on their cp.async path and,
        # with the work counter, the item ring's state; the consumers do not spill in the key loop
        assert int(spill) <= 416, (d, page, spill)
        assert serial == "False", (d, page, "ptxas serialized the wgmmas (C7512: too few registers)")
        assert overlap == "True", "no PV GEMM left in flight across the softmax"
        assert lazy == "True", "O's rescale is not behind the warp vote (lazy rescale)"
        assert cregs in regs.split(",") and lregs in regs.split(","), regs
        assert (int(bulk) > 0) == (use_tma == "True" or q_tma == "True"), (d, page, bulk)
        assert (int(stsm) > 0) == (o_stage == "1"), (d, page, stsm)


def test_rescale_asm_ties_outputs_to_the_accumulator():
    """The lazy rescale's PTX: n outputs tied to the n accumulator inputs, each multiplied by its own
    factor ($2n + i), the whole block skipped on the vote ($3n) by a warp-uniform branch."""
    from pagedprefill.backends.triton.hopper_kernel import softmax as sm

    for n in (2, 16):
        asm = sm._rescale_asm.fn(n)
        cons = sm._rescale_constraints.fn(n).split(",")
        assert cons == ["=f"] * n + [str(i) for i in range(n)] + ["f"] * n + ["r"] * n
        assert f"setp.ne.u32 p, ${3 * n}, 0; @!p bra.uni SKIP;" in asm and asm.rstrip().endswith("SKIP: }")
        muls = [m for m in asm.split(";") if "mul.f32" in m]
        assert [m.split() for m in muls] == [["mul.f32", f"${i},", f"${i},", f"${2 * n + i}"] for i in range(n)]


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


def hopper_params(seed: int, long: bool | None = None) -> dict:
    r = random.Random(seed)
    params = random_params(seed, (BF16, F16), long=r.random() < 0.3 if long is None else long, variants=False)
    params["dqk"] = r.choice([64, 96, 128, 128, 192, 256])
    params["dvo"] = 128 if params["dqk"] == 192 else params["dqk"]
    if params["kv_layout"] == "interleaved" and params["dqk"] > 128:
        params["kv_layout"] = "hnd"
    params["page_size"] = r.choice([0, 1, 3, 8, 16, 16, 64])
    params["hq"], params["hkv"] = r.choice([(4, 4), (8, 2), (12, 4), (16, 2), (32, 8), (6, 1), (28, 4), (40, 8)])
    return params


def check_forced(case, lse_atol: float = 2e-2, **knobs) -> None:
    """A case run on the Hopper kernel (no split-KV), against the fp64 oracle."""
    assert hp.unavailable_reason(batch_of(case)) is None
    out, lse = call(case, knobs=dict(num_splits=1), hopper=knobs)
    check(case, out, lse, atol=atol_for(case.kwargs["q"].dtype), lse_atol=lse_atol)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(560, 572))
def test_gpu_d64_without_lse_sums_rows_by_wgmma(seed, monkeypatch):
    """D 64 calls that return no LSE take the row sums' wgmma (the default there): random lengths
    (the even seeds' long: many key tiles a row block), pages, GQA ratios and grids, checked row by row
    against the float64 oracle."""
    if seed % 2:
        monkeypatch.setattr(hp, "_num_sms", lambda device, n=1 + seed % 3: n)
    params = {**hopper_params(seed, long=seed % 2 == 0), "dqk": 64, "dvo": 64, "return_lse": False}
    case = make_case(seed, **params)
    assert hp.HopperPlan(batch_of(case))._constexprs(None, False)["ROWSUM"]
    check_forced(case)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dqk, dvo, kv_dtype, page_size, group",
    [
        (64, 64, None, 16, 4),
        (64, 64, None, 128, 3),
        (96, 96, None, 16, 1),
        (192, 128, None, 0, 1),
        (128, 128, torch.float8_e4m3fn, 16, 5),
        (96, 96, torch.float8_e4m3fn, 16, 1),
        (128, 128, None, 64, 7),
    ],
)
def test_gpu_two_consumers_by_rule_on_short_queries(dqk, dvo, kv_dtype, page_size, group, monkeypatch):
    """Short queries over a prefix take ``NARROW`` (128-row blocks) by the rule at D 64, 96, Dqk 192,
    8-bit K/V at D 96 and 128 and pages of 64 / 128: odd lengths, shuffled pages, a grid of 1-3 programs
    on half the cases so that every program walks many items, checked row by row against the float64
    oracle."""
    r = random.Random(dqk * 1000 + page_size * 10 + group)
    if r.random() < 0.5:
        programs = r.randint(1, 3)
        monkeypatch.setattr(hp, "_num_sms", lambda device: programs)
    n = r.randint(5, 11)
    lens_q = [r.randint(1, 128 // group) for _ in range(n)]  # (<= 128 rows: 192-row blocks pad 1.5x)
    lens_kv = [q + r.choice([0, 1, 63, 200, 517]) for q in lens_q]
    hkv = r.choice([1, 2])
    case = make_case(
        r.randint(0, 10**6),
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=group * hkv,
        hkv=hkv,
        dqk=dqk,
        dvo=dvo,
        page_size=page_size,
        dtype=BF16,
        kv_dtype=kv_dtype,
        device="cuda",
    )
    cfg = hp.config(batch_of(case))
    assert (cfg.consumers, cfg.consumer_regs) == (2, hp.NARROW["consumer_regs"]), cfg
    check_forced(case)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(500, 540))
def test_gpu_random_grid_forced(seed, monkeypatch):
    """Odd seeds shrink the persistent grid to 1-3 programs so that every program walks many work items
    (the ring's phases carried across items); items dealt in chunks of 0 (all), 1, 2, 3 or 4 pairs, in
    static rounds or off the work counter, 64-key or 128-key tiles, scales up to 2 (running maxima move)."""
    if seed % 2:
        monkeypatch.setattr(hp, "_num_sms", lambda device, n=1 + seed % 3: n)
    params = hopper_params(seed)
    params["scale"] = (None, 0.3, 1.0, 2.0)[seed % 4]
    knobs = dict(chunk=seed % 5, dynamic=seed // 2 % 2, **(TILES_128 if seed % 3 == 0 and params["dqk"] == 128 else {}))
    check_forced(make_case(seed, **params), **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "group, dqk, knobs",
    [
        (3, 128, {}),
        (4, 128, dict(consumers=2, consumer_regs=216)),
        (6, 128, dict(stages=2)),
        (4, 128, dict(BLOCK_N=32)),
        (4, 128, dict(BLOCK_N=128, stages=2)),
        (4, 192, {}),
        (7, 64, dict(rowsum=1)),  # (D 64's row sums by a wgmma: the default there without an LSE)
        (5, 64, {}),
        (3, 128, dict(rowsum=1)),  # (... and by a wgmma where they are not by default)
        (6, 96, dict(rowsum=1)),
        (5, 256, dict(rowsum=1)),
        (5, 256, {}),
        (3, 96, {}),
        (4, 96, dict(BLOCK_N=32)),
        (4, 256, dict(BLOCK_N=64, stages=2)),
        (4, 256, dict(BLOCK_N=64, stages=2, split=1)),  # (K and V on barriers of their own)
    ],
)
def test_gpu_tile_boundaries(group, dqk, knobs, monkeypatch):
    """Causal consumers' own key ranges ending one key either side of tile boundaries (an off-by-one in
    a consumer's tile count or unmasked range changes the output), 2 or 3 consumers, 2-stage rings,
    32/64/128-key tiles, D 96, Dqk 192, D 256, GQA 3, 5, 6, 7."""
    monkeypatch.setattr(hp, "_num_sms", lambda device: 2)
    case = make_case(
        51,
        lens_q=[40, 41, 150, 90],
        lens_kv=[65, 84, 100, 2000],
        hq=2 * group,
        hkv=2,
        dqk=dqk,
        dvo=128 if dqk == 192 else dqk,
        page_size=16,
        dtype=F16,
        causal=True,
        device="cuda",
    )
    check_forced(case, **knobs)


def _paged16_causal_case(seed: int, lens_q: list, lens_kv: list, group: int, dqk: int):
    """A causal bf16 case on the GPU over pages of 16 tokens (K/V tiles by TMA), two KV heads."""
    return make_case(
        seed,
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=2 * group,
        hkv=2,
        dqk=dqk,
        dvo=dqk,
        page_size=16,
        dtype=BF16,
        causal=True,
        device="cuda",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [0, 1])
@pytest.mark.parametrize("dqk", [64, 128, 256])
def test_gpu_gather_warps_long_items_end_on_gathered_tiles(dynamic, dqk, monkeypatch):
    """16-bit K/V by TMA (one warp issuing, two gathering): a program walks many items of 15-40 key
    tiles (more than twice the ring), each ending on a tile across kv_len that the gather warps fill:
    they must not take that tile's stage before the consumers released its previous tiles."""
    monkeypatch.setattr(hp, "_num_sms", lambda device: 2)
    r = random.Random(dqk + dynamic)
    lens_kv = [64 * r.randint(15, 40) + r.randint(1, 63) for _ in range(9)]
    case = _paged16_causal_case(dqk + dynamic, [r.randint(20, 130) for _ in lens_kv], lens_kv, 4, dqk)
    check_forced(case, dynamic=dynamic)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [0, 1])
@pytest.mark.parametrize("dqk, knobs", [(256, dict(BLOCK_N=64, stages=2, split=1)), (128, {}), (64, {})])
def test_gpu_gather_warps_items_on_whole_tiles(dynamic, dqk, knobs, monkeypatch):
    """16-bit K/V by TMA (one warp issuing, two gathering): most items end on a whole tile (kv_len a
    multiple of 64), so the gather warps fill nothing for them and the consumers may run many tiles
    ahead of those warps; one item in five ends across kv_len. Run to the end and right: gather warps
    that waited on the stages' empty barriers themselves hung here (a 2-stage ring: a parity seen an
    even number of phases late never completes once the consumers are done)."""
    monkeypatch.setattr(hp, "_num_sms", lambda device: 2)
    r = random.Random(7 * dqk + dynamic)
    lens_kv = [64 * r.randint(6, 30) + (r.randint(1, 63) if i % 5 == 4 else 0) for i in range(11)]
    case = _paged16_causal_case(dqk + 3 * dynamic, [min(kv, r.randint(20, 300)) for kv in lens_kv], lens_kv, 3, dqk)
    check_forced(case, dynamic=dynamic, **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("slope", [0.004, 0.03, 0.3, -0.03])
@pytest.mark.parametrize("dqk, kv8", [(128, False), (96, False), (256, False), (64, False), (128, True), (128, "qkv")])
def test_gpu_running_max_grows_across_tiles(slope, dqk, kv8):
    """Logits that rise (or fall) along the keys: each row's running max grows by a little per tile
    (kept stale until it passes 2^8 of headroom, then O is rescaled) or by a lot (every tile rescales),
    one row block of noise on top; D 96 rescales two accumulators; 8-bit K/V on float16 GEMMs; e4m3 q,
    k and v on 8-bit GEMMs (P up to 2^8 in e4m3); D 64 rescales the row sums' wgmma accumulator with O."""
    lens_kv = [1500, 333]
    case = make_case(
        77 + dqk,
        lens_q=[300, 333],
        lens_kv=lens_kv,
        hq=6,
        hkv=2,
        dqk=dqk,
        page_size=0,
        dtype=E4M3 if kv8 == "qkv" else BF16,
        kv_dtype=torch.float8_e4m3fn if kv8 else None,
        causal=True,
        device="cuda",
    )
    kw = case.kwargs
    # logit slope per key: q[0] * k[0] * scale; with 8-bit K the ramp rides on q (k stays below e4m3's 448)
    lift = 256.0 if kv8 else 4.0
    kw["q"][..., 0] = lift
    ramp = torch.cat([torch.arange(n, device="cuda") for n in lens_kv]).float() * slope * math.sqrt(dqk) / lift
    k = kw["k_cache"]
    scale = float(kw["k_scale"]) if kv8 else 1.0
    if kv8:
        assert (ramp / scale).abs().max() < 440
    # (ragged rows: sequences packed; 16-bit K flattens past 400, the logits then stop rising)
    k[:, :, 0] = (ramp[:, None] / scale).clamp(-400, 400).to(k.dtype)
    # (8-bit wgmmas accumulate with less than float32's precision, ~2^-13 of the logit measured here
    # on the H200: the LSE of logits in the hundreds is off by that share of them; bound 2^-12)
    logit = float(ramp.abs().max()) * lift * float(kw.get("q_scale", 1.0)) / math.sqrt(dqk)
    # (D 64: the row sums by a wgmma, rescaled with O; with an LSE only by the knob)
    knobs = dict(rowsum=1) if dqk == 64 else {}
    check_forced(case, lse_atol=2e-2 + (2.0**-12 * logit if kv8 == "qkv" else 0.0), **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, dynamic", [(True, 0), (False, 1)])
def test_gpu_chunked_dealing_short_last_chunk(causal, dynamic, monkeypatch):
    """Many row blocks per pair, 6 pairs dealt in chunks of 4 (the last one short) on a 3-program grid,
    and the same call again on the same workspace (the work counter starts from zero every run)."""
    monkeypatch.setattr(hp, "_num_sms", lambda device: 3)
    case = make_case(
        41,
        lens_q=[700, 300, 520],
        lens_kv=[900, 300, 1000],
        hq=12,
        hkv=2,
        dqk=128,
        page_size=16,
        dtype=BF16,
        causal=causal,
        device="cuda",
    )
    for _ in range(2):
        case.kwargs["out"].fill_(float("nan"))
        case.kwargs["lse"].fill_(float("nan"))
        check_forced(case, chunk=4, dynamic=dynamic)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1600, 1630))
def test_gpu_random_grid_shares(seed, monkeypatch):
    """The last static round's items split by keys into 2-5 shares (forced), float32 partials merged
    after the kernel: the random grid on persistent grids of 1-4 programs (so that the shares follow
    whole items on each program), every head dim and page size, windows and soft-caps on a third of
    the seeds, fp8 K/V on a quarter; uncovered rows of the poisoned out / lse stay untouched."""
    monkeypatch.setattr(hp, "_num_sms", lambda device, n=1 + seed % 4: n)
    r = random.Random(seed)
    params = hopper_params(seed)
    params["workspace_bytes"] = 64 << 20
    if seed % 3 == 0:
        params["window_left"] = r.choice([17, 64, 200])
        params["logits_soft_cap"] = 30.0
    if seed % 4 == 1:
        params["kv_dtype"] = torch.float8_e4m3fn
    knobs = dict(dynamic=0, shares=2 + seed % 4, chunk=seed % 3)
    case = make_case(seed, **params)
    with tuning.override("triton", num_splits=1), tuning.override("hopper", **knobs):
        plan = planned(case, "triton")[1].backend
    assert isinstance(plan, hp.HopperPlan) and plan.shares == (knobs["shares"] if any(case.lens_q) else 1)
    out, lse = call(case, knobs=dict(num_splits=1), hopper=knobs)
    check(case, out, lse, atol=atol_for(params["dtype"], params.get("kv_dtype")), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_chunked_prefill_splits_its_last_round(causal, monkeypatch):
    """Chunked prefill on an 8-program grid: 44 items make five rounds and 4 items, which the plan
    splits in two by keys on its own; the result matches the oracle, run twice on one workspace
    (the second run's partials overwrite the first's), and matches the same call unsplit."""
    monkeypatch.setattr(hp, "_num_sms", lambda device: 8)
    case = make_case(
        43,
        lens_q=[512, 512],
        lens_kv=[4096, 4096],
        hq=8,
        hkv=2,
        dqk=128,
        page_size=16,
        dtype=BF16,
        causal=causal,
        device="cuda",
    )
    with tuning.override("triton", num_splits=1):
        plan = planned(case, "triton")[1].backend
    assert (plan.tail_base, plan.shares) == (40, 2)
    for _ in range(2):
        case.kwargs["out"].fill_(float("nan"))
        case.kwargs["lse"].fill_(float("nan"))
        out, lse = call(case, knobs=dict(num_splits=1))
        check(case, out, lse, atol=atol_for(BF16), lse_atol=2e-2)
    whole, whole_lse = call(case, knobs=dict(num_splits=1), hopper=dict(shares=1))
    assert (out.float() - whole.float()).abs().max() < 2e-2
    assert (lse - whole_lse).abs().max() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1400, 1424))
def test_gpu_random_grid_fp8_kv(seed, monkeypatch):
    """e4m3 / e5m2 K/V widened to q's dtype in the kernel (TMA or cp.async into the staging slots),
    with their device scales folded in, on the random grid: every head dim, page size and layout, small
    persistent grids, both schedules, variants on a third of the seeds."""
    if seed % 2:
        monkeypatch.setattr(hp, "_num_sms", lambda device, n=1 + seed % 3: n)
    r = random.Random(seed)
    params = hopper_params(seed)
    params["kv_dtype"] = (torch.float8_e4m3fn, torch.float8_e5m2)[seed % 2]
    if seed % 3 == 0:
        params["window_left"] = r.choice([17, 64, 200])
        params["logits_soft_cap"] = 30.0
    knobs = dict(chunk=seed % 5, dynamic=seed // 2 % 2)
    case = make_case(seed, **params)
    assert hp.config(batch_of(case)) is not None and hp.unavailable_reason(batch_of(case)) is None
    out, lse = call(case, knobs=dict(num_splits=1), hopper=knobs)
    check(case, out, lse, atol=atol_for(params["dtype"], params["kv_dtype"]), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "q_dtype, dqk", [(BF16, 64), (BF16, 96), (BF16, 128), (BF16, 192), (BF16, 256), (E4M3, 64), (E4M3, 128)]
)
@pytest.mark.parametrize("page_size", [16, 1, 0])
def test_gpu_fp8_tile_boundaries(q_dtype, dqk, page_size, monkeypatch):
    """8-bit K/V (widened for bf16 q; e4m3 q on 8-bit wgmmas, V transposed): consumers' key ranges
    ending either side of tile boundaries (the last tile gathered, the rest by TMA or all gathered),
    GQA 3 and 5 (Q copied by the consumers), items many per program (the staging slots' and the ring's
    phases carried across items), a negative k_scale or q_scale (no max-first shortcut) on D 128, and
    the bound launch on the second run.

    e4m3 q: k_scale x 16 makes each row's logits span 9-42 log2 units, so a row max taken before a
    negative scale would push P far past e4m3's range, and most rows' outputs stand well above the
    tolerance. That is 4% of the largest |v|: rounding P to e4m3 moves an output by at most 2^-4 of
    it, and a float64 emulation of that rounding on these cases reads 0.9-1.3%."""
    monkeypatch.setattr(hp, "_num_sms", lambda device: 2)
    group = 3 if dqk in (64, 128, 256) else 5
    case = make_case(
        52 if q_dtype == BF16 else 53,
        lens_q=[40, 41, 150, 90],
        lens_kv=[65, 84, 100, 1500],
        hq=2 * group,
        hkv=2,
        dqk=dqk,
        dvo=128 if dqk == 192 else dqk,
        page_size=page_size,
        dtype=q_dtype,
        kv_dtype=torch.float8_e4m3fn,
        causal=True,
        device="cuda",
    )
    kw = case.kwargs
    atol = atol_for(q_dtype, torch.float8_e4m3fn)
    if q_dtype == E4M3:
        kw["k_scale"] = kw["k_scale"] * 16
        atol = 0.04 * float(kw["v_cache"].float().abs().max() * kw["v_scale"])
    if dqk == 128:
        name = "k_scale" if q_dtype == BF16 else "q_scale"
        kw[name] = -kw[name]
    assert hp.unavailable_reason(batch_of(case)) is None
    for _ in range(2):  # (the second run: the bound launch)
        kw["out"].fill_(float("nan"))
        out, lse = call(case, knobs=dict(num_splits=1))
        check(case, out, lse, atol=atol, lse_atol=2e-2)


def _largest(t: torch.Tensor) -> float:
    """max |t| (0 for an empty tensor: a batch of empty sequences)."""
    return float(t.float().abs().max()) if t.numel() else 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1500, 1524))
def test_gpu_random_grid_fp8_qkv(seed, monkeypatch):
    """e4m3 q, k and v on 8-bit wgmmas (V transposed by the load warps, P converted in registers) on the
    random grid at D 64 and 128: every page size and layout, GQA 1-8 (3, 5, 7 included), small
    persistent grids, both schedules, 64-key, 128 x 128 and 32-key tiles, a negative q_scale (no
    max-first shortcut) on a quarter of the seeds, windows and sinks each alone and with a soft-cap.

    k_scale x 16 sharpens the logits, so that outputs stand near single V rows (about half the rows
    above twice the tolerance, where an all-zero output fails; with the data's own scales 3%), and
    the tolerance is 4% of the largest |v|, as in :func:`test_gpu_fp8_tile_boundaries`."""
    if seed % 2:
        monkeypatch.setattr(hp, "_num_sms", lambda device, n=1 + seed % 3: n)
    r = random.Random(seed)
    params = hopper_params(seed)
    params["dqk"] = params["dvo"] = r.choice([64, 128])
    params["dtype"] = E4M3
    params.pop("kv_dtype", None)
    if seed % 3 == 0:
        params["window_left"] = r.choice([17, 64, 200])
    if seed % 3 == 1:
        params["sinks"] = True
    if seed % 6 in (0, 1):
        params["logits_soft_cap"] = 30.0
    knobs = dict(chunk=seed % 5, dynamic=seed // 2 % 2)
    if seed % 4 == 1:
        knobs.update(TILES_128)
    if seed % 4 == 3:
        knobs.update(BLOCK_N=32)
    case = make_case(seed, **params)
    kw = case.kwargs
    kw["k_scale"] = kw["k_scale"] * 16
    if seed % 4 == 2:
        kw["q_scale"] = -kw["q_scale"]
    atol = 0.04 * _largest(kw["v_cache"]) * float(kw["v_scale"])
    # (8-bit wgmmas accumulate to ~2^-13 of the logit: see test_gpu_running_max_grows_across_tiles)
    # (a bound on |logit| by Cauchy-Schwarz: the largest q row norm times the largest K row norm)
    logit = _largest(kw["q"].float().norm(dim=-1)) * _largest(kw["k_cache"].float().norm(dim=-1))
    logit *= abs(float(kw["q_scale"] * kw["k_scale"]) * kw["scale"])
    assert hp.unavailable_reason(batch_of(case)) is None
    out, lse = call(case, knobs=dict(num_splits=1), hopper=knobs)
    check(case, out, lse, atol=atol, lse_atol=2e-2 + 2.0**-12 * logit)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1300, 1330))
def test_gpu_random_grid_variants(seed, monkeypatch):
    """Windows (narrower than a tile, a tile, a block, wider than the keys), soft-capping and sinks on
    the Hopper kernel, in every combination, on small persistent grids."""
    if seed % 2:
        monkeypatch.setattr(hp, "_num_sms", lambda device, n=1 + seed % 3: n)
    r = random.Random(seed)
    params = hopper_params(seed)
    if seed % 3 != 2:
        params["window_left"] = r.choice([0, 1, 17, 63, 64, 65, 191, 200, 1000, 5000])
    if seed % 3 != 1:
        params["logits_soft_cap"] = r.choice([2.0, 30.0, 50.0])
    params["sinks"] = seed % 4 < 2
    params["scale"] = (None, 0.5, 1.0)[seed % 3]
    knobs = dict(dynamic=seed // 2 % 2, **(TILES_128 if seed % 5 == 0 and params["dqk"] == 128 else {}))
    check_forced(make_case(seed, **params), **knobs)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 31, 63, 64, 100, 127, 128, 129, 500])
def test_gpu_window_tile_boundaries(window, monkeypatch):
    """Windows whose lower edge falls one key either side of key-tile and row-block boundaries, causal
    and not, long enough that whole tiles are skipped."""
    monkeypatch.setattr(hp, "_num_sms", lambda device: 2)
    for causal in (True, False):
        case = make_case(
            61,
            lens_q=[190, 64, 400],
            lens_kv=[700, 64, 2000],
            hq=8,
            hkv=2,
            dqk=128,
            page_size=16,
            dtype=BF16,
            causal=causal,
            window_left=window,
            device="cuda",
        )
        check_forced(case)


@pytest.mark.gpu
def test_gpu_default_routing():
    """The Hopper kernel serves what it can unless split-KV is chosen; backend="auto" sends its
    calls to Triton (D 256 too, on TMA-boxed pages) except a handful of short prompts at D 128 (few
    key tiles per program, >= 20 GFLOP), and calls on the portable kernel (D 80) to cuDNN."""

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
            dtype=BF16,
            device="cuda",
        )

    served = (case(), case(page_size=1), case(page_size=8), case(page_size=0), case(dqk=64), case(dqk=192, dvo=128))
    for c in (*served, case(dqk=256), case(dqk=96)):
        assert tb.uses_hopper_kernel(batch_of(c))
    assert not tb.uses_hopper_kernel(batch_of(case(dqk=80)))
    assert not tb.uses_hopper_kernel(batch_of(case(lens_q=(4,), lens_kv=(9000,))))  # split-KV
    long = case(lens_q=(8192,), lens_kv=(8192,))
    four = case(lens_q=(2048,) * 4, lens_kv=(2048,) * 4)  # (34 GFLOP in 44 key tiles a program)
    assert not tb.few_tiles(batch_of(long)) and tb.few_tiles(batch_of(four)) and tb.few_tiles(batch_of(case()))
    # (the Triton kernel takes two consumers of 128-row items where few key tiles fall to each program)
    assert hp.config(batch_of(four)).consumers == hp.config(batch_of(case())).consumers == 2
    assert hp.config(batch_of(long)).consumers == 3
    for c, expect in (
        (case(), "triton"),  # (30 tokens: few tiles, but a kernel shorter than cuDNN's host time)
        (four, "cudnn"),  # (few key tiles a program)
        (long, "triton"),
        (case(dqk=64), "triton"),
        (case(dqk=80), "cudnn"),
        (case(dqk=96), "triton"),
        (case(dqk=256), "triton"),  # (two 64-key stages, K released apart from V: 1.04x cuDNN)
    ):
        out, _ = pagedprefill.cudnn_batch_prefill_with_kv_cache(**c.kwargs, backend="auto")
        assert pagedprefill.last_backend() == expect
        check_sampled(c, out, None, atol=atol_for(BF16))


@pytest.mark.gpu
def test_gpu_sibling_variant_compiled_at_first_launch():
    """A handful of short prompts runs on two consumers (few key tiles a program); its first launch
    also compiles the three-consumer variant, so that a long batch of the same layout then compiles
    nothing (GQA 5 keeps the layout apart from other tests'; both outputs checked)."""
    import triton

    def case(seed, lens):
        return make_case(
            seed,
            lens_q=lens,
            lens_kv=[n + 37 for n in lens],
            hq=10,
            hkv=2,
            dqk=128,
            page_size=32,
            dtype=BF16,
            device="cuda",
        )

    short, long = case(1800, [300, 211, 97]), case(1801, [4000, 3100, 2500, 3900])
    assert hp.config(batch_of(short)).consumers == 2 and hp.config(batch_of(long)).consumers == 3
    compiled = []
    old_hook = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(k.get("repr")) or False
    try:
        out, lse = call(short, knobs=dict(num_splits=1))
        torch.cuda.synchronize()
        check(short, out, lse, atol=atol_for(BF16))
        compiled.clear()
        out, lse = call(long, knobs=dict(num_splits=1))
        torch.cuda.synchronize()
        assert not compiled, f"compiled after the sibling's warm-up: {compiled}"
        check_sampled(long, out, lse, atol=atol_for(BF16))
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old_hook


@pytest.mark.gpu
@pytest.mark.parametrize("page_size, dynamic", [(16, 0), (0, 1), (1, 0)])
def test_gpu_cuda_graph_replay_forced(page_size, dynamic, monkeypatch):
    from test_backend_triton import graph_case

    monkeypatch.setattr(hp, "_num_sms", lambda device: 3)  # programs walk several work items
    r = random.Random(page_size)
    bsz, max_q, max_kv, dtype = 4, 200, 700, BF16

    def new_case(seed):
        lq = [r.randint(0, max_q) for _ in range(bsz)]
        lkv = [r.randint(0, max_kv) for _ in range(bsz)]
        return graph_case(seed, lq, lkv, max_q, max_kv, page_size, dtype, 16, 4)

    base = new_case(600)
    static = {k: v for k, v in base.kwargs.items() if isinstance(v, torch.Tensor)}
    with tuning.override("triton", num_splits=1), tuning.override("hopper", dynamic=dynamic):
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**base.kwargs, backend="triton")
        assert pagedprefill.last_backend() == "triton"
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
    """cp.async needs 16-byte rows: a K/V view at an odd element offset takes the portable kernel."""
    case = make_case(7, lens_q=[33], lens_kv=[70], hq=8, hkv=2, dqk=128, page_size=0, dtype=F16, device="cuda")
    k = case.kwargs["k_cache"]
    shifted = torch.empty(k.numel() + 1, dtype=k.dtype, device="cuda")[1:].view(k.shape)
    shifted.copy_(k)
    case.kwargs["k_cache"] = shifted
    assert hp.unavailable_reason(batch_of(case)) is not None
    out, lse = call(case)
    check(case, out, lse, atol=atol_for(F16), lse_atol=2e-2)


def test_interpreter_flag_is_shared():
    assert launch.INTERPRETED == (os.environ.get("TRITON_INTERPRET") == "1")


def test_desc_args_name_the_four_descriptors():
    """The bound launch takes the descriptors at DESC_ARGS of the kernel's arguments."""
    if hp.hk is None:
        pytest.skip(hp.IMPORT_ERROR)
    names = [p.name for p in hp.hk.attention_kernel.params]
    assert names[hp.DESC_ARGS] == ["k_desc", "k1_desc", "v_desc", "v1_desc", "q_desc"]


def test_tma_plan_for_d96_boxes_64_plus_32_columns():
    """D 96: K and V boxed as 64 + 32 columns, the 32-column boxes in 64-byte swizzled rows (the
    kernel's layout for those tiles); Q by the consumers' cp.async, O unstaged."""
    case = make_case(2, lens_q=[3], lens_kv=[70], hq=4, hkv=2, dqk=96, page_size=16, dtype=BF16)
    p, lp, ws = planned(case, "torch")
    box = hp._page_box(lp.batch, hp.DEFAULT)
    (k0, *_), (v0, *_), k1, v1 = hp._tma_plan(call_tensors(case, p, lp, ws), lp.batch, box)
    assert [list(d.block_shape) for d in (k0, k1, v0, v1)] == [[box, 64], [box, 32], [box, 64], [box, 32]]
    assert k1.layout.swizzle_byte_width == v1.layout.swizzle_byte_width == 64 and k0.layout.swizzle_byte_width == 128
    assert not hp.q_tma_applies(lp.batch, case.kwargs["q"]) and hp.o_stage_mode(lp.batch, False) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(560, 584))
def test_gpu_random_grid_device_vectors(seed, monkeypatch):
    """Lengths and offsets on the device, read by the Hopper kernel itself (no metadata table launch:
    ``write_device_table`` may not be called): random shapes, GQA ratios, page sizes, offset units,
    LSE layouts and persistent grids of 1-3 programs (odd seeds), against the float64 oracle."""
    from pagedprefill import workspace

    if seed % 2:
        monkeypatch.setattr(hp, "_num_sms", lambda device, n=1 + seed % 3: n)
    params = hopper_params(seed)
    params.update(lens_on_device=True, offsets=("elements", "tokens")[seed % 2])
    case = make_case(seed, **params)
    _, lp, _ = planned(case, "triton")
    if type(lp.backend).__name__ != "HopperPlan":
        pytest.skip(f"not the Hopper kernel here ({type(lp.backend).__name__})")
    assert lp.reads_vectors, "the Hopper kernel did not take the device vectors"
    monkeypatch.setattr(workspace, "write_device_table", lambda *a, **k: pytest.fail("a metadata table launch"))
    out, lse = call(case, knobs=dict(num_splits=1), hopper=dict(dynamic=seed // 2 % 2))
    check(case, out, lse, atol=atol_for(case.kwargs["q"].dtype), lse_atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1700, 1712))
def test_gpu_device_vectors_with_shares(seed, monkeypatch):
    """Device vectors read by the kernel (no table is carved: the scratch is the whole workspace) with
    the last static round split into 2-4 shares whose float32 partials live in that scratch, on
    persistent grids of 1-4 programs; the workspace, out and lse poisoned before each of two calls
    (the second through the one-shot call's cache), against the float64 oracle."""
    monkeypatch.setattr(hp, "_num_sms", lambda device, n=1 + seed % 4: n)
    params = hopper_params(seed)
    params.update(lens_on_device=True, offsets=("elements", "tokens")[seed % 2], workspace_bytes=64 << 20)
    knobs = dict(dynamic=0, shares=2 + seed % 3)
    case = make_case(seed, **params)
    with tuning.override("triton", num_splits=1), tuning.override("hopper", **knobs):
        lp = planned(case, "triton")[1]
    if type(lp.backend).__name__ != "HopperPlan":
        pytest.skip(f"not the Hopper kernel here ({type(lp.backend).__name__})")
    assert lp.reads_vectors and lp.backend.shares == knobs["shares"]
    for _ in range(2):
        for name in ("out", "lse", "workspace_buffer"):
            t = case.kwargs.get(name)
            if t is not None:
                t.fill_(255 if t.dtype == torch.uint8 else float("nan"))
        out, lse = call(case, knobs=dict(num_splits=1), hopper=knobs)
        check(case, out, lse, atol=atol_for(case.kwargs["q"].dtype), lse_atol=2e-2)


def _rows_probe_kernel():
    """A Gluon kernel that writes, for every sequence b, the 8 rows the Hopper kernel's work items read
    (:meth:`.hopper_kernel.rows.SequenceRows.of`) into OUT (8, n), as the table's row order."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from pagedprefill.backends.triton.hopper_kernel.rows import sequence_rows

    @gluon.jit
    def probe(OUT, n, META, LQ, LKV, OQ, OO, OK, OV, OS, IP, LP, max_q, max_kv, rows_q, rows_o, rows_k, rows_v,
              lse_rows, table_width, table_stride, num_indices, num_heads, lse_b_stride, PAGE_SIZE: gl.constexpr,
              VECTORS: gl.constexpr, CSR: gl.constexpr, HAS_OO: gl.constexpr, HAS_OV: gl.constexpr,
              LSE_MODE: gl.constexpr, UNIT_Q: gl.constexpr, UNIT_O: gl.constexpr, UNIT_K: gl.constexpr,
              UNIT_V: gl.constexpr, UNIT_S: gl.constexpr):  # fmt: skip
        rows = sequence_rows(META, n, LQ, LKV, OQ, OO, OK, OV, OS, IP, LP, max_q, max_kv, rows_q, rows_o, rows_k,
                             rows_v, lse_rows, table_width, table_stride, num_indices, num_heads, lse_b_stride,
                             VECTORS, CSR, HAS_OO, HAS_OV, LSE_MODE, UNIT_Q, UNIT_O, UNIT_K, UNIT_V,
                             UNIT_S)  # fmt: skip
        for b in range(n):
            r = rows.of(b, PAGE_SIZE, True)
            for i in gl.static_range(8):
                gl.store(OUT + i * n + b, r[i])

    return probe


@pytest.mark.gpu
@pytest.mark.parametrize("pages", [0, 1, 2])
@pytest.mark.parametrize("lse_mode", [0, 1, 2])
@pytest.mark.parametrize("units", ["tokens", "elements"])
def test_gpu_rows_from_device_vectors_are_the_tables(pages, lse_mode, units):
    """Each sequence's rows as the Hopper kernel computes them from device vectors equal the metadata
    table's definition (``device_table_torch``) on hostile vectors: lengths past their bounds and
    negative, offsets past the tensors' rows, negative and past 2^31 (int64), CSR pointers that fall
    or leave ``kv_indices``, last-page lengths out of [1, page_size]; and read from that table, too
    (whose paged K / V starts and ragged page-list starts are 0, as the work items take them)."""
    from pagedprefill.batch import DeviceVectors, per_token
    from pagedprefill.kernels.metadata import Bounds, device_table_torch

    r = random.Random(pages * 100 + lse_mode * 10 + (units == "tokens"))
    dev, bsz, hq, page_size = torch.device("cuda"), 37, 6, 16
    per = dict.fromkeys(("q", "o", "k", "v", "stats"), 1) if units == "tokens" else per_token(hq, 2, 64, 64)

    def vec(lo, hi, n=bsz, dtype=torch.int32):
        return torch.tensor([r.randint(lo, hi) for _ in range(n)], dtype=dtype, device=dev)

    def offsets(name, rows):
        u = per[name]
        t = vec(-3 * u, (rows + 40) * u, bsz + 1, dtype=r.choice([torch.int32, torch.int64]))
        if t.dtype == torch.int64:
            t[r.randrange(bsz)] = 2**33 + 5
        return t

    bd = Bounds(
        max_q=50,
        max_kv=300,
        rows_q=700,
        rows_o=650,
        rows_k=0 if pages else 2000,
        rows_v=0 if pages else 1900,
        lse_numel=600 * hq,
        lse_mode=lse_mode,
        pages=pages,
        table_width=7 if pages == 1 else 0,
        table_stride=9 if pages == 1 else 0,
        num_indices=120 if pages == 2 else 0,
        page_size=page_size if pages else 0,
        num_heads=hq,
        units=per,
    )
    offs = {"q": offsets("q", 700), "o": offsets("o", 650)}
    if not pages:
        offs.update(k=offsets("k", 2000), v=offsets("v", 1900))
    if lse_mode == 2:
        offs["stats"] = offsets("stats", 600)
    if r.random() < 0.5:
        del offs["o"]
    ip = vec(-4, 130, bsz + 1) if pages == 2 else None
    last = vec(-2, 20) if pages == 2 else None
    vecs = DeviceVectors(vec(-5, 90), None if pages == 2 else vec(-5, 500), offs, ip, last, units)
    table = torch.full((8, bsz), -9, dtype=torch.int32, device=dev)
    device_table_torch(bd, vecs.lens_q, vecs.lens_kv, offs, ip, last, table)
    ints, modes = hp.vector_args(bd, vecs)
    probe = _rows_probe_kernel()
    for from_vectors in (True, False):
        got = torch.full((8, bsz), -11, dtype=torch.int32, device=dev)
        tensors = hp.vector_tensors(vecs) if from_vectors else (None,) * 9
        args = ints if from_vectors else (None,) * len(ints)
        kw = modes if from_vectors else dict(modes, VECTORS=False)
        probe[(1,)](got, bsz, table, *tensors, *args[:-1], hq, args[-1], PAGE_SIZE=bd.page_size, **kw, num_warps=4)
        torch.cuda.synchronize()
        assert torch.equal(got, table), (from_vectors, (got != table).nonzero()[:5].tolist(), got, table)
