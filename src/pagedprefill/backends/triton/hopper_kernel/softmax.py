"""The online softmax of one S tile, with the lazy rescale of O (by warp vote) and per-thread row sums."""

# (no ``from __future__ import annotations``: Gluon aggregates check their fields' annotations)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .geometry import Geometry

# Lazy rescale (FA4's): a row keeps its running max until a tile's max passes it by more than this
# (log2 units), so p <= 2^8 and O, l stay consistent (both are scaled by the max in use, the final
# O / l and LSE = m + log2(l) are exact); O's multiply is then skipped by every warp whose 16 rows all
# kept theirs. The decision is one vote per warp: a warpgroup-wide one (shared memory and a barrier per
# tile) measured slower than always rescaling.
LAZY_BOUND: gl.constexpr = gl.constexpr(8.0)


@gluon.jit
def _rescale(acc, alpha):
    """acc * alpha[:, None] (acc: a wgmma accumulator, alpha: its rows' factors, two rows a thread),
    branched around by whole warps whose alphas are all exactly 1."""
    # (vote.sync.any over the warp: the branch below is warp-uniform, bra.uni. The vote's pack of 2 is
    # a thread's two rows, r and r + 8, of a 64-row wgmma tile (Geometry.SUB_M): every element of a
    # thread then holds the same vote, and each 16-register block tests its first one)
    need = gl.inline_asm_elementwise(
        "{ .reg .pred p, q; setp.neu.f32 p, $2, 0f3F800000; setp.neu.or.f32 p, $3, 0f3F800000, p; "
        "vote.sync.any.pred q, p, 0xffffffff; selp.u32 $0, 1, 0, q; mov.u32 $1, $0; }",
        "=r,=r,f,f",
        [alpha],
        dtype=gl.int32,
        is_pure=True,
        pack=2,
    )
    PACK: gl.constexpr = 16  # (accumulator registers per asm block: each block re-tests the vote)
    return gl.inline_asm_elementwise(
        _rescale_asm(PACK),
        _rescale_constraints(PACK),
        [acc, alpha[:, None], need[:, None]],
        dtype=gl.float32,
        is_pure=True,
        pack=PACK,
    )


@gluon.constexpr_function
def _rescale_asm(n):
    """PTX for n accumulator registers multiplied in place ($0..$n-1, tied to inputs $n..$2n-1) by
    their factors ($2n..$3n-1), skipped when the vote ($3n) is 0."""
    muls = " ".join(f"mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n))
    return "{ .reg .pred p; setp.ne.u32 p, $" + str(3 * n) + ", 0; @!p bra.uni SKIP; " + muls + " SKIP: }"


@gluon.constexpr_function
def _rescale_constraints(n):
    return ",".join(["=f"] * n + [str(i) for i in range(n)] + ["f"] * n + ["r"] * n)


@gluon.jit
def _tanh(x):
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _masked(s, start_n, diag, kv_len, window, geo: Geometry):
    """S with the keys a row may not see set to -inf (causal: past its diagonal; else past kv_len;
    WINDOW: more than ``window`` before its diagonal)."""
    cols = start_n + gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
    if geo.CAUSAL:
        visible = cols[None, :] <= diag[:, None]
    else:
        visible = (cols < kv_len)[None, :]
    if geo.WINDOW:
        visible = visible & (cols[None, :] >= (diag - window)[:, None])
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def _softmax(s, m_i, l_i, qk_e, qk_r, start_n, diag, kv_len, window, cap_out, MASKED: gl.constexpr, geo: Geometry):
    """Online-softmax step on one S tile: returns (p, m, l, alpha), p unnormalised (fp32), m the row max
    in use (lazy: see LAZY_BOUND), l each thread's partial row sums (see _quad_sums; with geo.ROWSUM l
    as given: the consumers' wgmma sums P). The scale is
    ``qk_e`` to multiply S elementwise and ``qk_r`` per row (KV8: [SUB_M, 1] and [SUB_M] tensors, each
    row's own; else one scalar twice). SOFTCAP: the logit is cap_out * tanh(s * qk) (qk then folds
    1 / cap in)."""
    if MASKED and not (geo.SOFTCAP or geo.K_SCALED or geo.Q_SCALED):
        # the scale is a host float > 0 (the Hopper plan refuses others): a masked -inf stays -inf
        # under it, so mask the raw logits and keep the unmasked path's one FFMA per element
        s = _masked(s, start_n, diag, kv_len, window, geo)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_r)
        m_new = gl.where(m_new > m_i + LAZY_BOUND, m_new, m_i)  # (lazy: see _rescale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        p = gl.exp2(s * qk_e - m_use[:, None])
    elif geo.SOFTCAP or MASKED or (geo.K_SCALED and not (geo.KV8 or geo.F8)):
        # scale first, then mask: a masked -inf must never meet a zero scale (a device scale may be
        # 0; K_SCALED: its sign is known only on the device, so max(s) * scale may not be max(s *
        # scale); KV8 moves the sign into Q, F8 takes this path for every tile when the scale is not > 0)
        if geo.SOFTCAP:
            s = _tanh(s * qk_e) * cap_out  # (log2 units, scaled and capped)
        else:
            s = s * qk_e
        if MASKED:
            s = _masked(s, start_n, diag, kv_len, window, geo)
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_new = gl.where(m_new > m_i + LAZY_BOUND, m_new, m_i)  # (lazy: see _rescale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
        p = gl.exp2(s - m_use[:, None])
    else:
        # every key visible to every row and qk >= 0: max(s) * qk = max(s * qk)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_r)
        m_new = gl.where(m_new > m_i + LAZY_BOUND, m_new, m_i)  # (lazy: see _rescale)
        m_use = m_new
        p = gl.exp2(s * qk_e - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    if not geo.ROWSUM:
        part = _quad_sums(p)
        l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, part.type.layout), assert_trivial=True)[:, None] + part
    return p, m_new, l_i, alpha


@gluon.jit
def _quad_sums(p):
    """Each thread's own row sums of a wgmma-layout tile ([rows, cols] -> [rows, 4]: column 8j + 2t + e
    is lane t of the quad's). The running l is kept so and reduced across the quad once per work item:
    the shuffles per tile measured 6-9% of the 16k prefill's time."""
    return gl.sum(gl.sum(gl.reshape(p, [p.shape[0], p.shape[1] // 8, 4, 2]), 3), 1)
