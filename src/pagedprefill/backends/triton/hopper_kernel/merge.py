"""The merge of split items' shares (:class:`.schedule.Schedule`): one program per split item and
``ROWS`` of its rows, after the attention kernel on the same stream.

The scratch, from float32 element ``PART_OFFSET`` on, holds for ``n = tail * shares * BLOCK_M`` share
rows (row ``(i * shares + s) * BLOCK_M + r``: row r of share s of split item i) their O (``n x DVO``,
each share normalised by its own sum), then their log2 LSEs (``n``, -inf where a share saw no key),
then per split item a header of 8 int32: its output row offset, LSE offset, q_len, KV head and first
row.
"""

import triton
import triton.language as tl

from pagedprefill.kernels.merge import combine_splits

PART_OFFSET = tl.constexpr(64)  # float32 elements before the partials (the work counter's bytes, and alignment)
HEADER_INTS = tl.constexpr(8)


@triton.jit(
    do_not_specialize=["tail", "shares", "stride_ot", "stride_oh", "num_heads_q"],
    do_not_specialize_on_alignment=["SCRATCH", "Out", "LSE"],
)
def share_merge_kernel(
    SCRATCH,
    Out,
    LSE,
    tail,
    shares,
    stride_ot,
    stride_oh,
    num_heads_q,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DVO: tl.constexpr,
    DV_P2: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """Program (i, c): rows ``[c ROWS, (c + 1) ROWS)`` of split item i. Each row's shares are
    weighted by ``2^(lse_s - max)``; out = their weighted mean, lse = max + log2(sum), natural
    log. A row no share saw a key of gets out 0 and lse -inf; rows past the sequence are left alone."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    PO = SCRATCH.to(tl.pointer_type(tl.float32), bitcast=True) + PART_OFFSET
    n_rows = tail * shares * BLOCK_M
    PL = PO + n_rows * DVO
    HD = (PL + n_rows).to(tl.pointer_type(tl.int32), bitcast=True) + i * HEADER_INTS
    o_start = tl.load(HD)
    lse_start = tl.load(HD + 1)
    q_len = tl.load(HD + 2)
    kv_head = tl.load(HD + 3)
    row0 = tl.load(HD + 4)
    r = c * ROWS + tl.arange(0, ROWS)
    rows = row0 + r
    tok = rows // GROUP
    ok = tok < q_len
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, DV_P2)
    d_ok = d < DVO
    m = tl.full([ROWS], float("-inf"), tl.float32)
    m_use, total, acc = combine_splits(PO, PL, i * shares * BLOCK_M + r, BLOCK_M, shares, m, d, ok, d_ok, DVO, DV_P2)
    has_key = total > 0.0
    inv = tl.where(has_key, 1.0 / tl.where(has_key, total, 1.0), 0.0)
    o_off = (o_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    o = (acc * inv[:, None]).to(Out.dtype.element_ty)
    tl.store(Out + o_off[:, None] + d[None, :], o, mask=ok[:, None] & d_ok[None, :])
    if HAS_LSE:
        lse2 = tl.where(has_key, m_use + tl.math.log2(tl.where(has_key, total, 1.0)), float("-inf"))
        lse_off = lse_start.to(tl.int64) + tok.to(tl.int64) * num_heads_q + head
        tl.store(LSE + lse_off, lse2 * 0.6931471805599453, mask=ok)
