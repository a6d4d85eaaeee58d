"""Configuration and launches of the Hopper kernel (:mod:`.hopper_kernel`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace

import torch

from pagedprefill import tuning
from pagedprefill.batch import CallTensors, DeviceVectors, PrefillBatch
from pagedprefill.kernels import metadata
from pagedprefill.kernels.launch import INTERPRETED, LaunchSlot, bind, fast_launch
from pagedprefill.kernels.metadata import Bounds

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import hopper_kernel as hk

    IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the Triton build
    gl = hk = TensorDescriptor = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

LOG2E = 1.4426950408889634
SMEM_BYTES = 227 * 1024 - 1024  # sm_90's shared memory per block, less room for the barriers


@dataclass(frozen=True)
class Config:
    """Launch knobs of the kernel (compile-time constants, except ``chunk`` and ``dynamic``).

    ``BLOCK_M = 64 * consumers`` query rows per work item; the register split is per thread and must
    satisfy ``128 * consumers * consumer_regs + 32 * load_warps * load_regs <= 65536``.
    """

    # keys per pipeline stage; 128 (FA3's causal D 128 tile, with consumers=2) is no rule's choice: a
    # knob kept correct on every path, the instrument for tile-shape attempts (decisions.md: 3-36% slower)
    BLOCK_N: int = 64
    stages: int = 5  # K/V shared-memory ring depth (fewer where Q and the ring would not fit)
    consumers: int = 3  # softmax/MMA warpgroups of 64 rows each (2 or 3)
    load_warps: int = 4  # (not where one warp issues the TMA copies: see `issues_alone`)
    consumer_regs: int = 152
    load_regs: int = 56
    # (sequence, KV head) pairs whose row blocks are dealt together; 0: all pairs. Off the work counter
    # `config` takes DYNAMIC_CHUNK
    chunk: int = 4
    # 1: items come off a per-call work counter as each program's loads reach them, instead of static
    # snake-ordered rounds: faster on varlen, 4k prompts, D 64 and MLA; slower on chunked prefill and
    # 1k prompts, where static rounds keep the programs that share K/V in step (L2 hits)
    dynamic: int = 1
    # 1: K and V of a stage on their own barriers, K released after its QK GEMM (16-bit K/V by TMA;
    # elsewhere the kernel ignores it): faster at D 256 on two 64-key stages, 3-5% slower at D 96 / 128
    split: int = 0
    # static rounds: split the last round's items by keys into this many shares (0: as
    # `tail_shares` decides; 1: never), each merged after the kernel
    shares: int = 0
    # 1: row sums by a wgmma of P against a block of ones (the kernel's ROWSUM), 0: by each thread's FADDs;
    # -1: as `tensor_row_sums` decides
    rowsum: int = -1
    # 1: the first two consumer warpgroups run as one partition of 8 warps (one copy of their code; see
    # hopper_kernel/sync.py for why they need not meet at every key tile); -1: as `merged_consumers` decides
    merged: int = -1

    @property
    def BLOCK_M(self) -> int:
        return 64 * self.consumers


DEFAULT = Config()
# where one warp issues the TMA copies (`issues_alone`): the warps that gather each item's tile across
# kv_len, and widen every 8-bit tile (the issuing warp, these and one idle warp make up the load warps'
# warpgroup, so the register split is unchanged)
ISSUER_GATHER_WARPS = 2
# off the work counter, chunks of 8 pairs: +6% on fp8 K/V (b8 q2k), +4% on its bf16 data and +3% on
# 4k prompts, level elsewhere (heaviest first over more pairs: fewer light items left at the end)
DYNAMIC_CHUNK = 8
# Dvo 256: O's accumulator alone is 128 registers per thread: two consumers of 224 (ptxas: no spill in
# the key loop; at 240 with two load warps the first consumer gets 200 and spills, load warps are
# padded to a warpgroup); beside Q (64 KiB), five 32-key stages (1.8x two 64-key ones released whole)
D256 = {"consumers": 2, "BLOCK_N": 32, "stages": 5, "consumer_regs": 224, "load_warps": 4, "load_regs": 56}
# ... and with 16-bit K/V whose tiles come by TMA: two 64-key stages, each K released once its QK GEMM
# is done (`split`), so that the next tiles' K is in flight while V still serves the PV GEMM; without
# the split two 64-key stages leave the loads exposed (0.8x five of 32 keys), with it 1.1x
D256_SPLIT = {"BLOCK_N": 64, "stages": 2, "split": 1}
# two consumers of 64 rows where a row block of 192 would pad a short query's rows by >= 1.2x more
# than one of 128 (`prefers_narrow`), and where each program would see few key tiles (`few_tiles`)
NARROW = {"consumers": 2, "consumer_regs": 224}
# 8-bit q, K and V: tiles are half the bytes, so the ring holds eight where shared memory allows (+2% on
# 8k prompts at D 128 and on D 64, two rounds each; with 16-bit q, fp8 K/V and D 64 bf16 read level)
F8_STAGES = 8
# D 96 with 16-bit K/V: a 64-key stage is 24 KiB, so six fit beside Q (+1.8% on d96_mha_b4_q4k, two
# rounds against five)
D96_STAGES = 6
# a `consumers` knob without `consumer_regs` takes the register split of the config with that many
CONSUMER_REGS = {DEFAULT.consumers: DEFAULT.consumer_regs, NARROW["consumers"]: NARROW["consumer_regs"]}
KNOBS = tuple(f.name for f in fields(Config))
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))  # (Dqk, Dvo) the kernel is built for
F8_HEAD_DIMS = ((64, 64), (128, 128))  # ... with 8-bit q, K and V on 8-bit wgmmas


def first_part(d: int) -> int:
    """Columns of a head dim's first GEMM part (the kernel's DQ0 / DV0): tensors are powers of two, so
    96 runs as 64 + 32, and K past 128 columns as a second part (192: 128 + 64, 256: 128 + 128)."""
    return 64 if d == 96 else min(d, 128)


def unavailable_reason(batch: PrefillBatch) -> str | None:
    """Why this kernel cannot serve the call (None when it can); the portable kernel serves it then."""
    if hk is None:
        return f"Gluon is not importable: {IMPORT_ERROR}"
    dt = batch.q.dtype
    if batch.fp8_q:  # (8-bit wgmmas)
        if not dt == batch.k.dtype == batch.v.dtype == torch.float8_e4m3fn:
            return "fp8 q with q, k and v all float8_e4m3fn"
        if (batch.head_dim_qk, batch.head_dim_vo) not in F8_HEAD_DIMS:
            return "fp8 q with head dims other than Dqk = Dvo in {64, 128}"
    else:
        kv_ok = batch.k.dtype == dt or batch.fp8_kv  # (8-bit K/V are widened to q's dtype in the kernel)
        if dt not in (torch.float16, torch.bfloat16) or not kv_ok or batch.v.dtype != batch.k.dtype:
            return "q 16-bit, and k and v in q's dtype or one fp8 dtype (or q, k, v all float8_e4m3fn)"
        if (batch.head_dim_qk, batch.head_dim_vo) not in HEAD_DIMS:
            return "head dims other than Dqk = Dvo in {64, 96, 128, 256} and Dqk 192 / Dvo 128"
        if batch.q_scaled:
            return "a q_scale tensor with 16-bit q"
    if not batch.scale > 0:
        return "a non-positive scale"
    # cp.async copies 16-byte chunks, and Triton proves an integer's alignment only as "divisible by
    # 16": every q, K and V stride must be a multiple of 16 elements
    for name, lay, aligned in zip("qkv", (batch.q, batch.k, batch.v), batch.aligned):
        if not aligned or any(st % 16 for st in lay.stride[:-1]):
            return f"{name} strides are not multiples of 16 elements, or its rows not 16-byte aligned (cp.async)"
    if batch.device.type != "cuda" or INTERPRETED:
        return "not a CUDA device"
    if torch.cuda.get_device_capability(batch.device) != (9, 0):
        return "the Hopper kernel is written for sm_90 (wgmma)"
    return None


def issues_alone(batch: PrefillBatch, cfg: Config, use_tma: bool) -> bool:
    """Whether one warp of its own issues the K/V tiles' TMA copies while ``ISSUER_GATHER_WARPS`` warps
    gather each item's tile across kv_len, in place of ``load_warps`` warps doing both in step: 16-bit
    K/V by TMA on tiles of <= 64 keys. Against the warps in step on the H200: +2-8% (chunked prefill
    +8%, D 256 +6%, D 96 +5%, D 64 +3%, 16k +2%), 128 sequences of <= 256 queries -1.5%; on
    128-key tiles (a knob) -2.5%, where its two gather warps also spill.

    8-bit K/V widened for 16-bit q, by TMA, at D 64 and 96: the two warps widen every tile (and gather
    the one across kv_len) while the issuing warp fills the staging slots: +8% on d64_b16_q2k and +12%
    on d96_mha_b4_q4k with e4m3 K/V. At D 128 two warps widen too slowly (-2% on fp8kv_b8_q2k; four
    beside the issuing warp are two warpgroups of 24 registers: -9%), Dqk 192 -7.5%, D 256 level."""
    if batch.fp8_kv and not batch.fp8_q:
        return use_tma and cfg.BLOCK_N <= 64 and (batch.head_dim_qk, batch.head_dim_vo) in ((64, 64), (96, 96))
    return _k16_by_tma(batch, use_tma) and cfg.BLOCK_N <= 64


def _k16_by_tma(batch: PrefillBatch, use_tma: bool) -> bool:
    """Whether K/V tiles come by TMA in q's 16-bit dtype (not widened or transposed 8-bit tiles)."""
    return use_tma and not (batch.fp8_kv or batch.fp8_q)


