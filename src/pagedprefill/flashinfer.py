"""FlashInfer's names with FlashInfer's conventions, for code ported by changing one import::

    from pagedprefill import flashinfer

    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, 32, 8, 128, 16, causal=True)
    out, lse = wrapper.run(q, (k_cache, v_cache), return_lse=True)   # lse in base 2, as FlashInfer's
    merged, lse = flashinfer.merge_state(out, lse, out2, lse2)         # base 2 here too

``merge_state`` / ``merge_state_in_place`` / ``merge_states`` here take base-2 LSEs (FlashInfer's
wrappers' convention); the top-level ``pagedprefill.merge_state`` takes this library's natural-log
LSEs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedprefill import merge as _merge
from pagedprefill.api import cudnn_batch_prefill_with_kv_cache
from pagedprefill.batch import fail
from pagedprefill.normalise import internal_overlap
from pagedprefill.wrappers import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

__all__ = [
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "cudnn_batch_prefill_with_kv_cache",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
]


def merge_state(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor) -> tuple[Tensor, Tensor]:
    """FlashInfer's ``merge_state``: base-2 LSEs (see :func:`pagedprefill.merge_state`)."""
    return _merge.merge_state(v_a, s_a, v_b, s_b, lse_base=2)


def merge_states(v: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """FlashInfer's ``merge_states``: base-2 LSEs (see :func:`pagedprefill.merge_states`)."""
    return _merge.merge_states(v, s, lse_base=2)


def merge_state_in_place(v: Tensor, s: Tensor, v_other: Tensor, s_other: Tensor, mask: Tensor | None = None) -> None:
    """FlashInfer's ``merge_state_in_place``: ``(v, s)`` becomes its merge with ``(v_other, s_other)``
    (base-2 LSEs; v (tokens, H, D), s (tokens, H) float32); with ``mask`` ((tokens,) bool), only
    the rows where it is True (a CUDA graph's fixed shapes with fewer live rows)."""
    for name, t in (("v", v), ("s", s)):  # (written in place: every element its own memory)
        if isinstance(t, Tensor) and internal_overlap(t):
            raise fail(name, "a tensor without overlapping elements (it is written in place)", f"strides {t.stride()}")
    merged_v, merged_s = _merge.merge_pair(v, s, v_other, s_other, True, ("v", "s", "v_other", "s_other"))
    if mask is None:
        v.copy_(merged_v)
        s.copy_(merged_s)
        return
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (v.shape[0],):
        given = f"{mask.dtype} of shape {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise fail("mask", f"a bool tensor of shape ({v.shape[0]},)", given)
    if mask.device != v.device:
        raise fail("mask", f"a tensor on v's device {v.device}", f"one on {mask.device}")
    v.copy_(torch.where(mask[:, None, None], merged_v, v))
    s.copy_(torch.where(mask[:, None], merged_s, s))
