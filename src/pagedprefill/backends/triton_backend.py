"""Triton backend: one fused FA2-style kernel for paged or ragged K/V, plus an optional split-KV path.

Design (see ``docs/triton_kernel.md`` for the full notes):

* One program computes ``BLOCK_M`` query *rows* of one sequence and one KV head, where a row is a
  (token, head-in-group) pair of the ``G = Hq / Hkv`` query heads sharing that KV head: row ``r`` is
  token ``r // G``, head ``kv_head * G + r % G``. Each K/V tile is therefore loaded once for all G
  heads. Grid ``(Hkv, B, num_m_blocks)`` with the m-block index reversed so the heaviest causal tiles
  are scheduled first; programs whose rows start past the sequence's ``q_len * G`` return at once.
* Online softmax in float32 with ``exp2`` (log2(e) folded into the scale). The KV loop is split into
  an unmasked part (every key visible to every row of the tile) and a masked tail (causal diagonal
  and the last partial block); only the tail evaluates masks.
* Paged K/V: the page id of each of the ``BLOCK_N`` keys of a tile is loaded from the block table as
  one vector (one scalar per tile when the page size is a multiple of ``BLOCK_N``), clamped to
  ``[0, num_pages)``, and the key rows are gathered with the cache's real strides (NHD, HND and
  interleaved K/V all work). Ragged K/V: rows ``k_start + j``.
* Head dims that are not a power of two are split into two power-of-two parts (192 = 128 + 64,
  96 = 64 + 32, 80 = 64 + 16): two dots instead of one padded dot. A second part that is not a power
  of two itself (e.g. 112 = 64 + 48) is padded to the next power of two with masked loads.
* Nothing about lengths, offsets or tables is read on the host: everything comes from ``batch.meta``
  and ``batch.block_tables`` in the kernel, so a call can be captured in a CUDA graph. Every integer
  argument that varies per call is ``do_not_specialize``; compile-time constants are only the dtypes,
  head dims, block sizes, group size, page size and the causal / lse / scale flags.
* Split-KV (optional, for small grids: short queries over long prefixes): the KV range of each
  sequence is cut into ``num_splits`` chunks handled by separate programs writing float32 partial
  outputs and LSEs into ``batch.scratch``; a second small kernel merges them.

``TRITON_INTERPRET``: Triton decides at *decoration* time (when this module is first imported)
whether the kernels run in the CPU interpreter. Set ``TRITON_INTERPRET=1`` before the first import
of ``pagedprefill.backends.triton_backend`` to run on the CPU; :func:`unavailable_reason` reports
the case where the variable was set too late.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import torch

from pagedprefill.api import META_FIELDS, PrefillBatch, elements_per_token, meta_bytes
from pagedprefill.backends import gluon_sm90

NAME = "triton"

try:  # triton is optional
    import triton
    import triton.language as tl

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

# Whether the kernels below were built for the interpreter (decided once, at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TRITON_MINOR = tuple(triton.__version__.split(".")[:2]) if triton is not None else None

MAX_HEAD_DIM = 256
GRID_LIMIT = 65535  # CUDA limit of grid dims y and z
LOG2E = 1.4426950408889634
# The kernels read the metadata rows by index, in this order.
assert META_FIELDS == ("lens_q", "lens_kv", "q_start", "o_start", "k_start", "v_start", "lse_start")


# --------------------------------------------------------------------------------------------
# Kernel configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Launch knobs of the main kernel (all compile-time constants)."""

    BLOCK_M: int  # query rows (token x head-in-group pairs) per program
    BLOCK_N: int  # keys per iteration
    num_warps: int
    num_stages: int
    warp_spec: int = 0  # 1: Triton's automatic warp specialisation of the unmasked KV loop (sm90+)
    lazy: int = 0  # 1: rescale the accumulators only when a row max grows by > 2^8 (unmasked loop)


@dataclass(frozen=True)
class SplitPolicy:
    """When and how much to split the KV range (host decision from host ints only)."""

    enabled: bool = True
    min_programs: int = 264  # split when the unsplit grid has fewer programs (~2 waves on 132 SMs)
    max_splits: int = 16
    min_keys_per_split: int = 512
    max_scratch_bytes: int = 32 << 20  # cap on the float32 partials (also capped by the workspace)


SPLIT_POLICY = SplitPolicy()
_OVERRIDE: dict = {}
_KNOBS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "num_splits", "warp_spec", "lazy", "gluon")


def _check_knobs(knobs: dict, where: str) -> dict:
    for key, val in knobs.items():
        if key not in _KNOBS:
            raise ValueError(f"{where}: unknown Triton knob {key!r}; expected one of {_KNOBS}")
        if key in ("BLOCK_M", "BLOCK_N") and (val < 16 or val & (val - 1)):
            raise ValueError(f"{where}: {key} must be a power of two >= 16, got {val}")
        if key in ("num_warps", "num_stages", "num_splits") and val < 1:
            raise ValueError(f"{where}: {key} must be >= 1, got {val}")
        if key == "gluon" and val not in (0, 1):
            raise ValueError(f"{where}: gluon must be 0 or 1, got {val}")
    return knobs


def _env_override() -> dict:
    """``PAGEDPREFILL_TRITON_CONFIG="BLOCK_M=128,BLOCK_N=64,num_warps=8,num_stages=3,num_splits=1"``."""
    raw = os.environ.get("PAGEDPREFILL_TRITON_CONFIG", "").strip()
    out = {}
    if raw:
        for item in raw.split(","):
            key, _, val = item.partition("=")
            out[key.strip()] = int(val)
    return _check_knobs(out, "PAGEDPREFILL_TRITON_CONFIG")


@contextlib.contextmanager
def config_override(**knobs: int):
    """Force launch knobs (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``, ``num_splits``)
    for the calls inside the block; for tests and tuning."""
    from pagedprefill import api

    saved = dict(_OVERRIDE)
    _OVERRIDE.update(_check_knobs(knobs, "config_override"))
    api.clear_call_cache()  # cached calls sized their scratch for the old knobs
    try:
        yield
    finally:
        _OVERRIDE.clear()
        _OVERRIDE.update(saved)
        api.clear_call_cache()


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << (x - 1).bit_length()


def split_head_dim(d: int) -> tuple[int, int, int]:
    """(part0, part1, real part1): part0 the largest power of two <= d; part1 the power of two that
    holds the rest (0 when d is a power of two); real part1 = d - part0 (< part1 means padded)."""
    d0 = _pow2_floor(d)
    rest = d - d0
    return d0, (_pow2_ceil(rest) if rest else 0), rest


