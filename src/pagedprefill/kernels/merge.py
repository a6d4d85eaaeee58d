"""Merging attention results over disjoint key sets, as one Triton pass over the inputs.

Row r of the inputs is a (token, head) pair. For states i with outputs v_i and log-sum-exps s_i
(natural log, or base 2 with ``BASE2``): m = max_i s_i, w_i = exp(s_i - m), v = sum w_i v_i / sum w_i,
s = m + log(sum w_i); rows where every s_i is -inf give v = 0, s = -inf. One program handles
``BLOCK_R`` rows x ``BLOCK_D`` columns; every byte moves once (bandwidth-bound). ``PAIR``: two states
at independent addresses (``merge_state``); else ``n_states`` stacked ones (``merge_states``).
:func:`combine_splits` is the same sum over the attention kernels' own float32 partials (split-KV,
the Hopper kernel's shares), for their merge kernels to call.
"""

from __future__ import annotations

from pagedprefill.kernels.launch import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _load_state(V, S, t, h, d, ok, d_ok, sv_t, sv_h, ss_t, ss_h, BASE2: tl.constexpr):
        s = tl.load(S + t * ss_t + h * ss_h, mask=ok, other=float("-inf")).to(tl.float32)
        if not BASE2:
            s = s * 1.4426950408889634
        # (a state with no key is never read: its O may be anything, NaN included, and adds nothing)
        has = ok & (s != float("-inf"))
        rows = V + t[:, None] * sv_t + h[:, None] * sv_h
        v = tl.load(rows + d[None, :], mask=has[:, None] & d_ok[None, :], other=0.0)
        return s, v.to(tl.float32)

    @triton.jit
    def combine_splits(PO, PL, prow, split_stride, n_splits, m, d, ok, d_ok, DV: tl.constexpr, BLOCK_D: tl.constexpr):
        """The kernels' float32 partials over ``n_splits`` disjoint key ranges of the same rows: split
        s of row r has its O (normalised by its own sum) at ``PO + (prow_r + s * split_stride) * DV``
        and its log2 LSE at ``PL + prow_r + s * split_stride``. ``m``: where the rows' max starts (-inf,
        or a sink's log2 logit). Returns ``(m_use, total, acc)``: the max (0 where it is -inf), the sum
        of ``2^(lse_s - m_use)`` and the sum of ``2^(lse_s - m_use) O_s`` (BLOCK_D columns, d < DV)."""
        for s in range(n_splits):
            m = tl.maximum(m, tl.load(PL + prow + s * split_stride, mask=ok, other=float("-inf")))
        m_use = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros_like(m_use)
        acc = tl.zeros([prow.shape[0], BLOCK_D], tl.float32)
        for s in range(n_splits):
            row = prow + s * split_stride
            w = tl.math.exp2(tl.load(PL + row, mask=ok, other=float("-inf")) - m_use)
            part = tl.load(PO + row[:, None] * DV + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            total += w
            acc += w[:, None] * part
        return m_use, total, acc

    @triton.jit(do_not_specialize=["n_rows", "n_states"])
    def merge_kernel(
        VA,
        SA,
        VB,
        SB,
        VO,
        SO,
        n_rows,
        n_heads,
        n_states,
        sa_t,
        sa_n,
        sa_h,
        ssa_t,
        ssa_n,
        ssa_h,
        sb_t,
        sb_h,
        ssb_t,
        ssb_h,
        so_t,
        so_h,
        sso_t,
        sso_h,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BASE2: tl.constexpr,
        PAIR: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < n_rows
        t = (rows // n_heads).to(tl.int64)
        h = (rows % n_heads).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        if PAIR:
            s_a, v_a = _load_state(VA, SA, t, h, d, ok, d_ok, sa_t, sa_h, ssa_t, ssa_h, BASE2)
            s_b, v_b = _load_state(VB, SB, t, h, d, ok, d_ok, sb_t, sb_h, ssb_t, ssb_h, BASE2)
            m = tl.maximum(s_a, s_b)
            m_use = tl.where(m == float("-inf"), 0.0, m)
            w_a = tl.math.exp2(s_a - m_use)
            w_b = tl.math.exp2(s_b - m_use)
            total = w_a + w_b
            acc = v_a * w_a[:, None] + v_b * w_b[:, None]
        else:
            m = tl.full([BLOCK_R], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK_R], tl.float32)
            acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
            for i in range(n_states):
                s, v = _load_state(VA + i * sa_n, SA + i * ssa_n, t, h, d, ok, d_ok, sa_t, sa_h, ssa_t, ssa_h, BASE2)
                m_new = tl.maximum(m, s)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(m - m_use)
                w = tl.math.exp2(s - m_use)
                acc = acc * alpha[:, None] + w[:, None] * v
                total = total * alpha + w
                m = m_new
            m_use = tl.where(m == float("-inf"), 0.0, m)
        has = total > 0.0
        inv = tl.where(has, 1.0 / tl.where(has, total, 1.0), 0.0)
        out = acc * inv[:, None]
        tl.store(
            VO + t[:, None] * so_t + h[:, None] * so_h + d[None, :],
            out.to(VO.dtype.element_ty),
            mask=ok[:, None] & d_ok[None, :],
        )
        if tl.program_id(1) == 0:
            lse = tl.where(has, m_use + tl.math.log2(tl.where(has, total, 1.0)), float("-inf"))
            if not BASE2:
                lse = lse * 0.6931471805599453
            tl.store(SO + t * sso_t + h * sso_h, lse, mask=ok)

else:
    merge_kernel = combine_splits = None
