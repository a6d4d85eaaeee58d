"""The load warps: where K/V rows are in global memory (:class:`KVSource`: pages, ragged rows, TMA
views), TMA and cp.async copies of K/V tiles and Q, the widening of 8-bit K/V, and the load
partition."""

# (no ``from __future__ import annotations``: Gluon aggregates check their fields' annotations)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, tma
from triton.language.core import _aggregate as aggregate

from .buffers import KVRing, QSlots, Staging, q_rows
from .geometry import Geometry, WorkItem, _window_range
from .schedule import ITEM_RING, Schedule


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
    def rows(self, w: WorkItem, t, r0, R: gl.constexpr, geo: Geometry, LD: gl.constexpr):
        """Element offsets (int64) of rows [r0, r0 + R) of key tile t's K and V, as rows of layout LD,
        and the mask of rows below ``hi``."""
        cols = t * geo.BLOCK_N + r0 + gl.arange(0, R, gl.SliceLayout(1, LD))
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
    def gather(self, k_buf, k1_buf, v_buf, v1_buf, w: WorkItem, t, geo: Geometry, K: gl.constexpr, V: gl.constexpr):
        """cp.async copies of key tile t's K rows (K: columns [0, DQ0) into k_buf, [DQ0, DQ0 + DQ1)
        into k1_buf) and V rows (V: likewise into v_buf and v1_buf); rows at or past ``hi``
        zero-filled. Fewer than four load warps take the rows in passes, so that each thread holds
        as many offsets at a time as with four (more spill their registers)."""
        R: gl.constexpr = _pass_rows(geo.BLOCK_N, geo.LOAD_WARPS)
        if R == geo.BLOCK_N:  # (the buffers whole: with fp8 q, V's is transposed and not sliced by rows)
            self._gather_rows(k_buf, k1_buf, v_buf, v1_buf, w, t, 0, R, geo, K, V)
        else:
            for p in gl.static_range(geo.BLOCK_N // R):
                if p > 0:  # (else ptxas computes every pass's offsets first, and spills them)
                    gl.thread_barrier()
                self._gather_rows(
                    k_buf.slice(p * R, R),
                    k1_buf.slice(p * R, R),
                    v_buf.slice(p * R, R),
                    v1_buf.slice(p * R, R),
                    w,
                    t,
                    p * R,
                    R,
                    geo,
                    K,
                    V,
                )

    @gluon.jit
    def _gather_rows(
        self,
        k_buf,
        k1_buf,
        v_buf,
        v1_buf,
        w: WorkItem,
        t,
        r0,
        R: gl.constexpr,
        geo: Geometry,
        K: gl.constexpr,
        V: gl.constexpr,
    ):
        """:meth:`gather` of rows [r0, r0 + R) of the tile into buffers of R rows."""
        LD: gl.constexpr = _chunk_layout(geo.DQ0, geo.VEC, geo.LOAD_WARPS)
        k_off, v_off, ok = self.rows(w, t, r0, R, geo, LD)
        if K:
            _copy_cols(self.K, k_buf, k_off, ok, 0, geo.DQ0, LD)
            if geo.DQ1 > 0:
                LD1: gl.constexpr = _chunk_layout(geo.DQ1, geo.VEC, geo.LOAD_WARPS)
                k1_off, _, ok1 = self.rows(w, t, r0, R, geo, LD1)
                _copy_cols(self.K, k1_buf, k1_off, ok1, geo.DQ0, geo.DQ1, LD1)
        if not V:
            pass
        elif geo.DV0 == geo.DQ0:  # (the same rows: their offsets once)
            _copy_cols(self.V, v_buf, v_off, ok, 0, geo.DV0, LD)
        else:
            LDV: gl.constexpr = _chunk_layout(geo.DV0, geo.VEC, geo.LOAD_WARPS)
            _, vv_off, okv = self.rows(w, t, r0, R, geo, LDV)
            _copy_cols(self.V, v_buf, vv_off, okv, 0, geo.DV0, LDV)
        if geo.DV1 > 0 and V:
            LDV1: gl.constexpr = _chunk_layout(geo.DV1, geo.VEC, geo.LOAD_WARPS)
            _, v1_off, okv1 = self.rows(w, t, r0, R, geo, LDV1)
            _copy_cols(self.V, v1_buf, v1_off, okv1, geo.DV0, geo.DV1, LDV1)


@gluon.constexpr_function
def _pass_rows(block_n, warps):
    """Rows a gather pass copies: the tile's with four load warps or more, a share of it with fewer."""
    return block_n if warps >= 4 else block_n * warps // 4


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
    as bulk-tensor copies of [64 / GROUP, GROUP, QB] boxes of the 3-D view [tokens, heads, Dqk] of
    q, once every consumer is past round r-1's last QK GEMM (``empty``); they complete on
    ``full``. A box is a QB-column tile of a slot (rows of up to 128 bytes, the same swizzled bytes
    as a 2-D box). Rows past the sequence read other tokens or zeros (past q's end); their results are never
    stored. An item without key tiles is signalled without copies (no consumer reads its Q)."""
    DQ0: gl.constexpr = geo.DQ0
    DQ1: gl.constexpr = geo.DQ1
    GROUP: gl.constexpr = geo.GROUP
    BITS: gl.constexpr = slots.q.dtype.primitive_bitwidth
    QB: gl.constexpr = min(DQ0, 1024 // BITS)  # (a box's columns: rows of at most 128 bytes)
    mbarrier.wait(slots.empty, (r & 1) ^ 1)  # (also for empty items: no phase may run ahead)
    if w.n_tiles == 0:
        mbarrier.arrive(slots.full)
    else:
        mbarrier.expect(slots.full, geo.NC * 64 * (DQ0 + DQ1) * BITS // 8)
        for ci in gl.static_range(geo.NC):
            tok = w.q_start + (w.row0 + ci * 64) // GROUP
            for h in gl.static_range(DQ0 // QB):
                dst = q_rows(slots.q, slots.q3, ci * 64, 64).slice(h * QB, QB, dim=1)
                dst = dst._reinterpret(slots.q.dtype, [64 // GROUP, GROUP, QB], q_desc.layout)
                tma.async_copy_global_to_shared(q_desc, [tok, w.kv_head * GROUP, h * QB], slots.full, dst)
            for h in gl.static_range(DQ1 // QB):  # (Dqk > 128: columns past 128 into q1)
                dst = q_rows(slots.q1, slots.q13, ci * 64, 64).slice(h * QB, QB, dim=1)
                dst = dst._reinterpret(slots.q.dtype, [64 // GROUP, GROUP, QB], q_desc.layout)
                tma.async_copy_global_to_shared(q_desc, [tok, w.kv_head * GROUP, DQ0 + h * QB], slots.full, dst)


@gluon.constexpr_function
def _pages_layout(nb, warps):
    """A tile's ``nb`` box page ids, every load thread holding all of them."""
    return gl.BlockedLayout([nb], [32], [warps], [0])


@gluon.jit
def _tile_pages(src: KVSource, w: WorkItem, t, geo: Geometry, MASKED: gl.constexpr):
    """Paged TMA: the page ids of key tile t's boxes (PAGE_BOX rows each) in one load, every load
    thread holding all of them (one load latency a tile, not one a box), clamped into the cache;
    MASKED: boxes at or past kv_len (a tile that may be the gathered one) read as page 0."""
    NB: gl.constexpr = geo.BLOCK_N // geo.PAGE_BOX
    pos = t * geo.BLOCK_N + gl.arange(0, NB, _pages_layout(NB, geo.TMA_WARPS)) * geo.PAGE_BOX
    if MASKED:
        ids = gl.load(w.BT_row + pos // geo.PAGE_SIZE, mask=pos < w.kv_len, other=0)
    else:
        ids = gl.load(w.BT_row + pos // geo.PAGE_SIZE)
    return gl.minimum(gl.maximum(ids, 0), src.num_pages - 1)


@gluon.jit
def _tma_tile(
    bufs,
    idx,
    bar,
    src: KVSource,
    w: WorkItem,
    t,
    ids,
    k_desc,
    k1_desc,
    v_desc,
    v1_desc,
    geo: Geometry,
    K: gl.constexpr,
    V: gl.constexpr,
):
    """Bulk-tensor copies of key tile t (wholly below kv_len) into slot ``idx`` of ``bufs`` (a
    :class:`KVRing` or :class:`Staging`): its K (K) and V (V) rows, PAGE_BOX rows a box (one box
    never crosses a page; paged: the boxes' page ids ``ids``, from :func:`_tile_pages`), completing on
    ``bar`` (its byte count set by the caller)."""
    k_buf = bufs.k.index(idx)
    k1_buf = bufs.k1.index(idx)
    v_buf = bufs.v.index(idx)
    v1_buf = bufs.v1.index(idx)
    PAGE_SIZE: gl.constexpr = geo.PAGE_SIZE
    PAGE_BOX: gl.constexpr = geo.PAGE_BOX
    NB: gl.constexpr = geo.BLOCK_N // PAGE_BOX
    box = gl.arange(0, NB, _pages_layout(NB, geo.TMA_WARPS))
    for p in gl.static_range(NB):
        pos = t * geo.BLOCK_N + p * PAGE_BOX
        if PAGE_SIZE == 0:
            k_row = w.k_start + pos
            v_row = w.v_start + pos
        else:
            page = gl.sum(gl.where(box == p, ids, 0), axis=0)
            k_row = page * src.k_page_rows + pos % PAGE_SIZE
            v_row = page * src.v_page_rows + pos % PAGE_SIZE
        kr, kc = _tma_coords(k_row, w.kv_head, src.k_head_off, geo.K_HEAD_ROWS)
        vr, vc = _tma_coords(v_row, w.kv_head, src.v_head_off, geo.V_HEAD_ROWS)
        if K:
            tma.async_copy_global_to_shared(k_desc, [kr, kc], bar, k_buf.slice(p * PAGE_BOX, PAGE_BOX))
            if geo.DQ1 > 0:
                tma.async_copy_global_to_shared(k1_desc, [kr, kc + geo.DQ0], bar, k1_buf.slice(p * PAGE_BOX, PAGE_BOX))
        v_dst = v_buf.slice(p * PAGE_BOX, PAGE_BOX)
        if not V:
            pass
        elif geo.DVO > 128:  # (V's TMA boxes are 128 columns wide: side by side)
            for h in gl.static_range(geo.DVO // 128):
                tma.async_copy_global_to_shared(v_desc, [vr, vc + h * 128], bar, v_dst.slice(h * 128, 128, dim=1))
        else:
            tma.async_copy_global_to_shared(v_desc, [vr, vc], bar, v_dst)
        if geo.DV1 > 0 and V:
            tma.async_copy_global_to_shared(v1_desc, [vr, vc + geo.DV0], bar, v1_buf.slice(p * PAGE_BOX, PAGE_BOX))


@gluon.jit
def _stage(stg: Staging, slot, src: KVSource, w: WorkItem, t, k_desc, k1_desc, v_desc, v1_desc, geo: Geometry):
    """KV8: start key tile t's 8-bit K/V (F8: V) on their way into staging slot ``slot``: TMA boxes for a tile
    wholly below kv_len, else a zero-filling cp.async gather (TMA mode: committed as a group that
    :func:`_staged` waits for; otherwise each thread's copies arrive on the slot's barrier)."""
    bar = stg.full.index(slot)
    if geo.USE_TMA and (t + 1) * geo.BLOCK_N <= w.kv_len:
        _stage_boxes(stg, slot, src, w, t, k_desc, k1_desc, v_desc, v1_desc, geo)
    else:
        src.gather(
            stg.k.index(slot), stg.k1.index(slot), stg.v.index(slot), stg.v1.index(slot), w, t, geo, not geo.F8, True
        )
        if geo.USE_TMA:
            async_copy.commit_group()
        else:
            async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _stage_boxes(stg: Staging, slot, src: KVSource, w: WorkItem, t, k_desc, k1_desc, v_desc, v1_desc, geo: Geometry):
    """:func:`_stage` of a tile wholly below kv_len: its TMA boxes, completing on the slot's barrier."""
    bar = stg.full.index(slot)
    if geo.F8:  # (V only)
        mbarrier.expect(bar, geo.BLOCK_N * geo.DVO)
    else:
        mbarrier.expect(bar, geo.BLOCK_N * (geo.DQ0 + geo.DQ1 + geo.DVO))
    ids = t
    if geo.PAGE_SIZE > 0:
        ids = _tile_pages(src, w, t, geo, False)
    _tma_tile(stg, slot, bar, src, w, t, ids, k_desc, k1_desc, v_desc, v1_desc, geo, not geo.F8, True)


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


@gluon.constexpr_function
def _transpose_layout(CH, DV0, LOAD_WARPS):
    """The registers of a [CH keys, DV0 columns] 8-bit V chunk as :func:`_transpose_v` moves it: a
    thread holds 4 consecutive columns (4-byte ``ldmatrix`` rows) of keys e + 8i + 32a (e, i, a in
    registers; key 32 on a warp where the warps outnumber the column groups of 16); lanes take
    columns 4c (c: 2 bits), keys 2j (j: 2 bits) and key 16; warps, then registers, the columns from
    16 on. A 4-byte store then writes 4 keys of one column, and its 8 groups of 4 lanes (j) write
    16-byte chunks that the ring's swizzle (64 bytes for 64-key tiles, 128 for 128-key ones) spreads
    over 4 of a bank line's 8 chunks: 2-way conflicts (8 lanes along the columns, as a blocked layout
    has them, met in 2 chunks: 4-way; 32-key tiles' 32-byte rows: 4-way), and the ``ldmatrix`` rows
    2-way (keys 16 apart take the same chunk of the staging's 128-byte swizzle). The same elements
    in keys-first register order (one 16-byte store per column) measured slower
    (``docs/decisions.md``)."""
    assert CH in (32, 64) and DV0 >= 16 * LOAD_WARPS // (2 if CH == 64 else 1)
    reg = [[0, 1], [0, 2], [1, 0], [8, 0]]
    lane = [[0, 4], [0, 8], [2, 0], [4, 0], [16, 0]]
    warp = []
    col = 16
    key5 = CH == 64
    for _ in range(LOAD_WARPS.bit_length() - 1):
        if col < DV0:
            warp.append([0, col])
            col *= 2
        else:
            warp.append([32, 0])
            key5 = False
    if key5:
        reg.append([32, 0])
    while col < DV0:
        reg.append([0, col])
        col *= 2
    return gl.DistributedLinearLayout(reg, lane, warp, [], [CH, DV0])


@gluon.jit
def _transpose_v(src_buf, dst_buf, geo: Geometry):
    """F8: the 8-bit V tile in src_buf ([BLOCK_N, DV0], as it arrived) -> dst_buf ([DV0, BLOCK_N]),
    its keys in the PV GEMM's operand order (key 32a + 16h + 8i + 2j + e at 32a + 16h + 4j + 2i + e:
    see :func:`.consumer._a_operand`), 64 keys (32 at 32-key tiles) at a time through registers
    (:func:`_transpose_layout`):
    4-byte loads along the columns, and 4-byte stores along the keys, which that order makes
    consecutive."""
    DV0: gl.constexpr = geo.DV0
    CH: gl.constexpr = min(geo.BLOCK_N, 64)
    L: gl.constexpr = _transpose_layout(CH, DV0, geo.LOAD_WARPS)
    for r in gl.static_range(geo.BLOCK_N // CH):
        x = src_buf.slice(r * CH, CH).load(L)
        x = gl.reshape(gl.permute(gl.reshape(x, [CH // 32, 2, 2, 4, 2, DV0]), (0, 1, 3, 2, 4, 5)), [CH, DV0])
        dst_buf.slice(r * CH, CH, dim=1).store(gl.permute(x, (1, 0)))


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
def _widen_staged(stg: Staging, n, w: WorkItem, t, ring: KVRing, s, geo: Geometry):
    """KV8: the load warps' n-th tile (key tile t of item w), once landed in its staging slot
    (:func:`_staged`), widened into ring stage s and signalled (a group sync, then one arrive)."""
    _staged(stg, n, w, t, geo)
    _widen(stg, n % geo.S8, ring, s, geo)
    fence_async_shared()  # (the widened tiles' generic writes before the consumers' wgmma)
    mbarrier.arrive(ring.full.index(s))


@gluon.jit
def _load_span(sched: Schedule, w: WorkItem, geo: Geometry):
    """Item w's first key tile to load and how many from there (a share's first tile; with a window,
    tiles wholly below every row's window are never loaded)."""
    t_lo = w.t0
    if geo.WINDOW:
        t_win, _ = _window_range(w.row0, w.q_len, w.kv_len, w.n_tiles, sched.window, geo.BLOCK_M, geo)
        t_lo = gl.maximum(t_win, t_lo)
    return t_lo, w.n_tiles - t_lo


@gluon.jit
def _tma_kv(
    ring: KVRing, s, v_phase, src: KVSource, w: WorkItem, t, ids, k_desc, k1_desc, v_desc, v1_desc, geo: Geometry
):
    """16-bit K/V: key tile t (wholly below kv_len) into ring stage s by TMA, once the stage is free
    (the caller waited for it; SPLIT: K on barrier s, V on STAGES + s once V's slot is free too,
    ``v_phase`` being its empty barrier's phase)."""
    STAGES: gl.constexpr = geo.STAGES
    BLOCK_N: gl.constexpr = geo.BLOCK_N
    if geo.SPLIT:
        mbarrier.expect(ring.full.index(s), 2 * BLOCK_N * (geo.DQ0 + geo.DQ1))
        _tma_tile(ring, s, ring.full.index(s), src, w, t, ids, k_desc, k1_desc, v_desc, v1_desc, geo, True, False)
        mbarrier.wait(ring.empty.index(STAGES + s), v_phase)
        mbarrier.expect(ring.full.index(STAGES + s), 2 * BLOCK_N * geo.DVO)
        _tma_tile(
            ring, s, ring.full.index(STAGES + s), src, w, t, ids, k_desc, k1_desc, v_desc, v1_desc, geo, False, True
        )
    else:
        mbarrier.expect(ring.full.index(s), 2 * BLOCK_N * (geo.DQ0 + geo.DQ1 + geo.DVO))
        _tma_tile(ring, s, ring.full.index(s), src, w, t, ids, k_desc, k1_desc, v_desc, v1_desc, geo, True, True)


@gluon.jit
def _gather_tail(ring: KVRing, s, v_phase, src: KVSource, w: WorkItem, t, geo: Geometry):
    """16-bit K/V by TMA: key tile t, the one across kv_len, gathered into ring stage s by cp.async
    (rows past the keys zero-filled, so stale cache slots never reach the PV GEMM) and signalled once
    every copy of the calling partition landed (SPLIT: once V's slot is free too)."""
    if geo.SPLIT:  # (the tile's K and V gathered together)
        mbarrier.wait(ring.empty.index(geo.STAGES + s), v_phase)
    src.gather(ring.k.index(s), ring.k1.index(s), ring.v.index(s), ring.v1.index(s), w, t, geo, True, True)
    async_copy.commit_group()
    async_copy.wait_group(0)
    # (the gathered tile's generic writes before the consumers' wgmma: with TMA tiles the consumers do
    # not fence. Every thread fences its own copies, then the group syncs before the one elected
    # arrive: Triton's barrier after the wait would otherwise stand before the fences, and the
    # arrive's own sync is then left out)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ring.full.index(s))
    if geo.SPLIT:
        mbarrier.arrive(ring.full.index(geo.STAGES + s))


@gluon.jit
def _gather_partition(sched: Schedule, ring: KVRing, stg: Staging, slots: QSlots, src: KVSource, q_desc, geo: Geometry):
    """ISSUER: these load warps gather each item's tile across kv_len (only an item's last tile can
    cross it; :func:`_load_partition`, on one warp, issues the rest), following the items as the
    consumers do. The issuing warp hands them every item once it waited for the stage of the item's
    last tile (``KVRing.tail_go``). They never wait on the stages' empty barriers themselves: such a
    wait tests a phase's parity only, and where no item ends on a gathered tile nothing keeps the
    consumers within two phases of these warps (a wait left an even number of phases behind blocks
    for good once the consumers are done).

    KV8: they widen every tile instead (:func:`_widen_partition`)."""
    if geo.KV8:
        _widen_partition(sched, ring, stg, slots, src, q_desc, geo)
    else:
        _tail_partition(sched, ring, src, geo)


@gluon.jit
def _widen_partition(sched: Schedule, ring: KVRing, stg: Staging, slots: QSlots, src: KVSource, q_desc, geo: Geometry):
    """ISSUER with KV8: the program's c-th key tile, once its ring stage is free and its staging slot
    c % S8 filled (by the issuing warp's TMA boxes; the tile across kv_len these warps gather
    themselves, into the slot they released last), widened into the stage; the slot then goes back
    to the issuing warp (``Staging.empty``). Each item's Q goes out from here, ordered by the ring's
    empty waits as :func:`_load_partition` orders it."""
    STAGES: gl.constexpr = geo.STAGES
    S8: gl.constexpr = geo.S8
    c = gl.program_id(0) * 0
    r = gl.program_id(0) * 0
    item = sched.take(r, geo.LOAD_WARPS)
    while sched.more(item, r):
        w = sched.work_item(item, geo, False)
        t_lo, n_load = _load_span(sched, w, geo)
        q_at = 0  # (at the item's first tile, as on every 8-bit path: see _load_partition)
        for i in range(n_load):
            t = t_lo + i
            n = c + i
            s = n % STAGES
            slot = n % S8
            mbarrier.wait(ring.empty.index(s), ((n // STAGES) & 1) ^ 1)
            if geo.Q_TMA:
                if i == q_at:
                    _issue_q(q_desc, slots, w, r, geo)
            if (t + 1) * geo.BLOCK_N > w.kv_len:  # (the slot's last tile was widened here: it is free)
                src.gather(
                    stg.k.index(slot), stg.k1.index(slot), stg.v.index(slot), stg.v1.index(slot), w, t, geo, True, True
                )
                async_copy.commit_group()
            _widen_staged(stg, n, w, t, ring, s, geo)
            mbarrier.arrive(stg.empty.index(slot))
        if geo.Q_TMA:
            if q_at == n_load:
                _issue_q(q_desc, slots, w, r, geo)
        c += n_load
        r += 1
        item = sched.take(r, geo.LOAD_WARPS)


@gluon.jit
def _tail_partition(sched: Schedule, ring: KVRing, src: KVSource, geo: Geometry):
    """ISSUER with 16-bit K/V: :func:`_gather_partition`'s gather of each item's tile across kv_len."""
    STAGES: gl.constexpr = geo.STAGES
    c = gl.program_id(0) * 0
    r = gl.program_id(0) * 0
    item = sched.take(r, geo.LOAD_WARPS)
    while sched.more(item, r):
        w = sched.work_item(item, geo, False)
        t_lo, n_load = _load_span(sched, w, geo)
        hs = r % ITEM_RING
        mbarrier.wait(ring.tail_go.index(hs), (r // ITEM_RING) & 1)
        mbarrier.arrive(ring.tail_done.index(hs))
        t = t_lo + n_load - 1
        if (n_load > 0) & ((t + 1) * geo.BLOCK_N > w.kv_len):
            n = c + n_load - 1
            _gather_tail(ring, n % STAGES, ((n // STAGES) & 1) ^ 1, src, w, t, geo)
        c += n_load
        r += 1
        item = sched.take(r, geo.LOAD_WARPS)


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
    being widened; the load warps widen each tile into its ring stage and signal it (count 1).

    F8: K's copies go straight into the ring as above; V's go into staging like KV8's, and the load
    warps transpose each tile into its ring stage and arrive once more (count + 1).

    ISSUER (16-bit K/V by TMA): this partition is one warp, which claims the items and issues every
    TMA copy with no partition-wide barrier between copies (load warps in step pay one before each:
    Triton's shared-memory barrier analysis) and no box arithmetic repeated on other warps; the tile
    across kv_len is :func:`_gather_partition`'s, handed over once its stage is free.

    ISSUER with KV8: this one warp claims the items and issues the TMA boxes of every tile wholly below
    kv_len into the staging slots (:func:`_stage_partition`); :func:`_widen_partition` does the rest."""
    if geo.ISSUER and geo.KV8:
        _stage_partition(sched, stg, src, k_desc, k1_desc, v_desc, v1_desc, geo)
    else:
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
                sched.post(item, r, geo.TMA_WARPS)
            w = sched.work_item(item, geo, False)
            t_lo, n_load = _load_span(sched, w, geo)
            # (Q_TMA: the item's Q goes out once its tile STAGES - 2 has a stage: the consumers have then
            # released the tile two before it, so when the last item had >= 2 tiles they are past its last
            # QK GEMM; with O_STAGE they hand the slots back only after the last item's epilogue read O
            # from them, so the empty wait may wait for that; or after the item's last tile. SPLIT releases
            # K a tile earlier, so that stage no longer implies the last QK GEMM is done: _issue_q's own
            # wait on the slots' empty barrier is what guards Q, here as everywhere. The 8-bit paths issue
            # it at the item's first tile: their consumers, behind load warps that widen or transpose
            # each tile, waited for Q at an item's start, and the earlier copy measured faster there)
            if geo.KV8 or geo.F8:
                q_at = 0
            else:
                q_at = gl.minimum(n_load, STAGES - 2)
            if geo.KV8 or geo.F8:  # (the item's first S8 - 1 tiles into staging; the slots' last tiles are widened)
                for j in gl.static_range(S8 - 1):
                    if j < n_load:
                        _stage(stg, (c + j) % S8, src, w, t_lo + j, k_desc, k1_desc, v_desc, v1_desc, geo)
            for i in range(n_load):
                t = t_lo + i
                s = (c + i) % STAGES
                if geo.KV8 or geo.F8:  # (slot (c + i - 1) % S8: widened in the last step, which ended in a group sync)
                    if i + S8 - 1 < n_load:
                        nxt = c + i + S8 - 1
                        _stage(stg, nxt % S8, src, w, t + S8 - 1, k_desc, k1_desc, v_desc, v1_desc, geo)
                ids = t
                # (16-bit K/V: the tile's page ids loaded before the wait, their latency under it; on the
                # 8-bit paths, bound by their load warps, loading them after it measured faster: decisions.md)
                if geo.USE_TMA and geo.PAGE_SIZE > 0 and not (geo.KV8 or geo.F8):
                    ids = _tile_pages(src, w, t, geo, True)
                mbarrier.wait(ring.empty.index(s), (((c + i) // STAGES) & 1) ^ 1)
                if geo.Q_TMA:
                    if i == q_at:
                        _issue_q(q_desc, slots, w, r, geo)
                if geo.KV8:
                    _widen_staged(stg, c + i, w, t, ring, s, geo)
                elif geo.F8:  # K straight into the ring (as for 16-bit K/V), then V transposed from staging
                    if not geo.USE_TMA:
                        src.gather(
                            ring.k.index(s), ring.k1.index(s), ring.v.index(s), ring.v1.index(s), w, t, geo, True, False
                        )
                        async_copy.mbarrier_arrive(ring.full.index(s), increment_count=False)
                    elif (t + 1) * BLOCK_N <= w.kv_len:
                        mbarrier.expect(ring.full.index(s), BLOCK_N * (DQ0 + DQ1))
                        k_ids = t
                        if geo.PAGE_SIZE > 0:
                            k_ids = _tile_pages(src, w, t, geo, False)
                        _tma_tile(
                            ring,
                            s,
                            ring.full.index(s),
                            src,
                            w,
                            t,
                            k_ids,
                            k_desc,
                            k1_desc,
                            v_desc,
                            v1_desc,
                            geo,
                            True,
                            False,
                        )
                    else:
                        src.gather(
                            ring.k.index(s), ring.k1.index(s), ring.v.index(s), ring.v1.index(s), w, t, geo, True, False
                        )
                        async_copy.commit_group()
                        async_copy.wait_group(0)
                        mbarrier.arrive(ring.full.index(s))
                    _staged(stg, c + i, w, t, geo)
                    _transpose_v(stg.v.index((c + i) % S8), ring.v.index(s), geo)
                    fence_async_shared()  # (V's generic writes before the consumers' wgmma)
                    mbarrier.arrive(ring.full.index(s))
                elif geo.USE_TMA:
                    v_empty_phase = (((c + i) // STAGES) & 1) ^ 1
                    if (t + 1) * BLOCK_N <= w.kv_len:
                        _tma_kv(ring, s, v_empty_phase, src, w, t, ids, k_desc, k1_desc, v_desc, v1_desc, geo)
                    elif not geo.ISSUER:  # (ISSUER: the gather warps' tile; 128-key tiles are the load warps')
                        _gather_tail(ring, s, v_empty_phase, src, w, t, geo)
                else:
                    src.gather(
                        ring.k.index(s), ring.k1.index(s), ring.v.index(s), ring.v1.index(s), w, t, geo, True, True
                    )
                    async_copy.mbarrier_arrive(ring.full.index(s), increment_count=False)
            if geo.ISSUER:  # (the stage of the item's last tile is free: the gather warps may fill it)
                hs = r % ITEM_RING
                mbarrier.wait(ring.tail_done.index(hs), ((r // ITEM_RING) & 1) ^ 1)
                mbarrier.arrive(ring.tail_go.index(hs))
            if geo.Q_TMA:
                if q_at == n_load:
                    _issue_q(q_desc, slots, w, r, geo)
            c += n_load
            r += 1
            item = sched.claim(r)
        if sched.dynamic != 0:  # (item >= total: the consumers' and gather warps' stop)
            sched.reset(item)
            sched.post(item, r, geo.TMA_WARPS)


@gluon.jit
def _stage_partition(sched: Schedule, stg: Staging, src: KVSource, k_desc, k1_desc, v_desc, v1_desc, geo: Geometry):
    """ISSUER with KV8 (one warp): the program's c-th key tile into staging slot c % S8 by TMA boxes
    once the widening warps released the slot's last tile; the tile across kv_len is theirs to gather."""
    S8: gl.constexpr = geo.S8
    c = gl.program_id(0) * 0
    r = gl.program_id(0) * 0
    item = sched.claim(r)
    while sched.more(item, r):
        if sched.dynamic != 0:
            sched.post(item, r, geo.TMA_WARPS)
        w = sched.work_item(item, geo, False)
        t_lo, n_load = _load_span(sched, w, geo)
        for i in range(n_load):
            t = t_lo + i
            if (t + 1) * geo.BLOCK_N <= w.kv_len:
                n = c + i
                slot = n % S8
                mbarrier.wait(stg.empty.index(slot), ((n // S8) & 1) ^ 1)
                _stage_boxes(stg, slot, src, w, t, k_desc, k1_desc, v_desc, v1_desc, geo)
        c += n_load
        r += 1
        item = sched.claim(r)
    if sched.dynamic != 0:  # (item >= total: the consumers' and widening warps' stop)
        sched.reset(item)
        sched.post(item, r, geo.TMA_WARPS)