def _narrow_layout(batch: PrefillBatch) -> bool:
    """Where ``NARROW`` was measured and may be picked: 16-bit q with K/V in its dtype at D 64, 96,
    128 and Dqk 192 / Dvo 128, or e4m3 / e5m2 K/V at D 96 and 128; ragged or in pages of >= 16 tokens
    (the cp.async gather of smaller pages: not measured). D 256 runs on two consumers anyway; fp8 q/k/v
    (D 64 and 128) and 8-bit K/V at D 64 read level on two consumers (+1 to +3%, inside the spread);
    8-bit K/V at Dqk 192 was not measured (the 8-bit rows were, with e4m3)."""
    if batch.fp8_q or batch.head_dim_vo > 128:
        return False
    if batch.fp8_kv and (batch.head_dim_qk, batch.head_dim_vo) not in ((96, 96), (128, 128)):
        return False
    return not (batch.paged and batch.page_size < 16)


def prefers_narrow(batch: PrefillBatch) -> bool:
    """Whether ``NARROW`` beat ``DEFAULT`` for calls like this one (:func:`_narrow_layout`): a
    sequence's ``max_q * group`` rows padded to 192-row blocks take >= 1.2x the rows they take in
    128-row blocks (64-token queries at GQA 4: 384 against 256 rows). 256 queries of 64 tokens over a
    512-token prefix, two consumers against three: +7% at D 128 (H200), and on an H100 +13% at D 128
    in pages of 64, +6.5% at D 64, +3.5% at D 96 (MHA), +9% at Dqk 192 (MHA, 64 sequences), +11% with
    e4m3 K/V at D 128, +10.5% with e4m3 K/V at D 96 (MHA). Where padding is even, two consumers lose
    6% (fewer rows share each K/V tile)."""
    if not _narrow_layout(batch):
        return False
    rows = batch.work_q * batch.group_size
    return 5 * (-(-rows // 192) * 192) >= 6 * (-(-rows // 128) * 128)


def static_rounds(batch: PrefillBatch, block_m: int) -> bool:
    """Whether items go in static rounds rather than off the work counter: chunked prefill (``max_kv >=
    4 max_q``), and prompts of at most 1024 tokens unless their lengths are uneven (the longest >= 384
    tokens, the row blocks under 80% filled: programs that share K/V in step gain less there than the
    counter's balance; `tune_hopper.py` on the H200: 32 ragged prompts of 16-505 tokens +5.5% off the
    counter, 16 of 128-1014 +8%, 64 of 16-975 +8%; 128 of 8-256 tokens -15%, 16 equal 1k prompts -10%;
    384 lies between the longest prompts measured either way). With lengths on the device (no sync:
    ``max_q`` is the caller's bound) the fill is estimated from q's rows (their sum, or a bound of it)
    with half a block of padding a sequence, and only prompts averaging >= 192 tokens may take the
    counter (a loose bound over short prompts would otherwise look uneven)."""
    if batch.work_kv >= 4 * batch.work_q:
        return True
    if batch.work_q > 1024 or batch.work_q < 384:
        return batch.work_q <= 1024
    g, h, n = batch.group_size, batch.host, batch.batch_size
    per_seq = -(-batch.work_q * g // block_m)
    if h is None:
        rows = min(batch.q.rows, n * batch.work_q)
        if rows < 192 * n:
            return True
        filled = -(-rows * g // block_m) + n // 2
    else:
        filled = sum(-(-q * g // block_m) for q in h.lens_q)
    return 5 * filled >= 4 * per_seq * n


# host lengths that give each program fewer key tiles of 192-row items than this (D 128, 16-bit K/V)
# run on two consumers (+4..+24% over three) and, at >= 20 GFLOP, on cuDNN (`tune_hopper.py`, two
# rounds each, 4-32 prompts of <= 1024 tokens without prefix: cuDNN 1.05x three consumers at 83 tiles a
# program, 1.08x at 38, 1.16x at 46, 1.24x at 15; Triton 1.10x at 128 tiles, 1.18x at 157 and 1.16x at
# 191; on two consumers cuDNN 1.00-1.06x): `dispatch.auto_order` sends them to cuDNN
FEW_TILES = 100


def tiles_per_program(
    batch: PrefillBatch, programs: int, limit: float = math.inf, block_m: int = 192, block_n: int = 64
) -> float:
    """Key tiles of ``block_m``-row items per program (host lengths; closed form per sequence: item
    m of n sees ``kv - q + (m + 1) block_m / group`` keys when causal, none for the first m0 items
    where that is <= 0 (fewer keys than queries), half a tile of rounding each). The count stops
    once it passes ``limit`` (what it returns then is only known to exceed it)."""
    g, tot = batch.group_size, 0.0
    stop = limit * programs / batch.num_kv_heads
    for q, kv in zip(batch.host.lens_q, batch.host.lens_kv):
        if q <= 0 or kv <= 0:
            continue
        n = -(-q * g // block_m)
        whole = n * -(-kv // block_n)
        if batch.causal:
            m0 = min(max((q - kv) * g // block_m, 0), n)
            k = n - m0
            part = (k * (kv - q) + block_m / g * (n * (n + 1) - m0 * (m0 + 1)) / 2) / block_n + k / 2
            tot += min(max(part, 0.0), whole)
        else:
            tot += whole
        if tot > stop:
            break
    return tot * batch.num_kv_heads / programs


def few_tiles(batch: PrefillBatch) -> bool:
    """Whether this D 128 call with 16-bit K/V and host lengths leaves each program under
    :data:`FEW_TILES` key tiles (a handful of short prompts: too few items to keep the persistent
    grid's programs busy). False off a GPU, in pages of >= 64 tokens (8 prompts of 1k in pages of 64 on
    an H100: three consumers 400 TF/s, two 322, cuDNN 373) and where it was not measured: device
    lengths, a window, sinks or soft-capping, pages under 16 tokens."""
    if batch.host is None or (batch.head_dim_qk, batch.head_dim_vo) != (128, 128) or batch.fp8_kv or batch.fp8_q:
        return False
    if batch.variants or (batch.paged and not 16 <= batch.page_size < 64) or batch.device.type != "cuda":
        return False
    return tiles_per_program(batch, _num_sms(batch.device), FEW_TILES) < FEW_TILES


# the last static round's items are split into at most this many shares, each of at least
# MIN_SHARE_TILES key tiles of the longest sequence, where that saves >= 5% of the rounds
MAX_SHARES = 4
MIN_SHARE_TILES = 4


def tail_shares(batch: PrefillBatch, cfg: Config, total: int, programs: int) -> tuple[int, int]:
    """``(tail_base, shares)``: with static rounds, the items from ``tail_base`` on (the last round's)
    run as ``shares`` pieces each, split by key tiles, so that the round's idle programs take them
    (704 items on 132 programs: five rounds and 44 items, which three shares each spread over the
    132); ``(total, 1)`` where no split applies (off the work counter, with sinks, where it would save
    under 5% of the rounds). ``cfg.shares`` >= 1 forces that count."""
    none = (total, 1)
    if cfg.dynamic or batch.has_sinks or total == 0 or programs <= 0:
        return none
    rounds = -(-total // programs)
    base = (rounds - 1) * programs
    tail = total - base
    if cfg.shares >= 1:
        return (base, cfg.shares) if cfg.shares > 1 else none
    tiles = -(-batch.work_kv // cfg.BLOCK_N)
    shares = min(MAX_SHARES, programs // tail, tiles // MIN_SHARE_TILES)
    if shares < 2 or 20 * (shares - 1) < rounds * shares:  # (saves (1 - 1/shares) of a round in `rounds`)
        return none
    return base, shares


def share_bytes(batch: PrefillBatch, cfg: Config, tail: int, shares: int) -> int:
    """Scratch bytes of the shares' partials (see :mod:`.hopper_kernel.merge`), from the scratch's start."""
    if shares <= 1:
        return 0
    rows = tail * shares * cfg.BLOCK_M
    return 4 * (hk.PART_OFFSET.value + rows * (batch.head_dim_vo + 1) + tail * hk.HEADER_INTS.value)


def merged_consumers(batch: PrefillBatch, cfg: Config) -> bool:
    """Whether the first two of three consumer warpgroups run as one 8-warp partition: where Q, K and V
    rows are one part each and the call is D 64, or D 128 with 8-bit K/V. On an H100, against three
    4-warp partitions (`bench/results/h100-ab.log` §19-20): d64_b16_q2k +2 to +4%, fp8kv_b8_q2k +6%,
    fp8_b2_q8k level; D 128 with 16-bit K/V level or slower (the 16k prefill 599-667 against 648-682
    TF/s, chunked prefill 618-635 against 636-660, varlen 520-568 against 560-572); with a second part
    (D 96, Dqk 192) -2 to -3% and on two consumers (D 256) -2%. Those keep their own partitions."""
    one_part = all(first_part(d) == d for d in (batch.head_dim_qk, batch.head_dim_vo))
    return cfg.consumers == 3 and one_part and (batch.head_dim_qk == 64 or batch.fp8_kv)


def config(batch: PrefillBatch) -> Config:
    """``DEFAULT`` (``NARROW`` where :func:`prefers_narrow` or :func:`few_tiles` says so), ``F8_STAGES``
    ring stages with 8-bit q (``D96_STAGES`` at D 96), and static rounds (``dynamic=0``) for short
    prompts (``max_q <= 1024``) of even lengths and chunked prefill (``max_kv >= 4 max_q``;
    :func:`static_rounds`); then any tuning override (``tuning.override("hopper", stages=4, ...)``; a
    ``consumers`` knob alone takes ``CONSUMER_REGS`` registers); last, chunks of ``DYNAMIC_CHUNK``
    pairs off the work counter unless a ``chunk`` knob is set."""
    over = dict(tuning.knobs("hopper"))
    bad = [k for k in over if k not in KNOBS]
    if bad:
        raise ValueError(f"unknown Hopper knob {bad[0]!r}; expected one of {KNOBS}")
    if batch.head_dim_vo > 128:
        base = replace(DEFAULT, **D256)
        by_hand = {"split", "BLOCK_N", "stages"} & over.keys()  # (then D256 and the knobs, as set)
        if not by_hand and not batch.fp8_kv and _page_box(batch, replace(base, **D256_SPLIT)):
            base = replace(base, **D256_SPLIT)
    else:
        base = replace(DEFAULT, **NARROW) if prefers_narrow(batch) or few_tiles(batch) else DEFAULT
    if batch.fp8_q:
        base = replace(base, stages=F8_STAGES)
    elif (batch.head_dim_qk, batch.head_dim_vo) == (96, 96) and not batch.fp8_kv:
        base = replace(base, stages=D96_STAGES)
    # (the rows the run's items take; a bad consumer count is refused below)
    if static_rounds(batch, 64 * max(over.get("consumers", base.consumers), 1)):
        base = replace(base, dynamic=0)
    if "consumers" in over and "consumer_regs" not in over and over["consumers"] in CONSUMER_REGS:
        over["consumer_regs"] = CONSUMER_REGS[over["consumers"]]
    cfg = replace(base, **over)
    if cfg.merged == -1:
        cfg = replace(cfg, merged=int(merged_consumers(batch, cfg)))
    if cfg.dynamic and "chunk" not in over:
        cfg = replace(cfg, chunk=DYNAMIC_CHUNK)
    why = None
    if cfg.consumers not in (2, 3):
        why = f"consumers must be 2 or 3, got {cfg.consumers}"
    elif cfg.stages < 2:  # one stage deadlocks: a consumer waits for the tile its own release unblocks
        why = f"stages must be >= 2, got {cfg.stages}"
    elif cfg.BLOCK_N not in (16, 32, 64, 128):
        why = f"BLOCK_N must be 16, 32, 64 or 128, got {cfg.BLOCK_N}"
    elif batch.fp8_q and cfg.BLOCK_N < 32:  # (V's keys are reordered in blocks of 32: see _transpose_v)
        why = f"BLOCK_N must be >= 32 with fp8 q, got {cfg.BLOCK_N}"
    elif cfg.load_warps not in (2, 4, 8):
        why = f"load_warps must be 2, 4 or 8, got {cfg.load_warps}"
    elif batch.fp8_q and 16 * cfg.load_warps > first_part(batch.head_dim_vo) * (2 if cfg.BLOCK_N >= 64 else 1):
        # (V's transpose gives each load warp 16 columns, then key 32 of a 64-key chunk: see _transpose_layout)
        why = f"load_warps <= {first_part(batch.head_dim_vo) // (8 if cfg.BLOCK_N >= 64 else 16)} with fp8 q here"
    elif any(r % 8 or not 24 <= r <= 256 for r in (cfg.consumer_regs, cfg.load_regs)):
        why = "consumer_regs and load_regs must be multiples of 8 in [24, 256]"
    elif 128 * cfg.consumers * cfg.consumer_regs + 32 * cfg.load_warps * cfg.load_regs > 65536:
        why = "registers over budget: 128 * consumers * consumer_regs + 32 * load_warps * load_regs > 65536"
    elif cfg.chunk < 0:
        why = f"chunk must be >= 0 (0: all pairs in one chunk), got {cfg.chunk}"
    elif cfg.dynamic not in (0, 1):
        why = f"dynamic must be 0 or 1, got {cfg.dynamic}"
    elif cfg.split not in (0, 1):
        why = f"split must be 0 or 1, got {cfg.split}"
    elif cfg.merged not in (0, 1):
        why = f"merged must be -1, 0 or 1, got {cfg.merged}"
    elif cfg.rowsum not in (-1, 0, 1):
        why = f"rowsum must be -1, 0 or 1, got {cfg.rowsum}"
    elif cfg.rowsum == 1 and batch.fp8_q:
        why = "rowsum=1 with fp8 q (the sum of e4m3-rounded P misses the LSE tolerance)"
    elif not 0 <= cfg.shares <= 64:
        why = f"shares must be in [0, 64] (0: automatic, 1: none), got {cfg.shares}"
    elif _ring_stages(batch, cfg, _staging_bytes(batch, cfg)) < 2:
        why = f"Q ({cfg.BLOCK_M} rows), two K/V stages of {cfg.BLOCK_N} keys and the fp8 staging exceed shared memory"
    if why:
        raise ValueError(f"Hopper knob: {why}")
    return cfg


def sibling(batch: PrefillBatch, cfg: Config) -> Config | None:
    """The other of ``DEFAULT`` and ``NARROW`` (the consumer count is a compile-time constant) where
    :func:`config` may pick either for this layout as only lengths and batch size change (where
    :func:`_narrow_layout` allows ``NARROW``), no tuning knobs. :class:`HopperPlan` compiles it
    beside its own at the first launch, so that a later call of the other kind compiles nothing."""
    if tuning.knobs("hopper") or not _narrow_layout(batch):
        return None
    if cfg.consumers == DEFAULT.consumers:
        sib = replace(cfg, **NARROW)
    else:
        sib = replace(cfg, consumers=DEFAULT.consumers, consumer_regs=DEFAULT.consumer_regs)
    return replace(sib, merged=int(merged_consumers(batch, sib)))


def _tma_view(t: torch.Tensor, batch: PrefillBatch, box_rows: int, d: int):
    """A 2-D view of a K or V cache (head dim ``d``) for TMA boxes of ``[box_rows, first_part(d)]``:
    ``(descriptor, page_rows, head_off, head_in_rows)``, or None when the strides do not allow one.

    Row ``page * page_rows + slot`` (paged) or ``start + key`` (ragged) holds the head-0 key row; a
    head is ``head_off`` rows further (HND-like layouts) or ``head_off`` elements to the right
    (NHD-like layouts, where all heads of a token share a row)."""
    h = batch.num_kv_heads
    if batch.paged:
        sp, sh, st = t.stride(0), t.stride(1), t.stride(2)
    else:
        sp, sh, st = 0, t.stride(1), t.stride(0)
    if t.data_ptr() % 16 or t.stride(-1) != 1 or (st * t.element_size()) % 16 or st < d:
        return None
    if h == 1 or (sh >= st and sh % st == 0):
        head_rows, head_off, cols = True, (sh // st if h > 1 else 0), d
    elif (h - 1) * sh + d <= st:
        head_rows, head_off, cols = False, sh, st
    else:
        return None
    if batch.paged:
        if sp % st:
            return None
        page_rows = sp // st
        rows = (t.shape[0] - 1) * page_rows + batch.page_size
    else:
        page_rows = 0
        rows = t.shape[0]
    rows += (h - 1) * head_off if head_rows else 0
    if rows <= 0 or rows >= 2**31:  # an empty cache (no TMA needed), or past int32 coordinates
        return None
    part = first_part(d)
    desc = TensorDescriptor(t, [rows, cols], [st, 1], [box_rows, part], _smem_layout(part, t.element_size()))
    return desc, page_rows, head_off, head_rows


def _smem_layout(cols: int, esz: int):
    """The kernel's shared layout for tiles of ``cols`` columns of ``esz``-byte elements: rows
    swizzled over their bytes, at most 128 (16-bit 32 columns: 64; 8-bit staging: 32, 64, 128)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(cols * esz, 128), element_bitwidth=8 * esz, rank=2)


def _page_box(batch: PrefillBatch, cfg: Config) -> int:
    """Rows per K/V TMA box, or 0 when whole tiles cannot come by TMA (pages under 16 tokens)."""
    if not batch.paged:
        return cfg.BLOCK_N
    box = min(batch.page_size, cfg.BLOCK_N)
    if batch.page_size < 16 or batch.page_size % box or cfg.BLOCK_N % box:
        return 0
    return box


def _tma_plan(t: CallTensors, batch: PrefillBatch, box: int):
    """``(k_view, v_view, k1_desc, v1_desc)`` for this call's tensors when whole tiles can arrive by
    TMA, else None; ``k1_desc`` / ``v1_desc`` box the columns past :func:`first_part` (Dqk 96 / > 128,
    Dvo 96), else None (Dvo 256: V's second 128 columns come through ``v_view`` too)."""
    if not box:
        return None
    kv = _tma_view(t.k, batch, box, batch.head_dim_qk), _tma_view(t.v, batch, box, batch.head_dim_vo)
    if None in kv:
        return None
    parts = []
    for (desc, *_), d, split in ((kv[0], batch.head_dim_qk, True), (kv[1], batch.head_dim_vo, batch.head_dim_vo == 96)):
        rest = d - first_part(d)
        parts.append(
            TensorDescriptor(
                desc.base, desc.shape, desc.strides, [box, rest], _smem_layout(rest, desc.base.element_size())
            )
            if rest and split
            else None
        )
    return (*kv, *parts)


def q_tma_applies(batch: PrefillBatch, q: torch.Tensor) -> bool:
    """Whether the load warps copy Q by TMA: GQA group dividing 64, q 16-byte aligned, some rows, and
    64-column boxes (not Dqk 96: its consumers copy their Q by cp.async)."""
    return 64 % batch.group_size == 0 and q.data_ptr() % 16 == 0 and q.shape[0] > 0 and batch.head_dim_qk != 96


def o_stage_mode(batch: PrefillBatch, q_tma: bool) -> int:
    """How the epilogue stores O (the kernel's ``O_STAGE``): 1 staged through the consumer's Q slot
    (out in q's dtype, and O fitting the slot's first 128 columns: Dqk = Dvo <= 128, or Dqk 192 with Q
    by TMA), else 0 straight from the wgmma accumulator layout. (Dqk 192 with the consumers' own Q
    copies: ptxas spilled 640 bytes around each item when staged, 204 unstaged.)"""
    slot = first_part(batch.head_dim_qk)  # (a slot's first part: the rest of Q lives apart)
    fits = batch.head_dim_vo <= slot and (batch.head_dim_qk <= 128 or q_tma)
    return int(batch.out.dtype == batch.q.dtype and fits)


def staging_slots(batch: PrefillBatch, cfg: Config) -> int:
    """Staging slots for 8-bit K/V (the kernel's ``STAGING``; 0: K/V in q's dtype), where tiles land
    before the load warps widen them (16-bit q) or transpose V (fp8 q: V only): three (two tiles in
    flight while one is widened) where that leaves the ring three stages, else two."""
    if not batch.fp8_kv:
        return 0
    return 3 if _ring_stages(batch, cfg, 3 * _staging_tile(batch, cfg)) >= 3 else 2


def _staging_tile(batch: PrefillBatch, cfg: Config) -> int:
    return cfg.BLOCK_N * (batch.head_dim_vo if batch.fp8_q else batch.head_dim_qk + batch.head_dim_vo)


def _staging_bytes(batch: PrefillBatch, cfg: Config) -> int:
    return staging_slots(batch, cfg) * _staging_tile(batch, cfg)


def tensor_row_sums(batch: PrefillBatch, cfg: Config) -> bool:
    """Whether the consumers sum P's rows on the tensor cores (the kernel's ``ROWSUM``: one more small
    wgmma a tile, in place of each thread's ~32 FADD / FFMA): at D 64 with 16-bit K/V, whose key loop is
    bound by issue slots (+5% on d64_b16_q2k), where no LSE is asked for. The sum is then of P rounded
    to the GEMMs' dtype: O is as accurate (its numerator holds the same rounded P), but the LSE only to
    that dtype (bf16: 1e-3 against the float32 sum's 1e-6, float64 oracle), so a call that returns it
    keeps the FADDs. At D 128 and 256 the wgmma's tensor time costs more than the FADDs (-3% on the 16k
    prefill, -1.5% at D 256); with e4m3 P the LSE misses the tests' tolerance (never with fp8 q)."""
    if batch.fp8_q:
        return False
    if cfg.rowsum >= 0:
        return bool(cfg.rowsum)
    return batch.head_dim_qk == batch.head_dim_vo == 64 and not batch.fp8_kv and not batch.has_lse


def _ring_stages(batch: PrefillBatch, cfg: Config, staging_bytes: int) -> int:
    esz = batch.q.dtype.itemsize
    q_bytes = cfg.BLOCK_M * batch.head_dim_qk * esz
    if tensor_row_sums(batch, cfg):  # (the block of ones: 8 x BLOCK_N in the GEMMs' 16-bit dtype)
        q_bytes += 8 * cfg.BLOCK_N * 2
    stage_bytes = cfg.BLOCK_N * (batch.head_dim_qk + batch.head_dim_vo) * esz
    return (SMEM_BYTES - q_bytes - staging_bytes) // stage_bytes


def stages(batch: PrefillBatch, cfg: Config) -> int:
    """``cfg.stages``, or fewer where Q, the K/V ring and the 8-bit staging slots would not fit in shared
    memory (Dqk > 128, 8-bit K/V)."""
    return max(2, min(cfg.stages, _ring_stages(batch, cfg, _staging_bytes(batch, cfg))))


def num_m_blocks(batch: PrefillBatch, cfg: Config) -> int:
    return -(-batch.work_q * batch.group_size // cfg.BLOCK_M)


MERGE_ROWS = 32  # rows of a split item per program of the shares' merge
_COUNTERS: dict = {}  # (device index, raw stream) -> that stream's work counter (eager launches)
_CAPTURED_COUNTERS: list = []  # one per launch captured in a CUDA graph, alive as long as the graphs
# int32 words of a work counter: the kernel also forms its partials' pointer 256 bytes past COUNTER
# (never read when the schedule is dynamic), which must stay inside the tensor
COUNTER_WORDS = 64


def work_counter(device: torch.device) -> torch.Tensor:
    """The dynamic scheduler's work counter for a launch on the current stream of ``device``: an int32
    tensor, zero whenever no launch that uses it is running.

    Eager launches on one stream never overlap and each leaves its counter at zero (see
    :meth:`.hopper_kernel.schedule.Schedule.reset`), so one counter per stream serves every plan with
    no zeroing launch, and none lives in a workspace that something else may write between two runs.
    (A destroyed stream's handle may come back for a new stream: the counter it finds is zero.)

    A launch captured in a CUDA graph gets a counter of its own, zeroed by a node of the graph before
    each replay: a graph replays on whatever stream is current then, possibly beside eager launches
    on the stream it was captured on, and a counter made during capture holds no zero until the first
    replay. Off CUDA (compile-only tests) a fresh zeroed tensor."""
    if device.type != "cuda":
        return torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if torch._C._cuda_isCurrentStreamCapturing():
        counter = torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=torch.device("cuda", idx))
        # (kept: the graph's private pool would otherwise hand the block to a later capture's tensor)
        _CAPTURED_COUNTERS.append(counter)
        return counter
    key = (idx, torch._C._cuda_getCurrentRawStream(idx))
    counter = _COUNTERS.get(key)
    if counter is None:
        counter = _COUNTERS[key] = torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=torch.device("cuda", idx))
    return counter


def vector_args(bd: Bounds, vecs: DeviceVectors) -> tuple[tuple, dict] | None:
    """``(bounds, modes)``: the kernel's arguments after its vectors (``hopper_kernel.BOUND_ARGS``) and
    its VECTORS constexprs, for reading ``vecs`` clamped to ``bd`` in place of the metadata table; None
    where that does not apply: a start that needs a prefix sum (no q offsets; ragged: no K offsets;
    packed LSE: no stats offsets), or a vector that is not a dense int32 / int64 row."""
    offs = vecs.offsets
    if "q" not in offs or (bd.pages == 0 and "k" not in offs) or (bd.lse_mode == 2 and "stats" not in offs):
        return None
    for t in (vecs.lens_q, vecs.lens_kv, vecs.kv_indptr, vecs.kv_last_page_len, *offs.values()):
        if t is not None and (t.dim() != 1 or t.stride(0) != 1 or t.dtype not in (torch.int32, torch.int64)):
            return None
    u = bd.units
    ints = (
        bd.max_q,
        bd.max_kv,
        bd.rows_q,
        bd.rows_o,
        bd.rows_k,
        bd.rows_v,
        bd.lse_numel // max(bd.num_heads, 1),
        bd.table_width,
        bd.table_stride,
        bd.num_indices,
        bd.max_q * bd.num_heads,
    )
    modes = dict(
        VECTORS=True,
        CSR=bd.pages == 2,
        HAS_OO="o" in offs,
        HAS_OV=bd.pages == 0 and "v" in offs,
        LSE_MODE=bd.lse_mode,
        **{f"UNIT_{n.upper()[0]}": u[n] for n in ("q", "o", "k", "v", "stats")},
    )
    return ints, modes


def vector_tensors(vecs: DeviceVectors) -> tuple:
    """The kernel's vector arguments ``hopper_kernel.VECTOR_ARGS``, in the device table launch's order
    (an absent one stands in as lens_q); kept on ``vecs`` (a plan runs its own vectors at every layer,
    and nothing rebinds a field of a DeviceVectors)."""
    got = vecs.__dict__.get("_kernel_order")
    if got is None:
        got = metadata.vector_tensors(vecs.lens_q, vecs.lens_kv, vecs.offsets, vecs.kv_indptr, vecs.kv_last_page_len)
        vecs.__dict__["_kernel_order"] = got
    return got


_WARM_MERGES: set = set()  # the merge's compiled constants (see HopperPlan._warm_merge)
_WARM_SIBLINGS: set = set()  # the sibling variants compiled (see HopperPlan._warm_sibling)


def _spec_key(a: object) -> object:
    """What of a launch argument Triton's specialisation may read: a tensor's dtype and 16-byte
    alignment, a descriptor's box and dtype, else the type (the kernel specialises no integer)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, TensorDescriptor):
        return (a.base.dtype, tuple(a.block_shape))
    return type(a)


DESC_ARGS = slice(27, 32)  # k_desc, k1_desc, v_desc, v1_desc, q_desc in the kernel's arguments
# the kernel reading the metadata table: its vector arguments and their bounds None, its modes off
_NO_VECTORS = (None,) * (len(hk.VECTOR_ARGS) + len(hk.BOUND_ARGS)) if hk is not None else ()
_TABLE_MODE = dict(
    VECTORS=False, CSR=False, HAS_OO=False, HAS_OV=False, LSE_MODE=0, UNIT_Q=1, UNIT_O=1, UNIT_K=1, UNIT_V=1, UNIT_S=1
)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class HopperPlan:
    """The Hopper kernel's launch for one batch: config and constexprs fixed at plan time; each run
    binds the call's tensors (with the stream's work counter: :func:`work_counter`) and builds
    their TMA descriptors, and merges the shares of split items
    (:func:`tail_shares`) after the kernel.

    ``workspace_bytes`` (the caller's scratch room; None: unbounded) bounds the shares' partials: a
    split that does not fit is not made."""

    name = "triton"

    def __init__(self, batch: PrefillBatch, workspace_bytes: int | None = None):
        self.batch = batch
        cfg = self.cfg = config(batch)
        self.n_m = num_m_blocks(batch, cfg)
        total = batch.num_kv_heads * batch.batch_size * self.n_m
        sms = _num_sms(batch.device) if batch.device.type == "cuda" else total
        if total + 2 * sms >= 2**31:  # (rounds run to total + grid in int32)
            raise ValueError(f"too many work items for one launch ({total}); split the batch")
        self.tail_base, self.shares = tail_shares(batch, cfg, total, sms)
        self.n_tail = total - self.tail_base
        self.workspace_bytes = share_bytes(batch, cfg, self.n_tail, self.shares)
        if workspace_bytes is not None and self.shares > 1 and self.workspace_bytes > workspace_bytes:
            self.tail_base, self.shares, self.n_tail = total, 1, 0
            self.workspace_bytes = 0
        items = self.tail_base + self.n_tail * self.shares
        self.grid = (max(min(items, sms), 1),)
        self._merge = LaunchSlot()  # the shares' merge, bound after its first launch
        self.box = _page_box(batch, cfg)
        # (a chunk of at least every pair is one chunk: capped there, chunk x row blocks stays within
        # total, which fits int32)
        n_bh = batch.num_kv_heads * batch.batch_size
        self.chunk = max(min(cfg.chunk, n_bh) if cfg.chunk > 0 else n_bh, 1)
        self.dynamic = int(bool(cfg.dynamic))
        self._kwargs: dict = {}
        # after the first launch: the compiled kernel bound to this layout's fixed arguments, and which
        # of (k_desc, k1_desc, v_desc, v1_desc, q_desc) it takes (the layout decides)
        self._bound = None
        self._bind_tried = False
        self._descs_present: tuple = ()
        self._vector_mode: tuple | None = None  # (take_vectors) the kernel's bounds and modes
        if not batch.has_sinks and batch.device.type == "cuda" and workspace_bytes != 0:
            # (a later call of this shape with other lengths may take static rounds and split, even where
            # this one runs off the work counter)
            self._warm_merge()

    def take_vectors(self, bd: Bounds, vecs: DeviceVectors) -> bool:
        """Whether the kernel reads this layout's device lengths and offsets itself, so that a run
        launches no metadata table before it (see :func:`vector_args`); if so, fixes the bounds it
        clamps them to (``bd``, this layout's)."""
        mode = vector_args(bd, vecs)
        if mode is None:
            return False
        self._vector_mode = mode
        self._kwargs.clear()
        return True

    def _merge_kwargs(self, cfg: Config | None = None) -> dict:
        batch, dvo = self.batch, self.batch.head_dim_vo
        return dict(
            GROUP=batch.group_size,
            BLOCK_M=(cfg or self.cfg).BLOCK_M,
            DVO=dvo,
            DV_P2=1 << (dvo - 1).bit_length(),
            ROWS=MERGE_ROWS,
            HAS_LSE=batch.has_lse,
            num_warps=4,
        )

    def _warm_merge(self, cfg: Config | None = None) -> None:
        """Compile the merge for this plan's constants (or ``cfg``'s row blocks) now, once per process,
        so that a later call whose lengths make a split (static rounds) compiles nothing."""
        kwargs = self._merge_kwargs(cfg)
        key = (self.batch.device, self.batch.out_dtype, tuple(kwargs.items()))
        if key in _WARM_MERGES:
            return
        dev, odt = self.batch.device, self.batch.out_dtype
        scratch = torch.empty(16, dtype=torch.uint8, device=dev)
        out = torch.empty(1, dtype=odt, device=dev)
        lse = torch.empty(1, dtype=torch.float32, device=dev) if self.batch.has_lse else out
        with torch.cuda.device(dev):
            hk.share_merge_kernel.warmup(scratch, out, lse, 1, 2, 1, 1, 1, grid=(1,), **kwargs)
        _WARM_MERGES.add(key)

    def _constexprs(self, tma, q_tma: bool) -> dict:
        key = (tma is not None and tma[0][3], tma is not None and tma[1][3], tma is not None, q_tma)
        got = self._kwargs.get(key)
        if got is None:
            got = self._kwargs[key] = self._kernel_constexprs(self.cfg, *key)
        return got

    def _kernel_constexprs(self, cfg: Config, k_head_rows: bool, v_head_rows: bool, use_tma: bool, q_tma: bool) -> dict:
        """The kernel's constexprs and launch options under ``cfg`` for a layout: K and V boxed by
        head rows (see :func:`_tma_plan`), K/V by TMA (else cp.async), Q by TMA."""
        batch = self.batch
        alone = issues_alone(batch, cfg, use_tma)
        if not use_tma and cfg.split and batch.head_dim_vo > 128 and cfg.BLOCK_N == 64 and stages(batch, cfg) == 2:
            # (strides the TMA cannot box: without the split two 64-key stages leave the loads exposed)
            cfg = replace(cfg, BLOCK_N=D256["BLOCK_N"], stages=D256["stages"], split=0)
        return dict(
            GROUP=batch.group_size,
            PAGE_SIZE=batch.page_size,
            DQK=batch.head_dim_qk,
            DVO=batch.head_dim_vo,
            NC=cfg.consumers,
            BLOCK_N=cfg.BLOCK_N,
            CAUSAL=batch.causal,
            HAS_LSE=batch.has_lse,
            STAGES=stages(batch, cfg),
            LOAD_WARPS=ISSUER_GATHER_WARPS if alone else cfg.load_warps,
            CONS_REGS=cfg.consumer_regs,
            LOAD_REGS=cfg.load_regs,
            USE_TMA=use_tma,
            PAGE_BOX=self.box if use_tma else 0,
            K_HEAD_ROWS=bool(k_head_rows),
            V_HEAD_ROWS=bool(v_head_rows),
            Q_TMA=q_tma,
            O_STAGE=o_stage_mode(batch, q_tma),
            WINDOW=batch.window_left >= 0,
            SOFTCAP=batch.logits_soft_cap > 0,
            HAS_SINKS=batch.has_sinks,
            STAGING=staging_slots(batch, cfg),
            F8=batch.fp8_q,
            Q_SCALED=batch.q_scaled,
            K_SCALED=batch.k_scaled,
            V_SCALED=batch.v_scaled,
            SPLIT=bool(cfg.split) and _k16_by_tma(batch, use_tma),
            ROWSUM=tensor_row_sums(batch, cfg),
            ISSUER=alone,
            MERGED=bool(cfg.merged),
            **(self._vector_mode[1] if self._vector_mode else _TABLE_MODE),
            num_warps=8 if cfg.merged else 4,
        )

    def launches(self, t: CallTensors) -> list:
        batch = self.batch
        meta = t.meta
        q, k, v, out = t.q, t.k, t.v, t.out
        bt = t.pages if batch.paged else meta
        if batch.paged:
            kstr, vstr = k.stride()[:3], v.stride()[:3]
        else:
            kstr, vstr = (*k.stride()[:2], 0), (*v.stride()[:2], 0)
        tma = _tma_plan(t, batch, self.box)
        tma_ints = (tma[0][1], tma[0][2], tma[1][1], tma[1][2]) if tma else (0, 0, 0, 0)
        q_tma = q_tma_applies(batch, q)
        q_desc = None
        if q_tma:  # (boxes of rows of up to 128 bytes, as the kernel's Q slots: see _issue_q)
            esz = q.element_size()
            cols = min(first_part(batch.head_dim_qk), 128 // esz)
            layout = gl.NVMMASharedLayout(swizzle_byte_width=cols * esz, element_bitwidth=8 * esz, rank=3)
            g = batch.group_size
            q_desc = TensorDescriptor(q, list(q.shape), list(q.stride()), [64 // g, g, cols], layout)
        counter = self._counter_arg(t, typed=True)
        args = (
            q,
            k,
            v,
            out,
            t.lse if t.lse is not None else meta,
            meta,
            bt,
            counter,
            self.dynamic,
            float(batch.scale) * LOG2E,
            meta.stride(0),
            batch.batch_size,
            self.n_m,
            batch.num_pages,
            q.stride(0),
            q.stride(1),
            *kstr,
            *vstr,
            out.stride(0),
            out.stride(1),
            batch.num_qo_heads,
            batch.num_kv_heads,
            self.chunk,
            tma[0][0] if tma else None,  # (DESC_ARGS: these four)
            tma[2] if tma else None,
            tma[1][0] if tma else None,
            tma[3] if tma else None,
            q_desc,
            *tma_ints,
            batch.window_left,
            float(batch.logits_soft_cap),
            t.sinks if t.sinks is not None else meta,
            t.q_scale if t.q_scale is not None else meta,
            t.k_scale if t.k_scale is not None else meta,
            t.v_scale if t.v_scale is not None else meta,
            self.tail_base,
            self.shares,
        )
        if self._vector_mode:
            args += (*vector_tensors(t.vectors), *self._vector_mode[0])
        else:
            args += _NO_VECTORS
        return [(hk.attention_kernel, self.grid, args, self._constexprs(tma, q_tma))]

    def _warm_sibling(self, args: tuple, kwargs: dict) -> None:
        """Compile :func:`sibling`'s variant of this launch (the same arguments, so the same
        specialisation; its own constexprs) and its merge, once per process, so that a later call
        whose lengths pick the other consumer count compiles nothing."""
        sib = sibling(self.batch, self.cfg)
        if sib is None or INTERPRETED:
            return
        layout = (kwargs["K_HEAD_ROWS"], kwargs["V_HEAD_ROWS"], kwargs["USE_TMA"], kwargs["Q_TMA"])
        sib_kwargs = self._kernel_constexprs(sib, *layout)
        key = (self.batch.device, tuple(sib_kwargs.items()), tuple(_spec_key(a) for a in args))
        if key not in _WARM_SIBLINGS:
            hk.attention_kernel.warmup(*args, grid=self.grid, **sib_kwargs)
            _WARM_SIBLINGS.add(key)
        if not self.batch.has_sinks:
            self._warm_merge(sib)

    def _merge_shares(self, t: CallTensors) -> None:
        """The launch that combines the split items' shares into out and the LSE (after the kernel)."""
        lse = t.lse if t.lse is not None else t.out  # (not read without an LSE)
        if self._merge.launch((t.scratch, t.out, lse)):
            return
        out = t.out
        args = (t.scratch, out, lse, self.n_tail, self.shares, out.stride(0), out.stride(1), self.batch.num_qo_heads)
        grid = (self.n_tail, self.cfg.BLOCK_M // MERGE_ROWS)
        self._merge.run(hk.share_merge_kernel, grid, args, self._merge_kwargs())

    def _tensors(self, t: CallTensors) -> tuple:
        """The kernel's tensor arguments in order (as :meth:`launches` passes them)."""
        meta = t.meta
        return (
            t.q,
            t.k,
            t.v,
            t.out,
            t.lse if t.lse is not None else meta,
            meta,
            t.pages if self.batch.paged else meta,
            self._counter_arg(t, typed=False),
            t.sinks if t.sinks is not None else meta,
            t.q_scale if t.q_scale is not None else meta,
            t.k_scale if t.k_scale is not None else meta,
            t.v_scale if t.v_scale is not None else meta,
        ) + (vector_tensors(t.vectors) if self._vector_mode else ())

    def _desc_bases(self) -> tuple:
        """For each descriptor the bound kernel takes, in order, its base tensor's index among
        :meth:`_tensors` (K, K's second part, V, V's second part, Q)."""
        return tuple(i for i, present in zip((1, 1, 2, 2, 0), self._descs_present) if present)

    def run(self, t: CallTensors) -> None:
        self._attend(t)
        if self.shares > 1:
            self._merge_shares(t)

    def _counter_arg(self, t: CallTensors, typed: bool):
        """The kernel's COUNTER (int32): the stream's work counter (dynamic), the scratch (split items'
        partials) or a stand-in (neither is read); ``typed=False``: a tensor at its address only (as
        the bound launch reads it), without the scratch's int32 view."""
        if self.dynamic:
            return work_counter(self.batch.device)
        if self.shares > 1:
            return t.scratch[:4].view(torch.int32) if typed else t.scratch
        return t.meta

    def _attend(self, t: CallTensors) -> None:
        bound = self._bound
        if bound is not None and bound(self._tensors(t)):
            return
        ((kernel, grid, args, kwargs),) = self.launches(t)
        descs = args[DESC_ARGS]
        if not self._bind_tried:
            self._bind_tried = True
            self._descs_present = tuple(d is not None for d in descs)
            bound = self._bound = bind(kernel, grid, args, kwargs, self._desc_bases())
            self._warm_sibling(args, kwargs)
        else:
            fast_launch(kernel, grid, args, kwargs)
        if bound is not None and tuple(d is not None for d in descs) == self._descs_present:
            # (a call whose descriptors differ from the bound launch's is never remembered for it)
            bound.remember(self._tensors(t), tuple(d for d in descs if d is not None))
