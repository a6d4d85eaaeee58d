"""The one-shot call's cache: a call whose signature matches an earlier one reuses its plan.

A serving engine calls the function once per layer with the same lengths, tables and workspace and
new q / K / V / out tensors of the same layout. Everything a plan depends on is in the signature:
every tensor's layout (shape, strides, dtype, device, 16-byte alignment), the contents of lengths
and offsets given on the host, the layouts of device inputs whose contents kernels read at every
run (block tables, device lengths and offsets, scales, sinks), the workspace's size, every scalar,
the thread (cuDNN handles are per thread) and the tuning generation. The cache holds no tensor of
any call: device inputs are passed again at every run, so a cached plan pins no caller buffer.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from pagedprefill import tuning

MAX_PLANS = 64  # the cache is cleared when full
_PLANS: dict[tuple, object] = {}
_LOCK = threading.Lock()


def _layout(t: object) -> tuple | None:
    if t is None:
        return ()
    if not isinstance(t, Tensor):
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15 == 0)


def _vector(t: object) -> tuple | None:
    """A length / offset vector: by contents on the host, by layout on the device."""
    if t is None:
        return ()
    if not isinstance(t, Tensor):
        return None
    if not t.is_cpu:
        return ("dev", t.shape, t.stride(), t.dtype, t.device)
    if t.dim() not in (1, 4) or t.dtype not in (torch.int32, torch.int64):
        return None
    try:
        # (the contents, as bytes: cheap to hash; an integer tensor never requires grad, so no detach)
        return (t.dtype, t.shape, t.numpy().tobytes())
    except RuntimeError:  # (no numpy)
        return (t.dtype, t.shape, tuple(t.reshape(-1).tolist()))


def _scale(s: object) -> tuple | None:
    if s is None:
        return ()
    if type(s) in (float, int):
        return ("v", s)
    if isinstance(s, Tensor) and not s.is_cpu:
        return _layout(s)
    return None


def signature(tensors: tuple, vectors: tuple, scales: tuple, scalars: tuple, types: tuple) -> tuple | None:
    """The key of a call, or None when it must take the full path (an argument of an unexpected type,
    or a CPU scale tensor). ``vectors``: lengths q / kv, then offsets q, o, k, v, stats. ``types``: the
    scalars' types (with them, True == 1 == 1.0 never makes a call whose causal is 1 take the plan of
    causal=True: it must be refused as the first such call was)."""
    parts = [
        ()
        if t is None
        else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15 == 0)
        if isinstance(t, Tensor)
        else None
        for t in tensors
    ]  # (_layout, inlined: a call's eight tensors)
    parts += [_vector(t) for t in vectors]
    if scales[0] is None and scales[1] is None and scales[2] is None:
        parts += _NO_SCALE_PARTS
    else:
        parts += [_scale(s) for s in scales]
    if None in parts:
        return None
    return (*parts, _aliases(vectors), scalars, types, threading.get_ident(), tuning.generation)


def _aliases(vectors: tuple) -> tuple:
    """Whether the o and stats offsets on the device are q's own vector (by address: their layouts
    are in the key): an out / packed LSE the call allocates depends on it
    (:func:`pagedprefill.normalise.alloc_rows`), and layouts alone would not tell two calls apart."""
    q = vectors[2]
    if not isinstance(q, Tensor) or q.is_cpu:
        return ()
    ptr = q.data_ptr()
    return tuple([isinstance(t, Tensor) and t.data_ptr() == ptr for t in (vectors[3], vectors[6])])


_NO_SCALE_PARTS = [(), (), ()]


def get(key: tuple | None):
    return _PLANS.get(key) if key is not None else None


def put(key: tuple | None, value) -> None:
    if key is None:
        return
    with _LOCK:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = value


def clear() -> None:
    """Forget every cached call plan."""
    _PLANS.clear()
