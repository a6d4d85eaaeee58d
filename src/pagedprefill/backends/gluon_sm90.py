"""Hopper (sm_90) attention kernel in Gluon, Triton's explicit-layout dialect.

Why Gluon: Triton 3.6 emits ``wgmma.wait_group 0`` right after every GEMM of the Triton kernel and
its automatic warp specialisation does not engage on it (``docs/triton_kernel.md``). Gluon exposes
``warpgroup_mma(is_async=True)`` / ``warpgroup_mma_wait(n)``, mbarriers and ``warp_specialize``.

A work item is ``BLOCK_M = 64 * consumers`` query rows of one sequence and one KV head; a row is a
(token, head-in-group) pair, GQA packing exactly as in ``triton_backend``. Items are ordered chunk
by chunk of ``Config.chunk`` (sequence, KV head) pairs, heaviest row block first within a chunk. A
persistent grid (one program per SM; ``Config.persistent``) takes them off a per-call work counter
as each program's load warps reach their next item (``Config.dynamic``, ``PrefillBatch.work_counter``;
the load warps pass the ids to the consumers through a small shared-memory ring), or deals them in
static rounds in snake order (``_round_item``; chunked prefill and prompts of <= 1024 tokens, where
that measured faster). Each program's warps are split (``gl.warp_specialize``):

* **load warps** (``load_warps``, few registers): for the program's key tile ``c`` (counted across
  its items) they wait until every consumer released stage ``c % stages`` (``kv_empty``), then fetch
  the tile's K and V rows: tiles wholly below ``kv_len`` as bulk-tensor (TMA) copies, one box per
  page, completing on ``kv_full``'s byte count (``Config.tma``, pages of >= 16 tokens and ragged
  K/V); otherwise a ``cp.async`` gather (page ids from the block table, clamped; any page size and
  page strides; rows past the tile's key range zero-filled) that arrives on ``kv_full`` when its
  copies land;
* **consumer warpgroups** (``consumers`` x 4 warps, 64 rows each): per item, take their Q rows
  in their own slot of shared memory (copied by the load warps' TMA, ``Config.q_tma``, or by their
  own ``cp.async``), then per tile ``j``: wait ``kv_full``, issue
  ``S_j = Q K_j^T`` as an asynchronous wgmma, rescale ``O`` for tile ``j - 1`` beside it, issue
  ``O += P_{j-1} V_{j-1}``, wait for ``S_j`` only, run the online softmax of tile ``j`` while the PV
  GEMM still runs, wait for it and release stage ``j - 1``. Consumers are not synchronised with
  each other, so one's softmax also overlaps another's GEMMs (``Config.pingpong`` makes them take
  turns; measured slower). On causal items each consumer walks only up to its own rows' diagonal
  and releases the rest of the item's tiles unread (``Config.own_rows``).

Lengths, offsets and page ids are read on the device (CUDA-graph safe, no host sync), every integer
that varies per call is ``do_not_specialize``, masks are evaluated only on tiles that cross the
causal diagonal or the end of the keys, rows without a visible key get out 0 and lse -inf.

Served (:func:`unavailable_reason`): sm_90, one 16-bit dtype for q/k/v, Dqk = Dvo in {64, 128} or
Dqk 192 / Dvo 128 (key columns in two parts, 128 + 64), a positive scale and no scale tensors,
q, K and V strides in multiples of 16 elements. ``triton_backend.use_gluon`` sends every such call
here unless split-KV is chosen; everything else takes the Triton kernel. Design notes and
measurements: ``docs/triton_kernel.md``.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, fields, replace

import torch

from pagedprefill.api import PrefillBatch

try:
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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the Triton build
    gluon = None
    TensorDescriptor = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

LOG2E = 1.4426950408889634


if gluon is not None:
    ITEM_RING = gl.constexpr(4)  # work items the load warps may hand out ahead (Config.dynamic)

    @gluon.jit
    def _softmax(
        s,
        m_i,
        l_i,
        qk_scale,
        start_n,
        diag,
        kv_len,
        MASKED: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        """Online-softmax step on one S tile: returns (p, m, l, alpha), p unnormalised (fp32)."""
        if MASKED:
            # scale first, then mask: a masked -inf must never meet a zero scale
            cols = start_n + gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
            s = s * qk_scale
            if CAUSAL:
                visible = cols[None, :] <= diag[:, None]
            else:
                visible = (cols < kv_len)[None, :]
            s = gl.where(visible, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet
            p = gl.exp2(s - m_use[:, None])
        else:
            # every key visible to every row and qk_scale > 0: max(s) * scale = max(s * scale)
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            m_use = m_new
            p = gl.exp2(s * qk_scale - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _kv_rows(t, hi, args, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, LD: gl.constexpr):
        """Element offsets (int64) of key tile t's K and V rows, as rows of layout LD, and the mask
        of rows below ``hi``."""
        (
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
        ) = args
        cols = t * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, LD))
        ok = cols < hi
        if PAGE_SIZE == 0:
            k_off = (k_start + cols).to(gl.int64) * stride_kn
            v_off = (v_start + cols).to(gl.int64) * stride_vn
        else:
            page = gl.load(BT_row + cols // PAGE_SIZE, mask=ok, other=0)
            page = gl.minimum(gl.maximum(page, 0), num_pages - 1).to(gl.int64)
            slot = (cols % PAGE_SIZE).to(gl.int64)
            k_off = page * stride_kn + slot * stride_ks
            v_off = page * stride_vn + slot * stride_vs
        k_off = k_off + kv_head.to(gl.int64) * stride_kh
        v_off = v_off + kv_head.to(gl.int64) * stride_vh
        return k_off, v_off, ok

    @gluon.jit
    def _gather_kv(
        k_buf,
        k1_buf,
        v_buf,
        t,
        hi,
        args,
        PAGE_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        DQ0: gl.constexpr,
        DQ1: gl.constexpr,
        DVO: gl.constexpr,
        NW: gl.constexpr,
        DBG: gl.constexpr,
    ):
        """cp.async copies of key tile t's K rows (columns [0, DQ0) into k_buf, [DQ0, DQ0 + DQ1) into
        k1_buf) and V rows (DVO columns); rows at or past ``hi`` zero-filled. NW: the load warps."""
        K = args[0]
        V = args[1]
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DQ0 // 8), DQ0 // 8], [NW, 1], [1, 0])
        k_off, v_off, ok = _kv_rows(t, hi, args, PAGE_SIZE, BLOCK_N, LD)
        d = gl.arange(0, DQ0, gl.SliceLayout(0, LD))
        if (DBG & 1) == 0:
            async_copy.async_copy_global_to_shared(k_buf, K + k_off[:, None] + d[None, :], mask=ok[:, None])
            if DQ1 > 0:
                LD1: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (DQ1 // 8), DQ1 // 8], [NW, 1], [1, 0])
                k1_off, _, ok1 = _kv_rows(t, hi, args, PAGE_SIZE, BLOCK_N, LD1)
                d1 = DQ0 + gl.arange(0, DQ1, gl.SliceLayout(0, LD1))
                async_copy.async_copy_global_to_shared(
                    k1_buf, K + k1_off[:, None] + d1[None, :], mask=ok1[:, None]
                )
            if (DBG & 4) == 0:
                if DVO == DQ0:
                    async_copy.async_copy_global_to_shared(
                        v_buf, V + v_off[:, None] + d[None, :], mask=ok[:, None]
                    )
                else:
                    LDV: gl.constexpr = gl.BlockedLayout(
                        [1, 8], [32 // (DVO // 8), DVO // 8], [NW, 1], [1, 0]
                    )
                    _, vv_off, okv = _kv_rows(t, hi, args, PAGE_SIZE, BLOCK_N, LDV)
                    dv = gl.arange(0, DVO, gl.SliceLayout(0, LDV))
                    async_copy.async_copy_global_to_shared(
                        v_buf, V + vv_off[:, None] + dv[None, :], mask=okv[:, None]
                    )

    @gluon.jit
    def _tma_coords(row, kv_head, head_off, HEAD_ROWS: gl.constexpr):
        """(row, column) of a head's key row in a cache's 2-D TMA view, from the head-0 row."""
        if HEAD_ROWS:
            return row + kv_head * head_off, 0
        return row, kv_head * head_off

    @gluon.jit
    def _num_rounds(total):
        """Rounds of work items: in round r every program takes one item (see ``_round_item``)."""
        return (total + gl.num_programs(0) - 1) // gl.num_programs(0)

    @gluon.jit
    def _round_item(r):
        """Program p's item in round r: p in even rounds, the mirror in odd ones. Items shrink as
        they go within a chunk of pairs (heaviest first), so the snake order evens out the programs'
        sums."""
        pid = gl.program_id(0)
        return r * gl.num_programs(0) + pid + (r % 2) * (gl.num_programs(0) - 1 - 2 * pid)

    @gluon.jit
    def _more_items(item, r, total, items):
        """Whether round r (holding item) is one to run."""
        dyn = items[4] != 0
        return (dyn & (item < total)) | ((not dyn) & (r < _num_rounds(total)))

    @gluon.jit
    def _claim_item(r, items):
        """Load warps: the item of round r: ``_round_item(r)``, or (``dynamic``) the next one off
        the call's work counter, so that a program takes its next item when its loads reach it."""
        if items[4] != 0:
            item = gl.atomic_add(items[0], 1, sem="relaxed")
        else:
            item = _round_item(r)
        return item

    @gluon.jit
    def _post_item(item, r, items, LOAD_WARPS: gl.constexpr):
        """Load warps (``dynamic``): hand round r's item to the consumers through slot r % ITEM_RING."""
        slot = r % ITEM_RING
        mbarrier.wait(items[3].index(slot), ((r // ITEM_RING) & 1) ^ 1)
        items[1].index(slot).store(
            gl.full([1], item, gl.int32, gl.BlockedLayout([1], [32], [LOAD_WARPS], [0]))
        )
        mbarrier.arrive(items[2].index(slot))

    @gluon.jit
    def _take_item(r, items):
        """Consumers: the item of round r: ``_round_item(r)``, or (``dynamic``) the load warps' pick."""
        if items[4] != 0:
            slot = r % ITEM_RING
            mbarrier.wait(items[2].index(slot), (r // ITEM_RING) & 1)
            item = gl.max(items[1].index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
            mbarrier.arrive(items[3].index(slot))
        else:
            item = _round_item(r)
        return item

    @gluon.jit
    def _issue_q(
        q_desc,
        qload,
        r,
        row0,
        q_start,
        kv_head,
        n_tiles,
        GROUP: gl.constexpr,
        NC: gl.constexpr,
        DQ1: gl.constexpr,
        DBG: gl.constexpr,
    ):
        """Load warps (``Config.q_tma``): round r's Q rows, ``NC`` slots of 64 rows (``64 / GROUP``
        tokens x ``GROUP`` heads), as bulk-tensor copies of ``[64 / GROUP, GROUP, 64]`` boxes of the
        3-D view ``[tokens, heads, Dqk]`` of q, once every consumer is past round r-1's last QK GEMM
        (``q_empty``); they complete on ``q_full``. A box is the 64-column tile of a slot (128-byte
        rows, the same swizzled bytes as a 2-D box). Rows past the sequence read other tokens or
        zeros (past q's end); their results are never stored. An item without key tiles is
        signalled without copies (no consumer reads its Q)."""
        q_smem, q1_smem, q_full, q_empty = qload
        DQ0: gl.constexpr = q_smem.shape[2]
        mbarrier.wait(q_empty, (r & 1) ^ 1)  # (also for empty items: no phase may run ahead)
        if (n_tiles == 0) | ((DBG & 8) != 0):  # (DBG bit 3, diagnostics: no Q copies)
            mbarrier.arrive(q_full)
        else:
            mbarrier.expect(q_full, NC * 64 * (DQ0 + DQ1) * 2)
            for ci in gl.static_range(NC):
                tok = q_start + (row0 + ci * 64) // GROUP
                for h in gl.static_range(DQ0 // 64):
                    dst = q_smem.index(ci).slice(h * 64, 64, dim=1)
                    dst = dst._reinterpret(q_smem.dtype, [64 // GROUP, GROUP, 64], q_desc.layout)
                    tma.async_copy_global_to_shared(q_desc, [tok, kv_head * GROUP, h * 64], q_full, dst)
                for h in gl.static_range(DQ1 // 64):  # (Dqk 192: columns past 128 into q1_smem)
                    dst = q1_smem.index(ci).slice(h * 64, 64, dim=1)
                    dst = dst._reinterpret(q_smem.dtype, [64 // GROUP, GROUP, 64], q_desc.layout)
                    tma.async_copy_global_to_shared(q_desc, [tok, kv_head * GROUP, DQ0 + h * 64], q_full, dst)

    @gluon.jit
    def _key_range(
        r_lo,
        q_len,
        kv_len,
        ROWS: gl.constexpr,
        GROUP: gl.constexpr,
        BLOCK_N: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):
        """Keys of rows [r_lo, r_lo + ROWS): (hi: keys [0, hi) visible to some row, n_tiles: key
        tiles covering them, 0 for rows all past the sequence, full: keys visible to every row, in
        whole tiles)."""
        if CAUSAL:
            tok_hi = gl.minimum((r_lo + ROWS - 1) // GROUP, q_len - 1)
            hi = gl.minimum(kv_len, tok_hi + (kv_len - q_len) + 1)
            full = gl.minimum(kv_len, r_lo // GROUP + (kv_len - q_len) + 1)
            full = (gl.maximum(full, 0) // BLOCK_N) * BLOCK_N
        else:
            hi = kv_len
            full = (kv_len // BLOCK_N) * BLOCK_N
        hi = gl.maximum(hi, 0)
        n_tiles = (hi + BLOCK_N - 1) // BLOCK_N
        n_tiles = gl.where(r_lo < q_len * GROUP, n_tiles, 0)  # rows past the sequence: nothing
        return hi, n_tiles, full

    @gluon.jit
    def _work_item(
        item,
        sched,
        GROUP: gl.constexpr,
        PAGE_SIZE: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        CAUSAL: gl.constexpr,
        HAS_LSE: gl.constexpr,
    ):
        """Work item -> its sequence, KV head, row block and key range. Items run heaviest row block
        first within a chunk of (sequence, KV head) pairs (``Config.chunk``: 4 by default, 0 for one
        chunk of all pairs); ``item >= total`` (a last round's missing items) decodes as the last item with
        ``q_len = 0``: no tiles, no stores."""
        META, BT, meta_stride, bt_stride, num_kv_heads, n_bh, num_m_blocks, chunk = sched
        total = n_bh * num_m_blocks
        valid = item < total
        item = gl.minimum(item, total - 1)  # (so that b < batch size: META is read unmasked)
        # chunks of `chunk` (sequence, KV head) pairs, one after the other; in a chunk, row blocks
        # heaviest first (z), then pairs: items running at once share their pairs' K/V in L2
        k = item // (chunk * num_m_blocks)
        within = item - k * (chunk * num_m_blocks)
        in_chunk = gl.minimum(chunk, n_bh - k * chunk)  # (the last chunk may be short)
        z = within // in_chunk
        rem = k * chunk + within - z * in_chunk
        b = rem // num_kv_heads
        kv_head = rem - b * num_kv_heads
        row0 = (num_m_blocks - 1 - z) * BLOCK_M
        q_len = gl.where(valid, gl.load(META + b), 0)
        kv_len = gl.load(META + meta_stride + b)
        q_start = gl.load(META + 2 * meta_stride + b)
        o_start = gl.load(META + 3 * meta_stride + b)
        lse_start = q_len * 0
        if HAS_LSE:
            lse_start = gl.load(META + 6 * meta_stride + b)
        if PAGE_SIZE > 0:
            BT_row = BT + b.to(gl.int64) * bt_stride
            k_start = q_len * 0
            v_start = q_len * 0
        else:
            BT_row = BT
            k_start = gl.load(META + 4 * meta_stride + b)
            v_start = gl.load(META + 5 * meta_stride + b)
        hi, n_tiles, full = _key_range(row0, q_len, kv_len, BLOCK_M, GROUP, BLOCK_N, CAUSAL)
        return (
            kv_head,
            row0,
            q_len,
            kv_len,
            q_start,
            o_start,
            lse_start,
            BT_row,
            k_start,
            v_start,
            hi,
            full,
            n_tiles,
        )

    @gluon.jit
    def _load_partition(
        args,
        gather,
        sched,
        k_desc,
        k1_desc,
        v_desc,
        q_desc,
        tma_ints,
        PAGE_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        DQ0: gl.constexpr,
        DQ1: gl.constexpr,
        DVO: gl.constexpr,
        STAGES: gl.constexpr,
        LOAD_WARPS: gl.constexpr,
        DBG: gl.constexpr,
        USE_TMA: gl.constexpr,
        PAGE_BOX: gl.constexpr,
        K_HEAD_ROWS: gl.constexpr,
        V_HEAD_ROWS: gl.constexpr,
        GROUP: gl.constexpr,
        BLOCK_M: gl.constexpr,
        CAUSAL: gl.constexpr,
        Q_TMA: gl.constexpr,
        V_RING: gl.constexpr,
    ):
        """Load warps: fill stage c % STAGES with the program's c-th key tile (counted across its work
        items) once every consumer released it.

        cp.async mode: every load thread gathers rows and arrives when its own copies land (barrier
        count = load threads). TMA mode (barrier count 1): tiles wholly below kv_len arrive as
        bulk-tensor copies of PAGE_BOX rows each, completing on the barrier's byte count; the tile
        that crosses kv_len is gathered with cp.async (rows past the keys zero-filled, so stale
        cache slots never reach the PV GEMM) and signalled once all load threads' copies landed.
        V_RING: V tiles go to slot c % V_STAGES of a ring of their own (v_full / v_empty), after the
        tile's K, so a K stage comes free at its QK GEMM and K runs further ahead of the consumers."""
        k_smem, k1_smem, v_smem, kv_full, kv_empty, total, items, qload, v_full, v_empty = args
        NCQ: gl.constexpr = BLOCK_M // 64  # (consumers: Q slots)
        V_STAGES: gl.constexpr = v_smem.shape[0]  # (V_RING: V's own ring; else STAGES)
        K, V, num_pages = gather[0], gather[1], gather[2]
        k_page_rows, k_head_off, v_page_rows, v_head_off = tma_ints
        c = gl.program_id(0) * 0  # tiles this program has loaded so far
        r = gl.program_id(0) * 0  # rounds (items) so far
        item = _claim_item(r, items)
        while _more_items(item, r, total, items):
            if items[4] != 0:
                _post_item(item, r, items, LOAD_WARPS)
            w = _work_item(item, sched, GROUP, PAGE_SIZE, BLOCK_M, BLOCK_N, CAUSAL, False)
            kv_head, row0, _, kv_len, q_start, _, _, BT_row, k_start, v_start, hi, _, n_tiles = w
            # (Q_TMA: the item's Q goes out once its tile STAGES - 2 has a stage: the consumers have
            # then released the tile two before it, so when the last item had >= 2 tiles they are
            # past its last QK GEMM; with O_STAGE 1 they hand the slots back only after the last
            # item's epilogue read O from them, so q_empty may wait for that; or after the item's
            # last tile)
            q_at = gl.minimum(n_tiles, STAGES - 2)
            g = (
                K,
                V,
                BT_row,
                kv_head,
                k_start,
                v_start,
                num_pages,
                gather[3],
                gather[4],
                gather[5],
                gather[6],
                gather[7],
                gather[8],
            )
            for t in range(n_tiles):
                s = (c + t) % STAGES
                mbarrier.wait(kv_empty.index(s), (((c + t) // STAGES) & 1) ^ 1)
                sv = s
                if V_RING:  # (V into its own ring once its slot is free: K first)
                    sv = (c + t) % V_STAGES
                if Q_TMA:
                    if t == q_at:
                        _issue_q(q_desc, qload, r, row0, q_start, kv_head, n_tiles, GROUP, NCQ, DQ1, DBG)
                if USE_TMA:
                    if (t + 1) * BLOCK_N <= kv_len:
                        if (DBG & 1) != 0:  # diagnostics: no copies
                            mbarrier.arrive(kv_full.index(s))
                        else:
                            mbarrier.expect(
                                kv_full.index(s),
                                2 * BLOCK_N * (DQ0 + DQ1 + (0 if ((DBG & 4) != 0 or V_RING) else DVO)),
                            )
                        for p in gl.static_range(BLOCK_N // PAGE_BOX):
                            pos = t * BLOCK_N + p * PAGE_BOX  # one box never crosses a page
                            if PAGE_SIZE == 0:
                                k_row = k_start + pos
                                v_row = v_start + pos
                            else:
                                page = gl.load(BT_row + pos // PAGE_SIZE)
                                page = gl.minimum(gl.maximum(page, 0), num_pages - 1)
                                k_row = page * k_page_rows + pos % PAGE_SIZE
                                v_row = page * v_page_rows + pos % PAGE_SIZE
                            kr, kc = _tma_coords(k_row, kv_head, k_head_off, K_HEAD_ROWS)
                            vr, vc = _tma_coords(v_row, kv_head, v_head_off, V_HEAD_ROWS)
                            k_dst = k_smem.index(s).slice(p * PAGE_BOX, PAGE_BOX)
                            v_dst = v_smem.index(s).slice(p * PAGE_BOX, PAGE_BOX)
                            if (DBG & 1) == 0:
                                tma.async_copy_global_to_shared(k_desc, [kr, kc], kv_full.index(s), k_dst)
                                if DQ1 > 0:
                                    k1_dst = k1_smem.index(s).slice(p * PAGE_BOX, PAGE_BOX)
                                    tma.async_copy_global_to_shared(
                                        k1_desc, [kr, kc + DQ0], kv_full.index(s), k1_dst
                                    )
                                if (DBG & 4) == 0 and not V_RING:
                                    tma.async_copy_global_to_shared(v_desc, [vr, vc], kv_full.index(s), v_dst)
                        if V_RING:
                            mbarrier.wait(v_empty.index(sv), (((c + t) // V_STAGES) & 1) ^ 1)
                            if (DBG & 5) != 0:  # diagnostics: no V copies
                                mbarrier.arrive(v_full.index(sv))
                            else:
                                mbarrier.expect(v_full.index(sv), 2 * BLOCK_N * DVO)
                                for p in gl.static_range(BLOCK_N // PAGE_BOX):
                                    pos = t * BLOCK_N + p * PAGE_BOX
                                    if PAGE_SIZE == 0:
                                        v_row = v_start + pos
                                    else:
                                        page = gl.load(BT_row + pos // PAGE_SIZE)
                                        page = gl.minimum(gl.maximum(page, 0), num_pages - 1)
                                        v_row = page * v_page_rows + pos % PAGE_SIZE
                                    vr, vc = _tma_coords(v_row, kv_head, v_head_off, V_HEAD_ROWS)
                                    v_dst = v_smem.index(sv).slice(p * PAGE_BOX, PAGE_BOX)
                                    tma.async_copy_global_to_shared(v_desc, [vr, vc], v_full.index(sv), v_dst)
                    else:
                        if V_RING:
                            mbarrier.wait(v_empty.index(sv), (((c + t) // V_STAGES) & 1) ^ 1)
                        _gather_kv(
                            k_smem.index(s),
                            k1_smem.index(s),
                            v_smem.index(sv),
                            t,
                            hi,
                            g,
                            PAGE_SIZE,
                            BLOCK_N,
                            DQ0,
                            DQ1,
                            DVO,
                            LOAD_WARPS,
                            DBG,
                        )
                        async_copy.commit_group()
                        async_copy.wait_group(0)
                        # (arrive follows a barrier of the load warps: all their copies have landed)
                        mbarrier.arrive(kv_full.index(s))
                        if V_RING:
                            mbarrier.arrive(v_full.index(sv))
                else:
                    if V_RING:
                        mbarrier.wait(v_empty.index(sv), (((c + t) // V_STAGES) & 1) ^ 1)
                    _gather_kv(
                        k_smem.index(s),
                        k1_smem.index(s),
                        v_smem.index(sv),
                        t,
                        hi,
                        g,
                        PAGE_SIZE,
                        BLOCK_N,
                        DQ0,
                        DQ1,
                        DVO,
                        LOAD_WARPS,
                        DBG,
                    )
                    async_copy.mbarrier_arrive(kv_full.index(s), increment_count=False)
                    if V_RING:  # (it also waits for the K copies: every earlier cp.async of the thread)
                        async_copy.mbarrier_arrive(v_full.index(sv), increment_count=False)
            if Q_TMA:
                if q_at == n_tiles:
                    _issue_q(q_desc, qload, r, row0, q_start, kv_head, n_tiles, GROUP, NCQ, DQ1, DBG)
            c += n_tiles
            r += 1
            item = _claim_item(r, items)
        if items[4] != 0:  # (item >= total: the consumers' stop)
            _post_item(item, r, items, LOAD_WARPS)

    @gluon.jit
    def _fence_tile(tile, kv_len, BLOCK_N: gl.constexpr, TILE_FENCE: gl.constexpr):
        """Consumers, after a key tile's full wait: fence the async proxy, so that the generic-proxy
        writes of a tile gathered by cp.async (the one crossing kv_len, or every tile without TMA)
        come before the wgmma's async-proxy reads. TMA tiles need none; TILE_FENCE 1 fences every
        tile regardless."""
        if TILE_FENCE:
            fence_async_shared()
        elif (tile + 1) * BLOCK_N > kv_len:
            fence_async_shared()

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
        w,
        qargs,
        R0: gl.constexpr,
        GROUP: gl.constexpr,
        SUB_M: gl.constexpr,
        C0: gl.constexpr,
        NCOL: gl.constexpr,
    ):
        """cp.async copies of columns [C0, C0 + NCOL) of work item w's Q rows [row0 + R0, row0 + R0 +
        SUB_M) into buf; rows past the sequence zero-filled."""
        Q, stride_qt, stride_qh = qargs
        kv_head, row0, q_len, q_start = w[0], w[1], w[2], w[4]
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (NCOL // 8), NCOL // 8], [4, 1], [1, 0])
        rows = row0 + R0 + gl.arange(0, SUB_M, gl.SliceLayout(1, LD))
        tok = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        off = (q_start + tok).to(gl.int64) * stride_qt + head.to(gl.int64) * stride_qh
        d = C0 + gl.arange(0, NCOL, gl.SliceLayout(0, LD))
        async_copy.async_copy_global_to_shared(
            buf, Q + off[:, None] + d[None, :], mask=(tok < q_len)[:, None]
        )

    @gluon.jit
    def _load_q_async(
        q_sub,
        q1_sub,
        w,
        qargs,
        R0: gl.constexpr,
        GROUP: gl.constexpr,
        SUB_M: gl.constexpr,
        DQ0: gl.constexpr,
        DQ1: gl.constexpr,
    ):
        """Work item w's Q rows for this warpgroup: key columns [0, DQ0) into q_sub, [DQ0, DQ0 + DQ1)
        into q1_sub (Dqk 192); one commit group."""
        _q_cols_async(q_sub, w, qargs, R0, GROUP, SUB_M, 0, DQ0)
        if DQ1 > 0:
            _q_cols_async(q1_sub, w, qargs, R0, GROUP, SUB_M, DQ0, DQ1)
        async_copy.commit_group()

    @gluon.jit
    def _consumer_partition(
        args,
        sched,
        R0: gl.constexpr,
        GROUP: gl.constexpr,
        DQ0: gl.constexpr,
        DQ1: gl.constexpr,
        DVO: gl.constexpr,
        SUB_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        HAS_LSE: gl.constexpr,
        DBG: gl.constexpr,
        PAGE_SIZE: gl.constexpr,
        BLOCK_M: gl.constexpr,
        OWN_ROWS: gl.constexpr,
        Q_TMA: gl.constexpr,
        O_STAGE: gl.constexpr,
        PINGPONG: gl.constexpr,
        TILE_FENCE: gl.constexpr,
        V_RING: gl.constexpr,
    ):
        """One consumer warpgroup: rows [row0 + R0, row0 + R0 + SUB_M) of each work item's block.
        V_RING: a tile's K stage is released after its QK GEMM, its V slot after its PV GEMM."""
        (
            Q,
            stride_qt,
            stride_qh,
            q_smem,
            q1_smem,
            k_smem,
            k1_smem,
            v_smem,
            kv_full,
            kv_empty,
            Out,
            LSE,
            total,
            qk_scale,
            stride_ot,
            stride_oh,
            num_heads_q,
            items,
            q_full,
            q_empty,
            o_smem,
            turn,
            v_full,
            v_empty,
        ) = args
        dtype: gl.constexpr = q_smem.dtype
        V_STAGES: gl.constexpr = v_smem.shape[0]
        ME: gl.constexpr = R0 // SUB_M
        NEXT: gl.constexpr = (ME + 1) % (BLOCK_M // SUB_M)
        # Q_TMA: the slot goes back to the load warps after this warpgroup's last QK GEMM of an item,
        # or, when O is staged through it (O_STAGE 1), after O is read back from it
        Q_EARLY: gl.constexpr = Q_TMA and O_STAGE != 1
        S_L: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        O_L: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DVO, 16]
        )
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        q_sub = q_smem.index(R0 // SUB_M)
        if DQ1 > 0:
            q1_sub = q1_smem.index(R0 // SUB_M)
        else:
            q1_sub = q_sub
        qargs = (Q, stride_qt, stride_qh)
        c = gl.program_id(0) * 0  # key tiles this program has consumed so far
        r = gl.program_id(0) * 0  # rounds (items) so far
        t = gl.program_id(0) * 0  # PINGPONG: GEMM turns this warpgroup has taken
        item = _take_item(r, items)
        while _more_items(item, r, total, items):
            w = _work_item(item, sched, GROUP, PAGE_SIZE, BLOCK_M, BLOCK_N, CAUSAL, HAS_LSE)
            kv_head, row0, q_len, kv_len, q_start, o_start, lse_start, _, _, _, _, full, n_tiles = w
            # this warpgroup's Q rows -> its own slot of q_smem, once all its warps are past the
            # previous item's GEMMs
            if Q_TMA:  # (the load warps' copies)
                # (every mbarrier.arrive of a warpgroup here is lowered as a bar.sync of its 128
                # threads and one elected arrive: no warp can lag a round behind the arrival)
                mbarrier.wait(q_full, r & 1)
            else:
                gl.thread_barrier()
                if (DBG & 8) == 0:
                    _load_q_async(q_sub, q1_sub, w, qargs, R0, GROUP, SUB_M, DQ0, DQ1)
                    async_copy.wait_group(0)
                fence_async_shared()
                gl.thread_barrier()
            rows_s = row0 + R0 + gl.arange(0, SUB_M, gl.SliceLayout(1, S_L))
            tok_s = rows_s // GROUP
            diag = tok_s + (kv_len - q_len)
            m_i = gl.full([SUB_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
            l_i = gl.zeros([SUB_M], gl.float32, gl.SliceLayout(1, S_L))
            acc = gl.zeros([SUB_M, DVO], gl.float32, O_L)
            s_zero = gl.zeros([SUB_M, BLOCK_N], gl.float32, S_L)
            p_op = gl.zeros([SUB_M, BLOCK_N], dtype, P_L)
            n_walk = n_tiles  # key tiles this warpgroup computes; below full_own none is masked
            full_own = full
            if CAUSAL and OWN_ROWS:
                # (this warpgroup's rows lie inside the block's: its range is within the block's)
                _, n_walk, full_own = _key_range(row0 + R0, q_len, kv_len, SUB_M, GROUP, BLOCK_N, CAUSAL)
            alpha = gl.full([SUB_M], 1.0, gl.float32, gl.SliceLayout(1, O_L))
            if Q_EARLY:
                if n_walk == 0:  # (Q_TMA: the slot is free once this warpgroup's last QK GEMM is done)
                    mbarrier.arrive(q_empty)
            if n_walk > 0:  # tile 0: nothing to overlap its softmax with yet
                s0 = c % STAGES
                mbarrier.wait(kv_full.index(s0), (c // STAGES) & 1)
                _fence_tile(0, kv_len, BLOCK_N, TILE_FENCE)
                if PINGPONG:
                    mbarrier.wait(turn.index(ME), t & 1)
                s_tok = _qk_async(q_sub, q1_sub, k_smem.index(s0), k1_smem.index(s0), s_zero, DQ1)
                if PINGPONG:
                    mbarrier.arrive(turn.index(NEXT))
                    t += 1
                sc = warpgroup_mma_wait(0, deps=[s_tok])
                if V_RING:
                    mbarrier.arrive(kv_empty.index(s0))
                if Q_EARLY:
                    if n_walk == 1:
                        mbarrier.arrive(q_empty)
                if full_own > 0:
                    p, m_i, l_i, alpha0 = _softmax(sc, m_i, l_i, qk_scale, 0, diag, kv_len, False, CAUSAL)
                else:
                    p, m_i, l_i, alpha0 = _softmax(sc, m_i, l_i, qk_scale, 0, diag, kv_len, True, CAUSAL)
                p_op = gl.convert_layout(p.to(dtype), P_L)
            for j in range(1, n_walk):
                s = (c + j) % STAGES
                prev = (c + j - 1) % STAGES
                mbarrier.wait(kv_full.index(s), ((c + j) // STAGES) & 1)
                _fence_tile(j, kv_len, BLOCK_N, TILE_FENCE)
                # S_j = Q K_j^T in flight while O is rescaled for tile j-1 (FA3's order: off the path
                # from the PV GEMM's wait to the next PV GEMM); then O += P_{j-1} V_{j-1} joins it,
                # and softmax(S_j) overlaps the PV GEMM. PINGPONG: the warpgroups issue these two
                # GEMMs in turn (0, 1, .., 0, ..), so one's softmax runs beside the others' GEMMs
                if PINGPONG:
                    mbarrier.wait(turn.index(ME), t & 1)
                s_tok = _qk_async(q_sub, q1_sub, k_smem.index(s), k1_smem.index(s), s_zero, DQ1)
                if j > 1:  # (tile 0 left O zero)
                    acc = acc * alpha[:, None]
                vprev = prev
                if V_RING:
                    vprev = (c + j - 1) % V_STAGES
                    mbarrier.wait(v_full.index(vprev), ((c + j - 1) // V_STAGES) & 1)
                    _fence_tile(j - 1, kv_len, BLOCK_N, TILE_FENCE)
                o_tok = warpgroup_mma(p_op, v_smem.index(vprev), acc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(NEXT))
                    t += 1
                sc = warpgroup_mma_wait(1, deps=[s_tok])
                if V_RING:  # (K_j read: the QK GEMM is retired)
                    mbarrier.arrive(kv_empty.index(s))
                if Q_EARLY:
                    if j == n_walk - 1:
                        mbarrier.arrive(q_empty)
                if (DBG & 2) != 0:
                    p = sc
                elif j * BLOCK_N < full_own:
                    p, m_i, l_i, alpha_s = _softmax(
                        sc, m_i, l_i, qk_scale, j * BLOCK_N, diag, kv_len, False, CAUSAL
                    )
                    alpha = gl.convert_layout(alpha_s, gl.SliceLayout(1, O_L))
                else:
                    p, m_i, l_i, alpha_s = _softmax(
                        sc, m_i, l_i, qk_scale, j * BLOCK_N, diag, kv_len, True, CAUSAL
                    )
                    alpha = gl.convert_layout(alpha_s, gl.SliceLayout(1, O_L))
                acc = warpgroup_mma_wait(0, deps=[o_tok])
                if V_RING:
                    mbarrier.arrive(v_empty.index(vprev))
                else:
                    mbarrier.arrive(kv_empty.index(prev))
                p_op = gl.convert_layout(p.to(dtype), P_L)
            if n_walk > 0:
                last = (c + n_walk - 1) % STAGES
                if n_walk > 1:
                    acc = acc * alpha[:, None]
                if V_RING:
                    vlast = (c + n_walk - 1) % V_STAGES
                    mbarrier.wait(v_full.index(vlast), ((c + n_walk - 1) // V_STAGES) & 1)
                    _fence_tile(n_walk - 1, kv_len, BLOCK_N, TILE_FENCE)
                    o_tok = warpgroup_mma(p_op, v_smem.index(vlast), acc, is_async=True)
                    acc = warpgroup_mma_wait(0, deps=[o_tok])
                    mbarrier.arrive(v_empty.index(vlast))
                else:
                    o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
                    acc = warpgroup_mma_wait(0, deps=[o_tok])
                    mbarrier.arrive(kv_empty.index(last))
            if OWN_ROWS:  # tiles past this warpgroup's last key: released unread, in ring order
                for j in range(n_walk, n_tiles):
                    mbarrier.wait(kv_full.index((c + j) % STAGES), ((c + j) // STAGES) & 1)
                    if PINGPONG:  # (an empty turn: every warpgroup takes one per tile)
                        mbarrier.wait(turn.index(ME), t & 1)
                        mbarrier.arrive(turn.index(NEXT))
                        t += 1
                    mbarrier.arrive(kv_empty.index((c + j) % STAGES))
                    if V_RING:
                        mbarrier.wait(v_full.index((c + j) % V_STAGES), ((c + j) // V_STAGES) & 1)
                        mbarrier.arrive(v_empty.index((c + j) % V_STAGES))
            c += n_tiles

            has_key = l_i > 0.0
            inv_l = gl.where(has_key, 1.0 / gl.where(has_key, l_i, 1.0), 0.0)
            lse2 = gl.where(has_key, m_i + gl.log2(gl.where(has_key, l_i, 1.0)), float("-inf"))
            o = (acc * gl.convert_layout(inv_l, gl.SliceLayout(1, O_L))[:, None]).to(Out.dtype.element_ty)
            q_out = q_len
            if (DBG & 16) != 0:  # diagnostics: every store masked off (the values are still computed)
                q_out = gl.minimum(q_len, -1 - kv_len)  # (kv_len >= 0, unknown to the compiler)
            if O_STAGE != 0:
                # through this warpgroup's Q slot (its last QK GEMM is done; O_STAGE 1) or its own
                # O buffer (2) into rows of 16-byte vectors: each warp stores whole 2^k-byte row
                # segments instead of 16-byte pieces of 8 rows (the wgmma accumulator's layout)
                if O_STAGE == 1:
                    o_sub = q_sub
                else:
                    o_sub = o_smem.index(ME)
                gl.thread_barrier()
                o_sub.store(o)
                gl.thread_barrier()
                TPW_D: gl.constexpr = DVO // 8
                ST_L: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [4, 1], [1, 0])
                o_st = o_sub.load(ST_L)
                if Q_TMA and O_STAGE == 1:  # (the slot goes back to the load warps; arrive syncs the group)
                    fence_async_shared()  # (O's generic-proxy writes before the next Q's TMA writes)
                    mbarrier.arrive(q_empty)
                rows_o = row0 + R0 + gl.arange(0, SUB_M, gl.SliceLayout(1, ST_L))
                d_o = gl.arange(0, DVO, gl.SliceLayout(0, ST_L))
            else:
                o_st = o
                rows_o = row0 + R0 + gl.arange(0, SUB_M, gl.SliceLayout(1, O_L))
                d_o = gl.arange(0, DVO, gl.SliceLayout(0, O_L))
            tok_o = rows_o // GROUP
            head_o = kv_head * GROUP + rows_o % GROUP
            o_off = (o_start + tok_o).to(gl.int64) * stride_ot + head_o.to(gl.int64) * stride_oh
            gl.store(Out + o_off[:, None] + d_o[None, :], o_st, mask=(tok_o < q_out)[:, None])
            if HAS_LSE:
                head_s = kv_head * GROUP + rows_s % GROUP
                lse_off = lse_start.to(gl.int64) + tok_s.to(gl.int64) * num_heads_q + head_s
                gl.store(LSE + lse_off, lse2 * 0.6931471805599453, mask=tok_s < q_out)
            r += 1
            item = _take_item(r, items)

    @gluon.jit(
        do_not_specialize=[
            "meta_stride",
            "batch_size",
            "num_m_blocks",
            "num_pages",
            "bt_stride",
            "chunk_pairs",
            "dynamic",
        ],
        do_not_specialize_on_alignment=["BT", "LSE", "COUNTER"],
    )
    def _attention_kernel(
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
        bt_stride,
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
        q_desc,
        k_page_rows,
        k_head_off,
        v_page_rows,
        v_head_off,
        GROUP: gl.constexpr,
        PAGE_SIZE: gl.constexpr,
        DQK: gl.constexpr,
        DVO: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        CAUSAL: gl.constexpr,
        HAS_LSE: gl.constexpr,
        STAGES: gl.constexpr,
        LOAD_WARPS: gl.constexpr,
        CONS_REGS: gl.constexpr,
        LOAD_REGS: gl.constexpr,
        NC: gl.constexpr,
        DBG: gl.constexpr,
        USE_TMA: gl.constexpr,
        PAGE_BOX: gl.constexpr,
        K_HEAD_ROWS: gl.constexpr,
        V_HEAD_ROWS: gl.constexpr,
        OWN_ROWS: gl.constexpr,
        Q_TMA: gl.constexpr,
        O_STAGE: gl.constexpr,
        PINGPONG: gl.constexpr,
        TILE_FENCE: gl.constexpr,
        V_STAGES: gl.constexpr,
        V_RING: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """LOAD_WARPS load warps feed NC consumer warpgroups of 64 rows each (BLOCK_M = 64 * NC); the
        kernel's own num_warps (4) are the first consumer. The ``num_kv_heads * batch_size *
        num_m_blocks`` work items (``_work_item``) are dealt in rounds of one per program
        (``_round_item``): one round when the grid covers them all, several when it is persistent
        (one program per SM), where the load warps fetch the next item's first tiles while the
        consumers finish the last one."""
        SUB_M: gl.constexpr = 64
        dtype: gl.constexpr = Q.dtype.element_ty
        # key columns in two parts of power-of-two widths: Dqk 192 = 128 + 64
        DQ0: gl.constexpr = DQK if DQK <= 128 else 128
        DQ1: gl.constexpr = DQK - DQ0
        SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        q_smem = gl.allocate_shared_memory(dtype, [NC, SUB_M, DQ0], SMEM)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DQ0], SMEM)
        v_smem = gl.allocate_shared_memory(dtype, [V_STAGES, BLOCK_N, DVO], SMEM)
        if DQ1 > 0:
            q1_smem = gl.allocate_shared_memory(dtype, [NC, SUB_M, DQ1], SMEM)
            k1_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DQ1], SMEM)
        else:  # (unused)
            q1_smem = q_smem
            k1_smem = k_smem
        kv_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(kv_full.index(i), count=1 if USE_TMA else LOAD_WARPS * 32)
            mbarrier.init(kv_empty.index(i), count=NC)
        if V_RING:  # V tiles in a ring of their own (Config.v_ring); else in the K/V stages
            v_full = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
            v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(V_STAGES):
                mbarrier.init(v_full.index(i), count=1 if USE_TMA else LOAD_WARPS * 32)
                mbarrier.init(v_empty.index(i), count=NC)
        else:
            v_full = kv_full
            v_empty = kv_empty
        # dynamic != 0: items come off the work counter; the load warps hand them to the consumers
        # through a ring of item ids (ITEM_RING slots, with full and empty barriers)
        item_ids = gl.allocate_shared_memory(gl.int32, [ITEM_RING, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        item_full = gl.allocate_shared_memory(gl.int64, [ITEM_RING, 1], mbarrier.MBarrierLayout())
        item_empty = gl.allocate_shared_memory(gl.int64, [ITEM_RING, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(ITEM_RING):
            mbarrier.init(item_full.index(i), count=1)
            mbarrier.init(item_empty.index(i), count=NC)
        items = (COUNTER, item_ids, item_full, item_empty, gl.to_tensor(dynamic))
        # Q_TMA: the load warps copy each item's Q (q_full, by bytes) once every consumer's last QK
        # GEMM of the item before is done (q_empty)
        if Q_TMA:
            q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(q_full, count=1)
            mbarrier.init(q_empty, count=NC)
        else:  # (unused)
            q_full = kv_full.index(0)
            q_empty = kv_empty.index(0)
        if O_STAGE == 2:  # O staged through a buffer of its own per consumer (Config.o_buf)
            o_smem = gl.allocate_shared_memory(dtype, [NC, SUB_M, DVO], SMEM)
        else:  # (unused)
            o_smem = q_smem
        # PINGPONG: consumer i issues its GEMMs of a tile once consumer i - 1 issued its own (turn[i])
        if PINGPONG:
            turn = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(NC):
                mbarrier.init(turn.index(i), count=1)
        else:  # (unused)
            turn = kv_full
        fence_async_shared()
        if PINGPONG:
            mbarrier.arrive(turn.index(0))  # (consumer 0 takes the first turn)

        # ints specialised to 1 arrive as constexprs; partitions take tensors
        n_bh = gl.to_tensor(num_kv_heads) * batch_size
        sched = (
            META,
            BT,
            gl.to_tensor(meta_stride),
            gl.to_tensor(bt_stride),
            gl.to_tensor(num_kv_heads),
            n_bh,
            gl.to_tensor(num_m_blocks),
            gl.to_tensor(chunk_pairs),
        )
        total = n_bh * num_m_blocks
        cons = (
            Q,
            gl.to_tensor(stride_qt),
            gl.to_tensor(stride_qh),
            q_smem,
            q1_smem,
            k_smem,
            k1_smem,
            v_smem,
            kv_full,
            kv_empty,
            Out,
            LSE,
            total,
            gl.to_tensor(sm_scale_log2),
            gl.to_tensor(stride_ot),
            gl.to_tensor(stride_oh),
            gl.to_tensor(num_heads_q),
            items,
            q_full,
            q_empty,
            o_smem,
            turn,
            v_full,
            v_empty,
        )
        load = (
            k_smem,
            k1_smem,
            v_smem,
            kv_full,
            kv_empty,
            total,
            items,
            (q_smem, q1_smem, q_full, q_empty),
            v_full,
            v_empty,
        )
        gather = (
            K,
            V,
            gl.to_tensor(num_pages),
            gl.to_tensor(stride_kn),
            gl.to_tensor(stride_kh),
            gl.to_tensor(stride_ks),
            gl.to_tensor(stride_vn),
            gl.to_tensor(stride_vh),
            gl.to_tensor(stride_vs),
        )
        tma_ints = (
            gl.to_tensor(k_page_rows),
            gl.to_tensor(k_head_off),
            gl.to_tensor(v_page_rows),
            gl.to_tensor(v_head_off),
        )
        # (constexprs are written inline: a tuple variable holding them would be lowered as tensors)
        ZERO: gl.constexpr = 0
        R1: gl.constexpr = SUB_M
        R2: gl.constexpr = 2 * SUB_M
        if NC == 2:
            gl.warp_specialize(
                [
                    (
                        _consumer_partition,
                        (
                            cons,
                            sched,
                            ZERO,
                            GROUP,
                            DQ0,
                            DQ1,
                            DVO,
                            SUB_M,
                            BLOCK_N,
                            STAGES,
                            CAUSAL,
                            HAS_LSE,
                            DBG,
                            PAGE_SIZE,
                            BLOCK_M,
                            OWN_ROWS,
                            Q_TMA,
                            O_STAGE,
                            PINGPONG,
                            TILE_FENCE,
                            V_RING,
                        ),
                    ),
                    (
                        _consumer_partition,
                        (
                            cons,
                            sched,
                            R1,
                            GROUP,
                            DQ0,
                            DQ1,
                            DVO,
                            SUB_M,
                            BLOCK_N,
                            STAGES,
                            CAUSAL,
                            HAS_LSE,
                            DBG,
                            PAGE_SIZE,
                            BLOCK_M,
                            OWN_ROWS,
                            Q_TMA,
                            O_STAGE,
                            PINGPONG,
                            TILE_FENCE,
                            V_RING,
                        ),
                    ),
                    (
                        _load_partition,
                        (
                            load,
                            gather,
                            sched,
                            k_desc,
                            k1_desc,
                            v_desc,
                            q_desc,
                            tma_ints,
                            PAGE_SIZE,
                            BLOCK_N,
                            DQ0,
                            DQ1,
                            DVO,
                            STAGES,
                            LOAD_WARPS,
                            DBG,
                            USE_TMA,
                            PAGE_BOX,
                            K_HEAD_ROWS,
                            V_HEAD_ROWS,
                            GROUP,
                            BLOCK_M,
                            CAUSAL,
                            Q_TMA,
                            V_RING,
                        ),
                    ),
                ],
                [4, LOAD_WARPS],
                [CONS_REGS, LOAD_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (
                        _consumer_partition,
                        (
                            cons,
                            sched,
                            ZERO,
                            GROUP,
                            DQ0,
                            DQ1,
                            DVO,
                            SUB_M,
                            BLOCK_N,
                            STAGES,
                            CAUSAL,
                            HAS_LSE,
                            DBG,
                            PAGE_SIZE,
                            BLOCK_M,
                            OWN_ROWS,
                            Q_TMA,
                            O_STAGE,
                            PINGPONG,
                            TILE_FENCE,
                            V_RING,
                        ),
                    ),
                    (
                        _consumer_partition,
                        (
                            cons,
                            sched,
                            R1,
                            GROUP,
                            DQ0,
                            DQ1,
                            DVO,
                            SUB_M,
                            BLOCK_N,
                            STAGES,
                            CAUSAL,
                            HAS_LSE,
                            DBG,
                            PAGE_SIZE,
                            BLOCK_M,
                            OWN_ROWS,
                            Q_TMA,
                            O_STAGE,
                            PINGPONG,
                            TILE_FENCE,
                            V_RING,
                        ),
                    ),
                    (
                        _consumer_partition,
                        (
                            cons,
                            sched,
                            R2,
                            GROUP,
                            DQ0,
                            DQ1,
                            DVO,
                            SUB_M,
                            BLOCK_N,
                            STAGES,
                            CAUSAL,
                            HAS_LSE,
                            DBG,
                            PAGE_SIZE,
                            BLOCK_M,
                            OWN_ROWS,
                            Q_TMA,
                            O_STAGE,
                            PINGPONG,
                            TILE_FENCE,
                            V_RING,
                        ),
                    ),
                    (
                        _load_partition,
                        (
                            load,
                            gather,
                            sched,
                            k_desc,
                            k1_desc,
                            v_desc,
                            q_desc,
                            tma_ints,
                            PAGE_SIZE,
                            BLOCK_N,
                            DQ0,
                            DQ1,
                            DVO,
                            STAGES,
                            LOAD_WARPS,
                            DBG,
                            USE_TMA,
                            PAGE_BOX,
                            K_HEAD_ROWS,
                            V_HEAD_ROWS,
                            GROUP,
                            BLOCK_M,
                            CAUSAL,
                            Q_TMA,
                            V_RING,
                        ),
                    ),
                ],
                [4, 4, LOAD_WARPS],
                [CONS_REGS, CONS_REGS, LOAD_REGS],
            )


def unavailable_reason(batch: PrefillBatch) -> str | None:
    """Why this kernel cannot serve the call (None when it can)."""
    if gluon is None:
        return f"Gluon is not importable: {_IMPORT_ERROR}"
    dt = batch.q.dtype
    if dt not in (torch.float16, torch.bfloat16) or batch.k.dtype != dt or batch.v.dtype != dt:
        return "q, k and v must share one 16-bit dtype"
    if (batch.head_dim_qk, batch.head_dim_vo) not in ((64, 64), (128, 128), (192, 128)):
        return "head dims other than Dqk = Dvo in {64, 128} and Dqk 192 / Dvo 128"
    if not batch.scale > 0 or any(x is not None for x in (batch.q_scale, batch.k_scale, batch.v_scale)):
        return "scale tensors or a non-positive scale"
    # cp.async copies 16-byte chunks, and Triton proves an integer's alignment only as "divisible by
    # 16": every q, K and V stride must be a multiple of 16 elements
    for name, t in (("q", batch.q), ("k", batch.k), ("v", batch.v)):
        if t.data_ptr() % 16 or t.stride(-1) != 1 or any(st % 16 for st in t.stride()[:-1]):
            return (
                f"{name} strides are not multiples of 16 elements, or its rows not 16-byte aligned (cp.async)"
            )
    if batch.device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(batch.device) != (9, 0):
        return "the Gluon kernel is written for sm_90 (wgmma)"
    return None


@dataclass(frozen=True)
class Config:
    """Launch knobs of the warp-specialised kernel (compile-time constants, except ``persistent``,
    which sets the grid, and ``chunk``, a runtime argument).

    ``BLOCK_M = 64 * consumers`` query rows per program; the register split is per thread and must
    satisfy ``128 * (consumers * consumer_regs + load_regs * load_warps / 4) <= 65536``.
    """

    BLOCK_N: int = 64  # keys per pipeline stage
    stages: int = 5  # K/V shared-memory ring depth
    consumers: int = 3  # softmax/MMA warpgroups of 64 rows each (2 or 3)
    load_warps: int = 4
    consumer_regs: int = 152
    load_regs: int = 56
    tma: int = 1  # bulk-tensor (TMA) copies for whole tiles where the cache allows (pages >= 16, ragged)
    persistent: int = 1  # programs per SM, each looping over work items; 0: one program per work item
    chunk: int = 4  # (sequence, KV head) pairs whose row blocks are dealt together; 0: all pairs
    # causal: each consumer walks and masks key tiles by its own 64 rows' diagonal, not the block's
    # (tiles past its last key are released unread). With q_tma and o_stage, against off on the H200:
    # +7% mla192, +3% page64, +1-2% q16k and b4_q4k, level on b16_q1k and chunked
    # (bench/results/h200-probe-2026-11-29.log)
    own_rows: int = 1
    # 1: items come off a per-call work counter as each program's loads reach them (list scheduling
    # in the same order) instead of the static snake rounds: +10% varlen, +3-5% b4_q4k, D 64 and
    # mla192; -7% chunked prefill and -1 to -3% on prompts of 1k (equal items: static rounds keep
    # the programs that share K/V in step, so its tiles stay in L2). A runtime argument; `config`
    # turns it off for max_q <= 1024 and for max_kv >= 4 max_q
    dynamic: int = 1
    # 1: the load warps copy each item's Q by TMA (Dqk 64 / 128, 192 with dqk192; GQA group dividing
    # 64, q 16-byte aligned; else cp.async by the consumers at the item's start), issued once the
    # consumers hand the slot back: past the item's last QK GEMM, or with o_stage once O is read back
    q_tma: int = 1
    # 1: the epilogue stages O through the warpgroup's Q slot and stores whole rows of 16-byte
    # vectors (out in q's dtype, Dqk = Dvo; else straight from the wgmma accumulator layout, 16-byte
    # pieces of 8 rows per warp store). With q_tma, measured on the H200 against neither: +10%
    # b16_q1k, +9% page1, +6% llama70b, +4% page64 and non-causal, +2% q16k, chunked and D 64
    # level, varlen -1% (bench/results/h200-ostage-probe.log)
    o_stage: int = 1
    # 1: q_tma and o_stage also for Dqk 192 / Dvo 128 (Q in two column parts, O staged in the first,
    # only where Q comes by TMA); mla192 +2% and +4% against off in two probes
    # (bench/results/h200-probe-2026-11-29.log)
    dqk192: int = 1
    # 1: o_stage through a buffer of each consumer's own instead of its Q slot, so (with q_tma) the
    # next item's Q is copied during the item's last tile and epilogue, not after it; the buffer
    # takes the room of K/V stages where shared memory is short (`stages`). Measured: level to -2%
    # on the 64-key shapes (5 -> 4 stages: level alone), -28% / -39% on WIDE page64 / chunked
    # (3 -> 2 stages)
    o_buf: int = 0
    # 1: the consumers issue each tile's two GEMMs in turn (FA3's ping-pong schedule, by mbarriers),
    # so one consumer's softmax runs beside the others' GEMMs instead of all softmaxes at once.
    # Measured on the rule's tiles: -12% b4_q4k, -7% varlen, -1 to -2.4% elsewhere, chunked (WIDE)
    # level; WIDE tiles everywhere (FA3's 2 x 64 rows x 128 keys): q16k 561 TFLOP/s against 566
    pingpong: int = 0
    # 1: the consumers fence the async proxy after every key tile's kv_full wait (MEMBAR.ALL.CTA +
    # FENCE.VIEW.ASYNC.S in the SASS key loop); 0: only after tiles gathered by cp.async (generic-
    # proxy writes), not after those the load warps took by TMA (async proxy, as wgmma reads).
    # 0 measured level on the H200 (-1.0% to +1.1%, bench/results/h200-probe-2026-11-29.log, 23:20
    # UTC); its 12-case GPU test grid passed (bench/results/h200-gpu-tests-2026-11-30.log)
    tile_fence: int = 1
    # 1: V tiles in a ring of their own: a K stage is released after its QK GEMM instead of after
    # the PV GEMM one tile later, so the load warps run K up to two tiles further ahead of the
    # consumers, and a K stage more fits where Q and the rings leave room (`ring_stages`: Dqk 192
    # 3 -> 4 K stages, D 128 5 -> 6)
    v_ring: int = 0

    @property
    def BLOCK_M(self) -> int:
        return 64 * self.consumers


DEFAULT = Config()
_ENV_KEYS = {f.name for f in fields(Config)}
_SWITCHES = (
    "tma",
    "own_rows",
    "dynamic",
    "q_tma",
    "o_stage",
    "dqk192",
    "o_buf",
    "pingpong",
    "tile_fence",
    "v_ring",
)
# Benchmark diagnostics only, never for results: bit 0 skips the K/V copies, bit 1 the softmax,
# bit 2 the V copies, bit 3 the Q copies, bit 4 the O / LSE stores (so the pipeline's compute-only
# and load-only speeds and the per-item costs can be measured).
DIAGNOSTIC_SKIP = 0


# 128 x 128 tiles on two consumers: 128 query rows per K/V tile instead of 192 (more L2 traffic per
# FLOP), half as many tile steps per key; faster where `prefers_wide` says (docs/triton_kernel.md)
WIDE = {"consumers": 2, "BLOCK_N": 128, "consumer_regs": 224, "load_regs": 56}


def prefers_wide(batch: PrefillBatch) -> bool:
    """Whether ``WIDE`` beat ``DEFAULT`` on the H200 for calls like this one, from host ints only:
    D = 128, TMA-eligible K/V, and non-causal, pages of >= 64 tokens or a prefix of >= 3 query lengths
    (``max_kv >= 4 * max_q``, chunked prefill); causal calls with ``max_q`` near ``max_kv`` and pages
    of 16 tokens lost 1-7%. A call picks one of two compiled variants per (dtype, GQA, page size,
    causal), never one per length."""
    if (batch.head_dim_qk, batch.head_dim_vo) != (128, 128) or (batch.paged and batch.page_size < 16):
        return False
    return not batch.causal or (batch.paged and batch.page_size >= 64) or batch.max_kv >= 4 * batch.max_q


def config(batch: PrefillBatch | None = None) -> Config:
    """``DEFAULT``, with ``WIDE`` where :func:`prefers_wide` says so for ``batch`` and static rounds
    (``dynamic=0``) for short prompts (``max_q <= 1024``) and chunked prefill (``max_kv >= 4 * max_q``);
    ``PAGEDPREFILL_GLUON_CONFIG="stages=4,consumers=2,..."`` replaces that choice with ``DEFAULT`` and
    its knobs applied; with a leading ``+`` (``"+q_tma=1"``) the knobs apply on top of the choice."""
    raw = os.environ.get("PAGEDPREFILL_GLUON_CONFIG", "").strip()
    base = DEFAULT
    if not raw or raw.startswith("+"):
        if batch is not None:
            base = replace(DEFAULT, **WIDE) if prefers_wide(batch) else DEFAULT
            if batch.max_q <= 1024 or batch.max_kv >= 4 * batch.max_q:
                base = replace(base, dynamic=0)
        raw = raw[1:].strip()
        if not raw:
            return base
    over = {}
    for item in raw.split(","):
        key, _, val = item.partition("=")
        key = key.strip()
        if key not in _ENV_KEYS:
            raise ValueError(
                f"PAGEDPREFILL_GLUON_CONFIG: unknown knob {key!r}; expected one of {sorted(_ENV_KEYS)}"
            )
        try:
            over[key] = int(val)
        except ValueError:
            raise ValueError(
                f"PAGEDPREFILL_GLUON_CONFIG: knob {key!r} takes an integer, got {val.strip()!r}"
            ) from None
    cfg = replace(base, **over)
    why = None
    if cfg.consumers not in (2, 3):
        why = f"consumers must be 2 or 3, got {cfg.consumers}"
    elif cfg.stages < 2:  # one stage deadlocks: a consumer waits for the tile its own release unblocks
        why = f"stages must be >= 2, got {cfg.stages}"
    elif cfg.BLOCK_N not in (16, 32, 64, 128):
        why = f"BLOCK_N must be 16, 32, 64 or 128, got {cfg.BLOCK_N}"
    elif cfg.load_warps not in (2, 4, 8):
        why = f"load_warps must be 2, 4 or 8, got {cfg.load_warps}"
    elif any(r % 8 or not 24 <= r <= 256 for r in (cfg.consumer_regs, cfg.load_regs)):
        why = "consumer_regs and load_regs must be multiples of 8 in [24, 256]"
    elif 128 * cfg.consumers * cfg.consumer_regs + 32 * cfg.load_warps * cfg.load_regs > 65536:
        why = "registers over budget: 128 * consumers * consumer_regs + 32 * load_warps * load_regs > 65536"
    elif not 0 <= cfg.persistent <= 4:
        why = f"persistent must be 0 (off) or 1-4 programs per SM, got {cfg.persistent}"
    elif cfg.chunk < 0:
        why = f"chunk must be >= 0 (0: all pairs in one chunk), got {cfg.chunk}"
    else:
        bad = [k for k in _SWITCHES if getattr(cfg, k) not in (0, 1)]
        if bad:
            why = f"{bad[0]} must be 0 or 1, got {getattr(cfg, bad[0])}"
    if why:
        raise ValueError(f"PAGEDPREFILL_GLUON_CONFIG: {why}")
    return cfg


def _tma_view(t: torch.Tensor, batch: PrefillBatch, box_rows: int, d: int):
    """A 2-D view of a K or V cache (head dim ``d``) for TMA boxes of ``[box_rows, min(d, 128)]``:
    ``(descriptor, page_rows, head_off, head_in_rows)``, or None when the strides do not allow one.

    Row ``page * page_rows + slot`` (paged) or ``start + key`` (ragged) holds the head-0 key row; a
    head is ``head_off`` rows further (HND-like layouts) or ``head_off`` elements to the right
    (NHD-like layouts, where all heads of a token share a row).
    """
    h = batch.num_kv_heads
    if batch.paged:
        sp, sh, st = t.stride(0), t.stride(1), t.stride(2)
    else:
        sp, sh, st = 0, t.stride(1), t.stride(0)
    if t.data_ptr() % 16 or t.stride(-1) != 1 or (st * t.element_size()) % 16 or st < d:
        return None
    if h == 1 or (sh >= st and sh % st == 0):
        head_rows, head_off, cols = True, (sh // st if h > 1 else 0), d
    elif (h - 1) * sh + d <= st:
        head_rows, head_off, cols = False, sh, st
    else:
        return None
    if batch.paged:
        if sp % st:
            return None
        page_rows = sp // st
        rows = (t.shape[0] - 1) * page_rows + batch.page_size
    else:
        page_rows = 0
        rows = t.shape[0]
    rows += (h - 1) * head_off if head_rows else 0
    if rows <= 0 or rows >= 2**31:  # an empty cache (no TMA needed), or past int32 coordinates
        return None
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    desc = TensorDescriptor(t, [rows, cols], [st, 1], [box_rows, min(d, 128)], layout)
    return desc, page_rows, head_off, head_rows


def _tma_plan(batch: PrefillBatch, cfg: Config):
    """``(box_rows, k_view, v_view, k1_desc)`` when this call's whole tiles can arrive by TMA, else
    None; ``k1_desc`` boxes K's columns past 128 (Dqk 192), else None."""
    if not cfg.tma:
        return None
    if batch.paged:
        box = min(batch.page_size, cfg.BLOCK_N)
        if batch.page_size < 16 or batch.page_size % box or cfg.BLOCK_N % box:
            return None
    else:
        box = cfg.BLOCK_N
    kv = _tma_view(batch.k, batch, box, batch.head_dim_qk), _tma_view(batch.v, batch, box, batch.head_dim_vo)
    if None in kv:
        return None
    k1 = None
    if batch.head_dim_qk > 128:
        k0 = kv[0][0]
        k1 = TensorDescriptor(batch.k, k0.shape, k0.strides, [box, batch.head_dim_qk - 128], k0.layout)
    return (box, *kv, k1)


def _q_tma_applies(batch: PrefillBatch, cfg: Config) -> bool:
    q, g = batch.q, batch.group_size
    dims = (64, 128, 192) if cfg.dqk192 else (64, 128)
    aligned = q.data_ptr() % 16 == 0
    return bool(cfg.q_tma and batch.head_dim_qk in dims and 64 % g == 0 and aligned and q.shape[0])


def _q_tma_desc(batch: PrefillBatch, cfg: Config):
    """The descriptor of q's 3-D view ``[tokens, heads, Dqk]`` for ``Config.q_tma``'s boxes of
    ``[64 / G, G, 64]``, or None where they do not apply (knob off, Dqk 192 with knob dqk192 off, a GQA
    group that does not divide 64, q not 16-byte aligned, no query tokens)."""
    if not _q_tma_applies(batch, cfg):
        return None
    q, g = batch.q, batch.group_size
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    return TensorDescriptor(q, list(q.shape), list(q.stride()), [64 // g, g, 64], layout)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


SMEM_BYTES = 227 * 1024 - 1024  # sm_90's shared memory per block, less room for the barriers


def o_stage_mode(batch: PrefillBatch, cfg: Config) -> int:
    """How the epilogue stores O (the kernel's ``O_STAGE``): 0 straight from the wgmma accumulator
    layout, 1 staged through the consumer's Q slot, 2 through a buffer of its own (``Config.o_buf``).
    Staging needs out in q's dtype and O to fit the slot's first min(Dqk, 128) columns; Dqk 192
    stages only with Q by TMA (``dqk192``; with the consumers' own Q copies ptxas spills 640 bytes
    around each item there, against 204 unstaged)."""
    dqk192 = batch.head_dim_qk == 192 and cfg.dqk192 and _q_tma_applies(batch, cfg)
    fits = batch.head_dim_qk == batch.head_dim_vo or dqk192
    if not (cfg.o_stage and batch.out.dtype == batch.q.dtype and fits):
        return 0
    return 2 if cfg.o_buf else 1


def _q_bytes(batch: PrefillBatch, cfg: Config) -> int:
    """Shared memory of the Q slots (and of O's own buffers with ``o_buf``)."""
    q_bytes = cfg.BLOCK_M * batch.head_dim_qk * batch.q.element_size()
    if o_stage_mode(batch, cfg) == 2:
        q_bytes += cfg.BLOCK_M * batch.head_dim_vo * batch.q.element_size()
    return q_bytes


def stages(batch: PrefillBatch, cfg: Config) -> int:
    """``cfg.stages``, or fewer where Q (and O's own buffer) and the K/V ring would not fit in shared
    memory (Dqk 192, ``o_buf``)."""
    stage_bytes = cfg.BLOCK_N * (batch.head_dim_qk + batch.head_dim_vo) * batch.q.element_size()
    return max(2, min(cfg.stages, (SMEM_BYTES - _q_bytes(batch, cfg)) // stage_bytes))


def ring_stages(batch: PrefillBatch, cfg: Config) -> tuple[int, int]:
    """``(K stages, V stages)``: both :func:`stages` in one K/V ring; with ``v_ring`` V keeps that
    many slots and K takes one stage more where it fits (the kernel's ``STAGES``, ``V_STAGES``)."""
    n = stages(batch, cfg)
    if not cfg.v_ring:
        return n, n
    esz = batch.q.element_size()
    k_bytes, v_bytes = cfg.BLOCK_N * batch.head_dim_qk * esz, cfg.BLOCK_N * batch.head_dim_vo * esz
    fits = _q_bytes(batch, cfg) + (n + 1) * k_bytes + n * v_bytes <= SMEM_BYTES
    return n + int(fits), n


def num_m_blocks(batch: PrefillBatch, cfg: Config) -> int:
    return -(-batch.max_q * batch.group_size // cfg.BLOCK_M)


def launch_plan(batch: PrefillBatch, cfg: Config | None = None):
    """The launches of one call: a list of ``(kernel, grid, args, kwargs)``. Reads no device data."""
    from pagedprefill.backends import triton_backend as tb  # (it imports this module)

    cfg = config(batch) if cfg is None else cfg
    if DIAGNOSTIC_SKIP:
        warnings.warn(
            f"gluon_sm90.DIAGNOSTIC_SKIP={DIAGNOSTIC_SKIP}: the Gluon kernel skips work, results are wrong",
            RuntimeWarning,
            stacklevel=2,
        )
    bsz, hkv = batch.batch_size, batch.num_kv_heads
    if bsz == 0 or batch.max_q == 0:
        return []
    paged = batch.paged
    meta = batch.meta
    bt = batch.block_tables if paged else meta
    k, v, q, out = batch.k, batch.v, batch.q, batch.out
    kstr, vstr = tb.kv_strides(batch)
    n_m = num_m_blocks(batch, cfg)
    tma_plan = _tma_plan(batch, cfg)
    if tma_plan:
        _, k_tma, v_tma, k1_desc = tma_plan
        tma_ints = (k_tma[1], k_tma[2], v_tma[1], v_tma[2])
    else:
        tma_ints = (0, 0, 0, 0)
    q_desc = _q_tma_desc(batch, cfg)
    k_stages, v_stages = ring_stages(batch, cfg)
    total = hkv * bsz * n_m
    grid = total
    if cfg.persistent and batch.device.type == "cuda":  # (CPU: compile-only tests)
        grid = min(total, _num_sms(batch.device) * cfg.persistent)
    if total + grid >= 2**31:  # (rounds run to total + grid in int32)
        raise ValueError(f"too many work items for one launch ({total}); split the batch")
    args = (
        q,
        k,
        v,
        out,
        batch.lse if batch.lse is not None else meta,
        meta,
        bt,
        batch.work_counter if batch.work_counter is not None else meta,
        int(bool(cfg.dynamic and batch.work_counter is not None)),
        float(batch.scale) * LOG2E,
        meta.stride(0),
        bsz,
        n_m,
        k.shape[0],
        bt.stride(0) if paged else 0,
        q.stride(0),
        q.stride(1),
        *kstr,
        *vstr,
        out.stride(0),
        out.stride(1),
        batch.num_qo_heads,
        hkv,
        min(cfg.chunk, hkv * bsz) if cfg.chunk > 0 else hkv * bsz,
        k_tma[0] if tma_plan else None,
        k1_desc if tma_plan else None,
        v_tma[0] if tma_plan else None,
        q_desc,
        *tma_ints,
    )
    kwargs = dict(
        GROUP=batch.group_size,
        PAGE_SIZE=batch.page_size if paged else 0,
        DQK=batch.head_dim_qk,
        DVO=batch.head_dim_vo,
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        CAUSAL=bool(batch.causal),
        HAS_LSE=batch.lse is not None,
        STAGES=k_stages,
        LOAD_WARPS=cfg.load_warps,
        CONS_REGS=cfg.consumer_regs,
        LOAD_REGS=cfg.load_regs,
        NC=cfg.consumers,
        DBG=DIAGNOSTIC_SKIP,
        USE_TMA=bool(tma_plan),
        PAGE_BOX=tma_plan[0] if tma_plan else 0,
        K_HEAD_ROWS=bool(tma_plan and k_tma[3]),
        V_HEAD_ROWS=bool(tma_plan and v_tma[3]),
        OWN_ROWS=bool(cfg.own_rows),
        Q_TMA=q_desc is not None,
        O_STAGE=o_stage_mode(batch, cfg),
        PINGPONG=bool(cfg.pingpong),
        TILE_FENCE=bool(cfg.tile_fence or not tma_plan),  # (without TMA every tile is gathered)
        V_STAGES=v_stages,
        V_RING=bool(cfg.v_ring),
        num_warps=4,
    )
    return [(_attention_kernel, (grid,), args, kwargs)]
