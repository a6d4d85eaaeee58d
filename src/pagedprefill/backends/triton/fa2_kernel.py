"""The portable Triton prefill kernel (any CUDA GPU from sm_80, and the CPU interpreter).

One program computes ``BLOCK_M`` query rows of one sequence and one KV head, where a row is a
(token, head-in-group) pair of the ``G = Hq / Hkv`` query heads sharing that KV head, so each K/V
tile is loaded once for all G heads. Grid ``(Hkv, B, num_m_blocks)``, the m-block index reversed so
the heaviest causal tiles go first; programs whose rows start past the sequence return at once.

Online softmax in float32 with ``exp2`` (log2(e) folded into the scale). The key range of a program
is cut in three: a masked head (tiles crossing a sliding window's lower edge), an unmasked middle
(every key visible to every row) and a masked tail (the causal diagonal, the end of the keys); tiles
wholly outside a window are never loaded. Head dims that are not a power of two run as two
power-of-two parts (``DQ0 + DQ1``, the second padded with masked loads when needed), or, for 8-bit
K/V, as one padded part. Split-KV: programs write float32 partial outputs and LSEs into the
workspace and :func:`merge_kernel` combines them (sinks join there).

Variants: ``WINDOW`` (keys ``j >= pos - window_left``), ``SOFTCAP`` (logit ``c * tanh(s / c)``),
``HAS_SINKS`` (a per-head logit in the softmax denominator). Everything that varies per call is
read from the metadata table (``pagedprefill.batch``) on the device, and every per-call integer
is ``do_not_specialize``.
"""

import triton
import triton.language as tl
from triton.language.core import _aggregate as aggregate

from pagedprefill.kernels.merge import combine_splits

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@aggregate
class Tile:
    """Compile-time shape of one key-tile step (:func:`_attend_tile`)."""

    CDT: tl.constexpr  # the dots' input dtype
    PREC: tl.constexpr  # their input precision (fp32: "ieee")
    PAGE_SIZE: tl.constexpr  # 0: ragged K/V
    PAGE_PER_TILE: tl.constexpr  # a tile lies in one page
    DQ0: tl.constexpr  # key columns of the first part (a power of two) ...
    DQ0_REAL: tl.constexpr  # ... of which real (the rest masked)
    DQ1: tl.constexpr
    DQ1_REAL: tl.constexpr
    DV0: tl.constexpr
    DV0_REAL: tl.constexpr
    DV1: tl.constexpr
    DV1_REAL: tl.constexpr
    BLOCK_N: tl.constexpr
    CAUSAL: tl.constexpr
    WINDOW: tl.constexpr
    SOFTCAP: tl.constexpr
    FAST_TANH: tl.constexpr
    LAZY: tl.constexpr  # rescale only when a row's max grew by more than 8 (unmasked tiles)

    @triton.constexpr_function
    def __init__(
        self,
        CDT,
        PREC,
        PAGE_SIZE,
        PAGE_PER_TILE,
        DQ0,
        DQ0_REAL,
        DQ1,
        DQ1_REAL,
        DV0,
        DV0_REAL,
        DV1,
        DV1_REAL,
        BLOCK_N,
        CAUSAL,
        WINDOW,
        SOFTCAP,
        FAST_TANH,
        LAZY,
    ):
        self.CDT = tl.constexpr(CDT)
        self.PREC = tl.constexpr(PREC)
        self.PAGE_SIZE = tl.constexpr(PAGE_SIZE)
        self.PAGE_PER_TILE = tl.constexpr(PAGE_PER_TILE)
        self.DQ0 = tl.constexpr(DQ0)
        self.DQ0_REAL = tl.constexpr(DQ0_REAL)
        self.DQ1 = tl.constexpr(DQ1)
        self.DQ1_REAL = tl.constexpr(DQ1_REAL)
        self.DV0 = tl.constexpr(DV0)
        self.DV0_REAL = tl.constexpr(DV0_REAL)
        self.DV1 = tl.constexpr(DV1)
        self.DV1_REAL = tl.constexpr(DV1_REAL)
        self.BLOCK_N = tl.constexpr(BLOCK_N)
        self.CAUSAL = tl.constexpr(CAUSAL)
        self.WINDOW = tl.constexpr(WINDOW)
        self.SOFTCAP = tl.constexpr(SOFTCAP)
        self.FAST_TANH = tl.constexpr(FAST_TANH)
        self.LAZY = tl.constexpr(LAZY)


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    if FAST:  # one MUFU op (sm_75+)
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    # (2 / (1 + e^-2x) - 1 alone loses x's digits near 0 to the subtraction: an absolute error of ~6e-8
    # that a large soft-cap multiplies; below 1/8 a Taylor polynomial, exact to float32 there)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.125, small, 2.0 / (1.0 + tl.math.exp2(x * (-2.0 * LOG2E))) - 1.0)


