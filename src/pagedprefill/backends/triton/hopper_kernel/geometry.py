"""The kernel's compile-time shape (:class:`Geometry`) and one work item's rows and key range
(:class:`WorkItem`)."""

# (no ``from __future__ import annotations``: Gluon aggregates check their fields' annotations)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate


@aggregate
class Geometry:
    """Compile-time shape of the kernel."""

    GROUP: gl.constexpr  # query heads per KV head
    PAGE_SIZE: gl.constexpr  # 0: ragged K/V
    DQ0: gl.constexpr  # key columns of the first QK part (<= 128; Dqk 96: 64)
    DQ1: gl.constexpr  # key columns after them (Dqk 96: 32, 192: 64, 256: 128), else 0
    DVO: gl.constexpr
    DV0: gl.constexpr  # V / O columns of the first PV part (Dvo 96: 64), else DVO
    DV1: gl.constexpr  # V / O columns after them (Dvo 96: 32), else 0
    SUB_M: gl.constexpr  # rows per consumer warpgroup
    NC: gl.constexpr  # consumer warpgroups
    MERGED: gl.constexpr  # the first two consumer warpgroups as one partition of 8 warps (rows 0-127):
    # one copy of their code where Gluon outlines each partition apart (instruction fetch)
    NP: gl.constexpr  # consumer partitions (each arrives once on the consumers' barriers)
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    STAGES: gl.constexpr
    CAUSAL: gl.constexpr
    HAS_LSE: gl.constexpr
    LOAD_WARPS: gl.constexpr
    USE_TMA: gl.constexpr  # whole K/V tiles by bulk-tensor copies
    PAGE_BOX: gl.constexpr  # rows per K/V TMA box (never crosses a page)
    K_HEAD_ROWS: gl.constexpr  # K's 2-D TMA view steps heads in rows (else in columns)
    V_HEAD_ROWS: gl.constexpr
    Q_TMA: gl.constexpr  # the load warps copy Q by TMA (else each consumer by cp.async)
    O_STAGE: gl.constexpr  # 1: O stored through the consumer's Q slot as whole rows
    WINDOW: gl.constexpr  # a sliding window: keys below position - window are skipped / masked
    SOFTCAP: gl.constexpr  # logits c * tanh(s / c)
    SINKS: gl.constexpr  # a per-head sink logit in every row's denominator
    KV8: gl.constexpr  # 8-bit K/V: tiles arrive in a staging ring and the load warps widen them
    F8: gl.constexpr  # 8-bit q, K and V on 8-bit wgmmas: V arrives in the staging ring and the load
    # warps transpose it into the K/V ring (the PV GEMM's B operand must be K-major)
    S8: gl.constexpr  # KV8: staging slots (tiles in flight ahead of the one being widened, plus it)
    VEC: gl.constexpr  # K/V elements per 16-byte cp.async chunk
    Q_SCALED: gl.constexpr  # F8: a device q_scale multiplies the logits too
    K_SCALED: gl.constexpr  # a device k_scale multiplies the logits (its sign is read on the device)
    V_SCALED: gl.constexpr  # a device v_scale multiplies O
    SPLIT: gl.constexpr  # K and V of a stage on barriers of their own (V's at STAGES + stage): K is
    # released once its QK GEMM is done, a tile before V
    ROWSUM: gl.constexpr  # row sums by a wgmma of P against a block of ones (QSlots.ones), beside the PV
    # GEMM and rescaled with O, in place of each thread's ~32 FADD / FFMA a tile (the sum is then of P as
    # the PV GEMM reads it, in its dtype)
    ISSUER: gl.constexpr  # K/V by TMA: one warp of its own claims the items and issues every TMA copy;
    # the LOAD_WARPS load warps only gather the tiles that cross kv_len (KV8: and widen every tile)
    TMA_WARPS: gl.constexpr  # warps of the partition that issues the TMA copies (1 with ISSUER)

    @gluon.constexpr_function
    def __init__(
        self,
        GROUP,
        PAGE_SIZE,
        DQK,
        DVO,
        NC,
        BLOCK_N,
        STAGES,
        CAUSAL,
        HAS_LSE,
        LOAD_WARPS,
        USE_TMA,
        PAGE_BOX,
        K_HEAD_ROWS,
        V_HEAD_ROWS,
        Q_TMA,
        O_STAGE,
        WINDOW,
        SOFTCAP,
        SINKS,
        KV8,
        F8,
        S8,
        Q_SCALED,
        K_SCALED,
        V_SCALED,
        SPLIT,
        ROWSUM,
        ISSUER,
        MERGED,
    ):
        self.GROUP = gl.constexpr(GROUP)
        self.PAGE_SIZE = gl.constexpr(PAGE_SIZE)
        dq0 = 64 if DQK == 96 else min(DQK, 128)  # (a tensor's dims are powers of two)
        self.DQ0 = gl.constexpr(dq0)
        self.DQ1 = gl.constexpr(DQK - dq0)
        self.DVO = gl.constexpr(DVO)
        self.DV0 = gl.constexpr(64 if DVO == 96 else DVO)
        self.DV1 = gl.constexpr(DVO - (64 if DVO == 96 else DVO))
        self.SUB_M = gl.constexpr(64)
        self.NC = gl.constexpr(NC)
        self.MERGED = gl.constexpr(MERGED)
        self.NP = gl.constexpr(NC - 1 if MERGED else NC)
        self.BLOCK_M = gl.constexpr(64 * NC)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.STAGES = gl.constexpr(STAGES)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.HAS_LSE = gl.constexpr(HAS_LSE)
        self.LOAD_WARPS = gl.constexpr(LOAD_WARPS)
        self.USE_TMA = gl.constexpr(USE_TMA)
        self.PAGE_BOX = gl.constexpr(PAGE_BOX)
        self.K_HEAD_ROWS = gl.constexpr(K_HEAD_ROWS)
        self.V_HEAD_ROWS = gl.constexpr(V_HEAD_ROWS)
        self.Q_TMA = gl.constexpr(Q_TMA)
        self.O_STAGE = gl.constexpr(O_STAGE)
        self.WINDOW = gl.constexpr(WINDOW)
        self.SOFTCAP = gl.constexpr(SOFTCAP)
        self.SINKS = gl.constexpr(SINKS)
        self.KV8 = gl.constexpr(KV8)
        self.F8 = gl.constexpr(F8)
        self.S8 = gl.constexpr(S8)
        self.VEC = gl.constexpr(16 if (KV8 or F8) else 8)
        self.Q_SCALED = gl.constexpr(Q_SCALED)
        self.K_SCALED = gl.constexpr(K_SCALED)
        self.V_SCALED = gl.constexpr(V_SCALED)
        self.SPLIT = gl.constexpr(SPLIT)
        self.ROWSUM = gl.constexpr(ROWSUM)
        self.ISSUER = gl.constexpr(ISSUER)
        self.TMA_WARPS = gl.constexpr(1 if ISSUER else LOAD_WARPS)


