"""The consumer warpgroups: QK and PV wgmmas around the softmax, and the epilogue (:class:`OutSink`:
where O and the LSE go)."""

# (no ``from __future__ import annotations``: Gluon aggregates check their fields' annotations)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from .buffers import KVRing, QSlots, q_rows
from .geometry import Geometry, WorkItem, _key_range, _window_range
from .loads import _chunk_layout
from .merge import HEADER_INTS
from .schedule import Schedule
from .softmax import _quad_sums, _rescale, _softmax
from .sync import wait_unsynced


@aggregate
class OutSink:
    """Q in global memory (consumers' own copies), and where O and the LSE go."""

    Q: gl.tensor
    stride_qt: gl.tensor
    stride_qh: gl.tensor
    Out: gl.tensor
    LSE: gl.tensor
    stride_ot: gl.tensor
    stride_oh: gl.tensor
    num_heads_q: gl.tensor
    qk_scale: gl.tensor  # softmax scale x log2(e)
    softcap: gl.tensor  # SOFTCAP: the cap c
    SINKS: gl.tensor  # SINKS: float32 (Hq,) sink logits
    Q_SCALE: gl.tensor  # Q_SCALED: float32 (1,)
    K_SCALE: gl.tensor  # K_SCALED: float32 (1,)
    V_SCALE: gl.tensor  # V_SCALED: float32 (1,)

    @gluon.constexpr_function
    def __init__(
        self,
        Q,
        stride_qt,
        stride_qh,
        Out,
        LSE,
        stride_ot,
        stride_oh,
        num_heads_q,
        qk_scale,
        softcap,
        SINKS,
        Q_SCALE,
        K_SCALE,
        V_SCALE,
    ):
        self.Q = Q
        self.stride_qt = stride_qt
        self.stride_qh = stride_qh
        self.Out = Out
        self.LSE = LSE
        self.stride_ot = stride_ot
        self.stride_oh = stride_oh
        self.num_heads_q = num_heads_q
        self.qk_scale = qk_scale
        self.softcap = softcap
        self.SINKS = SINKS
        self.Q_SCALE = Q_SCALE
        self.K_SCALE = K_SCALE
        self.V_SCALE = V_SCALE


