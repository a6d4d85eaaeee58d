"""pagedprefill: batched prefill attention over a paged KV cache (cuDNN, Triton and PyTorch backends)."""

from pagedprefill.api import (
    BACKENDS,
    BackendUnavailableError,
    batch_prefill_with_kv_cache,
    cudnn_batch_prefill_with_kv_cache,
    last_backend,
)

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "batch_prefill_with_kv_cache",
    "cudnn_batch_prefill_with_kv_cache",
    "last_backend",
]
__version__ = "0.1.0"
