"""Waits on a ring stage without the partition barrier Triton puts before them.

Triton 3.6's shared-memory barrier analysis counts an mbarrier wait as a write to the barrier, so it
puts a partition-wide ``bar.sync`` between any two waits (or an arrive and a wait) on one barrier
allocation: one per key tile at the head of the consumers' loop. A wait writes nothing another
thread reads; the barrier only makes the warpgroups of a partition meet. In a partition of one
warpgroup that costs little; in the 8-warp consumer partition (``Geometry.MERGED``) it makes its two
warpgroups run in lockstep, softmax beside softmax, instead of each one's softmax beside the other's
GEMMs.

:func:`wait_unsynced` marks a wait with a PTX comment, and :func:`drop_marked_barriers`, run on the
kernel's PTX (a stage hook installed on import), deletes the ``bar.sync`` Triton put between that
mark and the wait. A marked wait must have no real hazard pending before it: no shared-memory write
by the partition's threads since the last barrier that another of its threads reads after the wait
(the consumers' key loop writes no shared memory: P stays in registers). Without the hook the
barrier stays: slower, never wrong. Triton's kernel cache keys on the kernel source (the mark
included), not on this pass: a change to what the pass drops must change ``MARK`` too.
"""

import re

from triton import knobs
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

MARK = "pagedprefill: wait without partition barrier"
_MARKED_MOV = gl.constexpr("mov.b32 $0, $1; // " + MARK)  # (a copy of the phase, carrying the mark)

# PTX lines between the mark and its wait that do not touch memory or synchronise (index arithmetic)
_ARITH = "add|sub|mul|mad|shl|shr|and|or|xor|mov|cvt|selp|setp|bfe"
_NEUTRAL = re.compile(r"^(//|\.loc|\{|\}|\.reg|\$L|[a-zA-Z_$][\w$]*:$|(" + _ARITH + r")\.)")
_BAR = re.compile(r"^(bar\.sync|barrier\.sync)\b")


@gluon.jit
def wait_unsynced(bar, phase):
    """``mbarrier.wait(bar, phase)`` with the partition barrier before it dropped (see the module)."""
    ph = gl.inline_asm_elementwise(_MARKED_MOV, "=r,r", [phase], dtype=gl.int32, is_pure=False, pack=1)
    mbarrier.wait(bar, ph)


def drop_marked_barriers(ptx: str) -> tuple[str, int]:
    """``ptx`` without the ``bar.sync`` between each mark and the next mbarrier wait, where only index
    arithmetic lies between them; and how many were dropped."""
    if MARK not in ptx:
        return ptx, 0
    lines = ptx.split("\n")
    keep = [True] * len(lines)
    dropped = 0
    i = 0
    while i < len(lines):
        if MARK not in lines[i]:
            i += 1
            continue
        bar = None
        j = i + 1
        while j < len(lines):
            t = lines[j].strip()
            if not t or _NEUTRAL.match(t):
                j += 1
                continue
            if _BAR.match(t) and bar is None:
                bar = j
                j += 1
                continue
            if t.startswith("mbarrier.try_wait") and bar is not None:
                keep[bar] = False
                dropped += 1
            break
        i = j
    return "\n".join(line for line, k in zip(lines, keep) if k), dropped


def _hook(previous):
    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        make_ptx = stages.get("ptx")
        if make_ptx is None:
            return

        def ptx_stage(src, metadata):
            return drop_marked_barriers(make_ptx(src, metadata))[0]

        stages["ptx"] = ptx_stage

    hook.pagedprefill = True
    return hook


def install() -> None:
    """Chain the PTX pass onto Triton's stage hook (once per process)."""
    current = knobs.runtime.add_stages_inspection_hook
    if not getattr(current, "pagedprefill", False):
        knobs.runtime.add_stages_inspection_hook = _hook(current)


install()
