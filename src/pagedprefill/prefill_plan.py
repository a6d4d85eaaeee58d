"""Plan once per batch, run per layer.

A :class:`PrefillPlan` holds what is fixed for a batch (its :class:`~pagedprefill.batch.Sequences`,
the device metadata when the lengths are on the host, the page table and the device lengths it
reads at every run) and, per layout of the layer tensors it has been run with, the chosen
backend's plan. :meth:`PrefillPlan.run` then checks the layer's tensors against the plan (a few
comparisons when the layout was seen before), checks that no output overlaps an input, and
launches.
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch
from torch import Tensor

from pagedprefill import dispatch, normalise, tuning, workspace
from pagedprefill.batch import META_FIELDS, CallTensors, DeviceVectors, PrefillBatch, Sequences, fail
from pagedprefill.kernels.launch import LaunchSlot


class LayerPlan:
    """One layout of the layer tensors: its batch and its backend's plan."""

    __slots__ = (
        "batch",
        "backend",
        "name",
        "meta_bytes",
        "out_shape",
        "lse_shape",
        "bounds",
        "return_lse",
        "extents",
        "disjoint",
        "views",
        "table_launch",
        "table_tensors",
        "reads_vectors",
        "stand_in",
    )

    def __init__(self, batch: PrefillBatch, backend, name: str, meta_bytes: int, out_shape, lse_shape, bounds, ret):
        self.batch, self.backend, self.name = batch, backend, name
        self.meta_bytes, self.out_shape, self.lse_shape, self.bounds = meta_bytes, out_shape, lse_shape, bounds
        self.return_lse = ret
        self.extents: dict[str, int] = {}  # argument name -> bytes its elements span (the layout fixes it)
        self.disjoint: set[tuple] = set()  # address combinations checked (the names come in one order)
        self.views = None  # (workspace, meta, scratch) of the plan's own workspace, once carved
        self.table_launch = LaunchSlot()  # the device table's launch, bound after its first one
        self.table_tensors = None  # (meta, its tensor arguments) for the plan's own workspace and vectors
        self.reads_vectors = False  # the backend reads the device vectors itself: no table is written
        self.stand_in = None  # (reads_vectors) an int32 tensor of the layout's own, as the unread table

    def check_overlaps(self, tensors: tuple, names) -> None:
        """:func:`normalise.check_spans` for this layout's tensors (``names()`` gives their argument
        names, in the same order, when needed), from their addresses and the byte extents their
        layouts fix (the written ones are out, lse and the workspace); a combination of addresses
        found disjoint before is not examined again."""
        ptrs = tuple([t.data_ptr() if t is not None else None for t in tensors])
        if ptrs in self.disjoint:
            return
        ext = self.extents
        spans = []
        for name, t, lo in zip(names(), tensors, ptrs):
            if t is None:
                continue
            e = ext.get(name)
            if e is None:
                first, last = normalise.byte_span(t)
                e = ext[name] = last - first
            if e:
                spans.append((name, lo, lo + e))
        normalise.check_spans(spans, _WRITTEN)
        if len(self.disjoint) >= 1024:
            self.disjoint.clear()
        self.disjoint.add(ptrs)


_WRITTEN = ("out", "lse", "workspace_buffer")


def _layout_key(t: object) -> tuple | None:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        return (type(t),)
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15 == 0)


def _scales_key(scales: tuple) -> object:
    q_s, k_s, v_s = scales
    if q_s is None and k_s is None and v_s is None:
        return None
    return tuple(_layout_key(s) if s is None or isinstance(s, Tensor) else type(s) for s in scales)


_VECTOR_NAMES = ("actual_seq_lens_q", "actual_seq_lens_kv", "kv_indptr", "kv_last_page_len")
_OFFSET_ARGS = {n: f"batch_offsets_{n}" for n in normalise.OFFSET_NAMES}


