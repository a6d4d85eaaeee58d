"""Which backend ``backend="auto"`` tries first on a CUDA device (filled from recorded benchmarks)."""

from __future__ import annotations

from pagedprefill.api import PrefillBatch


def order(batch: PrefillBatch) -> list[str]:
    return ["triton", "cudnn", "torch"]
