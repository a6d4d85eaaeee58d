"""The calls a benchmark times, built from the workloads (:mod:`pagedprefill.workloads`).

A :class:`Case` is one workload on one device: the keyword arguments of the public function on the
workload's data and, for an fp8 workload, also on the 16-bit data it was quantized from (what a
system without that fp8 path runs, as the workloads' README says). References and contiguous
copies for the outside systems are made on demand, once per data.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch

import pagedprefill
from pagedprefill import dispatch
from pagedprefill import workloads as wl

from . import checks
from .common import Skip, note, short, sync

# The public function every mode calls, looked up at call time (tests replace it).
prefill = pagedprefill.cudnn_batch_prefill_with_kv_cache

_WORKSPACE_RE = re.compile(r"workspace_buffer: expected at least (\d+) bytes")


def library_call(kwargs: dict, backend: str) -> Callable[[], tuple]:
    """The public function on ``kwargs`` with ``backend`` (reads ``kwargs`` at call time, so that a
    grown workspace is seen)."""

    def call():
        return prefill(**kwargs, backend=backend)

    return call


def classify(e: BaseException) -> Skip | None:
    """A :class:`Skip` when exception ``e`` of a first call means "cannot run this here", else None."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, pagedprefill.BackendUnavailableError):
        return Skip(f"unavailable: {msg}", "unavailable")
    if isinstance(e, ImportError):
        return Skip(f"backend module not importable: {msg}", "unavailable")
    if isinstance(e, NotImplementedError):
        return Skip(f"not implemented: {msg}", "unsupported")
    if isinstance(e, ValueError) and ("cannot serve this call" in msg or "no backend can serve" in msg):
        return Skip(f"unsupported: {msg}", "unsupported")
    return None


def first_call(kwargs: dict, backend: str, say: Callable[[str], None] = note) -> float:
    """Make the first (warm-up, graph-building, compiling) call; the seconds it took.

    Raises :class:`Skip` when the backend cannot run the call here. A workspace too small for the
    backend is replaced once by one of the size the error names (``kwargs["workspace_buffer"]``).
    """
    if backend in dispatch.BACKENDS and backend != "auto":
        try:
            dispatch.backend_module(backend)
        except Exception as e:  # a backend that cannot even be imported here is unavailable
            raise Skip(f"backend module not importable: {short(e)}") from e
    device = kwargs["q"].device
    for attempt in range(2):
        t0 = time.perf_counter()
        try:
            library_call(kwargs, backend)()
            sync(device)
            return time.perf_counter() - t0
        except Exception as e:
            skip = classify(e)
            if skip is not None:
                raise skip from e
            m = _WORKSPACE_RE.search(str(e))
            if m and attempt == 0:
                need = -(-int(m.group(1)) // 2**20) * 2**20
                say(f"  {backend}: growing the workspace to {need / 2**20:.0f} MiB ({str(e)[:120]})")
                kwargs["workspace_buffer"] = torch.empty(need, dtype=torch.uint8, device=device)
                continue
            raise
    raise AssertionError("unreachable")


class Case:
    """One workload built on ``device``.

    ``data`` names the data a run uses: the workload's own (``self.kind``: ``"bf16"``, ``"fp8_kv"``
    or ``"fp8"``; with ``--dtype fp16`` a 16-bit workload's data is ``"fp16"``) and, for an fp8
    workload, ``self.wide`` (the 16-bit data it was quantized from). :meth:`kwargs` gives the call's
    keyword arguments; :meth:`reference` and :meth:`dense` are made once per data, on demand.
    """

    def __init__(self, w: dict, device: torch.device, dtype: torch.dtype, seed: int = 0, lens_on_device: bool = False):
        self.workload = dict(w)
        self.name = w["name"]
        self.device = device
        self.gflop = wl.flops(w) / 1e9
        self.q_lens, self.kv_lens = wl.lengths(w)
        self.wide = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
        kind = wl.data_kind(w)
        self.kind = self.wide if kind == "bf16" else kind
        wide = wl.build_case(w, device, dtype=dtype, seed=seed, lens_on_device=lens_on_device, fp8=False)
        self._calls = {self.wide: wide}
        if kind != "bf16":
            self._calls[kind] = wl.quantize_case(wide, kind)
        self._refs: dict[str, dict] = {}
        self._dense: dict[str, dict] = {}

    @property
    def fp8(self) -> bool:
        return self.kind != self.wide

    def kwargs(self, data: str | None = None) -> dict:
        """The call's keyword arguments on ``data`` (default: the workload's own)."""
        return self._calls[data or self.kind]

    def reference(self, data: str | None = None) -> dict:
        """:func:`pagedprefill.bench.checks.reference` of the call on ``data`` (made once)."""
        data = data or self.kind
        if data not in self._refs:
            t0 = time.perf_counter()
            self._refs[data] = checks.reference(self.kwargs(data))
            took = time.perf_counter() - t0
            note(f"  reference on the {data} data ({self._refs[data]['kind']}) in {took:.2f} s")
        return self._refs[data]

    def dense(self, data: str | None = None) -> dict:
        """The call's data stored contiguously (:func:`pagedprefill.workloads.dense_reference_inputs`)."""
        data = data or self.kind
        if data not in self._dense:
            self._dense[data] = wl.dense_reference_inputs(self.kwargs(data))
        return self._dense[data]