def _vector_tensors(vectors: DeviceVectors | None) -> tuple:
    """The device vectors a run reads (for the overlap check), named by :func:`_vector_names`."""
    if vectors is None:
        return ()
    v = vectors
    return (v.lens_q, v.lens_kv, v.kv_indptr, v.kv_last_page_len, *v.offsets.values())


def _vector_names(vectors: DeviceVectors | None) -> tuple:
    """The argument names of :func:`_vector_tensors`, in its order."""
    if vectors is None:
        return ()
    return _VECTOR_NAMES + tuple([_OFFSET_ARGS[n] for n in vectors.offsets])


def _own_copy(t: Tensor) -> Tensor:
    """A copy of ``t`` in its own memory with ``t``'s strides (the storage span it covers, cloned:
    views with gaps or repeated rows keep their layout, which the plan's row stride was taken from)."""
    n = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    return t.as_strided((n,), (1,), t.storage_offset()).clone().as_strided(t.size(), t.stride())


PLANS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # op id -> plan (pagedprefill.ops)
_IDS = itertools.count(1)


class PrefillPlan:
    """A planned batch. Build it with :func:`pagedprefill.plan` (or a FlashInfer wrapper's ``plan``);
    call :meth:`run` once per layer."""

    def __init__(
        self,
        seq: Sequences,
        vectors: DeviceVectors | None,
        pages: Tensor | None,
        *,
        device: torch.device,
        backend: str,
        workspace_buffer: Tensor | None,
        o_data_type: torch.dtype | None = None,
        return_lse: bool = False,
        host_pages: Tensor | None = None,
        split_kv: bool = True,
    ):
        self.seq = seq
        self.split_kv = split_kv  # (False: no backend splits a sequence's keys, whatever the workspace)
        self.vectors = vectors
        if pages is not None and pages.device.type == "cpu":
            # page ids on the CPU: the plan's own copy, made here once (as FlashInfer's plan does), so
            # that a later change to the caller's tensor can neither reach a run nor bypass the check
            # of the ids against the cache (made at each new layout, from host_pages)
            host_pages = _own_copy(pages)
            if device.type != "cpu":
                pages = host_pages.to(torch.int32).contiguous().pin_memory().to(device, non_blocking=True)
            else:
                pages = host_pages
        self.pages = pages
        self.host_pages = host_pages  # (the CPU page ids the plan validates, or None: ids on the device)
        self.device = device
        # (with more than one GPU a run may find another one current: checked per run, see execute)
        self._other_gpus = device.type == "cuda" and torch.cuda.device_count() > 1
        self.backend = dispatch.check_backend(backend)
        self.workspace = workspace_buffer
        self.o_data_type = o_data_type
        self.default_return_lse = return_lse
        self.op_id = next(_IDS)
        PLANS[self.op_id] = self
        self._vector_tensors = _vector_tensors(vectors)
        # the plan's page ids when the kernels read them as they are (int32, on the device)
        self._pages_as_is = pages if pages is not None and workspace.pages_as_is(seq, pages, device) else None
        self.layers: dict[tuple, LayerPlan] = {}
        self._last: tuple | None = None  # (key, LayerPlan) of the last layout run
        self.meta: Tensor | None = None
        self._copy_event = None
        if seq.host is not None:
            self.meta = workspace.host_table(seq.host, device)
            if device.type == "cuda" and seq.batch_size:
                self._copy_event = torch.cuda.Event()
                self._copy_event.record()

    # ----------------------------------------------------------------------------------------
    # per layout
    # ----------------------------------------------------------------------------------------

    def layer(self, q, k, v, out, lse, scales, sinks, return_lse: bool, ws: Tensor, vectors=None) -> LayerPlan:
        """The plan of this layout (made and checked the first time it is seen; ``vectors``: the
        device vectors when the plan does not hold them)."""
        key = (
            _layout_key(q),
            _layout_key(k),
            _layout_key(v),
            _layout_key(out),
            None if lse is None else _layout_key(lse),
            _scales_key(scales),
            None if sinks is None else _layout_key(sinks),
            return_lse,
            ws.numel(),
            ws.data_ptr() & 15 == 0,  # (the device table is carved from its first bytes)
            tuning.generation,  # (a layout planned under other backend knobs is planned again)
        )
        last = self._last
        if last is not None and last[0] == key:  # (a run of the last layout: no hashing of the key)
            return last[1]
        lp = self.layers.get(key)
        if lp is None:
            lp = self.layers[key] = self._make_layer(q, k, v, out, lse, scales, sinks, return_lse, ws, vectors)
        self._last = (key, lp)
        return lp

    def _make_layer(self, q, k, v, out, lse, scales, sinks, return_lse, ws, vectors) -> LayerPlan:
        seq = self.seq
        if isinstance(q, Tensor) and q.dim() == 3 and q.shape[-1] != seq.head_dim_qk:  # (before k is held to q)
            raise fail("q", f"head dim {seq.head_dim_qk} (the plan's head_dim_qk)", q.shape[-1])
        if isinstance(q, Tensor) and not normalise.same_device(q.device, self.device):  # (before k is held to q)
            raise fail("q", f"a tensor on the plan's device {self.device}", f"one on {q.device}")
        q, k, v, shape = normalise.layer_tensors(q, k, v, seq.page_size > 0)
        if self.host_pages is not None:  # (page ids on the CPU are validated against the cache's pages)
            normalise.check_page_ids(self.host_pages, seq, shape.num_pages)
        o_dtype = normalise.resolve_out_dtype(q.dtype, self.o_data_type, out)
        q_s, k_s, v_s = normalise.scales(q.dtype, k.dtype, *scales, q.device, seq.graph_mode)
        normalise.sinks_arg(sinks, seq.num_qo_heads, q.device)
        if return_lse and seq.lse == "none":
            raise fail("return_lse", "False: the plan was made without an LSE layout (plan with return_lse=True)", True)
        lse_mode = seq.lse if return_lse else "none"
        out_allocated = out is None
        if out is None:  # (the layout of the buffers each run allocates: no memory behind it)
            rows = normalise.alloc_rows(seq, q.shape[0], "o")
            out = torch.empty((rows, shape.num_qo_heads, shape.head_dim_vo), dtype=o_dtype, device="meta")
        else:
            out = normalise.check_tensor("out", out, 3, q.device)
            if out.dtype != o_dtype:
                raise fail("out", f"dtype {o_dtype} (o_data_type)", out.dtype)
        lse_shape = None
        if lse_mode != "none":
            if lse is None:
                if lse_mode == "packed":
                    lse_shape = (normalise.alloc_rows(seq, q.shape[0], "stats"), seq.num_qo_heads)
                else:
                    lse_shape = (seq.batch_size, seq.max_q, seq.num_qo_heads)
                lse = torch.empty(lse_shape, dtype=torch.float32, device="meta")
            else:
                _check_lse(lse, seq, q.device)
        elif lse is not None:
            raise fail("lse", "None when return_lse=False", "a tensor")
        batch = normalise.batch_for(
            seq,
            q,
            k,
            v,
            out,
            lse.view(-1) if lse is not None else None,
            shape,
            (q_s is not None, k_s is not None, v_s is not None),
            sinks is not None,
            out_allocated,
        )
        # (the scratch a backend may spend on split-KV partials: none where the plan disables it)
        module = dispatch.choose(batch, self.backend, ws.numel() if self.split_kv else 0)
        meta_b = workspace.meta_bytes(batch.batch_size) if batch.device_metadata else 0
        bplan = module.plan(batch, max(ws.numel() - meta_b, 0) if self.split_kv else 0)
        workspace.check_size(ws, meta_b, bplan.workspace_bytes, module.NAME)
        bounds = None
        if batch.device_metadata:
            n_idx = self.pages.numel() if self.pages is not None else 0
            bounds = workspace.bounds(batch, vectors or self.vectors, n_idx)
        out_shape = tuple(out.shape) if out_allocated else None
        lp = LayerPlan(batch, bplan, module.NAME, meta_b, out_shape, lse_shape, bounds, return_lse)
        take = getattr(bplan, "take_vectors", None)  # (a backend that computes the table's rows itself)
        lp.reads_vectors = bounds is not None and take is not None and take(bounds, vectors or self.vectors)
        if lp.reads_vectors:  # (no table to carve from the workspace at each run: the scratch is all of it)
            lp.stand_in = torch.empty(len(META_FIELDS), dtype=torch.int32, device=batch.device)
        return lp

    # ----------------------------------------------------------------------------------------
    # per run
    # ----------------------------------------------------------------------------------------

    def execute(
        self,
        lp: LayerPlan,
        q,
        k,
        v,
        out,
        lse,
        scales,
        sinks,
        ws: Tensor,
        pages: Tensor | None,
        vectors: DeviceVectors | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Run ``lp`` on this call's tensors (already matched to its layout)."""
        batch = lp.batch
        dev = batch.device
        if self._other_gpus and dev.index != torch.cuda.current_device():
            # (Triton launches on the current device and its stream: the tensors' device must be it)
            with torch.cuda.device(dev):
                return self.execute(lp, q, k, v, out, lse, scales, sinks, ws, pages, vectors)
        if out is None:
            out = torch.zeros(lp.out_shape, dtype=batch.out_dtype, device=dev)
        lse_user = None
        if lp.return_lse:
            lse_user = lse if lse is not None else torch.full(lp.lse_shape, -math.inf, dtype=torch.float32, device=dev)
        scaled = scales[0] is not None or scales[1] is not None or scales[2] is not None
        if scaled:  # (a float scale's value is not part of the layout: checked at every run)
            for name, x in zip(("q_scale", "k_scale", "v_scale"), scales):
                normalise.number_scale(name, x)
        if sinks is not None and not sinks.is_contiguous():
            sinks = sinks.contiguous()  # (every backend reads the sinks as one contiguous row of Hq floats)
        vec_tensors = self._vector_tensors if vectors is self.vectors else _vector_tensors(vectors)
        tensors = (q, k, v, out, lse_user, ws, pages, sinks, *vec_tensors)
        if scaled:
            tensors += tuple(s for s in scales if isinstance(s, Tensor))

        def names() -> tuple:
            page_name = "block_tables" if self.seq.pages == "table" else "kv_indices"
            fixed = ("q", "k_cache", "v_cache", "out", "lse", "workspace_buffer", page_name, "sinks")
            sn = (n for n, s in zip(("q_scale", "k_scale", "v_scale"), scales) if isinstance(s, Tensor))
            return fixed + _vector_names(vectors) + (tuple(sn) if scaled else ())

        lp.check_overlaps(tensors, names)
        if batch.empty:
            dispatch.set_last(lp.name)
            return out, lse_user
        nested = workspace.acquire(ws)
        try:
            views = lp.views
            if lp.reads_vectors:  # (no table: the kernel's table argument is never read)
                meta, scratch = lp.stand_in, ws
            elif views is not None and views[0] is ws:  # (the plan's own workspace: carved once)
                meta, scratch = views[1], views[2]
            else:
                meta, scratch = workspace.carve(ws, batch.batch_size, batch.device_metadata)
                if ws is self.workspace:
                    lp.views = (ws, meta, scratch)
            if meta is None:
                meta = self.meta
                if self._copy_event is not None:
                    self._wait_copy()
            elif not lp.reads_vectors:
                tt = lp.table_tensors
                own = vectors is self.vectors
                if tt is None or tt[0] is not meta or not own or not lp.table_launch.launch(tt[1]):
                    workspace.write_device_table(lp.bounds, vectors, meta, lp.table_launch)
                    if own and lp.views is not None and lp.views[1] is meta:
                        lp.table_tensors = (meta, workspace.table_tensors(vectors, meta))
            q_s, k_s, v_s = (device_scale(s, dev) for s in scales) if scaled else (None, None, None)
            t = CallTensors(
                q,
                k,
                v,
                out,
                lse_user.view(-1) if lse_user is not None else None,
                meta,
                pages if pages is self._pages_as_is else workspace.device_pages(self.seq, pages, dev),
                q_s,
                k_s,
                v_s,
                sinks,
                scratch,
                vectors if lp.reads_vectors else None,
            )
            lp.backend.run(t)
        finally:
            if not nested:
                workspace.release(ws)
        dispatch.set_last(lp.name)
        return out, lse_user

    def _wait_copy(self) -> None:
        """Order this run after the plan's metadata copy, whatever stream it runs on."""
        ev = self._copy_event
        if torch.cuda.is_current_stream_capturing():
            if not ev.query():  # (torch.cuda.graph synchronises before capturing)
                raise RuntimeError("the plan's metadata copy is still in flight while a CUDA graph is captured")
        else:
            torch.cuda.current_stream(self.device).wait_event(ev)
            self.meta.record_stream(torch.cuda.current_stream(self.device))
        if ev.query():
            self._copy_event = None

    def run(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        out: Tensor | None = None,
        lse: Tensor | None = None,
        *,
        q_scale: Tensor | float | None = None,
        k_scale: Tensor | float | None = None,
        v_scale: Tensor | float | None = None,
        sinks: Tensor | None = None,
        return_lse: bool | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of one layer over the planned batch.

        Args:
            q: (total_q_tokens, Hq, Dqk) as planned; k_cache, v_cache: the paged
                (num_pages, Hkv, page_size, D) or ragged (total_kv_tokens, Hkv, D) cache.
            out: optional (rows, Hq, Dvo) output; lse: optional float32 LSE buffer in the planned
                layout. Rows that belong to no sequence are never written.
            q_scale, k_scale, v_scale: fp8 scales (one-element float32 tensors or floats).
            sinks: float32 (Hq,) attention-sink logits, or None.
            return_lse: default: whether the plan was made with ``return_lse=True``.

        Returns:
            (out, lse): lse is None unless the LSE is returned (natural log).
        """
        if return_lse is None:
            return_lse = self.default_return_lse
        elif return_lse is not True and return_lse is not False:
            normalise.bool_arg("return_lse", return_lse)
        if self.workspace is None:
            raise fail("workspace_buffer", "a workspace given to plan()", None)
        scales = (q_scale, k_scale, v_scale)
        lp = self.layer(q, k_cache, v_cache, out, lse, scales, sinks, return_lse, self.workspace)
        return self.execute(lp, q, k_cache, v_cache, out, lse, scales, sinks, self.workspace, self.pages, self.vectors)

    @property
    def backend_name(self) -> str | None:
        """The backend the last layout seen runs on (None before the first run)."""
        return next(reversed(self.layers.values())).name if self.layers else None


def device_scale(s, device: torch.device) -> Tensor | None:
    """A scale as the kernels read it: a one-element float32 tensor on ``device``."""
    if s is None:
        return None
    if isinstance(s, Tensor):
        s = s.reshape(1)
        return s if s.device == device else s.to(device)
    return torch.full((1,), float(s), dtype=torch.float32, device=device)


def _check_lse(lse: object, seq: Sequences, device: torch.device) -> None:
    if not isinstance(lse, Tensor):
        raise fail("lse", "a float32 torch.Tensor", type(lse).__name__)
    if lse.dtype != torch.float32:
        raise fail("lse", "dtype float32", lse.dtype)
    if not normalise.same_device(lse.device, device):
        raise fail("lse", f"a tensor on q's device {device}", f"one on {lse.device}")
    if not lse.is_contiguous():
        raise fail("lse", "a contiguous tensor", f"strides {tuple(lse.stride())}")
    if seq.lse == "padded" and tuple(lse.shape) != (seq.batch_size, seq.max_q, seq.num_qo_heads):
        raise fail(
            "lse",
            f"shape (B, max_token_per_sequence, Hq) = ({seq.batch_size}, {seq.max_q}, {seq.num_qo_heads})",
            f"shape {tuple(lse.shape)}",
        )
