"""Work items dealt to the persistent grid: static snake rounds or a per-call work counter, handed from
the load warps to the consumers through a ring of item ids (:class:`Schedule`).

Static rounds may end in a round that leaves most programs idle (704 items on 132 SMs: five full
rounds and one of 44). The items of that last round can then be split by keys into ``shares``
pieces each, dealt as items of their own: each piece writes its rows' float32 O and log2 LSE into
the scratch, and :func:`.merge.share_merge_kernel` combines them."""

# (no ``from __future__ import annotations``: Gluon aggregates check their fields' annotations)

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.language.core import _aggregate as aggregate

from .geometry import Geometry, WorkItem, _key_range
from .rows import SequenceRows

ITEM_RING = gl.constexpr(4)  # work items the load warps may hand out ahead (dynamic scheduling)


@aggregate
class Schedule:
    """The work items of one launch and how a program gets its next one."""

    rows: SequenceRows  # where each sequence's lengths and starts come from
    BT: gl.tensor  # page ids (paged): sequence b's start at metadata row bt_start
    num_kv_heads: gl.tensor
    n_bh: gl.tensor  # (sequence, KV head) pairs
    num_m_blocks: gl.tensor
    chunk: gl.tensor  # pairs whose row blocks are dealt together
    total: gl.tensor  # work items
    counter: gl.tensor  # dynamic: the stream's work counter (zero at the launch; left at zero by it)
    dynamic: gl.tensor
    item_ids: gl.shared_memory_descriptor  # dynamic: item ids the load warps hand the consumers
    item_full: gl.shared_memory_descriptor
    item_empty: gl.shared_memory_descriptor
    window: gl.tensor  # WINDOW: window_left
    tail_base: gl.tensor  # items from here on are split by keys (n_bh * num_m_blocks: none)
    shares: gl.tensor  # pieces per split item (1: none)
    part: gl.tensor  # float32: the shares' O rows, then their LSEs, then each split item's header

    @gluon.constexpr_function
    def __init__(
        self,
        rows,
        BT,
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
        tail_base,
        shares,
        part,
    ):
        self.rows = rows
        self.BT = BT
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
        self.tail_base = tail_base
        self.shares = shares
        self.part = part

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
    def reset(self, item):
        """Load warps (dynamic), past their last claim (``item >= total``): a program claims until it
        draws an item past the last, so a launch's claims are 0 .. total + grid - 1, one at a time;
        the program that drew the last one zeroes the counter for the next launch on the stream, with
        no claim left to come. (Zeroed inside :meth:`claim`, in the item loop, every such launch hung
        on the H200, the counter reading zero while it ran: see docs/decisions.md.)"""
        last = item == self.total + gl.num_programs(0) - 1
        gl.atomic_xchg(self.counter, 0, mask=last, sem="relaxed")

    @gluon.jit
    def post(self, item, r, WARPS: gl.constexpr):
        """The claiming partition of WARPS warps (dynamic): hand round r's item to the consumers (and
        with ``Geometry.ISSUER`` the gather warps) through slot r % ITEM_RING."""
        slot = r % ITEM_RING
        mbarrier.wait(self.item_empty.index(slot), ((r // ITEM_RING) & 1) ^ 1)
        self.item_ids.index(slot).store(gl.full([1], item, gl.int32, gl.BlockedLayout([1], [32], [WARPS], [0])))
        mbarrier.arrive(self.item_full.index(slot))

    @gluon.jit
    def take(self, r, WARPS: gl.constexpr = 4):
        """Consumers (and the gather warps of a partition of WARPS warps): round r's item: the static
        round's, or (dynamic) the claiming partition's pick."""
        if self.dynamic != 0:
            slot = r % ITEM_RING
            mbarrier.wait(self.item_full.index(slot), (r // ITEM_RING) & 1)
            item = gl.max(self.item_ids.index(slot).load(gl.BlockedLayout([1], [32], [WARPS], [0])), 0)
            mbarrier.arrive(self.item_empty.index(slot))
        else:
            item = self.round_item(r)
        return item

    @gluon.jit
    def work_item(self, item, geo: Geometry, WITH_LSE: gl.constexpr):
        """Work item -> its sequence, KV head, row block and key range. Items run heaviest row block
        first within a chunk of (sequence, KV head) pairs; ``item >= total`` (a last round's missing
        items) decodes as the last item with ``q_len = 0``: no tiles, no stores. Item ``tail_base +
        shares * i + s`` is share s of item ``tail_base + i``: its key tiles ``[s n / shares, (s + 1) n /
        shares)`` of the item's n."""
        n_items = self.n_bh * self.num_m_blocks
        valid = item < self.total
        is_share = valid & (item >= self.tail_base)
        tail = gl.where(is_share, (item - self.tail_base) // self.shares, 0)
        share = gl.where(is_share, item - self.tail_base - tail * self.shares, -1)
        item = gl.where(is_share, self.tail_base + tail, item)
        item = gl.minimum(item, n_items - 1)  # (so that b < batch size: its rows are read unmasked)
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
        rows = self.rows.of(b, geo.PAGE_SIZE, WITH_LSE)
        q_len, kv_len, q_start, o_start, k_start, v_start, lse_start, bt_start = rows
        q_len = gl.where(valid, q_len, 0)
        if geo.PAGE_SIZE > 0:
            BT_row = self.BT + bt_start.to(gl.int64)
        else:
            BT_row = self.BT
        hi, n_tiles, full = _key_range(row0, q_len, kv_len, geo.BLOCK_M, geo)
        t0 = gl.where(is_share, share * n_tiles // self.shares, 0)
        n_tiles = gl.where(is_share, (share + 1) * n_tiles // self.shares, n_tiles)
        return WorkItem(
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
            t0,
            share,
            tail,
        )
