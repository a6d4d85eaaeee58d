"""cuDNN backend: batched prefill attention as cuDNN SDPA graphs (``nvidia-cudnn-frontend``).

:mod:`.graph` says how a batch becomes a graph and how graphs are cached; :mod:`.prepare` writes,
at every run, the graph's metadata rows and page table and the rows no key is visible to. A run
costs, besides the graph, that one preparation launch.

Known cuDNN limitation: cuDNN reads whole pages (whole key tiles), so the slots past ``kv_len`` in a
sequence's last page are loaded and multiplied by a zero probability; NaN or Inf there gives NaN in
that sequence's output. Those slots must hold finite values (any finite garbage is fine).
"""

from __future__ import annotations

import array
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pagedprefill.batch import CallTensors, PrefillBatch
from pagedprefill.kernels import launch

from . import graph, prepare
from .graph import graph_builds  # noqa: F401  (re-exported: the benchmark counts builds)

NAME = "cudnn"
_AVAILABLE: set[int] = set()  # device indices where unavailable_reason() said None


# a graph operand a call brings -> where the run's tensors hold it (as _call_operands names them)
_CALL_OPERAND = {
    name: operator.attrgetter(attr)
    for name, attr in (
        ("q", "q"),
        ("k", "k"),
        ("v", "v"),
        ("o", "out"),
        ("stats", "lse"),
        ("sinks", "sinks"),
        ("descale_q", "q_scale"),
        ("descale_k", "k_scale"),
        ("descale_v", "v_scale"),
    )
}


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs a CUDA GPU"
    if device.index in _AVAILABLE:
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    try:
        cudnn = graph.cudnn_module()
    except ImportError as exc:
        return str(exc)
    try:
        ver = int(cudnn.backend_version())
    except Exception as exc:
        return f"the cuDNN library (libcudnn.so.9) could not be loaded: {exc}; pip install nvidia-cudnn-cu12"
    if ver < graph.MIN_BACKEND_VERSION:
        return f"cuDNN library {ver} is too old: paged prefill needs cuDNN >= 9.5; pip install -U nvidia-cudnn-cu12"
    _AVAILABLE.add(device.index)
    return None


def _built(batch: PrefillBatch) -> graph.Plan | str:
    return graph.plan_for_spec(graph.graph_spec(batch), graph.device_index(batch.device), prepare.make_consts)


def unsupported_reason(batch: PrefillBatch) -> str | None:
    reason = graph.static_reason(batch)
    if reason or batch.device.type != "cuda" or batch.empty:
        return reason
    if unavailable_reason(batch.device) is not None:
        return None  # the caller reports unavailability separately
    got = _built(batch)
    return got if isinstance(got, str) else None


def plan(batch: PrefillBatch, workspace_bytes: int | None) -> CudnnPlan:
    return CudnnPlan(batch)


@dataclass
class _Views:
    """A run's regions of the scratch."""

    ints: Tensor  # (ROWS, row) int32
    table: Tensor | None  # (Bb, table_width) int32
    floats: Tensor | None  # (8,) float32 (fp8 only)
    workspace: Tensor  # uint8 cuDNN workspace
    raw: tuple | None = None  # (RawExecute, its address template, the per-call holes) for this scratch