# Measured winners on H100/H200, keyed by (Dqk, Dvo, dtype bytes of the dot operands, group size,
# causal); consulted before the heuristics below. Filled from GPU sweeps
# (PAGEDPREFILL_TRITON_CONFIG=... or config_override(...) while benchmarking).
TUNED_SM90: dict[tuple[int, int, int, int, bool], Config] = {}


def default_config(
    dqk: int, dvo: int, elem_bytes: int, group: int, causal: bool, capability: tuple[int, int] | None
) -> Config:
    """Python-side config table keyed by (head dims, dtype size, group size, causal, GPU).

    Tuned for H100/H200 (sm90, 228 KB shared memory); smaller GPUs get fewer stages / rows.
    ``capability`` None means the interpreter (small tiles keep it fast and exercise tiling).
    """
    if capability is None:
        return Config(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    tuned = TUNED_SM90.get((dqk, dvo, elem_bytes, group, causal)) if capability[0] == 9 else None
    if tuned is not None:
        return tuned
    d = max(sum(split_head_dim(dqk)[:2]), sum(split_head_dim(dvo)[:2]))
    # (ptxas spills and the H200 sweeps behind these choices: docs/triton_kernel.md)
    if elem_bytes == 4:  # float32: IEEE dots run on FMA units, register hungry: small tiles
        cfg = Config(32, 16, 8, 2) if d <= 128 else Config(16, 16, 8, 2)
    elif d <= 64:
        cfg = Config(128, 64, 4, 3)
    elif d <= 192:
        # H200 sweep (docs/triton_kernel.md, 2026-11-29): 256 rows on 8 warps with lazy rescaling
        # was the best or near-best config on every D128 and D192/128 workload but page size 1.
        cfg = Config(256, 64, 8, 3, lazy=1)
    else:
        cfg = Config(64, 64, 8, 2)
    major, _minor = capability
    if major < 9 and elem_bytes < 4:  # Ampere / Ada: mma.sync keeps operands in registers
        if 64 < d <= 192:
            cfg = Config(64, 64, 8, 2)
        elif d > 192:
            cfg = Config(64, 32, 8, 2)
    return cfg


# --------------------------------------------------------------------------------------------
# Availability
# --------------------------------------------------------------------------------------------


def unavailable_reason(device: torch.device) -> str | None:
    if triton is None:
        return f"triton is not importable ({_IMPORT_ERROR}); pip install triton"
    if device.type == "cuda":
        if INTERPRETED:
            return None  # the interpreter copies device tensors to the host and back
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"the Triton kernels need CUDA compute capability >= 8.0, this GPU has {major}.{minor}"
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            return (
                "no CUDA GPU; set TRITON_INTERPRET=1 to run the Triton kernels on the CPU "
                "through the interpreter"
            )
        if not INTERPRETED:
            return (
                "TRITON_INTERPRET=1 was set after pagedprefill.backends.triton_backend was imported "
                "(Triton picks the interpreter when the kernels are decorated); set it before the import"
            )
        return None
    return f"device type {device.type!r} is not supported by the Triton backend (CUDA only)"


def _served_dim(d: int) -> bool:
    return 16 <= d <= MAX_HEAD_DIM and d % 16 == 0


def unsupported_reason(batch: PrefillBatch) -> str | None:
    dqk, dvo = batch.head_dim_qk, batch.head_dim_vo
    if not (_served_dim(dqk) and _served_dim(dvo)):
        return (
            f"head dims Dqk={dqk}, Dvo={dvo} are not served: the Triton kernels serve head dims that are "
            f"multiples of 16 from 16 to {MAX_HEAD_DIM} (e.g. 64, 96, 128, 256, and Dqk=192 with Dvo=128)"
        )
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if batch.k.dtype in fp8 and batch.device.type == "cuda" and not INTERPRETED:
        if torch.cuda.get_device_capability(batch.device) < (8, 9):
            return "fp8 K/V needs CUDA compute capability >= 8.9 in the Triton kernels"
    return None


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _kv_offsets(
        BT_row,
        cols,
        kv_mask,
        kv_head,
        k_start,
        v_start,
        num_pages,
        stride_kn,
        stride_kh,
        stride_ks,
        stride_vn,
        stride_vh,
        stride_vs,
        start_n,
        PAGE_SIZE: tl.constexpr,
        PAGE_PER_TILE: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """int64 element offsets of the K rows and V rows of keys ``cols`` (one tile)."""
        if PAGE_SIZE == 0:  # ragged
            k_off = (k_start + cols).to(tl.int64) * stride_kn
            v_off = (v_start + cols).to(tl.int64) * stride_vn
        else:
            if PAGE_PER_TILE:  # the whole tile lies in one page
                page = tl.load(BT_row + start_n // PAGE_SIZE)
            elif MASKED:
                page = tl.load(BT_row + cols // PAGE_SIZE, mask=kv_mask, other=0)
            else:
                page = tl.load(BT_row + cols // PAGE_SIZE)
            page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
            slot = (cols % PAGE_SIZE).to(tl.int64)
            k_off = page * stride_kn + slot * stride_ks
            v_off = page * stride_vn + slot * stride_vs
        head = kv_head.to(tl.int64)  # Hkv * head stride may pass 2^31 (heads outermost)
        return k_off + head * stride_kh, v_off + head * stride_vh

    @triton.jit
    def _attend_tile(
        acc0,
        acc1,
        l_i,
        m_i,
        q0,
        q1,
        K,
        V,
        BT_row,
        start_n,
        kv_len,
        diag,
        qk_scale,
        kv_head,
        k_start,
        v_start,
        num_pages,
        stride_kn,
        stride_kh,
        stride_ks,
        stride_vn,
        stride_vh,
        stride_vs,
        CDT: tl.constexpr,
        PREC: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        PAGE_PER_TILE: tl.constexpr,
        DQ0: tl.constexpr,
        DQ1: tl.constexpr,
        DQ1_REAL: tl.constexpr,
        DV0: tl.constexpr,
        DV1: tl.constexpr,
        DV1_REAL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        MASKED: tl.constexpr,
        LAZY: tl.constexpr,
    ):
        """One online-softmax step over keys [start_n, start_n + BLOCK_N)."""
        cols = start_n + tl.arange(0, BLOCK_N)
        kv_mask = cols < kv_len
        k_off, v_off = _kv_offsets(
            BT_row,
            cols,
            kv_mask,
            kv_head,
            k_start,
            v_start,
            num_pages,
            stride_kn,
            stride_kh,
            stride_ks,
            stride_vn,
            stride_vh,
            stride_vs,
            start_n,
            PAGE_SIZE,
            PAGE_PER_TILE,
            MASKED,
        )
        # S = Q K^T, head dim in up to two power-of-two parts
        dq0 = tl.arange(0, DQ0)
        if MASKED:
            k0 = tl.load(K + k_off[:, None] + dq0[None, :], mask=kv_mask[:, None], other=0.0)
        else:
            k0 = tl.load(K + k_off[:, None] + dq0[None, :])
        qk = tl.dot(q0, tl.trans(k0.to(CDT)), input_precision=PREC)
        if DQ1 > 0:
            dq1 = DQ0 + tl.arange(0, DQ1)
            if DQ1_REAL < DQ1:
                k1 = tl.load(
                    K + k_off[:, None] + dq1[None, :],
                    mask=kv_mask[:, None] & (dq1 < DQ0 + DQ1_REAL)[None, :],
                    other=0.0,
                )
            elif MASKED:
                k1 = tl.load(K + k_off[:, None] + dq1[None, :], mask=kv_mask[:, None], other=0.0)
            else:
                k1 = tl.load(K + k_off[:, None] + dq1[None, :])
            qk = tl.dot(q1, tl.trans(k1.to(CDT)), acc=qk, input_precision=PREC)

        if MASKED:
            # scale first, then mask: a masked -inf must never meet a zero scale
            s = qk * qk_scale
            if CAUSAL:
                visible = cols[None, :] <= diag[:, None]  # diag < kv_len for every real row
            else:
                visible = kv_mask[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
            p = tl.math.exp2(s - m_use[:, None])
        elif LAZY:
            # Rescale the accumulators only when some row's running max grew by more than 8 (log2
            # units): with a stale max, p <= 2^8, harmless in fp32 and in the 16-bit P operand.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            if tl.max(m_new - m_i, 0) > 8.0:
                alpha = tl.math.exp2(m_i - m_new)
                acc0 = acc0 * alpha[:, None]
                if DV1 > 0:
                    acc1 = acc1 * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            m_new = m_i
            m_use = m_i
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        else:
            # every key visible to every row: qk_scale >= 0, so max(qk) * scale = max(qk * scale)
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        if LAZY and not MASKED:
            l_i = l_i + tl.sum(p, 1)  # accumulators already rescaled above when needed
        else:
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc0 = acc0 * alpha[:, None]
            if DV1 > 0:
                acc1 = acc1 * alpha[:, None]
        p = p.to(CDT)

        dv0 = tl.arange(0, DV0)
        if MASKED:
            v0 = tl.load(V + v_off[:, None] + dv0[None, :], mask=kv_mask[:, None], other=0.0)
        else:
            v0 = tl.load(V + v_off[:, None] + dv0[None, :])
        acc0 = tl.dot(p, v0.to(CDT), acc=acc0, input_precision=PREC)
        if DV1 > 0:
            dv1 = DV0 + tl.arange(0, DV1)
            if DV1_REAL < DV1:
                v1 = tl.load(
                    V + v_off[:, None] + dv1[None, :],
                    mask=kv_mask[:, None] & (dv1 < DV0 + DV1_REAL)[None, :],
                    other=0.0,
                )
            elif MASKED:
                v1 = tl.load(V + v_off[:, None] + dv1[None, :], mask=kv_mask[:, None], other=0.0)
            else:
                v1 = tl.load(V + v_off[:, None] + dv1[None, :])
            acc1 = tl.dot(p, v1.to(CDT), acc=acc1, input_precision=PREC)
        return acc0, acc1, l_i, m_new

    @triton.jit(
        do_not_specialize=[
            "meta_stride",
            "b_offset",
            "m_offset",
            "num_m_blocks",
            "num_pages",
            "bt_stride",
            "max_q",
            "num_splits",
        ],
        # a caller's table / lse may be a slice at any 4-byte offset: no alignment variants
        do_not_specialize_on_alignment=["BT", "LSE"],
    )
    def _prefill_kernel(
        Q,
        K,
        V,
        Out,
        LSE,
        META,
        BT,
        QS,
        KS,
        VS,
        PO,  # split-KV partial outputs (float32), or a dummy
        PL,  # split-KV partial LSEs (float32, log2 units), or a dummy
        sm_scale_log2,
        meta_stride,
        b_offset,
        m_offset,
        num_m_blocks,
        num_pages,
        bt_stride,
        stride_qt,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_ks,
        stride_vn,
        stride_vh,
        stride_vs,
        stride_ot,
        stride_oh,
        num_heads_q,
        max_q,
        num_splits,
        GROUP: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        PAGE_PER_TILE: tl.constexpr,
        DQ0: tl.constexpr,
        DQ1: tl.constexpr,
        DQ1_REAL: tl.constexpr,
        DV0: tl.constexpr,
        DV1: tl.constexpr,
        DV1_REAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CDT: tl.constexpr,
        PREC: tl.constexpr,
        CAUSAL: tl.constexpr,
        HAS_LSE: tl.constexpr,
        HAS_Q_SCALE: tl.constexpr,
        HAS_K_SCALE: tl.constexpr,
        HAS_V_SCALE: tl.constexpr,
        MAYBE_NEG_SCALE: tl.constexpr,
        SPLIT: tl.constexpr,
        WARP_SPEC: tl.constexpr,
        LAZY_RESCALE: tl.constexpr,
    ):
        kv_head = tl.program_id(0)
        b = tl.program_id(1) + b_offset
        pid_m = tl.program_id(2) + m_offset
        if SPLIT:
            split = pid_m % num_splits
            pid_m = pid_m // num_splits
        m_blk = num_m_blocks - 1 - pid_m  # heaviest (last) row blocks first
        q_len = tl.load(META + b)
        row0 = m_blk * BLOCK_M
        if row0 < q_len * GROUP:
            kv_len = tl.load(META + meta_stride + b)
            q_start = tl.load(META + 2 * meta_stride + b)

            rows = row0 + tl.arange(0, BLOCK_M)
            tok = rows // GROUP
            head = kv_head * GROUP + rows % GROUP
            row_ok = tok < q_len
            q_off = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh

            qk_scale = sm_scale_log2
            if HAS_Q_SCALE:
                qk_scale = qk_scale * tl.load(QS)
            if HAS_K_SCALE:
                qk_scale = qk_scale * tl.load(KS)

            dq0 = tl.arange(0, DQ0)
            q0 = tl.load(Q + q_off[:, None] + dq0[None, :], mask=row_ok[:, None], other=0.0).to(CDT)
            if DQ1 > 0:
                dq1 = DQ0 + tl.arange(0, DQ1)
                q1 = tl.load(
                    Q + q_off[:, None] + dq1[None, :],
                    mask=row_ok[:, None] & (dq1 < DQ0 + DQ1_REAL)[None, :],
                    other=0.0,
                ).to(CDT)
            else:
                q1 = q0  # unused
            if MAYBE_NEG_SCALE:  # q.k * s == (-q).k * (-s): keep the scale non-negative
                neg = qk_scale < 0
                q0 = tl.where(neg, -q0, q0)
                if DQ1 > 0:
                    q1 = tl.where(neg, -q1, q1)
                qk_scale = tl.abs(qk_scale)

            # KV range of this program
            if CAUSAL:
                diag = tok + (kv_len - q_len)  # last visible key of each row
                tok_lo = row0 // GROUP
                tok_hi = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
                hi = tl.minimum(kv_len, tok_hi + (kv_len - q_len) + 1)
                full = tl.minimum(kv_len, tok_lo + (kv_len - q_len) + 1)
                full = (tl.maximum(full, 0) // BLOCK_N) * BLOCK_N
            else:
                diag = tok  # unused
                hi = kv_len
                full = (kv_len // BLOCK_N) * BLOCK_N
            lo = 0
            if SPLIT:
                chunk = tl.cdiv(tl.cdiv(tl.maximum(hi, 0), num_splits), BLOCK_N) * BLOCK_N
                lo = split * chunk
                hi = tl.minimum(hi, lo + chunk)
                full = tl.maximum(tl.minimum(full, hi), lo)

            if PAGE_SIZE > 0:
                BT_row = BT + b.to(tl.int64) * bt_stride
                k_start = 0
                v_start = 0
            else:
                BT_row = BT
                k_start = tl.load(META + 4 * meta_stride + b)
                v_start = tl.load(META + 5 * meta_stride + b)

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc0 = tl.zeros([BLOCK_M, DV0], tl.float32)
            if DV1 > 0:
                acc1 = tl.zeros([BLOCK_M, DV1], tl.float32)
            else:
                acc1 = tl.zeros([1, 1], tl.float32)  # unused

            for start_n in tl.range(lo, full, BLOCK_N, warp_specialize=WARP_SPEC):
                acc0, acc1, l_i, m_i = _attend_tile(
                    acc0,
                    acc1,
                    l_i,
                    m_i,
                    q0,
                    q1,
                    K,
                    V,
                    BT_row,
                    start_n,
                    kv_len,
                    diag,
                    qk_scale,
                    kv_head,
                    k_start,
                    v_start,
                    num_pages,
                    stride_kn,
                    stride_kh,
                    stride_ks,
                    stride_vn,
                    stride_vh,
                    stride_vs,
                    CDT,
                    PREC,
                    PAGE_SIZE,
                    PAGE_PER_TILE,
                    DQ0,
                    DQ1,
                    DQ1_REAL,
                    DV0,
                    DV1,
                    DV1_REAL,
                    BLOCK_N,
                    CAUSAL,
                    False,
                    LAZY_RESCALE,
                )
            for start_n in range(full, hi, BLOCK_N):
                acc0, acc1, l_i, m_i = _attend_tile(
                    acc0,
                    acc1,
                    l_i,
                    m_i,
                    q0,
                    q1,
                    K,
                    V,
                    BT_row,
                    start_n,
                    kv_len,
                    diag,
                    qk_scale,
                    kv_head,
                    k_start,
                    v_start,
                    num_pages,
                    stride_kn,
                    stride_kh,
                    stride_ks,
                    stride_vn,
                    stride_vh,
                    stride_vs,
                    CDT,
                    PREC,
                    PAGE_SIZE,
                    PAGE_PER_TILE,
                    DQ0,
                    DQ1,
                    DQ1_REAL,
                    DV0,
                    DV1,
                    DV1_REAL,
                    BLOCK_N,
                    CAUSAL,
                    True,
                    LAZY_RESCALE,
                )

            has_key = l_i > 0.0
            inv_l = tl.where(has_key, 1.0 / tl.where(has_key, l_i, 1.0), 0.0)
            lse2 = tl.where(has_key, m_i + tl.math.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
            dv0 = tl.arange(0, DV0)
            if DV1 > 0:
                dv1 = DV0 + tl.arange(0, DV1)
            if SPLIT:
                # partials: PO[split, b, tok, head, :] float32, PL[split, b, tok, head] (log2 units)
                prow = ((split * meta_stride + b).to(tl.int64) * max_q + tok) * num_heads_q + head
                o0 = acc0 * inv_l[:, None]
                tl.store(PO + prow[:, None] * (DV0 + DV1_REAL) + dv0[None, :], o0, mask=row_ok[:, None])
                if DV1 > 0:
                    o1 = acc1 * inv_l[:, None]
                    tl.store(
                        PO + prow[:, None] * (DV0 + DV1_REAL) + dv1[None, :],
                        o1,
                        mask=row_ok[:, None] & (dv1 < DV0 + DV1_REAL)[None, :],
                    )
                tl.store(PL + prow, lse2, mask=row_ok)
            else:
                o_start = tl.load(META + 3 * meta_stride + b)
                o_off = (o_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
                v_scale = 1.0
                if HAS_V_SCALE:
                    v_scale = tl.load(VS)
                o0 = (acc0 * (inv_l * v_scale)[:, None]).to(Out.dtype.element_ty)
                tl.store(Out + o_off[:, None] + dv0[None, :], o0, mask=row_ok[:, None])
                if DV1 > 0:
                    o1 = acc1 * (inv_l * v_scale)[:, None]
                    tl.store(
                        Out + o_off[:, None] + dv1[None, :],
                        o1.to(Out.dtype.element_ty),
                        mask=row_ok[:, None] & (dv1 < DV0 + DV1_REAL)[None, :],
                    )
                if HAS_LSE:
                    lse_start = tl.load(META + 6 * meta_stride + b)
                    lse_off = lse_start.to(tl.int64) + tok.to(tl.int64) * num_heads_q + head
                    tl.store(LSE + lse_off, lse2 * 0.6931471805599453, mask=row_ok)

    @triton.jit(
        do_not_specialize=["meta_stride", "b_offset", "max_q", "num_splits"],
        do_not_specialize_on_alignment=["LSE"],
    )
    def _merge_kernel(
        Out,
        LSE,
        META,
        VS,
        PO,
        PL,
        meta_stride,
        b_offset,
        max_q,
        stride_ot,
        stride_oh,
        num_heads_q,
        num_splits,
        DV: tl.constexpr,
        DV_P2: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HAS_LSE: tl.constexpr,
        HAS_V_SCALE: tl.constexpr,
    ):
        """Combine the split-KV partials of one (sequence, token) for BLOCK_H heads."""
        b = tl.program_id(1) + b_offset
        tok = tl.program_id(0)
        q_len = tl.load(META + b)
        if tok < q_len:
            heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
            h_ok = heads < num_heads_q
            d = tl.arange(0, DV_P2)
            d_ok = d < DV
            m = tl.full([BLOCK_H], float("-inf"), tl.float32)
            for s in range(num_splits):
                prow = ((s * meta_stride + b).to(tl.int64) * max_q + tok) * num_heads_q + heads
                m = tl.maximum(m, tl.load(PL + prow, mask=h_ok, other=float("-inf")))
            m_use = tl.where(m == float("-inf"), 0.0, m)
            total = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, DV_P2], tl.float32)
            for s in range(num_splits):
                prow = ((s * meta_stride + b).to(tl.int64) * max_q + tok) * num_heads_q + heads
                w = tl.math.exp2(tl.load(PL + prow, mask=h_ok, other=float("-inf")) - m_use)
                part = tl.load(
                    PO + prow[:, None] * DV + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0
                )
                total += w
                acc += w[:, None] * part
            has_key = total > 0.0
            scale = tl.where(has_key, 1.0 / tl.where(has_key, total, 1.0), 0.0)
            if HAS_V_SCALE:
                scale = scale * tl.load(VS)
            o_start = tl.load(META + 3 * meta_stride + b)
            o_off = (o_start + tok).to(tl.int64) * stride_ot + heads.to(tl.int64) * stride_oh
            tl.store(
                Out + o_off[:, None] + d[None, :],
                (acc * scale[:, None]).to(Out.dtype.element_ty),
                mask=h_ok[:, None] & d_ok[None, :],
            )
            if HAS_LSE:
                lse2 = tl.where(has_key, m_use + tl.math.log2(tl.where(has_key, total, 1.0)), float("-inf"))
                lse_start = tl.load(META + 6 * meta_stride + b)
                lse_off = lse_start.to(tl.int64) + tok.to(tl.int64) * num_heads_q + heads
                tl.store(LSE + lse_off, lse2 * 0.6931471805599453, mask=h_ok)

    _META_INTS = [
        "meta_stride", "n_seq", "s_lq", "s_lkv", "s_oq", "s_oo", "s_ok", "s_ov", "s_os", "max_q", "max_kv",
        "rows_q", "rows_o", "rows_k", "rows_v", "lse_numel", "kv_reach", "unit_q", "unit_o", "unit_k",
        "unit_v", "unit_s", "num_heads", "lse_b_stride",
    ]  # fmt: skip

    @triton.jit(do_not_specialize=_META_INTS)
    def _metadata_kernel(
        META, meta_stride, n_seq,
        LQ, LKV, s_lq, s_lkv,
        OQ, OO, OK, OV, OS, s_oq, s_oo, s_ok, s_ov, s_os,
        max_q, max_kv, rows_q, rows_o, rows_k, rows_v, lse_numel, kv_reach,
        unit_q, unit_o, unit_k, unit_v, unit_s, num_heads, lse_b_stride,
        HAS_OQ: tl.constexpr, HAS_OO: tl.constexpr, HAS_OK: tl.constexpr, HAS_OV: tl.constexpr,
        PAGED: tl.constexpr, LSE_MODE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """api._device_metadata in one program: the (7, n_seq) int32 table from untrusted device
        lengths/offsets, clamped the same way (prefix sums carried across BLOCK-sized chunks), and
        the zero work counter right after it (``PrefillBatch.work_counter``).
        LSE_MODE: 0 none, 1 padded (B, max_q, Hq), 2 packed (offsets OS)."""
        big = 2147483647
        carry_q = tl.zeros([], tl.int64)
        carry_kv = tl.zeros([], tl.int64)
        for c0 in range(0, n_seq, BLOCK):
            b = c0 + tl.arange(0, BLOCK)
            ok = b < n_seq
            lq = tl.load(LQ + b * s_lq, mask=ok, other=0).to(tl.int64)
            lq = tl.minimum(tl.maximum(lq, 0), max_q)
            lkv = tl.load(LKV + b * s_lkv, mask=ok, other=0).to(tl.int64)
            lkv = tl.minimum(tl.maximum(lkv, 0), max_kv)
            pre_q = carry_q + tl.cumsum(lq, 0) - lq
            pre_kv = carry_kv + tl.cumsum(lkv, 0) - lkv
            carry_q += tl.sum(lq, 0)
            carry_kv += tl.sum(lkv, 0)
            if HAS_OQ:
                qs = tl.load(OQ + b * s_oq, mask=ok, other=0).to(tl.int64) // unit_q
                qs = tl.minimum(tl.maximum(qs, 0), big)
            else:
                qs = pre_q
            if HAS_OO:
                os_ = tl.load(OO + b * s_oo, mask=ok, other=0).to(tl.int64) // unit_o
                os_ = tl.minimum(tl.maximum(os_, 0), big)
            else:
                os_ = qs
            lq = tl.minimum(lq, tl.maximum(rows_q - qs, 0))
            lq = tl.minimum(lq, tl.maximum(rows_o - os_, 0))
            if PAGED:
                ks = tl.zeros_like(lq)
                vs = ks
                lkv = tl.minimum(lkv, kv_reach)
            else:
                if HAS_OK:
                    ks = tl.load(OK + b * s_ok, mask=ok, other=0).to(tl.int64) // unit_k
                    ks = tl.minimum(tl.maximum(ks, 0), big)
                else:
                    ks = pre_kv
                if HAS_OV:
                    vs = tl.load(OV + b * s_ov, mask=ok, other=0).to(tl.int64) // unit_v
                    vs = tl.minimum(tl.maximum(vs, 0), big)
                else:
                    vs = ks
                lkv = tl.minimum(lkv, tl.maximum(rows_k - ks, 0))
                lkv = tl.minimum(lkv, tl.maximum(rows_v - vs, 0))
            if LSE_MODE == 1:
                ls = b.to(tl.int64) * lse_b_stride
            elif LSE_MODE == 2:
                ls = tl.load(OS + b * s_os, mask=ok, other=0).to(tl.int64) // unit_s
                ls = tl.minimum(tl.maximum(ls, 0), big) * num_heads
                lq = tl.minimum(lq, tl.maximum((lse_numel - ls) // num_heads, 0))
            else:
                ls = tl.zeros_like(lq)
            tl.store(META + b, tl.minimum(lq, big).to(tl.int32), mask=ok)
            tl.store(META + meta_stride + b, tl.minimum(lkv, big).to(tl.int32), mask=ok)
            tl.store(META + 2 * meta_stride + b, tl.minimum(qs, big).to(tl.int32), mask=ok)
            tl.store(META + 3 * meta_stride + b, tl.minimum(os_, big).to(tl.int32), mask=ok)
            tl.store(META + 4 * meta_stride + b, tl.minimum(ks, big).to(tl.int32), mask=ok)
            tl.store(META + 5 * meta_stride + b, tl.minimum(vs, big).to(tl.int32), mask=ok)
            tl.store(META + 6 * meta_stride + b, tl.minimum(ls, big).to(tl.int32), mask=ok)
        tl.store(META + 7 * meta_stride, 0)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def _tl_dtype(dt: torch.dtype):
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dt]


def _compute_dtype(batch: PrefillBatch) -> torch.dtype:
    """Dtype of the dot operands: q's dtype; fp8 q (with its fp8 K/V) computes in float16, which
    holds every e4m3 and e5m2 value exactly and keeps more mantissa than bfloat16 for P."""
    if batch.q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return batch.q.dtype
    return torch.float16


def _capability(batch: PrefillBatch) -> tuple[int, int] | None:
    if INTERPRETED or batch.device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(batch.device)


def choose_config(batch: PrefillBatch) -> Config:
    """The launch knobs for this call: table defaults, then any override (context or env)."""
    cdt = _compute_dtype(batch)
    cfg = default_config(
        batch.head_dim_qk,
        batch.head_dim_vo,
        torch.finfo(cdt).bits // 8,
        batch.group_size,
        batch.causal,
        _capability(batch),
    )
    if batch.page_size == 1 and cfg.BLOCK_M == 256 and _capability(batch) is not None:
        cfg = Config(128, 64, 4, 3)  # per-key gathers: the smaller tile wins (240 vs 213 TFLOP/s)
    over = {**_env_override(), **_OVERRIDE}
    fields = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "warp_spec", "lazy")
    known = {k: over[k] for k in fields if k in over}
    return replace(cfg, **known) if known else cfg


def _num_m_blocks(batch: PrefillBatch, cfg: Config) -> int:
    return -(-batch.max_q * batch.group_size // cfg.BLOCK_M)


def _available_scratch(batch: PrefillBatch) -> int:
    """Bytes of the caller's workspace left after the metadata (no limit when unknown)."""
    ws = batch.extras.get("workspace")
    if ws is None:
        return 1 << 62
    return ws.numel() - meta_bytes(batch.batch_size)


def choose_splits(batch: PrefillBatch, cfg: Config) -> int:
    """Number of KV splits (1 = no split-KV), from host ints only (no lengths are read).

    The count is a runtime kernel argument (no recompilation when it changes); only split / no
    split is a compile-time constant. An automatic split that does not fit in the caller's
    workspace is reduced (or dropped) rather than failing the call.
    """
    over = {**_env_override(), **_OVERRIDE}
    if "num_splits" in over:
        return max(1, int(over["num_splits"]))
    pol = SPLIT_POLICY
    if not pol.enabled or batch.batch_size == 0 or batch.max_q == 0:
        return 1
    programs = batch.num_kv_heads * batch.batch_size * _num_m_blocks(batch, cfg)
    if programs >= pol.min_programs:
        return 1
    by_len = batch.max_kv // pol.min_keys_per_split
    by_grid = -(-pol.min_programs // programs)
    splits = min(pol.max_splits, by_len, by_grid)
    avail = min(_available_scratch(batch), pol.max_scratch_bytes)
    while splits >= 2 and _partials_bytes(batch, splits) > avail:
        splits -= 1
    return splits if splits >= 2 else 1


def workspace_bytes(batch: PrefillBatch) -> int:
    if triton is None or unsupported_reason(batch) is not None:
        return 0
    cfg = choose_config(batch)
    splits = choose_splits(batch, cfg)
    return _partials_bytes(batch, splits)


def _partials_bytes(batch: PrefillBatch, splits: int) -> int:
    if splits <= 1:
        return 0
    rows = splits * batch.batch_size * batch.max_q * batch.num_qo_heads
    return rows * (batch.head_dim_vo + 1) * 4 + 256  # + alignment slack


def kv_strides(batch: PrefillBatch) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(row or page, head, slot) element strides of K and V as the kernels take them (slot 0: ragged)."""
    if batch.paged:
        return batch.k.stride()[:3], batch.v.stride()[:3]
    return (*batch.k.stride()[:2], 0), (*batch.v.stride()[:2], 0)


def grid_chunks(n_y: int, n_z: int):
    """``(y0, ny, z0, nz)`` pieces of a grid whose y and z extents may pass CUDA's 65535 limit."""
    for y0 in range(0, n_y, GRID_LIMIT):
        for z0 in range(0, n_z, GRID_LIMIT):
            yield y0, min(GRID_LIMIT, n_y - y0), z0, min(GRID_LIMIT, n_z - z0)


def launch_plan(batch: PrefillBatch, cfg: Config | None = None, num_splits: int | None = None):
    """Everything ``run`` launches: a list of ``(kernel, grid, args, kwargs)``.

    Exposed for tests (compile-key checks) and tuning scripts. Reads no device data.
    """
    cfg = choose_config(batch) if cfg is None else cfg
    splits = choose_splits(batch, cfg) if num_splits is None else num_splits
    bsz, hkv, g = batch.batch_size, batch.num_kv_heads, batch.group_size
    if bsz == 0 or batch.max_q == 0:
        return []
    dq0, dq1, dq1_real = split_head_dim(batch.head_dim_qk)
    dv0, dv1, dv1_real = split_head_dim(batch.head_dim_vo)
    cdt = _compute_dtype(batch)
    paged = batch.paged
    page_size = batch.page_size if paged else 0
    meta = batch.meta
    bt = batch.block_tables if paged else meta
    dummy = meta
    k, v, q, out = batch.k, batch.v, batch.q, batch.out
    kstr, vstr = kv_strides(batch)
    if splits > 1:
        nbytes = _partials_bytes(batch, splits)
        if batch.scratch.numel() < nbytes:
            raise ValueError(
                f"workspace_buffer: expected at least {nbytes} bytes of backend scratch for "
                f"{splits} KV splits, got {batch.scratch.numel()}"
            )
        base = batch.scratch
        pad = (-base.data_ptr()) % 16
        rows = splits * bsz * batch.max_q * batch.num_qo_heads
        po = base[pad : pad + rows * batch.head_dim_vo * 4].view(torch.float32)
        pl_start = pad + rows * batch.head_dim_vo * 4
        pl = base[pl_start : pl_start + rows * 4].view(torch.float32)
    else:
        po = pl = dummy
    scale_neg_possible = batch.scale < 0 or batch.q_scale is not None or batch.k_scale is not None
    n_m = _num_m_blocks(batch, cfg)
    plans = []
    for b0, nb, z0, nz in grid_chunks(bsz, n_m * splits):
        args = (
            q,
            k,
            v,
            out,
            batch.lse if batch.lse is not None else dummy,
            meta,
            bt,
            batch.q_scale if batch.q_scale is not None else dummy,
            batch.k_scale if batch.k_scale is not None else dummy,
            batch.v_scale if batch.v_scale is not None else dummy,
            po,
            pl,
            float(batch.scale) * LOG2E,
            meta.stride(0),
            b0,
            z0,
            n_m,
            k.shape[0],
            bt.stride(0) if paged else 0,
            q.stride(0),
            q.stride(1),
            *kstr,
            *vstr,
            out.stride(0),
            out.stride(1),
            batch.num_qo_heads,
            batch.max_q,
            splits,
        )
        kwargs = dict(
            GROUP=g,
            PAGE_SIZE=page_size,
            PAGE_PER_TILE=bool(page_size and page_size % cfg.BLOCK_N == 0),
            DQ0=dq0,
            DQ1=dq1,
            DQ1_REAL=dq1_real,
            DV0=dv0,
            DV1=dv1,
            DV1_REAL=dv1_real,
            BLOCK_M=cfg.BLOCK_M,
            BLOCK_N=cfg.BLOCK_N,
            CDT=_tl_dtype(cdt),
            PREC="ieee" if cdt == torch.float32 else "tf32",
            CAUSAL=bool(batch.causal),
            HAS_LSE=batch.lse is not None and splits == 1,
            HAS_Q_SCALE=batch.q_scale is not None,
            HAS_K_SCALE=batch.k_scale is not None,
            HAS_V_SCALE=batch.v_scale is not None and splits == 1,
            MAYBE_NEG_SCALE=scale_neg_possible,
            SPLIT=splits > 1,
            WARP_SPEC=bool(cfg.warp_spec),
            LAZY_RESCALE=bool(cfg.lazy),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        plans.append((_prefill_kernel, (hkv, nb, nz), args, kwargs))
    if splits > 1:
        block_h = min(_pow2_ceil(batch.num_qo_heads), 16)
        nh = -(-batch.num_qo_heads // block_h)
        dv_p2 = _pow2_ceil(batch.head_dim_vo)
        for b0 in range(0, bsz, GRID_LIMIT):
            nb = min(GRID_LIMIT, bsz - b0)
            args = (
                out,
                batch.lse if batch.lse is not None else dummy,
                meta,
                batch.v_scale if batch.v_scale is not None else dummy,
                po,
                pl,
                meta.stride(0),
                b0,
                batch.max_q,
                out.stride(0),
                out.stride(1),
                batch.num_qo_heads,
                splits,
            )
            kwargs = dict(
                DV=batch.head_dim_vo,
                DV_P2=dv_p2,
                BLOCK_H=block_h,
                HAS_LSE=batch.lse is not None,
                HAS_V_SCALE=batch.v_scale is not None,
                num_warps=4,
                num_stages=1,
            )
            plans.append((_merge_kernel, (batch.max_q, nb, nh), args, kwargs))
    return plans


def _fallback_config(cfg: Config) -> Config | None:
    """A smaller config after an out-of-resources compile error (None when nothing is left)."""
    if cfg.num_stages > 2:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.BLOCK_N > 32:
        return replace(cfg, BLOCK_N=cfg.BLOCK_N // 2)
    if cfg.BLOCK_M > 64:
        return replace(cfg, BLOCK_M=cfg.BLOCK_M // 2, num_warps=4)
    if cfg.num_stages > 1:
        return replace(cfg, num_stages=1)
    return None


_FALLBACKS: dict = {}


def device_metadata(batch: PrefillBatch) -> bool:
    """Fill ``batch.meta`` from the device lengths/offsets exactly as ``api._device_metadata`` does
    (CUDA-graph mode: no host sync, every value clamped), in ONE launch instead of ~25 torch ops.
    Returns False (nothing done) when the Triton kernels cannot run here."""
    if triton is None or unavailable_reason(batch.device) is not None:
        return False
    if batch.batch_size == 0:
        return True
    ex = batch.extras
    offs, units = ex["raw_offsets"], ex["units"]
    lens_q, lens_kv = ex["raw_lens"]
    hq = batch.num_qo_heads
    per_token = elements_per_token(batch)
    vecs, strides, divs = [], [], []
    for name in ("q", "o", "k", "v", "stats"):
        t = offs.get(name)
        if batch.paged and name in ("k", "v"):
            t = None
        vecs.append(t if t is not None else lens_q)
        strides.append(t.stride(0) if t is not None else 0)
        divs.append(per_token[name] if units == "elements" else 1)
    if batch.lse is None:
        lse_mode = 0
    else:
        lse_mode = 2 if batch.lse_packed else 1
    meta = batch.meta
    ctx = torch.cuda.device(batch.device) if batch.device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        _metadata_kernel[(1,)](
            meta, meta.stride(0), batch.batch_size,
            lens_q, lens_kv, lens_q.stride(0), lens_kv.stride(0),
            *vecs, *strides,
            batch.max_q, batch.max_kv, batch.q.shape[0], batch.out.shape[0], batch.k.shape[0],
            batch.v.shape[0], batch.lse.numel() if batch.lse is not None else 0,
            batch.block_tables.shape[1] * batch.page_size if batch.paged else 0,
            *divs, hq, batch.max_q * hq,
            HAS_OQ=offs.get("q") is not None, HAS_OO=offs.get("o") is not None,
            HAS_OK=not batch.paged and offs.get("k") is not None,
            HAS_OV=not batch.paged and offs.get("v") is not None,
            PAGED=batch.paged, LSE_MODE=lse_mode, BLOCK=1024, num_warps=4,
        )  # fmt: skip
    return True


# --------------------------------------------------------------------------------------------
# Launching without Triton's per-call argument binding
# --------------------------------------------------------------------------------------------

_LAUNCHES: dict = {}  # (kernel, device, knobs, kwargs, specialisation of args) -> (compiled, constexprs)
_LAUNCHES_MAX = 4096
# the Triton internals relied on (CompiledKernel[grid](*all params), KernelParam, knobs) as checked
_FAST_LAUNCH_TRITON = ("3", "6")


class _Uncacheable(Exception):
    """An argument fast_launch cannot key exactly: that launch goes through Triton's own path."""


def _spec_of(a: object) -> object:
    """At least everything Triton specialises a runtime argument on (finer is safe: a miss only
    means one launch through Triton's own path). Only tensors, ints, floats, bools and None."""
    t = type(a)
    if t is int:
        if -(2**31) <= a < 2**31:
            wide = 0
        elif -(2**63) <= a < 2**63:
            wide = 1
        elif 0 <= a < 2**64:
            wide = 2
        else:
            raise _Uncacheable  # Triton refuses it: let it say so
        return (a == 1, a % 16 == 0, wide)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if a is None or t is bool:
        return a
    if t is float:
        return float
    if t is gluon_sm90.TensorDescriptor:  # Triton specialises it on dtype, block shape and layout only
        return (t, a.base.dtype, tuple(a.block_shape), a.layout, a.padding)
    raise _Uncacheable  # tuples, constexprs, other descriptors, tensor-likes, ...


def _kwargs_key(kwargs: dict) -> tuple:
    """Constexprs and options by type and value (True, 1 and 1.0 compile apart); floats are not
    keyed (0.0 == -0.0, NaN != NaN)."""
    out = []
    for k, v in kwargs.items():
        if type(v) is float:
            raise _Uncacheable
        out.append((k, type(v), v))
    return tuple(out)


def _current_device() -> int:
    return triton.runtime.driver.active.get_current_device()


def fast_launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)`` where ``args`` are the positional (runtime) parameters and
    ``kwargs`` the constexprs and launch options. A launch whose argument specialisation, kwargs
    and device match an earlier one calls that compiled kernel directly, which skips Triton's
    per-call binding (about 30 µs of host time for a kernel with 30 arguments). The compiled
    kernel's own launcher still calls Triton's launch hooks (profilers); a kernel with pre-run hooks,
    a callable grid, another Triton version and the interpreter always take Triton's own path."""
    if INTERPRETED or kernel.pre_run_hooks or callable(grid) or _TRITON_MINOR != _FAST_LAUNCH_TRITON:
        kernel[grid](*args, **kwargs)
        return
    try:
        jit_knobs = (triton.knobs.runtime.debug, triton.knobs.compilation.instrumentation_mode)
        key = (kernel, _current_device(), jit_knobs, _kwargs_key(kwargs), tuple(_spec_of(a) for a in args))
        hit = _LAUNCHES.get(key)
    except (_Uncacheable, TypeError):  # TypeError: an unhashable option
        kernel[grid](*args, **kwargs)
        return
    if hit is not None:
        compiled, constexprs = hit
        compiled[(*grid, 1, 1)[:3]](*args, *constexprs)
        return
    compiled = kernel[grid](*args, **kwargs)
    rest = kernel.params[len(args) :]
    if compiled is None or not hasattr(compiled, "function") or not all(p.is_constexpr for p in rest):
        return
    if len(_LAUNCHES) >= _LAUNCHES_MAX:
        _LAUNCHES.clear()
    _LAUNCHES[key] = (compiled, tuple(kwargs[p.name] if p.name in kwargs else p.default for p in rest))


def compile_count() -> int:
    """Kernel variants compiled so far in this process (all devices); 0 under the interpreter."""
    if triton is None or INTERPRETED:
        return 0
    total = 0
    kernels = [_prefill_kernel, _merge_kernel, _metadata_kernel]
    if gluon_sm90.gluon is not None:
        kernels.append(gluon_sm90._attention_kernel)
    for kernel in kernels:
        total += sum(len(cache[0]) for cache in kernel.device_caches.values())
    return total


def use_gluon(batch: PrefillBatch, splits: int) -> bool:
    """Whether this call runs the Hopper Gluon kernel (``gluon_sm90``) instead of ``_prefill_kernel``.

    Wherever it can serve the call (sm_90, 16-bit q/k/v, Dqk = Dvo in {64, 128} or Dqk 192 / Dvo
    128, no scale tensors, 16-element q/K/V strides, no split-KV): on the H200 it was faster than the
    Triton kernel on every shape measured, paged (page sizes 1, 4, 8, 16, 64) and ragged, D = 64 and
    128, and Dqk 192 / Dvo 128 (``docs/triton_kernel.md``). Knob ``gluon=0`` turns it off.
    """
    mode = {**_env_override(), **_OVERRIDE}.get("gluon")
    if mode == 0 or INTERPRETED or splits > 1:
        return False
    return gluon_sm90.unavailable_reason(batch) is None


def runs_gluon(batch: PrefillBatch) -> bool:
    """Whether :func:`run` would take the Gluon kernel for this call (its config and split count
    included), from host ints only."""
    return use_gluon(batch, choose_splits(batch, choose_config(batch)))


def run(batch: PrefillBatch) -> None:
    if batch.batch_size == 0 or batch.max_q == 0:
        return
    cfg = choose_config(batch)
    splits = choose_splits(batch, cfg)  # from the table config, exactly as workspace_bytes
    if use_gluon(batch, splits):
        with torch.cuda.device(batch.device):
            for kernel, grid, args, kwargs in gluon_sm90.launch_plan(batch):
                fast_launch(kernel, grid, args, kwargs)
        return
    key = (cfg, batch.device.type, batch.head_dim_qk, batch.head_dim_vo, batch.q.dtype, batch.k.dtype)
    cfg = _FALLBACKS.get(key, cfg)
    ctx = torch.cuda.device(batch.device) if batch.device.type == "cuda" else contextlib.nullcontext()
    with ctx:
        while True:
            try:
                for kernel, grid, args, kwargs in launch_plan(batch, cfg, splits):
                    fast_launch(kernel, grid, args, kwargs)
                return
            except triton.runtime.errors.OutOfResources:
                smaller = _fallback_config(cfg)
                if smaller is None:
                    raise
                cfg = smaller
                _FALLBACKS[key] = cfg
