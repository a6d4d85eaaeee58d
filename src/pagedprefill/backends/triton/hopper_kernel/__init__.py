"""The Hopper (sm_90) attention kernel in Gluon, Triton's explicit-layout dialect.

How it works (``docs/design.md`` has the reasons and ``docs/decisions.md`` what was tried):

* A work item is ``BLOCK_M = 64 * NC`` query rows of one sequence and one KV head; a row is a
  (token, head-in-group) pair, so each K/V tile is loaded once for the whole GQA group.
* A persistent grid (one program per SM) takes items in chunks of (sequence, KV head) pairs,
  heaviest row block first; either off a work counter as each program's loads reach their next
  item (``dynamic``: one counter per stream, which the launch's last claim leaves at zero), or in
  static snake-ordered rounds.
* Each program is split into partitions (``gl.warp_specialize``): the load warps fill a ring of
  ``STAGES`` K/V tiles (bulk-tensor copies for tiles wholly below ``kv_len``, a zero-filling
  ``cp.async`` gather otherwise) and copy each item's Q by TMA; ``NC`` consumer warpgroups of 64
  rows each (at D 64, and D 128 with 8-bit K/V, the first two as one 8-warp partition, ``Geometry.MERGED``: one copy of
  their code; ``sync`` keeps them from meeting at every key tile) run ``S_j = Q K_j^T`` as an
  asynchronous wgmma beside the rescale of O and
  ``O += P_{j-1} V_{j-1}``, so the softmax of tile j overlaps the PV GEMM of tile j-1.
* Causal consumers walk key tiles only up to their own rows' diagonal and release the rest unread.
* Static rounds whose last round would leave most programs idle split that round's items by keys
  into shares (float32 partials in the scratch), merged by :func:`share_merge_kernel` after the
  kernel.

The state is grouped in aggregates: :class:`Geometry` (compile-time shape of the kernel),
:class:`Schedule` (work items and the item ring), :class:`KVRing` / :class:`QSlots` (shared
memory and its barriers), :class:`KVSource` (where K/V rows are in global memory) and
:class:`WorkItem` (one item's sequence, head, rows and key range).

Files by concern: ``geometry`` (shape, work item), ``schedule`` (dealing items), ``buffers`` (shared
memory rings), ``loads`` (the load partition, TMA / cp.async, 8-bit widening), ``softmax`` (the
online softmax and O's lazy rescale), ``consumer`` (the consumer partition and epilogue), ``kernel``
(the entry), ``merge`` (the shares' merge), ``sync`` (waits without a partition barrier: a PTX
pass), ``rows`` (a sequence's lengths and starts: the metadata
table's, or computed from the device vectors in place of the table).

Lengths, offsets and page ids are read on the device; page ids are clamped; rows with no visible
key get out 0 and lse -inf.
"""

from . import sync  # noqa: F401  (installs the PTX pass of sync.wait_unsynced)
from .kernel import BOUND_ARGS, VECTOR_ARGS, attention_kernel
from .merge import HEADER_INTS, PART_OFFSET, share_merge_kernel

__all__ = ["BOUND_ARGS", "HEADER_INTS", "PART_OFFSET", "VECTOR_ARGS", "attention_kernel", "share_merge_kernel"]
