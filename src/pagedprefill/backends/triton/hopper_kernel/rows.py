"""A sequence's rows of the metadata (lengths and starts) as a work item reads them: from the
``(8, B)`` table, or (``VECTORS``) from the caller's device lengths and offsets, clamped in the
kernel exactly as :func:`pagedprefill.kernels.metadata.device_table_torch` defines the table. The
second way needs no table launch before the kernel: a run with device lengths is one launch.

Only starts that need no prefix sum are read this way: the q offsets always, and ragged K's
offsets (the host side, :func:`..hopper.vector_args`, keeps the table otherwise). The offsets'
units are constexprs, so that no work item divides by a runtime value; 32-bit vectors stay in
32-bit arithmetic where no product can overflow it."""

# (no ``from __future__ import annotations``: Gluon aggregates check their fields' annotations)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate

INT32_BIG = gl.constexpr(2147483647)


@aggregate
class SequenceRows:
    """Where sequence b's rows come from. Without ``VECTORS`` every vector field is a stand-in (the
    table) and every bound 0."""

    META: gl.tensor  # the (8, B) int32 table (not VECTORS)
    meta_stride: gl.tensor
    LQ: gl.tensor  # VECTORS: lens_q (B,)
    LKV: gl.tensor  # lens_kv (B,) (not CSR)
    OQ: gl.tensor  # batch_offsets_q (B + 1,), in units of UNIT_Q elements
    OO: gl.tensor  # batch_offsets_o (HAS_OO; else q's)
    OK: gl.tensor  # batch_offsets_k (ragged)
    OV: gl.tensor  # batch_offsets_v (ragged, HAS_OV; else k's)
    OS: gl.tensor  # batch_offsets_stats (LSE_MODE 2)
    IP: gl.tensor  # CSR: kv_indptr (B + 1,)
    LP: gl.tensor  # CSR: kv_last_page_len (B,)
    max_q: gl.tensor
    max_kv: gl.tensor
    rows_q: gl.tensor  # rows of q / out / ragged K / ragged V
    rows_o: gl.tensor
    rows_k: gl.tensor
    rows_v: gl.tensor
    lse_rows: gl.tensor  # LSE_MODE 2: rows of Hq entries in the flat LSE
    table_width: gl.tensor  # block table: page ids per sequence, and its row stride
    table_stride: gl.tensor
    num_indices: gl.tensor  # CSR: entries of kv_indices
    num_heads: gl.tensor
    lse_b_stride: gl.tensor  # LSE_MODE 1: max_q * Hq
    VECTORS: gl.constexpr
    CSR: gl.constexpr
    HAS_OO: gl.constexpr
    HAS_OV: gl.constexpr
    LSE_MODE: gl.constexpr  # 0 none, 1 padded (B, max_q, Hq), 2 packed at batch_offsets_stats
    UNIT_Q: gl.constexpr  # elements per token of each offset (1 with token offsets)
    UNIT_O: gl.constexpr
    UNIT_K: gl.constexpr
    UNIT_V: gl.constexpr
    UNIT_S: gl.constexpr

    @gluon.constexpr_function
    def __init__(
        self,
        META,
        meta_stride,
        LQ,
        LKV,
        OQ,
        OO,
        OK,
        OV,
        OS,
        IP,
        LP,
        max_q,
        max_kv,
        rows_q,
        rows_o,
        rows_k,
        rows_v,
        lse_rows,
        table_width,
        table_stride,
        num_indices,
        num_heads,
        lse_b_stride,
        VECTORS,
        CSR,
        HAS_OO,
        HAS_OV,
        LSE_MODE,
        UNIT_Q,
        UNIT_O,
        UNIT_K,
        UNIT_V,
        UNIT_S,
    ):
        self.META = META
        self.meta_stride = meta_stride
        self.LQ = LQ
        self.LKV = LKV
        self.OQ = OQ
        self.OO = OO
        self.OK = OK
        self.OV = OV
        self.OS = OS
        self.IP = IP
        self.LP = LP
        self.max_q = max_q
        self.max_kv = max_kv
        self.rows_q = rows_q
        self.rows_o = rows_o
        self.rows_k = rows_k
        self.rows_v = rows_v
        self.lse_rows = lse_rows
        self.table_width = table_width
        self.table_stride = table_stride
        self.num_indices = num_indices
        self.num_heads = num_heads
        self.lse_b_stride = lse_b_stride
        self.VECTORS = gl.constexpr(VECTORS)
        self.CSR = gl.constexpr(CSR)
        self.HAS_OO = gl.constexpr(HAS_OO)
        self.HAS_OV = gl.constexpr(HAS_OV)
        self.LSE_MODE = gl.constexpr(LSE_MODE)
        self.UNIT_Q = gl.constexpr(UNIT_Q)
        self.UNIT_O = gl.constexpr(UNIT_O)
        self.UNIT_K = gl.constexpr(UNIT_K)
        self.UNIT_V = gl.constexpr(UNIT_V)
        self.UNIT_S = gl.constexpr(UNIT_S)

    @gluon.jit
    def of(self, b, PAGE_SIZE: gl.constexpr, WITH_LSE: gl.constexpr):
        """Sequence b's ``(q_len, kv_len, q_start, o_start, k_start, v_start, lse_start, bt_start)``
        (int32; b < the batch size). Ragged: bt_start 0; paged: k_start and v_start 0; lse_start is
        read from the table only ``WITH_LSE`` (0 otherwise)."""
        if self.VECTORS:
            rows = self._from_vectors(b, PAGE_SIZE)
        else:
            rows = self._from_table(b, PAGE_SIZE, WITH_LSE)
        return rows

    @gluon.jit
    def _from_table(self, b, PAGE_SIZE: gl.constexpr, WITH_LSE: gl.constexpr):
        M = self.META
        ms = self.meta_stride
        q_len = gl.load(M + b)
        zero = q_len * 0
        lse_start = zero
        if WITH_LSE:
            lse_start = gl.load(M + 6 * ms + b)
        if PAGE_SIZE > 0:
            bt_start = gl.load(M + 7 * ms + b)
            k_start = zero
            v_start = zero
        else:
            bt_start = zero
            k_start = gl.load(M + 4 * ms + b)
            v_start = gl.load(M + 5 * ms + b)
        kv_len = gl.load(M + ms + b)
        q_start = gl.load(M + 2 * ms + b)
        o_start = gl.load(M + 3 * ms + b)
        return q_len, kv_len, q_start, o_start, k_start, v_start, lse_start, bt_start

    @gluon.jit
    def _from_vectors(self, b, PAGE_SIZE: gl.constexpr):
        lq = _bounded(gl.load(self.LQ + b), self.max_q)
        if self.CSR:  # (in 64 bits: a pointer difference of garbage may overflow 32)
            p0 = gl.load(self.IP + b).to(gl.int64)
            n = gl.maximum(gl.load(self.IP + b + 1).to(gl.int64) - p0, 0)
            last = gl.minimum(gl.maximum(gl.load(self.LP + b).to(gl.int64), 1), PAGE_SIZE)
            lkv = gl.minimum(gl.where(n > 0, (n - 1) * PAGE_SIZE + last, 0), self.max_kv).to(gl.int32)
        else:
            p0 = b.to(gl.int64) * 0
            lkv = _bounded(gl.load(self.LKV + b), self.max_kv)
        qs = _start(self.OQ, b, self.UNIT_Q)
        os = qs
        if self.HAS_OO:
            os = _start(self.OO, b, self.UNIT_O)
        lq = gl.minimum(lq, gl.maximum(self.rows_q - qs, 0))
        lq = gl.minimum(lq, gl.maximum(self.rows_o - os, 0))
        zero = lq * 0
        if PAGE_SIZE > 0:
            ks = zero
            vs = zero
            if self.CSR:
                bs64 = gl.minimum(gl.maximum(p0, 0), self.num_indices)
                lkv = gl.minimum(lkv.to(gl.int64), (self.num_indices - bs64) * PAGE_SIZE).to(gl.int32)
            else:
                lkv = gl.minimum(lkv.to(gl.int64), self.table_width.to(gl.int64) * PAGE_SIZE).to(gl.int32)
                bs64 = b.to(gl.int64) * self.table_stride
            bs = gl.minimum(bs64, INT32_BIG).to(gl.int32)
        else:
            ks = _start(self.OK, b, self.UNIT_K)
            vs = ks
            if self.HAS_OV:
                vs = _start(self.OV, b, self.UNIT_V)
            lkv = gl.minimum(lkv, gl.maximum(self.rows_k - ks, 0))
            lkv = gl.minimum(lkv, gl.maximum(self.rows_v - vs, 0))
            bs = zero
        ls = zero
        if self.LSE_MODE == 1:
            ls = gl.minimum(b.to(gl.int64) * self.lse_b_stride, INT32_BIG).to(gl.int32)
        elif self.LSE_MODE == 2:
            s = _start(self.OS, b, self.UNIT_S)
            # (the rows of Hq entries from s on: (lse_numel - s Hq) // Hq, which is lse_rows - s)
            lq = gl.minimum(lq, gl.maximum(self.lse_rows - s, 0))
            ls = gl.minimum(s.to(gl.int64) * self.num_heads, INT32_BIG).to(gl.int32)
        return lq, lkv, qs, os, ks, vs, ls, bs