@aggregate
class WorkItem:
    """One work item: its sequence's metadata and the key range of its rows."""

    kv_head: gl.tensor
    row0: gl.tensor  # first row (token x head-in-group) of the item's block
    q_len: gl.tensor  # 0 for a last round's missing item
    kv_len: gl.tensor
    q_start: gl.tensor
    o_start: gl.tensor
    lse_start: gl.tensor
    BT_row: gl.tensor  # the sequence's page ids (paged), else the metadata pointer
    k_start: gl.tensor
    v_start: gl.tensor
    hi: gl.tensor  # keys [0, hi) are visible to some row of the block
    full: gl.tensor  # keys [0, full) are visible to every row, in whole tiles
    n_tiles: gl.tensor  # key tiles covering [0, hi) (a share: its last tile + 1); 0 when every row is past the sequence
    t0: gl.tensor  # the first key tile the item computes: 0, or a share's first tile
    share: gl.tensor  # which share of a split item this is (see Schedule.work_item), -1 for a whole item
    tail: gl.tensor  # a share's split item, counted from the first split one

    @gluon.constexpr_function
    def __init__(
        self,
        kv_head,
        row0,
        q_len,
        kv_len,
        q_start,
        o_start,
        lse_start,
        BT_row,
        k_start,
        v_start,
        hi,
        full,
        n_tiles,
        t0,
        share,
        tail,
    ):
        self.kv_head = kv_head
        self.row0 = row0
        self.q_len = q_len
        self.kv_len = kv_len
        self.q_start = q_start
        self.o_start = o_start
        self.lse_start = lse_start
        self.BT_row = BT_row
        self.k_start = k_start
        self.v_start = v_start
        self.hi = hi
        self.full = full
        self.n_tiles = n_tiles
        self.t0 = t0
        self.share = share
        self.tail = tail


@gluon.jit
def _key_range(r_lo, q_len, kv_len, ROWS: gl.constexpr, geo: Geometry):
    """Keys of rows [r_lo, r_lo + ROWS): (hi: keys [0, hi) visible to some row, n_tiles: key tiles
    covering them, 0 for rows all past the sequence, full: keys visible to every row, in whole
    tiles)."""
    if geo.CAUSAL:
        tok_hi = gl.minimum((r_lo + ROWS - 1) // geo.GROUP, q_len - 1)
        hi = gl.minimum(kv_len, tok_hi + (kv_len - q_len) + 1)
        full = gl.minimum(kv_len, r_lo // geo.GROUP + (kv_len - q_len) + 1)
        full = (gl.maximum(full, 0) // geo.BLOCK_N) * geo.BLOCK_N
    else:
        hi = kv_len
        full = (kv_len // geo.BLOCK_N) * geo.BLOCK_N
    hi = gl.maximum(hi, 0)
    n_tiles = (hi + geo.BLOCK_N - 1) // geo.BLOCK_N
    n_tiles = gl.where(r_lo < q_len * geo.GROUP, n_tiles, 0)  # rows past the sequence: nothing
    return hi, n_tiles, full


@gluon.jit
def _window_range(r_lo, q_len, kv_len, n_tiles, window, ROWS: gl.constexpr, geo: Geometry):
    """The sliding window's lower edge for rows [r_lo, r_lo + ROWS): (t_lo: the first key tile any row
    sees, at most n_tiles; head_end: keys from here on are above every row's edge, in whole tiles)."""
    tok_hi = gl.minimum((r_lo + ROWS - 1) // geo.GROUP, q_len - 1)
    first = gl.maximum(r_lo // geo.GROUP + (kv_len - q_len) - window, 0)
    t_lo = gl.minimum(first // geo.BLOCK_N, n_tiles)
    edge = gl.maximum(tok_hi + (kv_len - q_len) - window, 0)
    head_end = (edge + geo.BLOCK_N - 1) // geo.BLOCK_N * geo.BLOCK_N
    return t_lo, head_end