@gluon.jit
def _qk_async(q_sub, q1_sub, k_buf, k1_buf, s_zero, DQ1: gl.constexpr):
    """S = Q K^T as asynchronous wgmmas (a second one for key columns past 128 when DQ1 > 0)."""
    tok = warpgroup_mma(q_sub, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if DQ1 > 0:
        tok = warpgroup_mma(q1_sub, k1_buf.permute((1, 0)), tok, is_async=True)
    return tok


@gluon.jit
def _q_cols_async(
    buf,
    w: WorkItem,
    out: OutSink,
    R0: gl.constexpr,
    ROWS: gl.constexpr,
    geo: Geometry,
    C0: gl.constexpr,
    NCOL: gl.constexpr,
):
    """cp.async copies of columns [C0, C0 + NCOL) of work item w's Q rows [row0 + R0, row0 + R0 +
    ROWS) into buf; rows past the sequence zero-filled."""
    GROUP: gl.constexpr = geo.GROUP
    VQ: gl.constexpr = 128 // out.Q.dtype.element_ty.primitive_bitwidth  # (16-byte chunks)
    LD: gl.constexpr = gl.BlockedLayout([1, VQ], [32 // (NCOL // VQ), NCOL // VQ], [ROWS // 16, 1], [1, 0])
    rows = w.row0 + R0 + gl.arange(0, ROWS, gl.SliceLayout(1, LD))
    tok = rows // GROUP
    head = w.kv_head * GROUP + rows % GROUP
    off = (w.q_start + tok).to(gl.int64) * out.stride_qt + head.to(gl.int64) * out.stride_qh
    d = C0 + gl.arange(0, NCOL, gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(buf, out.Q + off[:, None] + d[None, :], mask=(tok < w.q_len)[:, None])


@gluon.jit
def _p_operand(p, P_L: gl.constexpr, dtype: gl.constexpr, F8: gl.constexpr):
    """P (float32, the QK accumulator's layout) as it crosses the loop to the next PV GEMM: in the
    GEMMs' dtype as that GEMM's A operand, or (F8) as it is (:func:`_a_operand` converts it there)."""
    if F8:
        p_op = p
    else:
        p_op = gl.convert_layout(p.to(dtype), P_L)
    return p_op


@gluon.jit
def _a_operand(p_op, P_L: gl.constexpr, F8: gl.constexpr):
    """The PV GEMM's A operand from the P carried from the last tile's softmax: in the GEMMs' dtype
    already (16-bit), or (F8) float32 in the QK accumulator's layout, converted here to e4m3.

    F8: P's key columns are reordered so that no value leaves its thread. An 8-bit A operand holds
    keys 4t..4t+3 (and 16 on) of each 32 in lane t of a quad, where the accumulator held 2t, 2t + 1,
    8 + 2t, 9 + 2t (and 16 on): operand key 32a + 16h + 4t + 2i + j is accumulator column 32a + 16h +
    8i + 2t + j, and the load warps store V's keys in the same order (:func:`.loads._transpose_v`).
    Each operand register is then two conversions of accumulator pairs. (Converted where the softmax
    ends, P crossed the loop as 8-bit values, and each register was rebuilt from its four bytes: ~6
    byte moves per register, a third of the loop's instructions.)"""
    if F8:
        M: gl.constexpr = p_op.shape[0]
        N: gl.constexpr = p_op.shape[1]
        p = gl.reshape(gl.permute(gl.reshape(p_op, [M, N // 32, 2, 2, 4, 2]), (0, 1, 2, 4, 3, 5)), [M, N])
        p = gl.convert_layout(p, P_L, assert_trivial=True)  # (float32: registers renamed only)
        a = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }",
            "=r,f,f,f,f",
            [p],
            dtype=gl.float8e4nv,
            is_pure=True,
            pack=4,
        )
    else:
        a = p_op
    return a


@gluon.jit
def _rowsum_async(a_op, slots: QSlots, lacc, PL_L: gl.constexpr):
    """lacc += P 1 (geo.ROWSUM): the PV GEMM's A operand against the block of ones, asynchronously."""
    a = gl.convert_layout(a_op, PL_L, assert_trivial=True)  # (an A operand's registers do not depend on N)
    return warpgroup_mma(a, slots.ones.permute((1, 0)), lacc, is_async=True)


@gluon.jit
def _pv_wait(o_tok, o1_tok, l_tok, acc1, lacc, TWO: gl.constexpr, ROWSUM: gl.constexpr):
    """Wait for a tile's PV GEMMs (two where TWO) and its row sums' wgmma (ROWSUM): (acc, acc1, lacc),
    the accumulators not computed passed through."""
    if TWO:
        if ROWSUM:
            acc, acc1, lacc = warpgroup_mma_wait(0, deps=[o_tok, o1_tok, l_tok])
        else:
            acc, acc1 = warpgroup_mma_wait(0, deps=[o_tok, o1_tok])
    else:
        if ROWSUM:
            acc, lacc = warpgroup_mma_wait(0, deps=[o_tok, l_tok])
        else:
            acc = warpgroup_mma_wait(0, deps=[o_tok])
    return acc, acc1, lacc


@gluon.jit
def _v_operand(v_buf, F8: gl.constexpr):
    """A V tile as the PV GEMM's B operand ([keys, Dvo]): F8 stores it transposed."""
    if F8:
        v_op = v_buf.permute((1, 0))
    else:
        v_op = v_buf
    return v_op


@gluon.constexpr_function
def _prep_rows(dq0, dq1, warps):
    """Rows of Q converted at a time: 16, or as many as the narrower part's layout covers."""
    narrow = min(dq0, dq1) if dq1 else dq0
    return max(16, warps * (32 // (narrow // 8)))


@gluon.jit
def _prep_q(q_sub, q1_sub, h0, h1, f_buf, sign, ROWS: gl.constexpr, geo: Geometry):
    """KV8: this warpgroup's Q rows, in q's 16-bit dtype, -> float16 in place (the GEMMs' dtype: the
    8-bit K/V widen to it in one instruction per pair), each row times ``sign`` and a power of two
    2^k that puts its largest magnitude in [2^14, 2^15): exact, since bf16's 8-bit significands fit
    fp16's 11 wherever fp16 is normal, and a row's entries under 2^-28 of its largest are all fp16
    loses. Each row's 2^-k goes to f_buf. h0 / h1: the same rows viewed as float16."""
    DQ0: gl.constexpr = geo.DQ0
    DQ1: gl.constexpr = geo.DQ1
    RCH: gl.constexpr = _prep_rows(DQ0, DQ1, ROWS // 16)
    L0: gl.constexpr = _chunk_layout(DQ0, 8, ROWS // 16)
    if DQ1 > 0:
        L1: gl.constexpr = _chunk_layout(DQ1, 8, ROWS // 16)
    for r in gl.static_range(ROWS // RCH):
        x = q_sub.slice(r * RCH, RCH).load(L0).to(gl.float32)
        amax = gl.max(gl.abs(x), 1)
        if DQ1 > 0:
            x1 = q1_sub.slice(r * RCH, RCH).load(L1).to(gl.float32)
            amax = gl.maximum(amax, gl.convert_layout(gl.max(gl.abs(x1), 1), gl.SliceLayout(1, L0)))
        e = ((amax.to(gl.int32, bitcast=True) >> 23) & 255) - 127  # floor(log2 amax) (0: -127)
        k = gl.minimum(gl.maximum(14 - e, -126), 126)
        up = ((k + 127) << 23).to(gl.float32, bitcast=True) * sign  # (+-2^k)
        f_buf.slice(r * RCH, RCH).store(((127 - k) << 23).to(gl.float32, bitcast=True))
        h0.slice(r * RCH, RCH).store((x * up[:, None]).to(gl.float16))
        if DQ1 > 0:
            up1 = gl.convert_layout(up, gl.SliceLayout(1, L1))
            h1.slice(r * RCH, RCH).store((x1 * up1[:, None]).to(gl.float16))


@gluon.jit
def _as_f16(buf):
    """``buf`` viewed as float16 (KV8: the slots after _prep_q)."""
    return buf._reinterpret(gl.float16, buf.shape, buf.layout)


@gluon.jit
def _release(ring: KVRing, i):
    """Hand ring stage (barrier) i back to the load warps: every consumer thread arrives once its own
    GEMMs on it are done (no partition barrier before one elected arrive)."""
    async_copy.mbarrier_arrive(ring.empty.index(i), increment_count=False)


@gluon.jit
def _skip_tile(ring: KVRing, u, geo: Geometry):
    """Release the program's u-th key tile unread (in ring order, so that the phases stay in step)."""
    STAGES: gl.constexpr = geo.STAGES
    mbarrier.wait(ring.full.index(u % STAGES), (u // STAGES) & 1)
    _release(ring, u % STAGES)
    if geo.SPLIT:
        mbarrier.wait(ring.full.index(STAGES + u % STAGES), (u // STAGES) & 1)
        _release(ring, STAGES + u % STAGES)


@gluon.jit
def _consumer_partition(
    sched: Schedule, ring: KVRing, slots: QSlots, out: OutSink, R0: gl.constexpr, ROWS: gl.constexpr, geo: Geometry
):
    """One consumer partition of ROWS // 16 warps (a warpgroup, or two with ``Geometry.MERGED``): rows
    [row0 + R0, row0 + R0 + ROWS) of each work item's block, 16 a warp."""
    GROUP: gl.constexpr = geo.GROUP
    DQ1: gl.constexpr = geo.DQ1
    DV0: gl.constexpr = geo.DV0
    DV1: gl.constexpr = geo.DV1
    SUB_M: gl.constexpr = ROWS
    CW: gl.constexpr = ROWS // 16  # (the partition's warps)
    BLOCK_N: gl.constexpr = geo.BLOCK_N
    STAGES: gl.constexpr = geo.STAGES
    CAUSAL: gl.constexpr = geo.CAUSAL
    dtype: gl.constexpr = ring.k.dtype  # (the GEMMs' inputs: q's dtype, or float16 for 8-bit K/V)
    qk_scale = out.qk_scale
    sign = 1.0
    if geo.K_SCALED:
        k_scale = gl.load(out.K_SCALE)
        if geo.KV8:  # (its sign goes into Q: the scale stays >= 0)
            sign = gl.where(k_scale < 0, -1.0, 1.0)
            k_scale = gl.abs(k_scale)
        qk_scale = qk_scale * k_scale
    if geo.Q_SCALED:
        qk_scale = qk_scale * gl.load(out.Q_SCALE)
    # F8: the softmax's unmasked path takes max(s) * scale for max(s * scale): only for scales > 0
    # (every tile of another call takes the masked path, which scales first)
    if geo.F8:
        fast_ok = qk_scale > 0
    else:
        fast_ok = True
    if geo.SOFTCAP:  # s = cap * tanh(scale * q.k / cap), in log2 units: cap_out * tanh(q.k * qk_scale / cap_out)
        cap_out = out.softcap * 1.4426950408889634
        qk_scale = qk_scale / cap_out
    else:
        cap_out = 1.0
    # Q_TMA: the slot goes back to the load warps after this warpgroup's last QK GEMM of an item, or,
    # when O is staged through it, after O is read back from it
    Q_EARLY: gl.constexpr = geo.Q_TMA and geo.O_STAGE != 1
    KI: gl.constexpr = 256 // dtype.primitive_bitwidth  # (a wgmma's K: 32 bytes)
    KW: gl.constexpr = 32 // dtype.primitive_bitwidth  # (A-operand elements per register)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1], instr_shape=[16, BLOCK_N, KI])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1], instr_shape=[16, DV0, KI])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=KW)
    if DV1 > 0:  # (O in two accumulators, DV0 + DV1 columns, one PV GEMM each)
        O1_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1], instr_shape=[16, DV1, KI])
        P1_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O1_L, k_width=KW)
        O1_E: gl.constexpr = O1_L
    else:  # (the epilogue's second accumulator layout: unused)
        O1_E: gl.constexpr = O_L
    # ROWSUM: the row sums' accumulator, [SUB_M, 8] (its 8 columns alike), and P as its A operand
    L_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1], instr_shape=[16, 8, KI])
    PL_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=L_L, k_width=KW)
    # (wgmma groups issued after a tile's QK GEMM: its PV GEMMs and the row sums')
    AFTER_QK: gl.constexpr = (2 if DV1 > 0 else 1) + (1 if geo.ROWSUM else 0)
    q_sub = q_rows(slots.q, slots.q3, R0, ROWS)
    if DQ1 > 0:
        q1_sub = q_rows(slots.q1, slots.q13, R0, ROWS)
    else:
        q1_sub = q_sub
    if geo.KV8:  # (the GEMMs read the slot as float16, see _prep_q)
        # (whole buffers reinterpreted, then sliced: a reinterpreted slice loses its buffer's row count,
        # which places the second 128-byte column block of a row)
        qg_sub = q_rows(_as_f16(slots.q), _as_f16(slots.q3), R0, ROWS)
        qg1_sub = q_rows(_as_f16(slots.q1), _as_f16(slots.q13), R0, ROWS)
        f_buf = slots.f.slice(R0, SUB_M)
        qk_r = gl.full([SUB_M], 1.0, gl.float32, gl.SliceLayout(1, S_L)) * qk_scale  # (set per item)
        qk_e = qk_r[:, None]
    else:
        qg_sub = q_sub
        qg1_sub = q1_sub
        qk_e = qk_scale
        qk_r = qk_scale
    c = gl.program_id(0) * 0  # key tiles this program has consumed so far
    r = gl.program_id(0) * 0  # rounds (items) so far
    item = sched.take(r, CW)
    while sched.more(item, r):
        w = sched.work_item(item, geo, geo.HAS_LSE)
        # this warpgroup's Q rows -> its own slot, once all its warps are past the previous item's GEMMs
        if geo.Q_TMA:  # (the load warps' copies)
            # (every mbarrier.arrive of a warpgroup here is lowered as a bar.sync of its 128 threads
            # and one elected arrive: no warp can lag a round behind the arrival)
            mbarrier.wait(slots.full, r & 1)
        else:
            gl.thread_barrier()
            _q_cols_async(q_sub, w, out, R0, ROWS, geo, 0, geo.DQ0)
            if DQ1 > 0:
                _q_cols_async(q1_sub, w, out, R0, ROWS, geo, geo.DQ0, DQ1)
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
        if geo.KV8:
            _prep_q(q_sub, q1_sub, qg_sub, qg1_sub, f_buf, sign, ROWS, geo)
            fence_async_shared()
            gl.thread_barrier()
            qk_r = qk_scale * f_buf.load(gl.SliceLayout(1, S_L))
            qk_e = qk_r[:, None]
        rows_s = w.row0 + R0 + gl.arange(0, SUB_M, gl.SliceLayout(1, S_L))
        tok_s = rows_s // GROUP
        diag = tok_s + (w.kv_len - w.q_len)
        m_i = gl.full([SUB_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
        l_i = _quad_sums(gl.zeros([SUB_M, BLOCK_N], gl.float32, S_L))  # (per thread: see _quad_sums)
        lacc = gl.zeros([SUB_M, 8], gl.float32, L_L)
        acc = gl.zeros([SUB_M, DV0], gl.float32, O_L)
        s_zero = gl.zeros([SUB_M, BLOCK_N], gl.float32, S_L)
        if geo.F8:  # (P crosses the loop in float32: see _a_operand)
            p_op = gl.zeros([SUB_M, BLOCK_N], gl.float32, S_L)
        else:
            p_op = gl.zeros([SUB_M, BLOCK_N], dtype, P_L)
        if DV1 > 0:
            acc1 = gl.zeros([SUB_M, DV1], gl.float32, O1_L)
            p_op1 = gl.zeros([SUB_M, BLOCK_N], dtype, P1_L)
        else:  # (unused: _pv_wait passes it through)
            acc1 = lacc
        n_walk = w.n_tiles  # key tiles this warpgroup computes up to; below full_own none is masked
        full_own = w.full
        if CAUSAL:
            # (this warpgroup's rows lie inside the block's: its range is within the block's; a share
            # ends at its own last tile)
            _, n_walk, full_own = _key_range(w.row0 + R0, w.q_len, w.kv_len, SUB_M, geo)
            n_walk = gl.minimum(n_walk, w.n_tiles)
        # the ring holds the block's tiles from t_lo on (a share's first tile, or the window's);
        # this warpgroup computes from t_own on (tiles before it are released unread), and with a
        # window keys from head_own on need no mask
        t_lo = w.t0
        t_own = w.t0
        head_own = 0
        if geo.WINDOW:
            t_win, _ = _window_range(w.row0, w.q_len, w.kv_len, w.n_tiles, sched.window, geo.BLOCK_M, geo)
            t_lo = gl.maximum(t_win, t_lo)
            t_own, head_own = _window_range(w.row0 + R0, w.q_len, w.kv_len, n_walk, sched.window, SUB_M, geo)
            t_own = gl.maximum(t_own, t_lo)
            for t in range(t_lo, t_own):
                _skip_tile(ring, c + t - t_lo, geo)
        n_walk = gl.maximum(n_walk, t_own)
        alpha = gl.full([SUB_M], 1.0, gl.float32, gl.SliceLayout(1, O_L))
        alpha_l = gl.full([SUB_M], 1.0, gl.float32, gl.SliceLayout(1, L_L))
        if DV1 > 0:
            alpha1 = gl.full([SUB_M], 1.0, gl.float32, gl.SliceLayout(1, O1_L))
        if Q_EARLY:
            if n_walk == t_own:  # (the slot is free once this warpgroup's last QK GEMM is done)
                mbarrier.arrive(slots.empty)
        if n_walk > t_own:  # the first tile: nothing to overlap its softmax with yet
            s0 = (c + t_own - t_lo) % STAGES
            mbarrier.wait(ring.full.index(s0), ((c + t_own - t_lo) // STAGES) & 1)
            if not geo.USE_TMA:  # (cp.async tiles; the load warps fence their generic writes on the TMA paths)
                fence_async_shared()
            s_tok = _qk_async(qg_sub, qg1_sub, ring.k.index(s0), ring.k1.index(s0), s_zero, DQ1)
            sc = warpgroup_mma_wait(0, deps=[s_tok])
            if geo.SPLIT:
                _release(ring, s0)
            if Q_EARLY:
                if n_walk == t_own + 1:
                    mbarrier.arrive(slots.empty)
            unmasked = (t_own * BLOCK_N < full_own) & fast_ok
            if geo.WINDOW:
                unmasked = unmasked & (t_own * BLOCK_N >= head_own)
            if unmasked:
                p, m_i, l_i, alpha0 = _softmax(
                    sc, m_i, l_i, qk_e, qk_r, t_own * BLOCK_N, diag, w.kv_len, sched.window, cap_out, False, geo
                )
            else:
                p, m_i, l_i, alpha0 = _softmax(
                    sc, m_i, l_i, qk_e, qk_r, t_own * BLOCK_N, diag, w.kv_len, sched.window, cap_out, True, geo
                )
            p_op = _p_operand(p, P_L, dtype, geo.F8)
            if DV1 > 0:
                p_op1 = _p_operand(p, P1_L, dtype, geo.F8)
        # the ring slot and phase of tile t and of tile t - 1, stepped per tile (a division by a stage
        # count that is not a power of two costs a dozen uniform instructions per tile)
        u = c + t_own + 1 - t_lo
        s = u % STAGES
        ph = (u // STAGES) & 1
        prev = (u - 1) % STAGES
        ph_prev = ((u - 1) // STAGES) & 1
        for t in range(t_own + 1, n_walk):
            wait_unsynced(ring.full.index(s), ph)  # (the loop writes no shared memory: see sync)
            if not geo.USE_TMA:
                fence_async_shared()
            # S_t = Q K_t^T in flight while O is rescaled for tile t-1 (off the path from the PV
            # GEMM's wait to the next PV GEMM); then O += P_{t-1} V_{t-1} joins it, and softmax(S_t)
            # overlaps the PV GEMM
            s_tok = _qk_async(qg_sub, qg1_sub, ring.k.index(s), ring.k1.index(s), s_zero, DQ1)
            if t > t_own + 1:  # (the first tile left O zero)
                acc = _rescale(acc, alpha)
                if DV1 > 0:
                    acc1 = _rescale(acc1, alpha1)
                if geo.ROWSUM:
                    lacc = lacc * alpha_l[:, None]
            if geo.SPLIT:
                mbarrier.wait(ring.full.index(STAGES + prev), ph_prev)
            a_op = _a_operand(p_op, P_L, geo.F8)
            o_tok = warpgroup_mma(a_op, _v_operand(ring.v.index(prev), geo.F8), acc, is_async=True)
            if DV1 > 0:
                o1_tok = warpgroup_mma(p_op1, ring.v1.index(prev), acc1, is_async=True)
            else:
                o1_tok = o_tok
            if geo.ROWSUM:
                l_tok = _rowsum_async(a_op, slots, lacc, PL_L)
            else:
                l_tok = o_tok
            sc = warpgroup_mma_wait(AFTER_QK, deps=[s_tok])  # (the QK GEMMs: issued before the others)
            if geo.SPLIT:
                _release(ring, s)
            if Q_EARLY:
                if t == n_walk - 1:
                    mbarrier.arrive(slots.empty)
            unmasked = (t * BLOCK_N < full_own) & fast_ok
            if geo.WINDOW:
                unmasked = unmasked & (t * BLOCK_N >= head_own)
            if unmasked:
                p, m_i, l_i, alpha_s = _softmax(
                    sc, m_i, l_i, qk_e, qk_r, t * BLOCK_N, diag, w.kv_len, sched.window, cap_out, False, geo
                )
                alpha = gl.convert_layout(alpha_s, gl.SliceLayout(1, O_L))
            else:
                p, m_i, l_i, alpha_s = _softmax(
                    sc, m_i, l_i, qk_e, qk_r, t * BLOCK_N, diag, w.kv_len, sched.window, cap_out, True, geo
                )
                alpha = gl.convert_layout(alpha_s, gl.SliceLayout(1, O_L))
            if geo.ROWSUM:
                alpha_l = gl.convert_layout(alpha_s, gl.SliceLayout(1, L_L))
            if DV1 > 0:
                alpha1 = gl.convert_layout(alpha_s, gl.SliceLayout(1, O1_L))
            acc, acc1, lacc = _pv_wait(o_tok, o1_tok, l_tok, acc1, lacc, DV1 > 0, geo.ROWSUM)
            _release(ring, STAGES + prev if geo.SPLIT else prev)
            p_op = _p_operand(p, P_L, dtype, geo.F8)
            if DV1 > 0:
                p_op1 = _p_operand(p, P1_L, dtype, geo.F8)
            prev = s
            ph_prev = ph
            wrap = s == STAGES - 1
            s = gl.where(wrap, 0, s + 1)
            ph = gl.where(wrap, ph ^ 1, ph)
        if n_walk > t_own:
            last = (c + n_walk - 1 - t_lo) % STAGES
            if n_walk > t_own + 1:
                acc = _rescale(acc, alpha)
                if DV1 > 0:
                    acc1 = _rescale(acc1, alpha1)
                if geo.ROWSUM:
                    lacc = lacc * alpha_l[:, None]
            if geo.SPLIT:
                mbarrier.wait(ring.full.index(STAGES + last), ((c + n_walk - 1 - t_lo) // STAGES) & 1)
            a_op = _a_operand(p_op, P_L, geo.F8)
            o_tok = warpgroup_mma(a_op, _v_operand(ring.v.index(last), geo.F8), acc, is_async=True)
            if DV1 > 0:
                o1_tok = warpgroup_mma(p_op1, ring.v1.index(last), acc1, is_async=True)
            else:
                o1_tok = o_tok
            if geo.ROWSUM:
                l_tok = _rowsum_async(a_op, slots, lacc, PL_L)
            else:
                l_tok = o_tok
            acc, acc1, lacc = _pv_wait(o_tok, o1_tok, l_tok, acc1, lacc, DV1 > 0, geo.ROWSUM)
            _release(ring, STAGES + last if geo.SPLIT else last)
        if CAUSAL:  # tiles past this warpgroup's last key: released unread, in ring order
            for t in range(n_walk, w.n_tiles):
                _skip_tile(ring, c + t - t_lo, geo)
        c += w.n_tiles - t_lo
        if geo.ROWSUM:
            l_i = gl.convert_layout(gl.max(lacc, 1), gl.SliceLayout(1, S_L))  # (its columns are alike)
        else:
            l_i = gl.convert_layout(gl.sum(l_i, 1), gl.SliceLayout(1, S_L))  # (the quad's lanes, once)

        if geo.SINKS:  # the sink joins the denominator: out = acc / (l + e^sink), lse = log(l + e^sink)
            sink2 = gl.load(out.SINKS + (w.kv_head * GROUP + rows_s % GROUP)) * 1.4426950408889634
            # (a -inf sink over a row with no key: m_f is -inf too; 0 in its place keeps 0 / -inf)
            m_f = gl.maximum(m_i, sink2)
            m_f = gl.where(m_f == float("-inf"), 0.0, m_f)
            a = gl.exp2(m_i - m_f)
            l_f = l_i * a + gl.exp2(sink2 - m_f)
            has_mass = l_f > 0.0
            inv_l = gl.where(has_mass, a / gl.where(has_mass, l_f, 1.0), 0.0)
            lse2 = gl.where(has_mass, m_f + gl.log2(gl.where(has_mass, l_f, 1.0)), float("-inf"))
        else:
            has_key = l_i > 0.0
            inv_l = gl.where(has_key, 1.0 / gl.where(has_key, l_i, 1.0), 0.0)
            lse2 = gl.where(has_key, m_i + gl.log2(gl.where(has_key, l_i, 1.0)), float("-inf"))
        if geo.V_SCALED:
            inv_l = inv_l * gl.load(out.V_SCALE)
        if DV1 > 0:
            acc1_e = acc1
        else:  # (unused)
            acc1_e = acc
        if w.share >= 0:  # a share of a split item: its float32 rows, merged after the kernel
            _store_share(acc, acc1_e, inv_l, lse2, w, sched, R0, ROWS, geo, O_L, O1_E, S_L)
            if geo.O_STAGE == 1:
                if geo.Q_TMA:  # (the slot goes back to the load warps: no O staged through it)
                    mbarrier.arrive(slots.empty)
        else:
            _store_rows(acc, acc1_e, inv_l, lse2, rows_s, tok_s, w, slots, out, q_sub, R0, ROWS, geo, O_L, O1_E)
        r += 1
        item = sched.take(r, CW)


@gluon.jit
def _store_share(
    acc,
    acc1,
    inv_l,
    lse2,
    w: WorkItem,
    sched: Schedule,
    R0: gl.constexpr,
    ROWS: gl.constexpr,
    geo: Geometry,
    O_L: gl.constexpr,
    O1_L: gl.constexpr,
    S_L: gl.constexpr,
):
    """Epilogue of a share: this warpgroup's rows of O (normalised by the share's own sum) and their
    log2 LSE (-inf where the share saw no key) into the scratch, and the split item's header (its
    output and LSE offsets, q_len, KV head and first row) from the first share's first warpgroup."""
    DVO: gl.constexpr = geo.DVO
    DV0: gl.constexpr = geo.DV0
    SUB_M: gl.constexpr = ROWS
    n_tail = sched.n_bh * sched.num_m_blocks - sched.tail_base
    n_rows = n_tail * sched.shares * geo.BLOCK_M
    first = (w.tail * sched.shares + w.share) * geo.BLOCK_M + R0
    rows = first + gl.arange(0, SUB_M, gl.SliceLayout(1, O_L))
    d = gl.arange(0, DV0, gl.SliceLayout(0, O_L))
    po = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, O_L))[:, None]
    gl.store(sched.part + rows[:, None] * DVO + d[None, :], po)
    if geo.DV1 > 0:
        rows1 = first + gl.arange(0, SUB_M, gl.SliceLayout(1, O1_L))
        d1 = DV0 + gl.arange(0, geo.DV1, gl.SliceLayout(0, O1_L))
        po1 = acc1 * gl.convert_layout(inv_l, gl.SliceLayout(1, O1_L))[:, None]
        gl.store(sched.part + rows1[:, None] * DVO + d1[None, :], po1)
    rows_s = first + gl.arange(0, SUB_M, gl.SliceLayout(1, S_L))
    gl.store(sched.part + n_rows * DVO + rows_s, lse2)
    if R0 == 0:
        if w.share == 0:
            HL: gl.constexpr = gl.BlockedLayout([1], [32], [ROWS // 16], [0])
            i = gl.arange(0, HEADER_INTS, HL)
            hd = gl.where(i == 0, w.o_start, gl.where(i == 1, w.lse_start, gl.where(i == 2, w.q_len, 0)))
            hd = gl.where(i == 3, w.kv_head, gl.where(i == 4, w.row0, hd))
            head = (sched.part + n_rows * (DVO + 1)).to(gl.pointer_type(gl.int32), bitcast=True)
            gl.store(head + w.tail * HEADER_INTS + i, hd)


@gluon.jit
def _store_rows(
    acc,
    acc1,
    inv_l,
    lse2,
    rows_s,
    tok_s,
    w: WorkItem,
    slots: QSlots,
    out: OutSink,
    q_sub,
    R0: gl.constexpr,
    ROWS: gl.constexpr,
    geo: Geometry,
    O_L: gl.constexpr,
    O1_L: gl.constexpr,
):
    """Epilogue of a whole item: this warpgroup's rows of O into out (rows past the sequence left
    alone) and their LSE (natural log), when asked for."""
    GROUP: gl.constexpr = geo.GROUP
    DVO: gl.constexpr = geo.DVO
    DV0: gl.constexpr = geo.DV0
    DV1: gl.constexpr = geo.DV1
    SUB_M: gl.constexpr = ROWS
    Out = out.Out
    o = (acc * gl.convert_layout(inv_l, gl.SliceLayout(1, O_L))[:, None]).to(Out.dtype.element_ty)
    if geo.O_STAGE == 1:
        # through this warpgroup's Q slot (its last QK GEMM is done) into rows of 16-byte
        # vectors: each warp stores whole 2^k-byte row segments instead of 16-byte pieces of 8
        # rows (the wgmma accumulator's layout)
        gl.thread_barrier()
        q_sub.store(o)
        gl.thread_barrier()
        TPW_D: gl.constexpr = DVO // 8
        ST_L: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [ROWS // 16, 1], [1, 0])
        o_st = q_sub.load(ST_L)
        if geo.Q_TMA:  # (the slot goes back to the load warps; arrive syncs the group)
            fence_async_shared()  # (O's generic-proxy writes before the next Q's TMA writes)
            mbarrier.arrive(slots.empty)
        rows_o = w.row0 + R0 + gl.arange(0, SUB_M, gl.SliceLayout(1, ST_L))
        d_o = gl.arange(0, DVO, gl.SliceLayout(0, ST_L))
    else:
        o_st = o
        rows_o = w.row0 + R0 + gl.arange(0, SUB_M, gl.SliceLayout(1, O_L))
        d_o = gl.arange(0, DV0, gl.SliceLayout(0, O_L))
    tok_o = rows_o // GROUP
    head_o = w.kv_head * GROUP + rows_o % GROUP
    o_off = (w.o_start + tok_o).to(gl.int64) * out.stride_ot + head_o.to(gl.int64) * out.stride_oh
    gl.store(Out + o_off[:, None] + d_o[None, :], o_st, mask=(tok_o < w.q_len)[:, None])
    if DV1 > 0:  # (O_STAGE 0: the second accumulator's columns, straight from its layout)
        o1 = (acc1 * gl.convert_layout(inv_l, gl.SliceLayout(1, O1_L))[:, None]).to(Out.dtype.element_ty)
        rows_o1 = w.row0 + R0 + gl.arange(0, SUB_M, gl.SliceLayout(1, O1_L))
        d_o1 = DV0 + gl.arange(0, DV1, gl.SliceLayout(0, O1_L))
        tok_o1 = rows_o1 // GROUP
        head_o1 = w.kv_head * GROUP + rows_o1 % GROUP
        o1_off = (w.o_start + tok_o1).to(gl.int64) * out.stride_ot + head_o1.to(gl.int64) * out.stride_oh
        gl.store(Out + o1_off[:, None] + d_o1[None, :], o1, mask=(tok_o1 < w.q_len)[:, None])
    if geo.HAS_LSE:
        head_s = w.kv_head * GROUP + rows_s % GROUP
        lse_off = w.lse_start.to(gl.int64) + tok_s.to(gl.int64) * out.num_heads_q + head_s
        gl.store(out.LSE + lse_off, lse2 * 0.6931471805599453, mask=tok_s < w.q_len)
