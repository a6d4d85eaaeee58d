"""Shared memory and its barriers: the K/V ring (:class:`KVRing`), the 8-bit staging slots
(:class:`Staging`) and the consumers' Q slots (:class:`QSlots`)."""

# (no ``from __future__ import annotations``: Gluon aggregates check their fields' annotations)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate


@gluon.constexpr_function
def _layout(cols, bits):
    """Shared layout of tiles of ``cols`` columns of ``bits``-bit elements: rows swizzled over their
    bytes, at most 128 (the host's TMA descriptors use the same)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(cols * bits // 8, 128), element_bitwidth=bits, rank=2)


@aggregate
class KVRing:
    """The K/V tiles in shared memory: ``STAGES`` slots with full / empty barriers; with
    ``Geometry.ISSUER``, a ring of hand-offs (``ITEM_RING`` slots) from the issuing warp to the gather
    warps, one per item: go once the item's last tile has a free stage, done once the gather warps
    took it (so that go's slot is never reused before its waiters saw it)."""

    k: gl.shared_memory_descriptor  # [STAGES, BLOCK_N, DQ0]
    k1: gl.shared_memory_descriptor  # [STAGES, BLOCK_N, DQ1] (DQ1 > 0), else k
    v: gl.shared_memory_descriptor  # [STAGES, BLOCK_N, DV0]
    v1: gl.shared_memory_descriptor  # [STAGES, BLOCK_N, DV1] (DV1 > 0), else v
    full: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    tail_go: gl.shared_memory_descriptor
    tail_done: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, k, k1, v, v1, full, empty, tail_go, tail_done):
        self.k = k
        self.k1 = k1
        self.v = v
        self.v1 = v1
        self.full = full
        self.empty = empty
        self.tail_go = tail_go
        self.tail_done = tail_done


@aggregate
class Staging:
    """KV8: 8-bit K/V tiles as they arrive, ``S8`` slots (TMA boxes for whole tiles, cp.async otherwise)
    with a barrier each, until the load warps widen them into the :class:`KVRing`; with
    ``Geometry.ISSUER`` the issuing warp fills a slot once the widening warps released it (``empty``)."""

    k: gl.shared_memory_descriptor  # [S8, BLOCK_N, DQ0] 8-bit
    k1: gl.shared_memory_descriptor  # [S8, BLOCK_N, DQ1] (DQ1 > 0), else k
    v: gl.shared_memory_descriptor  # [S8, BLOCK_N, DV0]
    v1: gl.shared_memory_descriptor  # [S8, BLOCK_N, DV1] (DV1 > 0), else v
    full: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, k, k1, v, v1, full, empty):
        self.k = k
        self.k1 = k1
        self.v = v
        self.v1 = v1
        self.full = full
        self.empty = empty


@aggregate
class QSlots:
    """Each consumer's Q rows in shared memory (and its O rows on the way out, O_STAGE), with the
    barriers of their TMA copies (Q_TMA). The first two warpgroups' rows are one [128, D] buffer (one
    8-warp partition reads it whole, ``Geometry.MERGED``), a third one's its own [64, D] (a buffer's
    rows are a power of two)."""

    q: gl.shared_memory_descriptor  # [64 * min(NC, 2), DQ0]: rows 0-127
    q3: gl.shared_memory_descriptor  # NC == 3: [64, DQ0], rows 128-191; else q
    q1: gl.shared_memory_descriptor  # [64 * min(NC, 2), DQ1] (DQ1 > 0), else q
    q13: gl.shared_memory_descriptor  # NC == 3 and DQ1 > 0: [64, DQ1]; else q1
    full: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    f: gl.shared_memory_descriptor  # KV8: [4 * 64] float32, each row's power of two (see _prep_q)
    ones: gl.shared_memory_descriptor  # [8, BLOCK_N] ones in the GEMMs' dtype: the row sums' B operand

    @gluon.constexpr_function
    def __init__(self, q, q3, q1, q13, full, empty, f, ones):
        self.q = q
        self.q3 = q3
        self.q1 = q1
        self.q13 = q13
        self.full = full
        self.empty = empty
        self.f = f
        self.ones = ones


@gluon.jit
def q_rows(pair, third, R0: gl.constexpr, ROWS: gl.constexpr):
    """Rows [R0, R0 + ROWS) of Q's slots (``pair``: rows 0-127, ``third``: 128-191)."""
    if R0 >= 128:
        return third
    else:
        return pair.slice(R0, ROWS)
