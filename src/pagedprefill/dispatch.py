"""Which backend serves a batch: the registry, ``backend="auto"``'s policy and :func:`last_backend`.

A backend is one registry line here and one module (or package) under ``pagedprefill.backends``.
"""

from __future__ import annotations

import importlib
import sys
import threading
from types import ModuleType

from pagedprefill.batch import BackendUnavailableError, PrefillBatch, fail, visible_pairs

BACKENDS = ("auto", "cudnn", "triton", "torch")
_MODULES = {
    "torch": "pagedprefill.backends.torch_ref",
    "triton": "pagedprefill.backends.triton",
    "cudnn": "pagedprefill.backends.cudnn",
}
_LAST = threading.local()


def backend_module(name: str) -> ModuleType:
    return importlib.import_module(_MODULES[name])


def clear_backend_caches() -> None:
    """Each backend module already imported forgets what it caches (its ``clear_caches``, where it
    has one); none is imported for it."""
    for path in _MODULES.values():
        module = sys.modules.get(path)
        clear = getattr(module, "clear_caches", None)
        if clear is not None:
            clear()


def check_backend(backend: object) -> str:
    """The requested backend's name ("auto" for None), or a ValueError naming the choices
    (NotImplementedError for FlashInfer's ``"cubin"``)."""
    if backend is None:
        return "auto"
    # (FlashInfer's selector for cuDNN's precompiled kernels, a path of its own)
    if isinstance(backend, str) and backend == "cubin":
        raise NotImplementedError(
            f"pagedprefill does not implement FlashInfer's backend='cubin'; expected one of {BACKENDS} or None"
        )
    if backend not in BACKENDS:
        raise fail("backend", f"one of {BACKENDS} or None", repr(backend))
    return backend


def support(name: str, batch: PrefillBatch) -> str | None:
    """Why backend ``name`` cannot serve ``batch`` (None when it can)."""
    try:
        module = backend_module(name)
    except ImportError as exc:
        return f"its module cannot be imported ({exc})"
    reason = module.unavailable_reason(batch.device)
    return reason if reason is not None else module.unsupported_reason(batch)


# the smallest call (FLOPs, 2 (Dqk + Dvo) per visible pair and query head) that auto sends to cuDNN for
# its few tiles: ~100 µs of kernel at the ~250 TFLOP/s such batches reach, above cuDNN's host time
CUDNN_MIN_FLOPS = 20e9


def _host_flops(batch: PrefillBatch) -> float:
    """The call's FLOPs from its host lengths."""
    pairs = sum(visible_pairs(q, kv, batch.causal) for q, kv in zip(batch.host.lens_q, batch.host.lens_kv))
    return 2.0 * (batch.head_dim_qk + batch.head_dim_vo) * batch.num_qo_heads * pairs


def auto_order(batch: PrefillBatch, workspace_bytes: int | None = None) -> list[str]:
    """Backends in the order ``auto`` tries them (fastest first), from the H200 measurements in
    ``bench/results`` (each backend's device time, side by side in one run):

    * wherever this project's Hopper kernel serves the call (16-bit, Dqk = Dvo in {64, 96, 128} or
      Dqk 192 / Dvo 128, sm_90): Triton, ahead of cuDNN on every such workload measured (page sizes
      16 and 64, ragged, 64 to 16k query tokens, GQA 4-8, MLA, D 96); at D 256 too where its tiles
      come by TMA on two 64-key stages with K released apart from V (1.04x cuDNN), while the five
      32-key stages it takes elsewhere (pages the TMA cannot box) read 0.97x, so cuDNN goes first there;
      but at D 128 a batch whose host lengths leave the kernel's programs few key tiles each (a
      handful of short prompts, ``triton.few_tiles``) goes to cuDNN first (1.05-1.16x Triton there),
      unless it is under :data:`CUDNN_MIN_FLOPS` (a kernel shorter than cuDNN's host time per call:
      40-65 µs against Triton's 15-22 in the 32-layer step, so an eager caller would wait on it);
    * page sizes under 16 (per-key gathers, where cuDNN's paged kernel is slow), fp8 (cuDNN refuses
      fp8 attention before Blackwell) and logit soft-capping or CSR pages (cuDNN has neither): Triton;
    * everything else (other head dims on the portable kernel): cuDNN first.

    A backend that cannot serve the call (a head dim it refuses, no graph built yet during CUDA graph
    capture, package missing) falls through to the next one."""
    if batch.device.type != "cuda":
        return ["torch"]
    try:
        from pagedprefill.backends import triton as tb

        hopper = tb.uses_hopper_kernel(batch, workspace_bytes)
    except ImportError:
        hopper = False
    few = hopper and tb.few_tiles(batch) and _host_flops(batch) >= CUDNN_MIN_FLOPS
    hopper_first = hopper and (batch.head_dim_vo <= 128 or tb.hopper_config(batch).split) and not few
    triton_first = hopper_first or (
        (batch.paged and batch.page_size < 16)
        or batch.fp8_q
        or batch.fp8_kv
        or batch.logits_soft_cap > 0
        or batch.pages == "csr"
    )
    return ["triton", "cudnn", "torch"] if triton_first else ["cudnn", "triton", "torch"]


def choose(batch: PrefillBatch, backend: str, workspace_bytes: int | None = None) -> ModuleType:
    """The backend module that serves ``batch`` (``backend`` checked by :func:`check_backend`)."""
    if backend != "auto":
        try:
            module = backend_module(backend)
        except ImportError as exc:
            raise BackendUnavailableError(f"backend={backend!r} is unavailable: {exc}") from exc
        reason = module.unavailable_reason(batch.device)
        if reason is not None:
            raise BackendUnavailableError(f"backend={backend!r} is unavailable: {reason}")
        reason = module.unsupported_reason(batch)
        if reason is not None:
            raise ValueError(f"backend={backend!r} cannot serve this call: {reason}")
        return module
    reasons = []
    for name in auto_order(batch, workspace_bytes):
        reason = support(name, batch)
        if reason is None:
            return backend_module(name)
        reasons.append(f"{name}: {reason}")
    raise ValueError("backend='auto': no backend can serve this call (" + "; ".join(reasons) + ")")


def set_last(name: str) -> None:
    _LAST.backend = name


def last_backend() -> str | None:
    """The backend that served the most recent successful call in this thread (e.g. what "auto"
    picked), or None before the first call."""
    return getattr(_LAST, "backend", None)