class CudnnPlan:
    """A built graph for one batch; each run binds the call's tensors."""

    name = NAME

    def __init__(self, batch: PrefillBatch):
        self.batch = batch
        got = _built(batch) if not batch.empty else None
        if isinstance(got, str):
            raise RuntimeError(f"backend='cudnn' cannot serve this call: {got}")
        self.graph = got
        self.workspace_bytes = got.layout.total if got is not None else 0
        h = batch.host
        spec = got.spec if got is not None else None
        # with host lengths: whether the graph has rows to compute, and whether some rows see no key
        self.skip_graph = h is not None and spec is not None and not prepare.handed_rows(spec, h.lens_q, h.lens_kv)
        self.fix = h is None or (spec is not None and prepare.skipped_rows(spec, h.lens_q, h.lens_kv))
        self._views: tuple | None = None
        self._prepare_launch = launch.LaunchSlot()  # the preparation's launch, bound to this graph
        self.triton = (
            batch.device.type == "cuda"
            and launch.unavailable_reason(batch.device) is None
            and (prepare._prepare_kernel is not None)
        )

    def views(self, scratch: Tensor) -> _Views:
        ptr = scratch.data_ptr()
        if self._views is not None and self._views[0] == ptr:
            return self._views[1]
        lay, spec = self.graph.layout, self.graph.spec
        base = (-ptr) % graph.ALIGN
        i32 = scratch[base : base + lay.workspace].view(torch.int32)
        ints = i32[: graph.ROWS * lay.row].view(graph.ROWS, lay.row)
        table = floats = None
        if spec.paged:
            t0 = lay.table // 4
            table = i32[t0 : t0 + spec.batch * spec.table_width].view(spec.batch, spec.table_width)
        if spec.fp8:
            floats = i32[lay.floats // 4 : lay.floats // 4 + 8].view(torch.float32)
        ws = scratch[base + lay.workspace : base + lay.workspace + lay.workspace_size]
        views = _Views(ints, table, floats, ws)
        self._views = (ptr, views)
        return views

    def _call_operands(self, t: CallTensors) -> dict[str, Tensor]:
        """The operands a call brings: q, K, V, out, and the LSE, sinks and fp8 scales the graph takes."""
        ops = {"q": t.q, "k": t.k, "v": t.v, "o": t.out}
        spec = self.graph.spec
        if spec.lse:
            ops["stats"] = t.lse
        if spec.sinks:
            ops["sinks"] = t.sinks
        if spec.fp8:
            ops.update(descale_q=t.q_scale, descale_k=t.k_scale, descale_v=t.v_scale)
        return ops

    def _scratch_operands(self, views: _Views) -> dict[str, Tensor]:
        """The operands that live in the scratch: metadata rows, page table, fp8 scale slots."""
        rows = views.ints
        ops = {
            "seq_q": rows[prepare.R_SEQ_Q],
            "seq_kv": rows[prepare.R_SEQ_KV],
            "off_q": rows[prepare.R_OFF_Q],
            "off_o": rows[prepare.R_OFF_O],
        }
        spec = self.graph.spec
        if spec.paged:
            ops["table_k"] = ops["table_v"] = views.table
        else:
            ops["off_k"], ops["off_v"] = rows[prepare.R_OFF_K], rows[prepare.R_OFF_V]
        if spec.lse:
            ops["off_stats"] = rows[prepare.R_OFF_S]
        if spec.fp8:
            f = views.floats
            ops.update(descale_s=f[0], scale_s=f[1], scale_o=f[2], amax_s=f[3], amax_o=f[4])
        return ops

    def _operands(self, t: CallTensors, views: _Views) -> dict[str, Any]:
        return {**self._scratch_operands(views), **self._call_operands(t)}

    def execute(self, t: CallTensors, views: _Views) -> None:
        """Bind every operand and run the built graph on torch's current stream: after the graph's first
        execution through the frontend's public call, by :class:`graph.RawExecute` where it applies
        (the scratch's operands' addresses in a template made once per scratch, the call's filled in)."""
        plan = self.graph
        if plan.spec.fp8:
            views.floats[:3].copy_(plan.consts.fp8)
        dev = graph.device_index(self.batch.device)
        h = graph.handle(dev)
        graph.cudnn_module().set_stream(h, graph.current_stream(dev))
        raw = plan.raw
        if raw:
            try:
                raw(self._raw_addresses(raw, t, views), views.workspace.data_ptr(), h)
                return
            except TypeError:  # (the internals changed shape: the public call from here on)
                plan.raw = False
        self._execute_public(t, views, h)
        if plan.raw is None:
            plan.raw = graph.RawExecute.of(plan) or False

    def _raw_addresses(self, raw: graph.RawExecute, t: CallTensors, views: _Views) -> array.array:
        """Every operand's address in ``raw``'s slot order: the scratch's from the views' template
        (made once), the call's read again."""
        tpl = views.raw
        if tpl is None or tpl[0] is not raw:
            fixed = {n: x.data_ptr() for n, x in self._scratch_operands(views).items()}
            tpl = views.raw = (raw, *raw.template(fixed))
        addrs = array.array("q", tpl[1])
        for i, name in tpl[2]:
            addrs[i] = _CALL_OPERAND[name](t).data_ptr()
        return addrs

    def _execute_public(self, t: CallTensors, views: _Views, h: Any) -> None:
        plan = self.graph
        ops = self._operands(t, views)
        if plan.binding == "tensors":
            try:
                plan.graph.execute({tn: ops[n] for n, tn in plan.tensors.items()}, views.workspace, handle=h)
                return
            except Exception as exc:  # the frontend could not take torch tensors: bind addresses instead
                if plan.binding_error is not None:
                    raise
                plan.binding, plan.binding_error = "addresses", f"{type(exc).__name__}: {exc}"
        pack = {tn: ops[n].data_ptr() for n, tn in plan.tensors.items()}
        plan.graph.execute(pack, views.workspace.data_ptr(), handle=h)

    def has_rows(self, t: CallTensors) -> bool:
        """Whether cuDNN has a row to compute: not without host rows, and never with an empty operand
        (cuDNN refuses a null device pointer in its variant pack)."""
        if self.skip_graph:
            return False
        ops = (t.q, t.out) if self.batch.paged else (t.q, t.out, t.k, t.v)
        return all(x.numel() for x in ops) and (t.lse is None or t.lse.numel() > 0)

    def _this_threads_graph(self) -> graph.Plan:
        """The graph, built for this thread's cuDNN handle: a plan made (or a call plan cached) on
        another thread resolves its graph again here instead of executing one of another handle."""
        plan = self.graph
        if plan.key:
            dev = graph.device_index(self.batch.device)
            if plan.key[1:3] != (dev, graph.handle(dev).backend_handle):
                got = _built(self.batch)
                if isinstance(got, str):
                    raise RuntimeError(f"backend='cudnn' cannot serve this call: {got}")
                self.graph, self._views = got, None
                self._prepare_launch = launch.LaunchSlot()
                self.workspace_bytes = got.layout.total
                plan = got
        return plan

    def run(self, t: CallTensors) -> None:
        if self.graph is None:
            return  # every q_len is 0: nothing is written
        batch, plan = self.batch, self._this_threads_graph()
        if t.scratch.numel() < plan.layout.total:
            raise ValueError(
                f"workspace_buffer: expected {plan.layout.total} bytes of cuDNN scratch, got {t.scratch.numel()}"
            )
        views = self.views(t.scratch)
        n_idx = prepare.table_span(t.pages) if batch.paged else 0
        if self.triton:
            prepare.prepare_triton(
                plan.spec,
                plan.layout,
                views.ints,
                views.table,
                t.meta,
                t.pages,
                t.out,
                t.lse,
                t.sinks,
                batch.batch_size,
                n_idx,
                self.fix,
                batch.work_q,
                self._prepare_launch,
            )
            if self.has_rows(t):
                self.execute(t, views)
            return
        fx = prepare.prepare_torch(
            plan.spec, plan.layout, plan.consts, views.ints, views.table, t.meta, t.pages, batch.batch_size, n_idx
        )
        if self.has_rows(t):
            self.execute(t, views)
        if self.fix:
            prepare.fill_empty_rows(plan.spec, plan.consts, t.out, t.lse, t.sinks, fx)


def clear_caches() -> None:
    """Forget every built graph (rebuilt on demand). Not while a captured CUDA graph replays one."""
    graph.clear()