@gluon.jit
def sequence_rows(
    META,
    meta_stride,
    LQ,
    LKV,
    OQ,
    OO,
    OK,
    OV,
    OS,
    IP,
    LP,
    max_q,
    max_kv,
    rows_q,
    rows_o,
    rows_k,
    rows_v,
    lse_rows,
    table_width,
    table_stride,
    num_indices,
    num_heads,
    lse_b_stride,
    VECTORS: gl.constexpr,
    CSR: gl.constexpr,
    HAS_OO: gl.constexpr,
    HAS_OV: gl.constexpr,
    LSE_MODE: gl.constexpr,
    UNIT_Q: gl.constexpr,
    UNIT_O: gl.constexpr,
    UNIT_K: gl.constexpr,
    UNIT_V: gl.constexpr,
    UNIT_S: gl.constexpr,
):
    """The kernel's :class:`SequenceRows`: without ``VECTORS`` the vectors and bounds (None) stand in as
    the table and 0."""
    ms = gl.to_tensor(meta_stride)
    if VECTORS:
        rows = SequenceRows(
            META,
            ms,
            LQ,
            LKV,
            OQ,
            OO,
            OK,
            OV,
            OS,
            IP,
            LP,
            gl.to_tensor(max_q),
            gl.to_tensor(max_kv),
            gl.to_tensor(rows_q),
            gl.to_tensor(rows_o),
            gl.to_tensor(rows_k),
            gl.to_tensor(rows_v),
            gl.to_tensor(lse_rows),
            gl.to_tensor(table_width),
            gl.to_tensor(table_stride),
            gl.to_tensor(num_indices),
            gl.to_tensor(num_heads),
            gl.to_tensor(lse_b_stride),
            VECTORS,
            CSR,
            HAS_OO,
            HAS_OV,
            LSE_MODE,
            UNIT_Q,
            UNIT_O,
            UNIT_K,
            UNIT_V,
            UNIT_S,
        )
    else:
        z = ms * 0
        rows = SequenceRows(
            META,
            ms,
            META,
            META,
            META,
            META,
            META,
            META,
            META,
            META,
            META,
            z,
            z,
            z,
            z,
            z,
            z,
            z,
            z,
            z,
            z,
            z,
            z,
            VECTORS,
            CSR,
            HAS_OO,
            HAS_OV,
            LSE_MODE,
            UNIT_Q,
            UNIT_O,
            UNIT_K,
            UNIT_V,
            UNIT_S,
        )
    return rows


@gluon.jit
def _bounded(x, hi):
    """A length read from a vector, clamped to [0, hi] (int32)."""
    x = gl.maximum(x, 0)
    if x.dtype == gl.int64:
        x = gl.minimum(x, hi.to(gl.int64)).to(gl.int32)
    else:
        x = gl.minimum(x, hi)
    return x


@gluon.jit
def _start(OFF, b, UNIT: gl.constexpr):
    """Offset b of OFF in tokens, clamped to [0, 2^31 - 1] (int32; a negative offset truncates towards
    0 where the table floors it: both clamp to 0)."""
    x = gl.load(OFF + b)
    if UNIT > 1:
        x = x // UNIT
    x = gl.maximum(x, 0)
    if x.dtype == gl.int64:
        x = gl.minimum(x, INT32_BIG).to(gl.int32)
    return x
