"""The Hopper (sm_90) attention kernel in Gluon, Triton's explicit-layout dialect.

How it works (``docs/design.md`` has the reasons and ``docs/decisions.md`` what was tried):

* A work item is ``BLOCK_M = 64 * NC`` query rows of one sequence and one KV head; a row is a
  (token, head-in-group) pair, so each K/V tile is loaded once for the whole GQA group.
* A persistent grid (one program per SM) takes items in chunks of (sequence, KV head) pairs,
  heaviest row block first; either off a per-call work counter as each program's loads reach
  their next item (``dynamic``), or in static snake-ordered rounds.
* Each program is split into partitions (``gl.warp_specialize``): the load warps fill a ring of
  ``STAGES`` K/V tiles (bulk-tensor copies for tiles wholly below ``kv_len``, a zero-filling
  ``cp.async`` gather otherwise) and copy each item's Q by TMA; ``NC`` consumer warpgroups of 64
  rows each run ``S_j = Q K_j^T`` as an asynchronous wgmma beside the rescale of O and
  ``O += P_{j-1} V_{j-1}``, so the softmax of tile j overlaps the PV GEMM of tile j-1.
* Causal consumers walk key tiles only up to their own rows' diagonal and release the rest unread.

The state is grouped in aggregates: :class:`Geometry` (compile-time shape of the kernel),
:class:`Schedule` (work items and the item ring), :class:`KVRing` / :class:`QSlots` (shared
memory and its barriers), :class:`KVSource` (where K/V rows are in global memory) and
:class:`WorkItem` (one item's sequence, head, rows and key range).

Lengths, offsets and page ids are read on the device; page ids are clamped; rows with no visible
key get out 0 and lse -inf.
"""

# (no ``from __future__ import annotations``: Gluon aggregates check their fields' annotations)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

