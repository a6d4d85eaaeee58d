"""pagedprefill: batched prefill attention over a paged KV cache (cuDNN, Triton and PyTorch backends).

``cudnn_batch_prefill_with_kv_cache`` is FlashInfer's function of that name (drop-in);
``batch_prefill_with_kv_cache`` the same with ``backend="auto"``; ``plan(...).run(...)`` plans a batch
once and runs it per layer; the ``BatchPrefillWith*Wrapper`` classes are FlashInfer's wrappers;
``merge_state(s)`` combine attention results over disjoint key sets.
"""

from pagedprefill.api import (
    batch_prefill_with_kv_cache,
    clear_caches,
    cudnn_batch_prefill_with_kv_cache,
    last_backend,
    plan,
)
from pagedprefill.batch import BackendUnavailableError
from pagedprefill.dispatch import BACKENDS
from pagedprefill.merge import merge_state, merge_states
from pagedprefill.prefill_plan import PrefillPlan
from pagedprefill.wrappers import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "PrefillPlan",
    "batch_prefill_with_kv_cache",
    "clear_caches",
    "cudnn_batch_prefill_with_kv_cache",
    "last_backend",
    "merge_state",
    "merge_states",
    "plan",
]
__version__ = "0.2.0"