@triton.jit
def _kv_offsets(kv, cols, kv_mask, start_n, PAGE_SIZE: tl.constexpr, PAGE_PER_TILE: tl.constexpr, MASKED: tl.constexpr):
    """int64 element offsets of the K rows and V rows of keys ``cols`` (one tile); ``kv`` as
    :func:`_attend_tile` takes it."""
    (
        _,
        _,
        BT_row,
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
    ) = kv
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
def _load_cols(ptr, rows_off, row_mask, C0: tl.constexpr, N: tl.constexpr, REAL: tl.constexpr, MASKED: tl.constexpr):
    """Columns [C0, C0 + N) of rows ``rows_off``; columns past C0 + REAL and (MASKED) rows outside
    ``row_mask`` read as 0."""
    d = C0 + tl.arange(0, N)
    if REAL < N:
        return tl.load(
            ptr + rows_off[:, None] + d[None, :], mask=row_mask[:, None] & (d < C0 + REAL)[None, :], other=0.0
        )
    if MASKED:
        return tl.load(ptr + rows_off[:, None] + d[None, :], mask=row_mask[:, None], other=0.0)
    return tl.load(ptr + rows_off[:, None] + d[None, :])


@triton.jit
def _attend_tile(acc0, acc1, l_i, m_i, q0, q1, start_n, kv, rows, t: Tile, MASKED: tl.constexpr):
    """One online-softmax step over keys [start_n, start_n + BLOCK_N). ``kv``: (K, V, BT_row, kv_head,
    k_start, v_start, num_pages, and K's then V's row / page, head and slot strides); ``rows``: (kv_len,
    diag, qk_scale, cap_in, cap_out, window)."""
    K = kv[0]
    V = kv[1]
    kv_len, diag, qk_scale, cap_in, cap_out, window = rows
    CDT: tl.constexpr = t.CDT
    PREC: tl.constexpr = t.PREC
    DQ0: tl.constexpr = t.DQ0
    DQ1: tl.constexpr = t.DQ1
    DV0: tl.constexpr = t.DV0
    DV1: tl.constexpr = t.DV1
    cols = start_n + tl.arange(0, t.BLOCK_N)
    kv_mask = cols < kv_len
    k_off, v_off = _kv_offsets(kv, cols, kv_mask, start_n, t.PAGE_SIZE, t.PAGE_PER_TILE, MASKED)
    # S = Q K^T, head dim in up to two power-of-two parts
    k0 = _load_cols(K, k_off, kv_mask, 0, DQ0, t.DQ0_REAL, MASKED)
    qk = tl.dot(q0, tl.trans(k0.to(CDT)), input_precision=PREC)
    if DQ1 > 0:
        k1 = _load_cols(K, k_off, kv_mask, DQ0, DQ1, t.DQ1_REAL, MASKED)
        qk = tl.dot(q1, tl.trans(k1.to(CDT)), acc=qk, input_precision=PREC)
    if t.SOFTCAP:  # capped logits, already in log2 units
        qk = cap_out * _tanh(qk * cap_in, t.FAST_TANH)
        sc = 1.0
    else:
        sc = qk_scale

    if MASKED:
        # scale first, then mask: a masked -inf must never meet a zero scale
        s = qk * sc
        if t.CAUSAL:
            visible = cols[None, :] <= diag[:, None]  # diag < kv_len for every real row
        else:
            visible = kv_mask[None, :]
        if t.WINDOW:
            visible = visible & (cols[None, :] >= diag[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        p = tl.math.exp2(s - m_use[:, None])
    elif t.LAZY:
        # Rescale the accumulators only when some row's running max grew by more than 8 (log2
        # units): with a stale max, p <= 2^8, harmless in fp32 and in the 16-bit P operand.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * sc)
        if tl.max(m_new - m_i, 0) > 8.0:
            alpha = tl.math.exp2(m_i - m_new)
            acc0 = acc0 * alpha[:, None]
            if DV1 > 0:
                acc1 = acc1 * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        m_new = m_i
        m_use = m_i
        p = tl.math.exp2(qk * sc - m_use[:, None])
    else:
        # every key visible to every row: the scale is >= 0, so max(qk) * scale = max(qk * scale)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * sc)
        m_use = m_new
        p = tl.math.exp2(qk * sc - m_use[:, None])
    if t.LAZY and not MASKED:
        l_i = l_i + tl.sum(p, 1)  # accumulators already rescaled above when needed
    else:
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc0 = acc0 * alpha[:, None]
        if DV1 > 0:
            acc1 = acc1 * alpha[:, None]
    p = p.to(CDT)
    v0 = _load_cols(V, v_off, kv_mask, 0, DV0, t.DV0_REAL, MASKED)
    acc0 = tl.dot(p, v0.to(CDT), acc=acc0, input_precision=PREC)
    if DV1 > 0:
        v1 = _load_cols(V, v_off, kv_mask, DV0, DV1, t.DV1_REAL, MASKED)
        acc1 = tl.dot(p, v1.to(CDT), acc=acc1, input_precision=PREC)
    return acc0, acc1, l_i, m_new


@triton.jit(
    do_not_specialize=[
        "meta_stride",
        "b_offset",
        "m_offset",
        "num_m_blocks",
        "num_pages",
        "max_q",
        "num_splits",
        "window",
    ],
    # a caller's table / lse may be a slice at any 4-byte offset: no alignment variants
    do_not_specialize_on_alignment=["BT", "LSE"],
)
def prefill_kernel(
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
    SINKS,
    PO,  # split-KV partial outputs (float32), or a dummy
    PL,  # split-KV partial LSEs (float32, log2 units), or a dummy
    sm_scale_log2,
    softcap,
    window,
    meta_stride,
    b_offset,
    m_offset,
    num_m_blocks,
    num_pages,
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
    DQ0_REAL: tl.constexpr,
    DQ1: tl.constexpr,
    DQ1_REAL: tl.constexpr,
    DV0: tl.constexpr,
    DV0_REAL: tl.constexpr,
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
    LAZY_RESCALE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FAST_TANH: tl.constexpr,
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
        q0 = _load_cols(Q, q_off, row_ok, 0, DQ0, DQ0_REAL, True).to(CDT)
        if DQ1 > 0:
            q1 = _load_cols(Q, q_off, row_ok, DQ0, DQ1, DQ1_REAL, True).to(CDT)
        else:
            q1 = q0  # unused
        if MAYBE_NEG_SCALE:  # q.k * s == (-q).k * (-s): keep the scale non-negative
            neg = qk_scale < 0
            q0 = tl.where(neg, -q0, q0)
            if DQ1 > 0:
                q1 = tl.where(neg, -q1, q1)
            qk_scale = tl.abs(qk_scale)
        cap_in = qk_scale
        cap_out = 1.0
        if SOFTCAP:  # s = c * tanh(scale * q.k / c), in log2 units: (c log2 e) * tanh(q.k * qk_scale / (c log2 e))
            cap_out = softcap * LOG2E
            cap_in = qk_scale / cap_out

        # key range of this program: rows see keys <= diag (causal) and >= diag - window (WINDOW)
        diag = tok + (kv_len - q_len)
        tok_lo = row0 // GROUP
        tok_hi = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
        if CAUSAL:
            hi = tl.minimum(kv_len, tok_hi + (kv_len - q_len) + 1)
            full = tl.minimum(kv_len, tok_lo + (kv_len - q_len) + 1)
            full = (tl.maximum(full, 0) // BLOCK_N) * BLOCK_N
        else:
            hi = kv_len
            full = (kv_len // BLOCK_N) * BLOCK_N
        lo = hi * 0
        head_end = lo
        if WINDOW:
            lo = (tl.maximum(tok_lo + (kv_len - q_len) - window, 0) // BLOCK_N) * BLOCK_N
            edge = tl.maximum(tok_hi + (kv_len - q_len) - window, 0)
            head_end = tl.cdiv(edge, BLOCK_N) * BLOCK_N
        hi = tl.maximum(hi, lo)
        if SPLIT:
            chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
            lo = lo + split * chunk
            hi = tl.minimum(hi, lo + chunk)
            hi = tl.maximum(hi, lo)
        a1 = tl.maximum(lo, tl.minimum(head_end, hi))  # masked head [lo, a1)
        a2 = tl.maximum(a1, tl.minimum(full, hi))  # unmasked [a1, a2), masked tail [a2, hi)

        if PAGE_SIZE > 0:
            BT_row = BT + tl.load(META + 7 * meta_stride + b).to(tl.int64)
            k_start = 0
            v_start = 0
        else:
            BT_row = BT
            k_start = tl.load(META + 4 * meta_stride + b)
            v_start = tl.load(META + 5 * meta_stride + b)

        kv = (
            K,
            V,
            BT_row,
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
        )
        rows = (kv_len, diag, qk_scale, cap_in, cap_out, window)
        tile = Tile(
            CDT,
            PREC,
            PAGE_SIZE,
            PAGE_PER_TILE,
            DQ0,
            DQ0_REAL,
            DQ1,
            DQ1_REAL,
            DV0,
            DV0_REAL,
            DV1,
            DV1_REAL,
            BLOCK_N,
            CAUSAL,
            WINDOW,
            SOFTCAP,
            FAST_TANH,
            LAZY_RESCALE,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc0 = tl.zeros([BLOCK_M, DV0], tl.float32)
        if DV1 > 0:
            acc1 = tl.zeros([BLOCK_M, DV1], tl.float32)
        else:
            acc1 = tl.zeros([1, 1], tl.float32)  # unused

        if WINDOW:
            for start_n in range(lo, a1, BLOCK_N):
                acc0, acc1, l_i, m_i = _attend_tile(acc0, acc1, l_i, m_i, q0, q1, start_n, kv, rows, tile, True)
        for start_n in range(a1, a2, BLOCK_N):
            acc0, acc1, l_i, m_i = _attend_tile(acc0, acc1, l_i, m_i, q0, q1, start_n, kv, rows, tile, False)
        for start_n in range(a2, hi, BLOCK_N):
            acc0, acc1, l_i, m_i = _attend_tile(acc0, acc1, l_i, m_i, q0, q1, start_n, kv, rows, tile, True)

        if HAS_SINKS and not SPLIT:  # the sink joins the denominator (m_i, l_i, acc share one max)
            sink2 = tl.load(SINKS + head) * LOG2E
            # (a -inf sink over a row with no key: m_f is -inf too; 0 in its place keeps 0 / -inf)
            m_f = tl.maximum(m_i, sink2)
            m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
            a = tl.math.exp2(m_i - m_f)
            l_f = l_i * a + tl.math.exp2(sink2 - m_f)
            has_mass = l_f > 0.0
            inv_l = tl.where(has_mass, a / tl.where(has_mass, l_f, 1.0), 0.0)
            lse2 = tl.where(has_mass, m_f + tl.math.log2(tl.where(has_mass, l_f, 1.0)), float("-inf"))
        else:
            has_key = l_i > 0.0
            inv_l = tl.where(has_key, 1.0 / tl.where(has_key, l_i, 1.0), 0.0)
            lse2 = tl.where(has_key, m_i + tl.math.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
        dv0 = tl.arange(0, DV0)
        dv0_ok = dv0 < DV0_REAL
        if DV1 > 0:
            dv1 = DV0 + tl.arange(0, DV1)
            dv1_ok = dv1 < DV0 + DV1_REAL
        DV: tl.constexpr = DV0_REAL + DV1_REAL
        if SPLIT:
            # partials: PO[split, b, tok, head, :] float32, PL[split, b, tok, head] (log2 units)
            prow = ((split * meta_stride + b).to(tl.int64) * max_q + tok) * num_heads_q + head
            tl.store(
                PO + prow[:, None] * DV + dv0[None, :], acc0 * inv_l[:, None], mask=row_ok[:, None] & dv0_ok[None, :]
            )
            if DV1 > 0:
                o1 = acc1 * inv_l[:, None]
                tl.store(PO + prow[:, None] * DV + dv1[None, :], o1, mask=row_ok[:, None] & dv1_ok[None, :])
            tl.store(PL + prow, lse2, mask=row_ok)
        else:
            o_start = tl.load(META + 3 * meta_stride + b)
            o_off = (o_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
            v_scale = 1.0
            if HAS_V_SCALE:
                v_scale = tl.load(VS)
            o0 = (acc0 * (inv_l * v_scale)[:, None]).to(Out.dtype.element_ty)
            tl.store(Out + o_off[:, None] + dv0[None, :], o0, mask=row_ok[:, None] & dv0_ok[None, :])
            if DV1 > 0:
                o1 = (acc1 * (inv_l * v_scale)[:, None]).to(Out.dtype.element_ty)
                tl.store(Out + o_off[:, None] + dv1[None, :], o1, mask=row_ok[:, None] & dv1_ok[None, :])
            if HAS_LSE:
                lse_start = tl.load(META + 6 * meta_stride + b)
                lse_off = lse_start.to(tl.int64) + tok.to(tl.int64) * num_heads_q + head
                tl.store(LSE + lse_off, lse2 * LN2, mask=row_ok)


@triton.jit(
    do_not_specialize=["meta_stride", "b_offset", "max_q", "num_splits"],
    do_not_specialize_on_alignment=["LSE"],
)
def merge_kernel(
    Out,
    LSE,
    META,
    VS,
    SINKS,
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
    HAS_SINKS: tl.constexpr,
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
        if HAS_SINKS:
            sink2 = tl.load(SINKS + heads, mask=h_ok, other=0.0) * LOG2E
            m = sink2
        # (split s of a row is meta_stride * max_q * Hq rows after split 0's)
        prow = (b.to(tl.int64) * max_q + tok) * num_heads_q + heads
        split_stride = meta_stride.to(tl.int64) * max_q * num_heads_q
        m_use, total, acc = combine_splits(PO, PL, prow, split_stride, num_splits, m, d, h_ok, d_ok, DV, DV_P2)
        if HAS_SINKS:
            total += tl.math.exp2(sink2 - m_use)
        has_key = total > 0.0
        scale = tl.where(has_key, 1.0 / tl.where(has_key, total, 1.0), 0.0)
        if HAS_V_SCALE:
            scale = scale * tl.load(VS)
        o_start = tl.load(META + 3 * meta_stride + b)
        o_off = (o_start + tok).to(tl.int64) * stride_ot + heads.to(tl.int64) * stride_oh
        out = (acc * scale[:, None]).to(Out.dtype.element_ty)
        tl.store(Out + o_off[:, None] + d[None, :], out, mask=h_ok[:, None] & d_ok[None, :])
        if HAS_LSE:
            lse2 = tl.where(has_key, m_use + tl.math.log2(tl.where(has_key, total, 1.0)), float("-inf"))
            lse_start = tl.load(META + 6 * meta_stride + b)
            lse_off = lse_start.to(tl.int64) + tok.to(tl.int64) * num_heads_q + heads
            tl.store(LSE + lse_off, lse2 * LN2, mask=h_ok)
