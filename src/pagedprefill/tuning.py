"""Launch-knob overrides for tuning scripts and tests: ``with tuning.override("triton", BLOCK_M=64): ...``.

Backends read their knobs here when they plan a call; plans made under other knobs are never reused
(the call cache keys on :data:`generation`). Knob names and values are each backend's to check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_KNOBS: dict[str, dict[str, int]] = {}
generation = 0


def knobs(backend: str) -> dict[str, int]:
    """The knobs forced for ``backend`` ("triton" for the portable kernel, "hopper" for the sm_90
    kernel); empty when none are."""
    return _KNOBS.get(backend, {})


@contextlib.contextmanager
def override(backend: str, **values: int) -> Iterator[None]:
    """Force ``values`` for ``backend``'s plans made inside the block."""
    global generation
    saved = dict(_KNOBS.get(backend, {}))
    _KNOBS[backend] = {**saved, **values}
    generation += 1
    try:
        yield
    finally:
        _KNOBS[backend] = saved
        generation += 1
