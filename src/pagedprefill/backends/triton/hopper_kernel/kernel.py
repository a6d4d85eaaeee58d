"""The kernel's entry: shared memory, barriers and the warp-specialised partitions."""

# (no ``from __future__ import annotations``: Gluon aggregates check their fields' annotations)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .buffers import KVRing, QSlots, Staging, _layout
from .consumer import OutSink, _consumer_partition
from .geometry import Geometry
from .loads import KVSource, _gather_partition, _load_partition
from .merge import PART_OFFSET
from .rows import sequence_rows
from .schedule import ITEM_RING, Schedule

# the device vectors a run with device lengths reads in place of the table (VECTORS), and their bounds
VECTOR_ARGS = ("LQ", "LKV", "OQ", "OO", "OK", "OV", "OS", "IP", "LP")
BOUND_ARGS = (
    "max_q",
    "max_kv",
    "rows_q",
    "rows_o",
    "rows_k",
    "rows_v",
    "lse_rows",
    "table_width",
    "table_stride",
    "num_indices",
    "lse_b_stride",
)


@gluon.jit(
    do_not_specialize=[
        "meta_stride",
        "batch_size",
        "num_m_blocks",
        "num_pages",
        "chunk_pairs",
        "dynamic",
        "window",
        "tail_base",
        "shares",
        *BOUND_ARGS,
    ],
    do_not_specialize_on_alignment=["BT", "LSE", "COUNTER", "SINKS", "Q_SCALE", "K_SCALE", "V_SCALE", *VECTOR_ARGS],
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
    Q_SCALE,
    K_SCALE,
    V_SCALE,
    tail_base,
    shares,
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
    lse_b_stride,
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
    STAGING: gl.constexpr,
    F8: gl.constexpr,
    Q_SCALED: gl.constexpr,
    K_SCALED: gl.constexpr,
    V_SCALED: gl.constexpr,
    SPLIT: gl.constexpr,
    ROWSUM: gl.constexpr,
    ISSUER: gl.constexpr,
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
    MERGED: gl.constexpr,
    num_warps: gl.constexpr,
):
    """LOAD_WARPS load warps feed NC consumer warpgroups of 64 rows each; the kernel's own num_warps are
    the first consumer partition (4 warps, or with MERGED 8: the first two warpgroups). The
    ``num_kv_heads * batch_size * num_m_blocks`` work items are dealt to a persistent grid (see
    :class:`Schedule`), those from ``tail_base`` on as ``shares`` pieces each; COUNTER is the stream's
    work counter (``dynamic``: zero at the launch, and zero again when it ends), or the backend's
    scratch, where the pieces' partials lie (from float32 element 64 on). ``VECTORS``: each sequence's
    lengths and starts come from the device vectors LQ .. LP under the bounds after them (see
    :class:`.rows.SequenceRows`; the modes CSR, HAS_OO, HAS_OV, LSE_MODE and the offsets' units UNIT_*),
    not from META; without it those arguments are None."""
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
        STAGING > 0 and not F8,
        F8,
        STAGING,
        Q_SCALED,
        K_SCALED,
        V_SCALED,
        SPLIT,
        ROWSUM,
        ISSUER,
        MERGED,
    )
    gl.static_assert(not ISSUER or (USE_TMA and not F8), "ISSUER needs 16-bit or widened 8-bit K/V by TMA")
    dtype: gl.constexpr = Q.dtype.element_ty
    # (rows swizzled over their bytes, at most 128: 16-bit 32-column parts and 8-bit 64-column tiles
    # take 64; the host's TMA descriptors use the same)
    SMEM: gl.constexpr = _layout(geo.DQ0, dtype.primitive_bitwidth)
    SMEM1: gl.constexpr = _layout(geo.DQ1, dtype.primitive_bitwidth)
    SMEMV1: gl.constexpr = _layout(geo.DV1, dtype.primitive_bitwidth)

    # the GEMMs' inputs: q's dtype; with 8-bit K/V float16 (see _prep_q)
    cdt: gl.constexpr = gl.float16 if geo.KV8 else dtype
    q_smem = gl.allocate_shared_memory(dtype, [min(NC, 2) * geo.SUB_M, geo.DQ0], SMEM)  # (see QSlots)
    if NC == 3:
        q3_smem = gl.allocate_shared_memory(dtype, [geo.SUB_M, geo.DQ0], SMEM)
    else:  # (unused)
        q3_smem = q_smem
    k_smem = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, geo.DQ0], SMEM)
    if F8:  # V transposed (keys contiguous): 8-bit wgmmas take K-major B operands only
        v_smem = gl.allocate_shared_memory(cdt, [STAGES, geo.DV0, BLOCK_N], _layout(BLOCK_N, 8))
    else:
        v_smem = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, geo.DV0], SMEM)
    if geo.DQ1 > 0:
        q1_smem = gl.allocate_shared_memory(dtype, [min(NC, 2) * geo.SUB_M, geo.DQ1], SMEM1)
        if NC == 3:
            q13_smem = gl.allocate_shared_memory(dtype, [geo.SUB_M, geo.DQ1], SMEM1)
        else:  # (unused)
            q13_smem = q1_smem
        k1_smem = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, geo.DQ1], SMEM1)
    else:  # (unused)
        q1_smem = q_smem
        q13_smem = q_smem
        k1_smem = k_smem
    if geo.DV1 > 0:
        v1_smem = gl.allocate_shared_memory(cdt, [STAGES, BLOCK_N, geo.DV1], SMEMV1)
    else:  # (unused)
        v1_smem = v_smem
    # (SPLIT: V's barriers after K's; only the 16-bit TMA path fills them)
    gl.static_assert(not SPLIT or (USE_TMA and STAGING == 0 and not F8), "SPLIT needs 16-bit K/V by TMA")
    NBAR: gl.constexpr = 2 * STAGES if SPLIT else STAGES
    kv_full = gl.allocate_shared_memory(gl.int64, [NBAR, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NBAR, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBAR):
        # (F8: K's copies, as for 16-bit K/V, and one more arrive once V is transposed)
        mbarrier.init(kv_full.index(i), count=(1 if (USE_TMA or geo.KV8) else LOAD_WARPS * 32) + (1 if F8 else 0))
        mbarrier.init(kv_empty.index(i), count=NC * 128)  # (every consumer thread: see consumer._release)
    if STAGING > 0:  # (8-bit tiles in the copies' own layouts: rows of 32, 64 or >= 128 bytes; F8: V only)
        kv_dt: gl.constexpr = K.dtype.element_ty
        st_v = gl.allocate_shared_memory(kv_dt, [STAGING, BLOCK_N, geo.DV0], _layout(geo.DV0, 8))
        if F8:  # (unused)
            st_k = st_v
        else:
            st_k = gl.allocate_shared_memory(kv_dt, [STAGING, BLOCK_N, geo.DQ0], _layout(geo.DQ0, 8))
        if geo.DQ1 > 0 and not F8:
            st_k1 = gl.allocate_shared_memory(kv_dt, [STAGING, BLOCK_N, geo.DQ1], _layout(geo.DQ1, 8))
        else:
            st_k1 = st_k
        if geo.DV1 > 0:
            st_v1 = gl.allocate_shared_memory(kv_dt, [STAGING, BLOCK_N, geo.DV1], _layout(geo.DV1, 8))
        else:
            st_v1 = st_v
        st_full = gl.allocate_shared_memory(gl.int64, [STAGING, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGING):
            mbarrier.init(st_full.index(i), count=1 if USE_TMA else LOAD_WARPS * 32)
        if ISSUER:  # (the widening warps hand each slot back to the issuing warp)
            st_empty = gl.allocate_shared_memory(gl.int64, [STAGING, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGING):
                mbarrier.init(st_empty.index(i), count=1)
        else:  # (unused)
            st_empty = st_full
    else:  # (unused)
        st_k = k_smem
        st_k1 = k_smem
        st_v = v_smem
        st_v1 = v_smem
        st_full = kv_full
        st_empty = kv_full
    if geo.KV8:  # (a 1-D buffer of a power of two elements, sliced per consumer)
        q_f = gl.allocate_shared_memory(gl.float32, [4 * geo.SUB_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:  # (unused)
        q_f = kv_full
    # dynamic != 0: items come off the work counter; the load warps hand them to the consumers
    # through a ring of item ids (ITEM_RING slots, with full and empty barriers)
    item_ids = gl.allocate_shared_memory(gl.int32, [ITEM_RING, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_full = gl.allocate_shared_memory(gl.int64, [ITEM_RING, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [ITEM_RING, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(ITEM_RING):
        mbarrier.init(item_full.index(i), count=1)
        # (ISSUER: the gather warps read it too)
        mbarrier.init(item_empty.index(i), count=geo.NP + (1 if ISSUER else 0))
    # ISSUER with 16-bit K/V: the issuing warp hands each item's tile across kv_len to the gather warps
    # (see KVRing)
    if ISSUER and STAGING == 0:
        tail_go = gl.allocate_shared_memory(gl.int64, [ITEM_RING, 1], mbarrier.MBarrierLayout())
        tail_done = gl.allocate_shared_memory(gl.int64, [ITEM_RING, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(ITEM_RING):
            mbarrier.init(tail_go.index(i), count=1)
            mbarrier.init(tail_done.index(i), count=1)
    else:  # (unused)
        tail_go = item_full
        tail_done = item_empty
    # Q_TMA: the load warps copy each item's Q (full, by bytes) once every consumer's last QK GEMM of
    # the item before is done (empty)
    if Q_TMA:
        q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_full, count=1)
        mbarrier.init(q_empty, count=geo.NP)
    else:  # (unused)
        q_full = kv_full.index(0)
        q_empty = kv_empty.index(0)
    if ROWSUM:  # the consumers' row sums: P times this block of ones, keys contiguous as K's are
        ONES_L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
        ones_v = gl.full([8, BLOCK_N], 1.0, gl.float32, ONES_L).to(cdt)
        ones = gl.allocate_shared_memory(cdt, [8, BLOCK_N], _layout(BLOCK_N, cdt.primitive_bitwidth), ones_v)
    else:  # (unused)
        ones = k_smem
    fence_async_shared()

    # ints specialised to 1 arrive as constexprs; partitions take tensors
    n_bh = gl.to_tensor(num_kv_heads) * batch_size
    tail_base_t = gl.to_tensor(tail_base)
    shares_t = gl.to_tensor(shares)
    total = tail_base_t + (n_bh * num_m_blocks - tail_base_t) * shares_t
    rows = sequence_rows(
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
        num_heads_q,
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
    )
    sched = Schedule(
        rows,
        BT,
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
        tail_base_t,
        shares_t,
        COUNTER.to(gl.pointer_type(gl.float32), bitcast=True) + PART_OFFSET,
    )
    ring = KVRing(k_smem, k1_smem, v_smem, v1_smem, kv_full, kv_empty, tail_go, tail_done)
    stg = Staging(st_k, st_k1, st_v, st_v1, st_full, st_empty)
    slots = QSlots(q_smem, q3_smem, q1_smem, q13_smem, q_full, q_empty, q_f, ones)
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
        Q_SCALE,
        K_SCALE,
        V_SCALE,
    )
    R0: gl.constexpr = 0
    R1: gl.constexpr = geo.SUB_M
    R2: gl.constexpr = 2 * geo.SUB_M
    W: gl.constexpr = geo.SUB_M  # (one warpgroup's rows)
    W2: gl.constexpr = 2 * geo.SUB_M
    # (ISSUER: the gather warps and the issuing warp share one warpgroup and its registers)
    if MERGED and NC == 3 and ISSUER:
        gl.warp_specialize(
            [
                (_consumer_partition, (sched, ring, slots, out, R0, W2, geo)),
                (_consumer_partition, (sched, ring, slots, out, R2, W, geo)),
                (_gather_partition, (sched, ring, stg, slots, src, q_desc, geo)),
                (_load_partition, (sched, ring, stg, slots, src, k_desc, k1_desc, v_desc, v1_desc, q_desc, geo)),
            ],
            [4, LOAD_WARPS, 1],
            [CONS_REGS, LOAD_REGS, LOAD_REGS],
        )
    elif MERGED and NC == 3:
        gl.warp_specialize(
            [
                (_consumer_partition, (sched, ring, slots, out, R0, W2, geo)),
                (_consumer_partition, (sched, ring, slots, out, R2, W, geo)),
                (_load_partition, (sched, ring, stg, slots, src, k_desc, k1_desc, v_desc, v1_desc, q_desc, geo)),
            ],
            [4, LOAD_WARPS],
            [CONS_REGS, LOAD_REGS],
        )
    elif MERGED and ISSUER:
        gl.warp_specialize(
            [
                (_consumer_partition, (sched, ring, slots, out, R0, W2, geo)),
                (_gather_partition, (sched, ring, stg, slots, src, q_desc, geo)),
                (_load_partition, (sched, ring, stg, slots, src, k_desc, k1_desc, v_desc, v1_desc, q_desc, geo)),
            ],
            [LOAD_WARPS, 1],
            [LOAD_REGS, LOAD_REGS],
        )
    elif MERGED:
        gl.warp_specialize(
            [
                (_consumer_partition, (sched, ring, slots, out, R0, W2, geo)),
                (_load_partition, (sched, ring, stg, slots, src, k_desc, k1_desc, v_desc, v1_desc, q_desc, geo)),
            ],
            [LOAD_WARPS],
            [LOAD_REGS],
        )
    elif NC == 2 and ISSUER:
        gl.warp_specialize(
            [
                (_consumer_partition, (sched, ring, slots, out, R0, W, geo)),
                (_consumer_partition, (sched, ring, slots, out, R1, W, geo)),
                (_gather_partition, (sched, ring, stg, slots, src, q_desc, geo)),
                (_load_partition, (sched, ring, stg, slots, src, k_desc, k1_desc, v_desc, v1_desc, q_desc, geo)),
            ],
            [4, LOAD_WARPS, 1],
            [CONS_REGS, LOAD_REGS, LOAD_REGS],
        )
    elif NC == 2:
        gl.warp_specialize(
            [
                (_consumer_partition, (sched, ring, slots, out, R0, W, geo)),
                (_consumer_partition, (sched, ring, slots, out, R1, W, geo)),
                (_load_partition, (sched, ring, stg, slots, src, k_desc, k1_desc, v_desc, v1_desc, q_desc, geo)),
            ],
            [4, LOAD_WARPS],
            [CONS_REGS, LOAD_REGS],
        )
    elif ISSUER:
        gl.warp_specialize(
            [
                (_consumer_partition, (sched, ring, slots, out, R0, W, geo)),
                (_consumer_partition, (sched, ring, slots, out, R1, W, geo)),
                (_consumer_partition, (sched, ring, slots, out, R2, W, geo)),
                (_gather_partition, (sched, ring, stg, slots, src, q_desc, geo)),
                (_load_partition, (sched, ring, stg, slots, src, k_desc, k1_desc, v_desc, v1_desc, q_desc, geo)),
            ],
            [4, 4, LOAD_WARPS, 1],
            [CONS_REGS, CONS_REGS, LOAD_REGS, LOAD_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_consumer_partition, (sched, ring, slots, out, R0, W, geo)),
                (_consumer_partition, (sched, ring, slots, out, R1, W, geo)),
                (_consumer_partition, (sched, ring, slots, out, R2, W, geo)),
                (_load_partition, (sched, ring, stg, slots, src, k_desc, k1_desc, v_desc, v1_desc, q_desc, geo)),
            ],
            [4, 4, LOAD_WARPS],
            [CONS_REGS, CONS_REGS, LOAD_REGS],
        )