ITEM_RING = gl.constexpr(4)  # work items the load warps may hand out ahead (dynamic scheduling)


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
    S8: gl.constexpr  # KV8: staging slots (tiles in flight ahead of the one being widened, plus it)
    VEC: gl.constexpr  # K/V elements per 16-byte cp.async chunk
    K_SCALED: gl.constexpr  # a device k_scale multiplies the logits (its sign is read on the device)
    V_SCALED: gl.constexpr  # a device v_scale multiplies O

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
        S8,
        K_SCALED,
        V_SCALED,
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
        self.S8 = gl.constexpr(S8)
        self.VEC = gl.constexpr(16 if KV8 else 8)
        self.K_SCALED = gl.constexpr(K_SCALED)
        self.V_SCALED = gl.constexpr(V_SCALED)


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
    n_tiles: gl.tensor  # key tiles covering [0, hi); 0 when every row is past the sequence

    @gluon.constexpr_function
    def __init__(
        self, kv_head, row0, q_len, kv_len, q_start, o_start, lse_start, BT_row, k_start, v_start, hi, full, n_tiles
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


@aggregate
class Schedule:
    """The work items of one launch and how a program gets its next one."""

    META: gl.tensor
    BT: gl.tensor  # page ids (paged): sequence b's start at metadata row bt_start
    meta_stride: gl.tensor
    num_kv_heads: gl.tensor
    n_bh: gl.tensor  # (sequence, KV head) pairs
    num_m_blocks: gl.tensor
    chunk: gl.tensor  # pairs whose row blocks are dealt together
    total: gl.tensor  # work items
    counter: gl.tensor  # dynamic: the call's work counter (zeroed before the launch)
    dynamic: gl.tensor
    item_ids: gl.shared_memory_descriptor  # dynamic: item ids the load warps hand the consumers
    item_full: gl.shared_memory_descriptor
    item_empty: gl.shared_memory_descriptor
    window: gl.tensor  # WINDOW: window_left

    @gluon.constexpr_function
    def __init__(
        self,
        META,
        BT,
        meta_stride,
        num_kv_heads,
        n_bh,
        num_m_blocks,
        chunk,
        total,
        counter,
        dynamic,
        item_ids,
        item_full,
        item_empty,
        window,
    ):
        self.META = META
        self.BT = BT
        self.meta_stride = meta_stride
        self.num_kv_heads = num_kv_heads
        self.n_bh = n_bh
        self.num_m_blocks = num_m_blocks
        self.chunk = chunk
        self.total = total
        self.counter = counter
        self.dynamic = dynamic
        self.item_ids = item_ids
        self.item_full = item_full
        self.item_empty = item_empty
        self.window = window

    @gluon.jit
    def num_rounds(self):
        """Rounds of static scheduling: in round r every program takes one item."""
        return (self.total + gl.num_programs(0) - 1) // gl.num_programs(0)

    @gluon.jit
    def round_item(self, r):
        """Program p's item in round r: p in even rounds, the mirror in odd ones. Items shrink as
        they go within a chunk of pairs (heaviest first), so the snake order evens out the
        programs' sums."""
        pid = gl.program_id(0)
        return r * gl.num_programs(0) + pid + (r % 2) * (gl.num_programs(0) - 1 - 2 * pid)

    @gluon.jit
    def more(self, item, r):
        """Whether round r (holding item) is one to run."""
        dyn = self.dynamic != 0
        return (dyn & (item < self.total)) | ((not dyn) & (r < self.num_rounds()))

    @gluon.jit
    def claim(self, r):
        """Load warps: round r's item: the static round's, or the next one off the work counter,
        so that a program takes its next item when its loads reach it."""
        if self.dynamic != 0:
            item = gl.atomic_add(self.counter, 1, sem="relaxed")
        else:
            item = self.round_item(r)
        return item

    @gluon.jit
    def post(self, item, r, LOAD_WARPS: gl.constexpr):
        """Load warps (dynamic): hand round r's item to the consumers through slot r % ITEM_RING."""
        slot = r % ITEM_RING
        mbarrier.wait(self.item_empty.index(slot), ((r // ITEM_RING) & 1) ^ 1)
        self.item_ids.index(slot).store(gl.full([1], item, gl.int32, gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])))
        mbarrier.arrive(self.item_full.index(slot))

    @gluon.jit
    def take(self, r):
        """Consumers: round r's item: the static round's, or (dynamic) the load warps' pick."""
        if self.dynamic != 0:
            slot = r % ITEM_RING
            mbarrier.wait(self.item_full.index(slot), (r // ITEM_RING) & 1)
            item = gl.max(self.item_ids.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
            mbarrier.arrive(self.item_empty.index(slot))
        else:
            item = self.round_item(r)
        return item

    @gluon.jit
    def work_item(self, item, geo: Geometry, WITH_LSE: gl.constexpr):
        """Work item -> its sequence, KV head, row block and key range. Items run heaviest row block
        first within a chunk of (sequence, KV head) pairs; ``item >= total`` (a last round's missing
        items) decodes as the last item with ``q_len = 0``: no tiles, no stores."""
        total = self.n_bh * self.num_m_blocks
        valid = item < total
        item = gl.minimum(item, total - 1)  # (so that b < batch size: META is read unmasked)
        # chunks of `chunk` pairs, one after the other; in a chunk, row blocks heaviest first (z),
        # then pairs: items running at once share their pairs' K/V in L2
        k = item // (self.chunk * self.num_m_blocks)
        within = item - k * (self.chunk * self.num_m_blocks)
        in_chunk = gl.minimum(self.chunk, self.n_bh - k * self.chunk)  # (the last chunk may be short)
        z = within // in_chunk
        rem = k * self.chunk + within - z * in_chunk
        b = rem // self.num_kv_heads
        kv_head = rem - b * self.num_kv_heads
        row0 = (self.num_m_blocks - 1 - z) * geo.BLOCK_M
        META = self.META
        meta_stride = self.meta_stride
        q_len = gl.where(valid, gl.load(META + b), 0)
        kv_len = gl.load(META + meta_stride + b)
        q_start = gl.load(META + 2 * meta_stride + b)
        o_start = gl.load(META + 3 * meta_stride + b)
        lse_start = q_len * 0
        if WITH_LSE:
            lse_start = gl.load(META + 6 * meta_stride + b)
        if geo.PAGE_SIZE > 0:
            BT_row = self.BT + gl.load(META + 7 * meta_stride + b).to(gl.int64)
            k_start = q_len * 0
            v_start = q_len * 0
        else:
            BT_row = self.BT
            k_start = gl.load(META + 4 * meta_stride + b)
            v_start = gl.load(META + 5 * meta_stride + b)
        hi, n_tiles, full = _key_range(row0, q_len, kv_len, geo.BLOCK_M, geo)
        return WorkItem(
            kv_head, row0, q_len, kv_len, q_start, o_start, lse_start, BT_row, k_start, v_start, hi, full, n_tiles
        )


@aggregate
class KVRing:
    """The K/V tiles in shared memory: ``STAGES`` slots with full / empty barriers."""

    k: gl.shared_memory_descriptor  # [STAGES, BLOCK_N, DQ0]
    k1: gl.shared_memory_descriptor  # [STAGES, BLOCK_N, DQ1] (DQ1 > 0), else k
    v: gl.shared_memory_descriptor  # [STAGES, BLOCK_N, DV0]
    v1: gl.shared_memory_descriptor  # [STAGES, BLOCK_N, DV1] (DV1 > 0), else v
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
class Staging:
    """KV8: 8-bit K/V tiles as they arrive, ``S8`` slots (TMA boxes for whole tiles, cp.async otherwise)
    with a barrier each, until the load warps widen them into the :class:`KVRing`."""

    k: gl.shared_memory_descriptor  # [S8, BLOCK_N, DQ0] 8-bit
    k1: gl.shared_memory_descriptor  # [S8, BLOCK_N, DQ1] (DQ1 > 0), else k
    v: gl.shared_memory_descriptor  # [S8, BLOCK_N, DV0]
    v1: gl.shared_memory_descriptor  # [S8, BLOCK_N, DV1] (DV1 > 0), else v
    full: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, k, k1, v, v1, full):
        self.k = k
        self.k1 = k1
        self.v = v
        self.v1 = v1
        self.full = full


@aggregate
class QSlots:
    """Each consumer's Q rows in shared memory (and its O rows on the way out, O_STAGE), with the
    barriers of their TMA copies (Q_TMA)."""

    q: gl.shared_memory_descriptor  # [NC, 64, DQ0]
    q1: gl.shared_memory_descriptor  # [NC, 64, DQ1] (DQ1 > 0), else q
    full: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    f: gl.shared_memory_descriptor  # KV8: [4 * 64] float32, each row's power of two (see _prep_q)

    @gluon.constexpr_function
    def __init__(self, q, q1, full, empty, f):
        self.q = q
        self.q1 = q1
        self.full = full
        self.empty = empty
        self.f = f


@aggregate
class KVSource:
    """Where K/V rows live in global memory (element strides) and their 2-D TMA views."""

    K: gl.tensor
    V: gl.tensor
    num_pages: gl.tensor
    stride_kn: gl.tensor  # row (ragged) or page stride
    stride_kh: gl.tensor
    stride_ks: gl.tensor  # slot stride (paged)
    stride_vn: gl.tensor
    stride_vh: gl.tensor
    stride_vs: gl.tensor
    k_page_rows: gl.tensor  # TMA view rows per page
    k_head_off: gl.tensor  # TMA view rows (K_HEAD_ROWS) or columns per KV head
    v_page_rows: gl.tensor
    v_head_off: gl.tensor

    @gluon.constexpr_function
    def __init__(
        self,
        K,
        V,
        num_pages,
        stride_kn,
        stride_kh,
        stride_ks,
        stride_vn,
        stride_vh,
        stride_vs,
        k_page_rows,
        k_head_off,
        v_page_rows,
        v_head_off,
    ):
        self.K = K
        self.V = V
        self.num_pages = num_pages
        self.stride_kn = stride_kn
        self.stride_kh = stride_kh
        self.stride_ks = stride_ks
        self.stride_vn = stride_vn
        self.stride_vh = stride_vh
        self.stride_vs = stride_vs
        self.k_page_rows = k_page_rows
        self.k_head_off = k_head_off
        self.v_page_rows = v_page_rows
        self.v_head_off = v_head_off

    @gluon.jit
    def rows(self, w: WorkItem, t, geo: Geometry, LD: gl.constexpr):
        """Element offsets (int64) of key tile t's K and V rows, as rows of layout LD, and the mask
        of rows below ``hi``."""
        cols = t * geo.BLOCK_N + gl.arange(0, geo.BLOCK_N, gl.SliceLayout(1, LD))
        ok = cols < w.hi
        if geo.PAGE_SIZE == 0:
            k_off = (w.k_start + cols).to(gl.int64) * self.stride_kn
            v_off = (w.v_start + cols).to(gl.int64) * self.stride_vn
        else:
            page = gl.load(w.BT_row + cols // geo.PAGE_SIZE, mask=ok, other=0)
            page = gl.minimum(gl.maximum(page, 0), self.num_pages - 1).to(gl.int64)
            slot = (cols % geo.PAGE_SIZE).to(gl.int64)
            k_off = page * self.stride_kn + slot * self.stride_ks
            v_off = page * self.stride_vn + slot * self.stride_vs
        k_off = k_off + w.kv_head.to(gl.int64) * self.stride_kh
        v_off = v_off + w.kv_head.to(gl.int64) * self.stride_vh
        return k_off, v_off, ok

    @gluon.jit
    def gather(self, k_buf, k1_buf, v_buf, v1_buf, w: WorkItem, t, geo: Geometry):
        """cp.async copies of key tile t's K rows (columns [0, DQ0) into k_buf, [DQ0, DQ0 + DQ1) into
        k1_buf) and V rows (likewise into v_buf and v1_buf); rows at or past ``hi`` zero-filled."""
        LD: gl.constexpr = _chunk_layout(geo.DQ0, geo.VEC, geo.LOAD_WARPS)
        k_off, v_off, ok = self.rows(w, t, geo, LD)
        _copy_cols(self.K, k_buf, k_off, ok, 0, geo.DQ0, LD)
        if geo.DQ1 > 0:
            LD1: gl.constexpr = _chunk_layout(geo.DQ1, geo.VEC, geo.LOAD_WARPS)
            k1_off, _, ok1 = self.rows(w, t, geo, LD1)
            _copy_cols(self.K, k1_buf, k1_off, ok1, geo.DQ0, geo.DQ1, LD1)
        if geo.DV0 == geo.DQ0:  # (the same rows: their offsets once)
            _copy_cols(self.V, v_buf, v_off, ok, 0, geo.DV0, LD)
        else:
            LDV: gl.constexpr = _chunk_layout(geo.DV0, geo.VEC, geo.LOAD_WARPS)
            _, vv_off, okv = self.rows(w, t, geo, LDV)
            _copy_cols(self.V, v_buf, vv_off, okv, 0, geo.DV0, LDV)
        if geo.DV1 > 0:
            LDV1: gl.constexpr = _chunk_layout(geo.DV1, geo.VEC, geo.LOAD_WARPS)
            _, v1_off, okv1 = self.rows(w, t, geo, LDV1)
            _copy_cols(self.V, v1_buf, v1_off, okv1, geo.DV0, geo.DV1, LDV1)


@gluon.constexpr_function
def _chunk_layout(cols, vec, warps):
    """Rows of ``cols`` elements as ``vec``-element chunks, one per thread."""
    tpc = cols // vec
    return gl.BlockedLayout([1, vec], [32 // tpc, tpc], [warps, 1], [1, 0])


@gluon.jit
def _copy_cols(base, buf, off, ok, C0: gl.constexpr, COLS: gl.constexpr, LD: gl.constexpr):
    """cp.async copies of columns [C0, C0 + COLS) of the rows at element offsets ``off`` into buf;
    rows not ``ok`` zero-filled."""
    d = C0 + gl.arange(0, COLS, gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(buf, base + off[:, None] + d[None, :], mask=ok[:, None])


@gluon.jit
def _tma_coords(row, kv_head, head_off, HEAD_ROWS: gl.constexpr):
    """(row, column) of a head's key row in a cache's 2-D TMA view, from the head-0 row."""
    if HEAD_ROWS:
        return row + kv_head * head_off, 0
    return row, kv_head * head_off


@gluon.jit
def _issue_q(q_desc, slots: QSlots, w: WorkItem, r, geo: Geometry):
    """Load warps (Q_TMA): round r's Q rows, NC slots of 64 rows (64 / GROUP tokens x GROUP heads),
    as bulk-tensor copies of [64 / GROUP, GROUP, 64] boxes of the 3-D view [tokens, heads, Dqk] of
    q, once every consumer is past round r-1's last QK GEMM (``empty``); they complete on
    ``full``. A box is the 64-column tile of a slot (128-byte rows, the same swizzled bytes as a 2-D
    box). Rows past the sequence read other tokens or zeros (past q's end); their results are never
    stored. An item without key tiles is signalled without copies (no consumer reads its Q)."""
    DQ0: gl.constexpr = geo.DQ0
    DQ1: gl.constexpr = geo.DQ1
    GROUP: gl.constexpr = geo.GROUP
    mbarrier.wait(slots.empty, (r & 1) ^ 1)  # (also for empty items: no phase may run ahead)
    if w.n_tiles == 0:
        mbarrier.arrive(slots.full)
    else:
        mbarrier.expect(slots.full, geo.NC * 64 * (DQ0 + DQ1) * 2)
        for ci in gl.static_range(geo.NC):
            tok = w.q_start + (w.row0 + ci * 64) // GROUP
            for h in gl.static_range(DQ0 // 64):
                dst = slots.q.index(ci).slice(h * 64, 64, dim=1)
                dst = dst._reinterpret(slots.q.dtype, [64 // GROUP, GROUP, 64], q_desc.layout)
                tma.async_copy_global_to_shared(q_desc, [tok, w.kv_head * GROUP, h * 64], slots.full, dst)
            for h in gl.static_range(DQ1 // 64):  # (Dqk > 128: columns past 128 into q1)
                dst = slots.q1.index(ci).slice(h * 64, 64, dim=1)
                dst = dst._reinterpret(slots.q.dtype, [64 // GROUP, GROUP, 64], q_desc.layout)
                tma.async_copy_global_to_shared(q_desc, [tok, w.kv_head * GROUP, DQ0 + h * 64], slots.full, dst)


@gluon.jit
def _tma_tile(bufs, idx, bar, src: KVSource, w: WorkItem, t, k_desc, k1_desc, v_desc, v1_desc, geo: Geometry):
    """Bulk-tensor copies of key tile t (wholly below kv_len) into slot ``idx`` of ``bufs`` (a
    :class:`KVRing` or :class:`Staging`), PAGE_BOX rows a box (one box never crosses a page),
    completing on ``bar`` (its byte count set by the caller)."""
    k_buf = bufs.k.index(idx)
    k1_buf = bufs.k1.index(idx)
    v_buf = bufs.v.index(idx)
    v1_buf = bufs.v1.index(idx)
    PAGE_SIZE: gl.constexpr = geo.PAGE_SIZE
    PAGE_BOX: gl.constexpr = geo.PAGE_BOX
    for p in gl.static_range(geo.BLOCK_N // PAGE_BOX):
        pos = t * geo.BLOCK_N + p * PAGE_BOX
        if PAGE_SIZE == 0:
            k_row = w.k_start + pos
            v_row = w.v_start + pos
        else:
            page = gl.load(w.BT_row + pos // PAGE_SIZE)
            page = gl.minimum(gl.maximum(page, 0), src.num_pages - 1)
            k_row = page * src.k_page_rows + pos % PAGE_SIZE
            v_row = page * src.v_page_rows + pos % PAGE_SIZE
        kr, kc = _tma_coords(k_row, w.kv_head, src.k_head_off, geo.K_HEAD_ROWS)
        vr, vc = _tma_coords(v_row, w.kv_head, src.v_head_off, geo.V_HEAD_ROWS)
        k_dst = k_buf.slice(p * PAGE_BOX, PAGE_BOX)
        v_dst = v_buf.slice(p * PAGE_BOX, PAGE_BOX)
        tma.async_copy_global_to_shared(k_desc, [kr, kc], bar, k_dst)
        if geo.DQ1 > 0:
            tma.async_copy_global_to_shared(k1_desc, [kr, kc + geo.DQ0], bar, k1_buf.slice(p * PAGE_BOX, PAGE_BOX))
        if geo.DVO > 128:  # (V's TMA boxes are 128 columns wide: side by side)
            for h in gl.static_range(geo.DVO // 128):
                tma.async_copy_global_to_shared(v_desc, [vr, vc + h * 128], bar, v_dst.slice(h * 128, 128, dim=1))
        else:
            tma.async_copy_global_to_shared(v_desc, [vr, vc], bar, v_dst)
        if geo.DV1 > 0:
            tma.async_copy_global_to_shared(v1_desc, [vr, vc + geo.DV0], bar, v1_buf.slice(p * PAGE_BOX, PAGE_BOX))


@gluon.jit
def _stage(stg: Staging, slot, src: KVSource, w: WorkItem, t, k_desc, k1_desc, v_desc, v1_desc, geo: Geometry):
    """KV8: start key tile t's 8-bit K/V on their way into staging slot ``slot``: TMA boxes for a tile
    wholly below kv_len, else a zero-filling cp.async gather (TMA mode: committed as a group that
    :func:`_staged` waits for; otherwise each thread's copies arrive on the slot's barrier)."""
    bar = stg.full.index(slot)
    if geo.USE_TMA and (t + 1) * geo.BLOCK_N <= w.kv_len:
        mbarrier.expect(bar, geo.BLOCK_N * (geo.DQ0 + geo.DQ1 + geo.DVO))
        _tma_tile(stg, slot, bar, src, w, t, k_desc, k1_desc, v_desc, v1_desc, geo)
    else:
        src.gather(stg.k.index(slot), stg.k1.index(slot), stg.v.index(slot), stg.v1.index(slot), w, t, geo)
        if geo.USE_TMA:
            async_copy.commit_group()
        else:
            async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _staged(stg: Staging, n, w: WorkItem, t, geo: Geometry):
    """KV8: wait until the load warps' n-th tile (key tile t of item w) has landed in its staging slot."""
    slot = n % geo.S8
    if geo.USE_TMA:
        if (t + 1) * geo.BLOCK_N > w.kv_len:  # (gathered: its group, then one arrive for all threads)
            async_copy.wait_group(0)
            mbarrier.arrive(stg.full.index(slot))
    mbarrier.wait(stg.full.index(slot), (n // geo.S8) & 1)


@gluon.constexpr_function
def _widen_rows(block_n, cols, warps):
    """Rows widened at a time: 32 elements a thread (registers: 8 in, 16 out)."""
    return min(block_n, 1024 * warps // cols)


@gluon.constexpr_function
def _widen_vec(cols):
    return 8 if cols >= 128 else 16


@gluon.jit
def _widen_part(src_buf, dst_buf, COLS: gl.constexpr, geo: Geometry):
    """KV8: the 8-bit tile in src_buf ([BLOCK_N, COLS]) -> dst_buf in the ring's 16-bit dtype, in
    chunks of rows through registers. A 16-byte store phase is 8 threads: they must cover one
    128-byte swizzle row of the 16-bit tile, so 16-bit rows of 256 bytes or more take 8 elements a
    thread (16 put two threads of a phase on the same banks of two column blocks: 2-way conflicts)."""
    L: gl.constexpr = _chunk_layout(COLS, _widen_vec(COLS), geo.LOAD_WARPS)
    RCH: gl.constexpr = _widen_rows(geo.BLOCK_N, COLS, geo.LOAD_WARPS)
    for r in gl.static_range(geo.BLOCK_N // RCH):
        x = src_buf.slice(r * RCH, RCH).load(L)
        dst_buf.slice(r * RCH, RCH).store(x.to(dst_buf.dtype))


@gluon.jit
def _widen(stg: Staging, slot, ring: KVRing, s, geo: Geometry):
    """KV8: staging slot ``slot`` -> ring stage s (the caller fences and signals it)."""
    _widen_part(stg.k.index(slot), ring.k.index(s), geo.DQ0, geo)
    if geo.DQ1 > 0:
        _widen_part(stg.k1.index(slot), ring.k1.index(s), geo.DQ1, geo)
    _widen_part(stg.v.index(slot), ring.v.index(s), geo.DV0, geo)
    if geo.DV1 > 0:
        _widen_part(stg.v1.index(slot), ring.v1.index(s), geo.DV1, geo)


@gluon.jit
def _load_partition(
    sched: Schedule,
    ring: KVRing,
    stg: Staging,
    slots: QSlots,
    src: KVSource,
    k_desc,
    k1_desc,
    v_desc,
    v1_desc,
    q_desc,
    geo: Geometry,
):
    """Load warps: fill stage c % STAGES with the program's c-th key tile (counted across its work
    items) once every consumer released it.

    cp.async mode: every load thread gathers rows and arrives when its own copies land (barrier
    count = load threads). TMA mode (barrier count 1): tiles wholly below kv_len arrive as
    bulk-tensor copies of PAGE_BOX rows each, completing on the barrier's byte count; the tile that
    crosses kv_len is gathered with cp.async (rows past the keys zero-filled, so stale cache slots
    never reach the PV GEMM) and signalled once all load threads' copies landed.

    KV8: the same copies go into staging slot c % S8, S8 - 1 tiles of the item ahead of the one
    being widened; the load warps widen each tile into its ring stage and signal it (count 1)."""
    STAGES: gl.constexpr = geo.STAGES
    BLOCK_N: gl.constexpr = geo.BLOCK_N
    DQ0: gl.constexpr = geo.DQ0
    DQ1: gl.constexpr = geo.DQ1
    S8: gl.constexpr = geo.S8
    c = gl.program_id(0) * 0  # tiles this program has loaded so far
    r = gl.program_id(0) * 0  # rounds (items) so far
    item = sched.claim(r)
    while sched.more(item, r):
        if sched.dynamic != 0:
            sched.post(item, r, geo.LOAD_WARPS)
        w = sched.work_item(item, geo, False)
        if geo.WINDOW:  # (tiles wholly below every row's window are never loaded)
            t_lo, _ = _window_range(w.row0, w.q_len, w.kv_len, w.n_tiles, sched.window, geo.BLOCK_M, geo)
        else:
            t_lo = 0
        n_load = w.n_tiles - t_lo
        # (Q_TMA: the item's Q goes out once its tile STAGES - 2 has a stage: the consumers have then
        # released the tile two before it, so when the last item had >= 2 tiles they are past its last
        # QK GEMM; with O_STAGE they hand the slots back only after the last item's epilogue read O
        # from them, so the empty wait may wait for that; or after the item's last tile)
        q_at = gl.minimum(n_load, STAGES - 2)
        if geo.KV8:  # (the item's first S8 - 1 tiles into staging; the slots' last tiles are widened)
            for j in gl.static_range(S8 - 1):
                if j < n_load:
                    _stage(stg, (c + j) % S8, src, w, t_lo + j, k_desc, k1_desc, v_desc, v1_desc, geo)
        for i in range(n_load):
            t = t_lo + i
            s = (c + i) % STAGES
            if geo.KV8:  # (slot (c + i - 1) % S8: widened in the last step, which ended in a group sync)
                if i + S8 - 1 < n_load:
                    nxt = c + i + S8 - 1
                    _stage(stg, nxt % S8, src, w, t + S8 - 1, k_desc, k1_desc, v_desc, v1_desc, geo)
            mbarrier.wait(ring.empty.index(s), (((c + i) // STAGES) & 1) ^ 1)
            if geo.Q_TMA:
                if i == q_at:
                    _issue_q(q_desc, slots, w, r, geo)
            if geo.KV8:
                _staged(stg, c + i, w, t, geo)
                _widen(stg, (c + i) % S8, ring, s, geo)
                fence_async_shared()  # (the widened tiles' generic writes before the consumers' wgmma)
                mbarrier.arrive(ring.full.index(s))  # (a group sync, then one arrive)
            elif geo.USE_TMA:
                if (t + 1) * BLOCK_N <= w.kv_len:
                    mbarrier.expect(ring.full.index(s), 2 * BLOCK_N * (DQ0 + DQ1 + geo.DVO))
                    _tma_tile(ring, s, ring.full.index(s), src, w, t, k_desc, k1_desc, v_desc, v1_desc, geo)
                else:
                    src.gather(ring.k.index(s), ring.k1.index(s), ring.v.index(s), ring.v1.index(s), w, t, geo)
                    async_copy.commit_group()
                    async_copy.wait_group(0)
                    # (arrive follows a barrier of the load warps: all their copies have landed)
                    mbarrier.arrive(ring.full.index(s))
            else:
                src.gather(ring.k.index(s), ring.k1.index(s), ring.v.index(s), ring.v1.index(s), w, t, geo)
                async_copy.mbarrier_arrive(ring.full.index(s), increment_count=False)
        if geo.Q_TMA:
            if q_at == n_load:
                _issue_q(q_desc, slots, w, r, geo)
        c += n_load
        r += 1
        item = sched.claim(r)
    if sched.dynamic != 0:  # (item >= total: the consumers' stop)
        sched.post(item, r, geo.LOAD_WARPS)


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
        self.K_SCALE = K_SCALE
        self.V_SCALE = V_SCALE


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
def _softmax(s, m_i, l_i, qk_e, qk_r, start_n, diag, kv_len, window, cap_out, MASKED: gl.constexpr, geo: Geometry):
    """Online-softmax step on one S tile: returns (p, m, l, alpha), p unnormalised (fp32), m the row max
    in use (lazy: see LAZY_BOUND), l each thread's partial row sums (see _quad_sums). The scale is
    ``qk_e`` to multiply S elementwise and ``qk_r`` per row (KV8: [SUB_M, 1] and [SUB_M] tensors, each
    row's own; else one scalar twice). SOFTCAP: the logit is cap_out * tanh(s * qk) (qk then folds
    1 / cap in)."""
    if geo.SOFTCAP or MASKED or (geo.K_SCALED and not geo.KV8):
        # scale first, then mask: a masked -inf must never meet a zero scale (K_SCALED: the scale's
        # sign is known only on the device, so max(s) * scale may not be max(s * scale); KV8 moves
        # the sign into Q)
        if geo.SOFTCAP:
            s = _tanh(s * qk_e) * cap_out  # (log2 units, scaled and capped)
        else:
            s = s * qk_e
        if MASKED:
            cols = start_n + gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
            if geo.CAUSAL:
                visible = cols[None, :] <= diag[:, None]
            else:
                visible = (cols < kv_len)[None, :]
            if geo.WINDOW:
                visible = visible & (cols[None, :] >= (diag - window)[:, None])
            s = gl.where(visible, s, float("-inf"))
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
    part = _quad_sums(p)
    l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(1, part.type.layout), assert_trivial=True)[:, None] + part
    return p, m_new, l_i, alpha


@gluon.jit
def _quad_sums(p):
    """Each thread's own row sums of a wgmma-layout tile ([rows, cols] -> [rows, 4]: column 8j + 2t + e
    is lane t of the quad's). The running l is kept so and reduced across the quad once per work item:
    the shuffles per tile measured 6-9% of the 16k prefill's time."""
    return gl.sum(gl.sum(gl.reshape(p, [p.shape[0], p.shape[1] // 8, 4, 2]), 3), 1)


@gluon.jit
def _qk_async(q_sub, q1_sub, k_buf, k1_buf, s_zero, DQ1: gl.constexpr):
    """S = Q K^T as asynchronous wgmmas (a second one for key columns past 128 when DQ1 > 0)."""
    tok = warpgroup_mma(q_sub, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if DQ1 > 0:
        tok = warpgroup_mma(q1_sub, k1_buf.permute((1, 0)), tok, is_async=True)
    return tok


@gluon.jit
def _q_cols_async(
    buf, w: WorkItem, out: OutSink, R0: gl.constexpr, geo: Geometry, C0: gl.constexpr, NCOL: gl.constexpr
):
    """cp.async copies of columns [C0, C0 + NCOL) of work item w's Q rows [row0 + R0, row0 + R0 +
    SUB_M) into buf; rows past the sequence zero-filled."""
    GROUP: gl.constexpr = geo.GROUP
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (NCOL // 8), NCOL // 8], [4, 1], [1, 0])
    rows = w.row0 + R0 + gl.arange(0, geo.SUB_M, gl.SliceLayout(1, LD))
    tok = rows // GROUP
    head = w.kv_head * GROUP + rows % GROUP
    off = (w.q_start + tok).to(gl.int64) * out.stride_qt + head.to(gl.int64) * out.stride_qh
    d = C0 + gl.arange(0, NCOL, gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(buf, out.Q + off[:, None] + d[None, :], mask=(tok < w.q_len)[:, None])


@gluon.constexpr_function
def _prep_rows(dq0, dq1):
    """Rows of Q converted at a time: 16, or as many as the narrower part's layout covers."""
    narrow = min(dq0, dq1) if dq1 else dq0
    return max(16, 4 * (32 // (narrow // 8)))


@gluon.jit
def _prep_q(q_sub, q1_sub, f_buf, sign, geo: Geometry):
    """KV8: this warpgroup's Q rows, in q's 16-bit dtype, -> float16 in place (the GEMMs' dtype: the
    8-bit K/V widen to it in one instruction per pair), each row times ``sign`` and a power of two
    2^k that puts its largest magnitude in [2^14, 2^15): exact, since bf16's 8-bit significands fit
    fp16's 11 wherever fp16 is normal, and a row's entries under 2^-28 of its largest are all fp16
    loses. Each row's 2^-k goes to f_buf."""
    DQ0: gl.constexpr = geo.DQ0
    DQ1: gl.constexpr = geo.DQ1
    RCH: gl.constexpr = _prep_rows(DQ0, DQ1)
    L0: gl.constexpr = _chunk_layout(DQ0, 8, 4)
    h0 = q_sub._reinterpret(gl.float16, q_sub.shape, q_sub.layout)
    if DQ1 > 0:
        L1: gl.constexpr = _chunk_layout(DQ1, 8, 4)
        h1 = q1_sub._reinterpret(gl.float16, q1_sub.shape, q1_sub.layout)
    for r in gl.static_range(geo.SUB_M // RCH):
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
def _consumer_partition(sched: Schedule, ring: KVRing, slots: QSlots, out: OutSink, R0: gl.constexpr, geo: Geometry):
    """One consumer warpgroup: rows [row0 + R0, row0 + R0 + SUB_M) of each work item's block."""
    GROUP: gl.constexpr = geo.GROUP
    DQ1: gl.constexpr = geo.DQ1
    DVO: gl.constexpr = geo.DVO
    DV0: gl.constexpr = geo.DV0
    DV1: gl.constexpr = geo.DV1
    SUB_M: gl.constexpr = geo.SUB_M
    BLOCK_N: gl.constexpr = geo.BLOCK_N
    STAGES: gl.constexpr = geo.STAGES
    CAUSAL: gl.constexpr = geo.CAUSAL
    dtype: gl.constexpr = ring.k.dtype  # (the GEMMs' inputs: q's dtype, or float16 for 8-bit K/V)
    Out = out.Out
    qk_scale = out.qk_scale
    sign = 1.0
    if geo.K_SCALED:
        k_scale = gl.load(out.K_SCALE)
        if geo.KV8:  # (its sign goes into Q: the scale stays >= 0)
            sign = gl.where(k_scale < 0, -1.0, 1.0)
            k_scale = gl.abs(k_scale)
        qk_scale = qk_scale * k_scale
    if geo.SOFTCAP:  # s = cap * tanh(scale * q.k / cap), in log2 units: cap_out * tanh(q.k * qk_scale / cap_out)
        cap_out = out.softcap * 1.4426950408889634
        qk_scale = qk_scale / cap_out
    else:
        cap_out = 1.0
    # Q_TMA: the slot goes back to the load warps after this warpgroup's last QK GEMM of an item, or,
    # when O is staged through it, after O is read back from it
    Q_EARLY: gl.constexpr = geo.Q_TMA and geo.O_STAGE != 1
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV0, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    if DV1 > 0:  # (O in two accumulators, DV0 + DV1 columns, one PV GEMM each)
        O1_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV1, 16])
        P1_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O1_L, k_width=2)
    q_sub = slots.q.index(R0 // SUB_M)
    if DQ1 > 0:
        q1_sub = slots.q1.index(R0 // SUB_M)
    else:
        q1_sub = q_sub
    if geo.KV8:  # (the GEMMs read the slot as float16, see _prep_q)
        qg_sub = q_sub._reinterpret(gl.float16, q_sub.shape, q_sub.layout)
        qg1_sub = q1_sub._reinterpret(gl.float16, q1_sub.shape, q1_sub.layout)
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
    item = sched.take(r)
    while sched.more(item, r):
        w = sched.work_item(item, geo, geo.HAS_LSE)
        # this warpgroup's Q rows -> its own slot, once all its warps are past the previous item's GEMMs
        if geo.Q_TMA:  # (the load warps' copies)
            # (every mbarrier.arrive of a warpgroup here is lowered as a bar.sync of its 128 threads
            # and one elected arrive: no warp can lag a round behind the arrival)
            mbarrier.wait(slots.full, r & 1)
        else:
            gl.thread_barrier()
            _q_cols_async(q_sub, w, out, R0, geo, 0, geo.DQ0)
            if DQ1 > 0:
                _q_cols_async(q1_sub, w, out, R0, geo, geo.DQ0, DQ1)
            async_copy.commit_group()
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()
        if geo.KV8:
            _prep_q(q_sub, q1_sub, f_buf, sign, geo)
            fence_async_shared()
            gl.thread_barrier()
            qk_r = qk_scale * f_buf.load(gl.SliceLayout(1, S_L))
            qk_e = qk_r[:, None]
        rows_s = w.row0 + R0 + gl.arange(0, SUB_M, gl.SliceLayout(1, S_L))
        tok_s = rows_s // GROUP
        diag = tok_s + (w.kv_len - w.q_len)
        m_i = gl.full([SUB_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
        l_i = _quad_sums(gl.zeros([SUB_M, BLOCK_N], gl.float32, S_L))  # (per thread: see _quad_sums)
        acc = gl.zeros([SUB_M, DV0], gl.float32, O_L)
        s_zero = gl.zeros([SUB_M, BLOCK_N], gl.float32, S_L)
        p_op = gl.zeros([SUB_M, BLOCK_N], dtype, P_L)
        if DV1 > 0:
            acc1 = gl.zeros([SUB_M, DV1], gl.float32, O1_L)
            p_op1 = gl.zeros([SUB_M, BLOCK_N], dtype, P1_L)
        n_walk = w.n_tiles  # key tiles this warpgroup computes up to; below full_own none is masked
        full_own = w.full
        if CAUSAL:
            # (this warpgroup's rows lie inside the block's: its range is within the block's)
            _, n_walk, full_own = _key_range(w.row0 + R0, w.q_len, w.kv_len, SUB_M, geo)
        if geo.WINDOW:
            # the ring holds the block's tiles from t_lo on; this warpgroup's own window starts at
            # t_own (tiles before it are released unread), and keys from head_own on need no mask
            t_lo, _ = _window_range(w.row0, w.q_len, w.kv_len, w.n_tiles, sched.window, geo.BLOCK_M, geo)
            t_own, head_own = _window_range(w.row0 + R0, w.q_len, w.kv_len, n_walk, sched.window, SUB_M, geo)
            t_own = gl.maximum(t_own, t_lo)
            n_walk = gl.maximum(n_walk, t_own)
            for t in range(t_lo, t_own):
                mbarrier.wait(ring.full.index((c + t - t_lo) % STAGES), ((c + t - t_lo) // STAGES) & 1)
                mbarrier.arrive(ring.empty.index((c + t - t_lo) % STAGES))
        else:
            t_lo = 0
            t_own = 0
            head_own = 0
        alpha = gl.full([SUB_M], 1.0, gl.float32, gl.SliceLayout(1, O_L))
        if DV1 > 0:
            alpha1 = gl.full([SUB_M], 1.0, gl.float32, gl.SliceLayout(1, O1_L))
        if Q_EARLY:
            if n_walk == t_own:  # (the slot is free once this warpgroup's last QK GEMM is done)
                mbarrier.arrive(slots.empty)
        if n_walk > t_own:  # the first tile: nothing to overlap its softmax with yet
            s0 = (c + t_own - t_lo) % STAGES
            mbarrier.wait(ring.full.index(s0), ((c + t_own - t_lo) // STAGES) & 1)
            fence_async_shared()
            s_tok = _qk_async(qg_sub, qg1_sub, ring.k.index(s0), ring.k1.index(s0), s_zero, DQ1)
            sc = warpgroup_mma_wait(0, deps=[s_tok])
            if Q_EARLY:
                if n_walk == t_own + 1:
                    mbarrier.arrive(slots.empty)
            unmasked = t_own * BLOCK_N < full_own
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
            p16 = p.to(dtype)
            p_op = gl.convert_layout(p16, P_L)
            if DV1 > 0:
                p_op1 = gl.convert_layout(p16, P1_L)
        for t in range(t_own + 1, n_walk):
            s = (c + t - t_lo) % STAGES
            prev = (c + t - t_lo - 1) % STAGES
            mbarrier.wait(ring.full.index(s), ((c + t - t_lo) // STAGES) & 1)
            fence_async_shared()
            # S_t = Q K_t^T in flight while O is rescaled for tile t-1 (off the path from the PV
            # GEMM's wait to the next PV GEMM); then O += P_{t-1} V_{t-1} joins it, and softmax(S_t)
            # overlaps the PV GEMM
            s_tok = _qk_async(qg_sub, qg1_sub, ring.k.index(s), ring.k1.index(s), s_zero, DQ1)
            if t > t_own + 1:  # (the first tile left O zero)
                acc = _rescale(acc, alpha)
                if DV1 > 0:
                    acc1 = _rescale(acc1, alpha1)
            o_tok = warpgroup_mma(p_op, ring.v.index(prev), acc, is_async=True)
            if DV1 > 0:
                o1_tok = warpgroup_mma(p_op1, ring.v1.index(prev), acc1, is_async=True)
                sc = warpgroup_mma_wait(2, deps=[s_tok])  # (the QK GEMMs: issued before both PV GEMMs)
            else:
                sc = warpgroup_mma_wait(1, deps=[s_tok])
            if Q_EARLY:
                if t == n_walk - 1:
                    mbarrier.arrive(slots.empty)
            unmasked = t * BLOCK_N < full_own
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
            if DV1 > 0:
                alpha1 = gl.convert_layout(alpha_s, gl.SliceLayout(1, O1_L))
                acc, acc1 = warpgroup_mma_wait(0, deps=[o_tok, o1_tok])
            else:
                acc = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(ring.empty.index(prev))
            p16 = p.to(dtype)
            p_op = gl.convert_layout(p16, P_L)
            if DV1 > 0:
                p_op1 = gl.convert_layout(p16, P1_L)
        if n_walk > t_own:
            last = (c + n_walk - 1 - t_lo) % STAGES
            if n_walk > t_own + 1:
                acc = _rescale(acc, alpha)
                if DV1 > 0:
                    acc1 = _rescale(acc1, alpha1)
            o_tok = warpgroup_mma(p_op, ring.v.index(last), acc, is_async=True)
            if DV1 > 0:
                o1_tok = warpgroup_mma(p_op1, ring.v1.index(last), acc1, is_async=True)
                acc, acc1 = warpgroup_mma_wait(0, deps=[o_tok, o1_tok])
            else:
                acc = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(ring.empty.index(last))
        if CAUSAL:  # tiles past this warpgroup's last key: released unread, in ring order
            for t in range(n_walk, w.n_tiles):
                mbarrier.wait(ring.full.index((c + t - t_lo) % STAGES), ((c + t - t_lo) // STAGES) & 1)
                mbarrier.arrive(ring.empty.index((c + t - t_lo) % STAGES))
        c += w.n_tiles - t_lo
        l_i = gl.convert_layout(gl.sum(l_i, 1), gl.SliceLayout(1, S_L))  # (the quad's lanes, once)

        if geo.SINKS:  # the sink joins the denominator: out = acc / (l + e^sink), lse = log(l + e^sink)
            sink2 = gl.load(out.SINKS + (w.kv_head * GROUP + rows_s % GROUP)) * 1.4426950408889634
            m_f = gl.maximum(m_i, sink2)
            a = gl.exp2(m_i - m_f)
            l_f = l_i * a + gl.exp2(sink2 - m_f)
            inv_l = a / l_f
            lse2 = m_f + gl.log2(l_f)
        else:
            has_key = l_i > 0.0
            inv_l = gl.where(has_key, 1.0 / gl.where(has_key, l_i, 1.0), 0.0)
            lse2 = gl.where(has_key, m_i + gl.log2(gl.where(has_key, l_i, 1.0)), float("-inf"))
        if geo.V_SCALED:
            inv_l = inv_l * gl.load(out.V_SCALE)
        o = (acc * gl.convert_layout(inv_l, gl.SliceLayout(1, O_L))[:, None]).to(Out.dtype.element_ty)
        if geo.O_STAGE == 1:
            # through this warpgroup's Q slot (its last QK GEMM is done) into rows of 16-byte
            # vectors: each warp stores whole 2^k-byte row segments instead of 16-byte pieces of 8
            # rows (the wgmma accumulator's layout)
            gl.thread_barrier()
            q_sub.store(o)
            gl.thread_barrier()
            TPW_D: gl.constexpr = DVO // 8
            ST_L: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [4, 1], [1, 0])
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
        r += 1
        item = sched.take(r)


@gluon.constexpr_function
def _layout8(cols):
    """Shared layout of 8-bit tiles of ``cols`` columns (the host's TMA descriptors use the same)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(cols, 128), element_bitwidth=8, rank=2)


@gluon.jit(
    do_not_specialize=["meta_stride", "batch_size", "num_m_blocks", "num_pages", "chunk_pairs", "dynamic", "window"],
    do_not_specialize_on_alignment=["BT", "LSE", "COUNTER", "SINKS", "K_SCALE", "V_SCALE"],
)
def attention_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    META,
    BT,
    COUNTER,
    dynamic,
    sm_scale_log2,
    meta_stride,
    batch_size,
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
    num_kv_heads,
    chunk_pairs,
    k_desc,
    k1_desc,
    v_desc,
    v1_desc,
    q_desc,
    k_page_rows,
    k_head_off,
    v_page_rows,
    v_head_off,
    window,
    softcap,
    SINKS,
    K_SCALE,
    V_SCALE,
    GROUP: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    DQK: gl.constexpr,
    DVO: gl.constexpr,
    NC: gl.constexpr,
    BLOCK_N: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_LSE: gl.constexpr,
    STAGES: gl.constexpr,
    LOAD_WARPS: gl.constexpr,
    CONS_REGS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    USE_TMA: gl.constexpr,
    PAGE_BOX: gl.constexpr,
    K_HEAD_ROWS: gl.constexpr,
    V_HEAD_ROWS: gl.constexpr,
    Q_TMA: gl.constexpr,
    O_STAGE: gl.constexpr,
    WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    KV8_STAGES: gl.constexpr,
    K_SCALED: gl.constexpr,
    V_SCALED: gl.constexpr,
    num_warps: gl.constexpr,
):
    """LOAD_WARPS load warps feed NC consumer warpgroups of 64 rows each; the kernel's own
    num_warps (4) are the first consumer. The ``num_kv_heads * batch_size * num_m_blocks`` work
    items are dealt to a persistent grid (see :class:`Schedule`)."""
    geo = Geometry(
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
        HAS_SINKS,
        KV8_STAGES > 0,
        KV8_STAGES,
        K_SCALED,
        V_SCALED,
    )
    dtype: gl.constexpr = Q.dtype.element_ty
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # (32-column parts: 64-byte rows, 64-byte swizzle; the host's TMA descriptors use the same)
    SMEM1: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=64 if geo.DQ1 == 32 else 128, element_bitwidth=16, rank=2
    )
    SMEMV1: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=64 if geo.DV1 == 32 else 128, element_bitwidth=16, rank=2
    )

    # the GEMMs' inputs: q's dtype; with 8-bit K/V float16 (see _prep_q)
    cdt: gl.constexpr = gl.float16 if geo.KV8 else dtype
    q_smem = gl.allocate_shared_memory(dtype, [NC, geo.SUB_M, geo.DQ0], SMEM)
    k_smem = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, geo.DQ0], SMEM)
    v_smem = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, geo.DV0], SMEM)
    if geo.DQ1 > 0:
        q1_smem = gl.allocate_shared_memory(dtype, [NC, geo.SUB_M, geo.DQ1], SMEM1)
        k1_smem = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, geo.DQ1], SMEM1)
    else:  # (unused)
        q1_smem = q_smem
        k1_smem = k_smem
    if geo.DV1 > 0:
        v1_smem = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, geo.DV1], SMEMV1)
    else:  # (unused)
        v1_smem = v_smem
    kv_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_full.index(i), count=1 if (USE_TMA or geo.KV8) else LOAD_WARPS * 32)
        mbarrier.init(kv_empty.index(i), count=NC)
    if geo.KV8:  # (8-bit tiles in the copies' own layouts: rows of 32, 64 or >= 128 bytes)
        kv_dt: gl.constexpr = K.dtype.element_ty
        st_k = gl.allocate_shared_memory(kv_dt, [KV8_STAGES, BLOCK_N, geo.DQ0], _layout8(geo.DQ0))
        st_v = gl.allocate_shared_memory(kv_dt, [KV8_STAGES, BLOCK_N, geo.DV0], _layout8(geo.DV0))
        if geo.DQ1 > 0:
            st_k1 = gl.allocate_shared_memory(kv_dt, [KV8_STAGES, BLOCK_N, geo.DQ1], _layout8(geo.DQ1))
        else:
            st_k1 = st_k
        if geo.DV1 > 0:
            st_v1 = gl.allocate_shared_memory(kv_dt, [KV8_STAGES, BLOCK_N, geo.DV1], _layout8(geo.DV1))
        else:
            st_v1 = st_v
        st_full = gl.allocate_shared_memory(gl.int64, [KV8_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(KV8_STAGES):
            mbarrier.init(st_full.index(i), count=1 if USE_TMA else LOAD_WARPS * 32)
        # (a 1-D buffer of a power of two elements, sliced per consumer)
        q_f = gl.allocate_shared_memory(gl.float32, [4 * geo.SUB_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:  # (unused)
        st_k = k_smem
        st_k1 = k_smem
        st_v = v_smem
        st_v1 = v_smem
        st_full = kv_full
        q_f = kv_full
    # dynamic != 0: items come off the work counter; the load warps hand them to the consumers
    # through a ring of item ids (ITEM_RING slots, with full and empty barriers)
    item_ids = gl.allocate_shared_memory(gl.int32, [ITEM_RING, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_full = gl.allocate_shared_memory(gl.int64, [ITEM_RING, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [ITEM_RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(ITEM_RING):
        mbarrier.init(item_full.index(i), count=1)
        mbarrier.init(item_empty.index(i), count=NC)
    # Q_TMA: the load warps copy each item's Q (full, by bytes) once every consumer's last QK GEMM of
    # the item before is done (empty)
    if Q_TMA:
        q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_full, count=1)
        mbarrier.init(q_empty, count=NC)
    else:  # (unused)
        q_full = kv_full.index(0)
        q_empty = kv_empty.index(0)
    fence_async_shared()

    # ints specialised to 1 arrive as constexprs; partitions take tensors
    n_bh = gl.to_tensor(num_kv_heads) * batch_size
    total = n_bh * num_m_blocks
    sched = Schedule(
        META,
        BT,
        gl.to_tensor(meta_stride),
        gl.to_tensor(num_kv_heads),
        n_bh,
        gl.to_tensor(num_m_blocks),
        gl.to_tensor(chunk_pairs),
        total,
        COUNTER,
        gl.to_tensor(dynamic),
        item_ids,
        item_full,
        item_empty,
        gl.to_tensor(window),
    )
    ring = KVRing(k_smem, k1_smem, v_smem, v1_smem, kv_full, kv_empty)
    stg = Staging(st_k, st_k1, st_v, st_v1, st_full)
    slots = QSlots(q_smem, q1_smem, q_full, q_empty, q_f)
    src = KVSource(
        K,
        V,
        gl.to_tensor(num_pages),
        gl.to_tensor(stride_kn),
        gl.to_tensor(stride_kh),
        gl.to_tensor(stride_ks),
        gl.to_tensor(stride_vn),
        gl.to_tensor(stride_vh),
        gl.to_tensor(stride_vs),
        gl.to_tensor(k_page_rows),
        gl.to_tensor(k_head_off),
        gl.to_tensor(v_page_rows),
        gl.to_tensor(v_head_off),
    )
    out = OutSink(
        Q,
        gl.to_tensor(stride_qt),
        gl.to_tensor(stride_qh),
        Out,
        LSE,
        gl.to_tensor(stride_ot),
        gl.to_tensor(stride_oh),
        gl.to_tensor(num_heads_q),
        gl.to_tensor(sm_scale_log2),
        gl.to_tensor(softcap),
        SINKS,
        K_SCALE,
        V_SCALE,
    )
    R0: gl.constexpr = 0
    R1: gl.constexpr = geo.SUB_M
    R2: gl.constexpr = 2 * geo.SUB_M
    if NC == 2:
        gl.warp_specialize(
            [
                (_consumer_partition, (sched, ring, slots, out, R0, geo)),
                (_consumer_partition, (sched, ring, slots, out, R1, geo)),
                (_load_partition, (sched, ring, stg, slots, src, k_desc, k1_desc, v_desc, v1_desc, q_desc, geo)),
            ],
            [4, LOAD_WARPS],
            [CONS_REGS, LOAD_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_consumer_partition, (sched, ring, slots, out, R0, geo)),
                (_consumer_partition, (sched, ring, slots, out, R1, geo)),
                (_consumer_partition, (sched, ring, slots, out, R2, geo)),
                (_load_partition, (sched, ring, stg, slots, src, k_desc, k1_desc, v_desc, v1_desc, q_desc, geo)),
            ],
            [4, 4, LOAD_WARPS],
            [CONS_REGS, CONS_REGS, LOAD_REGS],
        )
