"""FlashInfer's prefill wrappers, drop-in: code written for ``flashinfer.BatchPrefillWithPagedKVCacheWrapper``
and ``BatchPrefillWithRaggedKVCacheWrapper`` runs by changing the import.

``plan(...)`` takes FlashInfer's arguments (CSR pages: ``qo_indptr``, ``paged_kv_indptr``,
``paged_kv_indices``, ``paged_kv_last_page_len``) and makes a :class:`~pagedprefill.PrefillPlan`;
``run(q, paged_kv_cache, ...)`` runs it. Arguments this library does not implement raise
``NotImplementedError`` naming them; they are never ignored. FlashInfer's own kernel names
``backend="fa2"`` / ``"fa3"`` run on this library's ``"auto"`` (the same attention); ``enable_pdl`` is a
launch hint, taken and not used. After ``plan``, the wrapper holds FlashInfer's record of what the
next run uses (``_causal``, ``_window_left``, ``_logits_soft_cap``, ``_sm_scale``), which engines check
before a run; after a deprecated ``forward``, its settings.

As in FlashInfer, the wrappers return the LSE in **base 2** (``log2`` of the sum of ``2^(s log2 e)``),
shape ``(q.shape[0], num_qo_heads)`` (``qo_indptr[-1]`` rows unless q is padded); the one-shot
``cudnn_batch_prefill_with_kv_cache`` and ``PrefillPlan.run`` return natural-log LSEs.
``pagedprefill.merge_state(..., lse_base=2)`` merges wrapper LSEs. A caller's ``lse`` buffer is
``(q rows, num_qo_heads)`` float32, as FlashInfer asks; its rows that no sequence covers are left as
they are.

FlashInfer's other entry points are here too: ``begin_forward`` (= ``plan``), ``run_return_lse``,
the deprecated ``forward`` / ``forward_return_lse`` (whose causal, window, soft-cap and scale replace
the plan's, for later runs too, as in FlashInfer), ``end_forward``,
``is_cuda_graph_enabled`` and ``reset_workspace_buffer`` (plan again after it); the paged wrapper's
``workspace_size`` raises ``NotImplementedError``. The paged cache may also take FlashInfer's page-size-1 forms (a
tuple of 3-D ``(pages, Hkv, D)`` tensors or one 4-D ``(pages, 2, Hkv, D)`` tensor). ``seq_lens``
beside CSR pages must equal the pages' KV lengths (checked where they are on the host); with
``seq_lens`` + ``block_tables`` (FlashInfer's cudnn form, which the runs then read) the CSR pages must
describe the same batch (checked where all of it is on the host). As in FlashInfer, ``run`` takes a
missing ``q_scale`` / ``k_scale`` / ``v_scale`` of an 8-bit tensor as 1.0 and checks a given ``out``
against q's rows and the planned output dtype. Unlike FlashInfer: with fp8 q and no ``o_data_type``
the output is bfloat16 (FlashInfer's paged wrapper returns q's fp8 dtype; an fp8 output is not
implemented here: ``o_data_type=float8`` raises ``NotImplementedError``), an ``lse`` buffer given with
``return_lse=False`` is refused rather than written, a ``q`` with more rows than ``qo_indptr[-1]``
runs (engines pad q to a CUDA graph's size; FlashInfer raises): its extra rows are left as they are
in a caller's ``out`` and hold 0 / -inf in allocated buffers, and the ragged ``run`` applies
``q_scale`` / ``k_scale`` / ``v_scale`` as the paged one does (FlashInfer's ragged fa2 / fa3 path
drops them; its cudnn path applies them).

Host time: pass ``qo_indptr`` / ``paged_kv_indptr`` / ``paged_kv_last_page_len`` on the CPU (as FlashInfer
recommends); on the device, ``plan`` reads them back once unless ``max_token_per_sequence`` and
``max_sequence_kv`` are given (then nothing is read back and the lengths are computed on the device).
With ``use_cuda_graph=True`` the indptr arrays live in device buffers that ``plan`` refills and every
``run`` reads, so a run captured once replays correctly after a new ``plan`` (same batch size and no
longer sequences than the first plan allowed: pass ``max_token_per_sequence`` / ``max_sequence_kv`` to
the first plan to set those bounds). A ``plan`` that raises leaves the wrapper as it was: its buffers
are filled only once the new plan has been made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re

import torch
from torch import Tensor

from pagedprefill import api, dispatch, normalise
from pagedprefill.batch import fail
from pagedprefill.normalise import describe
from pagedprefill.prefill_plan import PrefillPlan

__all__ = ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper"]

LOG2E = 1.4426950408889634
# plan arguments of FlashInfer's both wrappers that this library does not implement, and their defaults
_UNPLANNED = dict(
    custom_mask=None,
    packed_custom_mask=None,
    pos_encoding_mode="NONE",
    use_fp16_qk_reduction=False,
    rope_scale=None,
    rope_theta=None,
    prefix_len_ptr=None,
    token_pos_in_items_ptr=None,
    token_pos_in_items_len=0,
    max_item_len_ptr=None,
    fixed_split_size=None,
    seq_lens_q=None,
)
# FlashInfer's own FlashAttention kernels (its default choices on Hopper and before): the same attention,
# served here by this library's fastest backend for the call
_FLASHINFER_FA = ("fa2", "fa3")


def _rope_unused(refused: dict, pos_encoding_mode: object) -> dict:
    """``refused`` without rope_scale / rope_theta where no RoPE is asked for: FlashInfer reads them
    only under pos_encoding_mode="ROPE_LLAMA" (code that passes its model's values keeps running)."""
    if pos_encoding_mode == "NONE":
        return {k: v for k, v in refused.items() if k not in ("rope_scale", "rope_theta")}
    return refused


def _refuse(**given) -> None:
    """NotImplementedError for every FlashInfer argument given a value this library does not implement."""
    for name, (value, default) in given.items():
        if value is not default and value != default:
            # (a tensor by its shape, dtype and device: its values would cost a device copy and say nothing)
            shown = describe(value) if isinstance(value, (Tensor, tuple, list)) else repr(value)
            raise NotImplementedError(
                f"pagedprefill does not implement FlashInfer's {name}={shown} (default {default!r})"
            )


def _positional_run_arguments(args: tuple) -> None:
    """NotImplementedError for FlashInfer's positional arguments after the cache (its fp8 route reads
    per-head q / k / v scale tensors there)."""
    raise NotImplementedError(
        f"pagedprefill does not implement FlashInfer's extra positional run arguments (got {len(args)}: "
        f"{describe(tuple(args))}); fp8 scales are keywords here: q_scale=, k_scale=, v_scale= (one-element "
        "float32 tensors or floats; per-head scale tensors are not implemented)"
    )


def _dtype(name: str, value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dt = getattr(torch, value, None)
        if isinstance(dt, torch.dtype):
            return dt
    raise fail(name, "a torch.dtype or its name (e.g. 'bfloat16')", repr(value))


def _beside_qo(name: str, t: object, qo: Tensor, fewer: int, device: torch.device | None = None) -> Tensor:
    """A CSR vector of the batch ``qo`` (qo_indptr) describes: ``qo``'s entries less ``fewer``, named
    against qo_indptr's length (either may be the wrong one)."""
    t = normalise.vector(name, t, None, device if device is not None else qo.device, False)
    n = qo.shape[0] - fewer
    if t.shape[0] != n:
        what = "as many entries as qo_indptr" if fewer == 0 else f"qo_indptr's entries less {fewer}"
        raise fail(name, f"{n} entries ({what}, which has {qo.shape[0]}: the batch size + 1)", t.shape[0])
    return t


def _all_or_nothing(plan):
    """A ``plan`` that leaves the wrapper as it was when it raises: with ``use_cuda_graph`` the new
    values reach the wrapper's buffers (which the last plan, and any graph captured from it, read at
    every run) only once the new plan has been made, and the bounds and batch size a first plan fixes,
    the planned dtypes and ``non_blocking`` are restored."""

    @functools.wraps(plan)
    def planned(self, *args, **kwargs) -> None:
        saved = (self._bounds, self._batch, self._dtypes, self._non_blocking)
        self._pending = []
        try:
            plan(self, *args, **kwargs)
        except BaseException:
            self._bounds, self._batch, self._dtypes, self._non_blocking = saved
            for buf, values, filled in reversed(self._pending):
                if filled:  # (a CPU buffer, filled while the plan read it: its old values back)
                    buf.copy_(values)
            raise
        finally:
            pending, self._pending = self._pending, None
        for buf, values, filled in pending:
            if not filled:
                buf.copy_(values, non_blocking=self._non_blocking)

    return planned


@contextlib.contextmanager
def _callers_names(names: dict):
    """A ``ValueError`` about an argument the wrapper passed on under another name (its message
    leading with ``name: expected ...``) names it, and every other such argument it mentions, as the
    caller wrote them (``names``: the library's name -> the caller's)."""
    try:
        yield
    except ValueError as e:
        msg = str(e)
        m = re.match(r"\w+", msg)
        if m is None or m.group(0) not in names:
            raise
        words = r"\b(" + "|".join(map(re.escape, names)) + r")\b"
        raise ValueError(re.sub(words, lambda w: names[w[1]], msg)) from e


class _Wrapper:
    _paged: bool

    def __init__(
        self,
        float_workspace_buffer: Tensor,
        kv_layout: str,
        use_cuda_graph: bool,
        backend: str,
        buffers: dict,
        custom_mask_buf,
        mask_indptr_buf,
        jit_args,
        jit_kwargs,
    ):
        if kv_layout not in ("NHD", "HND"):
            raise fail("kv_layout", '"NHD" or "HND"', repr(kv_layout))
        _refuse(
            custom_mask_buf=(custom_mask_buf, None),
            mask_indptr_buf=(mask_indptr_buf, None),
            jit_args=(jit_args, None),
            jit_kwargs=(jit_kwargs, None),
        )
        if backend in _FLASHINFER_FA:
            backend = "auto"
        if backend not in dispatch.BACKENDS:
            raise NotImplementedError(
                f"pagedprefill does not implement FlashInfer's backend={backend!r}; its backends are "
                f"{dispatch.BACKENDS} (and FlashInfer's {_FLASHINFER_FA}, served as 'auto')"
            )
        self._workspace = float_workspace_buffer
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._backend = backend
        self._buffers = {k: v for k, v in buffers.items() if v is not None}  # (the buffers given)
        self._plan: PrefillPlan | None = None
        self._arg_names: dict[str, str] = {}  # (the library's argument -> the caller's, for errors)
        self._variant_plans: dict[tuple, PrefillPlan] = {}
        self._lse_rows: tuple[int, int] | Tensor | None = None  # (first, end) rows, or the device qo_indptr
        self._bounds: tuple[int, int] | None = None
        self._batch: int | None = None
        self._pending: list | None = None  # (use_cuda_graph, inside plan: buffer copies made once it succeeds)
        self._dtypes: tuple = (None, None)
        self._non_blocking = True  # (plan's non_blocking: the use_cuda_graph buffers' copies)
        # a deprecated forward()'s causal / window / soft-cap / scale, which (as in FlashInfer) later runs keep
        self._forwarded: dict = {}
        self._o_rows_own = False  # (ragged plan with o_indptr: out's rows are the plan's to check, not q's)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        """Whether the wrapper was made with ``use_cuda_graph=True`` (FlashInfer's property)."""
        return self._use_cuda_graph

    def reset_workspace_buffer(
        self, float_workspace_buffer: Tensor, int_workspace_buffer: Tensor | None = None
    ) -> None:
        """FlashInfer's ``reset_workspace_buffer``: later plans use ``float_workspace_buffer`` (this
        library needs no int workspace, so ``int_workspace_buffer`` is not used); plan again before
        the next run."""
        self._workspace = float_workspace_buffer
        self._plan = None
        self._variant_plans = {}

    def end_forward(self) -> None:
        """FlashInfer's deprecated ``end_forward``: nothing to release."""

    # FlashInfer's record of the plan, which engines check before each run (vLLM asserts on them): what
    # the next run uses, so after a deprecated forward() its causal / window / soft-cap / scale, as
    # FlashInfer's forward() sets these fields before it runs
    @property
    def _causal(self) -> bool:
        return self._run_plan().seq.causal

    @property
    def _window_left(self) -> int:
        return self._run_plan().seq.window_left

    @property
    def _logits_soft_cap(self) -> float:
        return self._run_plan().seq.logits_soft_cap

    @property
    def _sm_scale(self) -> float:
        return self._run_plan().seq.scale

    def _run_plan(self) -> PrefillPlan:
        """The plan a run uses: the last ``plan``'s, with the last deprecated ``forward``'s changes."""
        return self._variant() if self._forwarded else self.plan_object

    @property
    def plan_object(self) -> PrefillPlan:
        """The :class:`~pagedprefill.PrefillPlan` made by the last ``plan``."""
        if self._plan is None:
            raise RuntimeError("plan() must be called before run()")
        return self._plan

    def _graph_vector(self, name: str, t: Tensor) -> Tensor:
        """use_cuda_graph: ``t``'s values in this wrapper's device buffer ``name`` (given, or made by the
        first plan), which every run reads."""
        buf = self._buffers.get(name)
        dev = self._workspace.device
        if name == "qo_indptr":  # (a captured graph is sized for one batch size)
            if self._batch is not None and t.numel() != self._batch + 1:
                raise fail(
                    "qo_indptr", f"{self._batch + 1} entries (use_cuda_graph: the batch size is fixed)", t.numel()
                )
            self._batch = t.numel() - 1
        if buf is None:
            buf = self._buffers[name] = torch.empty(t.numel(), dtype=torch.int32, device=dev)
        if buf.numel() < t.numel():
            raise fail(f"{name}_buf", f"at least {t.numel()} entries for this plan", f"{buf.numel()}")
        view = buf[: t.numel()]
        self._fill(view, t.reshape(-1))
        return view

    def _graph_table(self, table: Tensor) -> Tensor:
        """use_cuda_graph: the block table's values in this wrapper's device buffer of the first shape."""
        buf = self._buffers.get("block_tables")
        if buf is None:
            buf = self._buffers["block_tables"] = torch.empty(
                table.shape, dtype=torch.int32, device=self._workspace.device
            )
        if buf.shape != table.shape:
            raise fail(
                "block_tables", f"shape {tuple(buf.shape)} (use_cuda_graph: as in the first plan)", tuple(table.shape)
            )
        self._fill(buf, table)
        return buf

    def _fill(self, buf: Tensor, values: Tensor) -> None:
        """``buf`` gets ``values``: at once, or (inside ``plan``) once the plan has been made; a CPU
        buffer (whose values the plan reads as host lengths while it is made) at once, its old values
        kept until the plan has been made."""
        if self._pending is None:
            buf.copy_(values, non_blocking=self._non_blocking)
        elif buf.device.type == "cpu":
            self._pending.append((buf, buf.clone(), True))
            buf.copy_(values, non_blocking=self._non_blocking)
        else:
            self._pending.append((buf, values, False))

    def _bounds_for(self, max_q, max_kv, lens_q_host, lens_kv_host) -> tuple[int, int]:
        """The plan's max lengths; with use_cuda_graph, fixed by the first plan."""
        if max_q is None:
            max_q = int(max(lens_q_host, default=0))
        if max_kv is None:
            max_kv = int(max(lens_kv_host, default=0))
        if self._use_cuda_graph:
            if self._bounds is None:
                self._bounds = (max_q, max_kv)
            elif max_q > self._bounds[0] or max_kv > self._bounds[1]:
                raise fail(
                    "qo_indptr / paged_kv_indptr" if self._paged else "qo_indptr / kv_indptr",
                    f"sequences no longer than the first plan's bounds (max_token_per_sequence={self._bounds[0]}, "
                    f"max_sequence_kv={self._bounds[1]}: a captured graph is sized for them; pass larger bounds "
                    "to the first plan)",
                    f"max lengths {max_q}, {max_kv}",
                )
            max_q, max_kv = self._bounds
        return max_q, max_kv

    def _plan_args(self, args: dict, *also_refused: str) -> None:
        """A ``plan`` call's arguments (its ``locals()``): those this library does not implement
        (:data:`_UNPLANNED`, and ``also_refused``, whose default is None) refused unless at their
        defaults, and its dtypes (``kv_data_type`` defaults to q's)."""
        refused = {name: (args[name], default) for name, default in _UNPLANNED.items()}
        refused.update({name: (args[name], None) for name in also_refused})
        if args["fixed_split_size"] in (-1, 0):  # (FlashInfer's "off": it takes `fixed_split_size or -1`)
            refused["fixed_split_size"] = (None, None)
        _refuse(**_rope_unused(refused, args["pos_encoding_mode"]))
        self._non_blocking = bool(args["non_blocking"])
        q_dt = _dtype("q_data_type", args["q_data_type"])
        kv_dt = _dtype("kv_data_type", args["kv_data_type"])
        o_dt = _dtype("o_data_type", args["o_data_type"])
        if o_dt is not None and q_dt is not None:  # (an output dtype no run could write: refused at plan)
            normalise.resolve_out_dtype(q_dt, o_dt, None)
        self._dtypes = (q_dt, kv_dt if kv_dt is not None else q_dt)

    def _make_plan(self, args: dict, names: dict, qo_indptr, page_size, lens_q, max_q, max_kv, **vecs) -> None:
        """The :class:`~pagedprefill.PrefillPlan` of a ``plan`` call (``args``: its ``locals()``; token
        offsets, FlashInfer's default scale 1 / sqrt(head_dim_qk)), and what its runs need beside it;
        ``names``: the caller's name of each library argument made from one of theirs, for errors."""
        sm_scale = args["sm_scale"]
        with _callers_names(names):
            self._plan = api.plan(
                self._workspace,
                num_qo_heads=args["num_qo_heads"],
                num_kv_heads=args["num_kv_heads"],
                head_dim_qk=args["head_dim_qk"],
                head_dim_vo=args["head_dim_vo"],
                page_size=page_size,
                actual_seq_lens_q=lens_q,
                max_token_per_sequence=max_q,
                max_sequence_kv=max_kv,
                causal=args["causal"],
                scale=sm_scale,  # (None: 1 / sqrt(head_dim_qk), once plan() has checked it)
                window_left=args["window_left"],
                logits_soft_cap=args["logits_soft_cap"] or 0.0,
                batch_offsets_units="tokens",
                o_data_type=_dtype("o_data_type", args["o_data_type"]),
                is_cuda_graph_compatible=self._use_cuda_graph,
                backend=self._backend,
                disable_split_kv=args["disable_split_kv"],
                **vecs,
            )
        # (the cache by the caller's name too: one (k, v) argument of the paged run, k and v of the ragged)
        cache = {"k_cache": "paged_kv_cache (k)", "v_cache": "paged_kv_cache (v)"} if self._paged else {}
        self._arg_names = {**names, "k_cache": "k", "v_cache": "v", **cache}
        self._variant_plans = {}
        self._forwarded = {}
        self._set_lse_rows(qo_indptr)

    def _set_lse_rows(self, qo_indptr: Tensor) -> None:
        """The rows a run's LSE covers, for the base-2 conversion of a caller's buffer: known on the
        host, or (device indptr, or a CUDA graph that a later plan may refill) read on the device."""
        on_host = qo_indptr.device.type == "cpu" and not self._use_cuda_graph
        self._lse_rows = (int(qo_indptr[0]), int(qo_indptr[-1])) if on_host else qo_indptr

    def _variant(self, **changes) -> PrefillPlan:
        """The plan with ``changes`` to its :class:`~pagedprefill.batch.Sequences` (a run's own
        window) on top of the last deprecated ``forward``'s causal / window / soft-cap / scale, made
        once."""
        base = self.plan_object
        changes = {**self._forwarded, **changes}
        changes = {k: v for k, v in changes.items() if getattr(base.seq, k) != v}
        if not changes:
            return base
        key = tuple(sorted(changes.items()))
        p = self._variant_plans.get(key)
        if p is None:
            p = self._variant_plans[key] = PrefillPlan(
                dataclasses.replace(base.seq, **changes),
                base.vectors,
                base.pages,
                device=base.device,
                backend=self._backend,
                workspace_buffer=base.workspace,
                o_data_type=base.o_data_type,
                host_pages=base.host_pages,
                split_kv=base.split_kv,
            )
        return p

    def _forward_plan(self, args: dict) -> PrefillPlan:
        """The plan a deprecated ``forward(...)`` call runs (``args``: its ``locals()``): its causal,
        window, soft-cap and scale replace the plan's."""
        refused = dict(
            pos_encoding_mode=(args["pos_encoding_mode"], "NONE"),
            use_fp16_qk_reduction=(args["use_fp16_qk_reduction"], False),
            rope_scale=(args["rope_scale"], None),
            rope_theta=(args["rope_theta"], None),
        )
        _refuse(**_rope_unused(refused, args["pos_encoding_mode"]))
        window_left, soft_cap = normalise.variant_args(args["window_left"], args["logits_soft_cap"])
        seq = self.plan_object.seq
        sm_scale = args["sm_scale"]
        scale = normalise.scale_arg(sm_scale) if sm_scale is not None else 1 / math.sqrt(seq.head_dim_qk)
        causal = normalise.bool_arg("causal", args["causal"])
        self._forwarded = dict(causal=causal, window_left=window_left, logits_soft_cap=soft_cap, scale=scale)
        return self._variant()

    def _run(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out,
        lse,
        return_lse,
        q_scale,
        k_scale,
        v_scale,
        window_left,
        sinks,
        p: PrefillPlan | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        p = p or self._run_plan()
        q_dt, kv_dt = self._dtypes
        if q_dt is not None and q.dtype != q_dt:
            raise fail("q", f"dtype {q_dt} (q_data_type of plan)", q.dtype)
        if kv_dt is not None and k.dtype != kv_dt:
            raise fail("paged_kv_cache" if self._paged else "k", f"dtype {kv_dt} (kv_data_type of plan)", k.dtype)
        # (FlashInfer: a missing scale of an 8-bit tensor is 1)
        q_scale = 1.0 if q_scale is None and q.element_size() == 1 else q_scale
        k_scale = 1.0 if k_scale is None and k.element_size() == 1 else k_scale
        v_scale = 1.0 if v_scale is None and v.element_size() == 1 else v_scale
        if out is not None:  # (FlashInfer's check of out: q's rows, Hq, Dvo, the planned output dtype)
            want = (q.shape[0], p.seq.num_qo_heads, p.seq.head_dim_vo)
            if self._o_rows_own:  # (rows placed by o_indptr: the plan checks that out holds them)
                if not isinstance(out, Tensor) or out.dim() != 3 or tuple(out.shape[1:]) != want[1:]:
                    shape = f"(rows up to o_indptr[-1], num_qo_heads, head_dim_vo) = (n, {want[1]}, {want[2]})"
                    raise fail("out", f"a tensor of shape {shape}", describe(out))
            elif not isinstance(out, Tensor) or tuple(out.shape) != want:
                raise fail("out", f"a tensor of shape (q rows, num_qo_heads, head_dim_vo) = {want}", describe(out))
            o_dt = p.o_data_type or (q.dtype if q.element_size() > 1 else None)
            if o_dt is not None and out.dtype != o_dt:
                raise fail("out", f"dtype {o_dt} (o_data_type of plan)", out.dtype)
        if window_left is not None and window_left != p.seq.window_left:
            p = self._variant(window_left=normalise.variant_args(window_left, 0.0)[0])
        lse_buf = None
        if lse is not None and not return_lse:  # (never silently ignored)
            raise fail("lse", "None when return_lse=False (return_lse=True fills it)", "a tensor")
        if lse is not None and return_lse:
            hq = p.seq.num_qo_heads
            if not isinstance(lse, Tensor) or tuple(lse.shape) != (q.shape[0], hq):
                given = f"shape {tuple(lse.shape)}" if isinstance(lse, Tensor) else type(lse).__name__
                raise fail("lse", f"a float32 tensor of shape (q rows, num_qo_heads) = ({q.shape[0]}, {hq})", given)
            lse_buf = lse
        with _callers_names(self._arg_names):
            o, lse_nat = p.run(
                q,
                k,
                v,
                out,
                lse_buf,
                q_scale=q_scale,
                k_scale=k_scale,
                v_scale=v_scale,
                sinks=sinks,
                return_lse=bool(return_lse),
            )
        if not return_lse:
            return o
        # FlashInfer's wrappers return base-2 LSEs; a caller's buffer keeps its rows that no sequence
        # covers (an allocated one holds -inf there, which the scaling keeps)
        rows = self._lse_rows
        if lse_buf is None or rows is None:
            return o, lse_nat.mul_(LOG2E)
        if isinstance(rows, tuple):
            lse_nat[rows[0] : rows[1]].mul_(LOG2E)
            return o, lse_nat
        idx = torch.arange(lse_nat.shape[0], device=lse_nat.device)
        covered = (idx >= rows[0]) & (idx < rows[-1])
        return o, lse_nat.copy_(torch.where(covered[:, None], lse_nat * LOG2E, lse_nat))


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's paged prefill wrapper: ``plan`` once per batch, ``run`` per layer."""

    _paged = True

    def __init__(
        self,
        float_workspace_buffer: Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Tensor | None = None,
        paged_kv_indptr_buf: Tensor | None = None,
        paged_kv_indices_buf: Tensor | None = None,
        paged_kv_last_page_len_buf: Tensor | None = None,
        custom_mask_buf: Tensor | None = None,
        mask_indptr_buf: Tensor | None = None,
        backend: str = "auto",
        jit_args: object = None,
        jit_kwargs: object = None,
    ) -> None:
        buffers = dict(
            qo_indptr=qo_indptr_buf,
            paged_kv_indptr=paged_kv_indptr_buf,
            paged_kv_indices=paged_kv_indices_buf,
            paged_kv_last_page_len=paged_kv_last_page_len_buf,
        )
        super().__init__(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            backend,
            buffers,
            custom_mask_buf,
            mask_indptr_buf,
            jit_args,
            jit_kwargs,
        )

    @_all_or_nothing
    def plan(
        self,
        qo_indptr: Tensor,
        paged_kv_indptr: Tensor,
        paged_kv_indices: Tensor,
        paged_kv_last_page_len: Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: Tensor | None = None,
        packed_custom_mask: Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
        prefix_len_ptr: Tensor | None = None,
        token_pos_in_items_ptr: Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: Tensor | None = None,
        seq_lens: Tensor | None = None,
        seq_lens_q: Tensor | None = None,
        block_tables: Tensor | None = None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        """FlashInfer's ``plan``: CSR pages (``paged_kv_indptr`` (B+1,), ``paged_kv_indices``,
        ``paged_kv_last_page_len`` (B,)) or, like its cudnn backend, ``seq_lens`` + ``block_tables``."""
        self._plan_args(locals())
        qo_indptr = normalise.vector("qo_indptr", qo_indptr, None, self._workspace.device, False)
        _check_indptr("qo_indptr", qo_indptr)
        lens_q = qo_indptr[1:] - qo_indptr[:-1]
        kv = {}
        if block_tables is not None:
            if seq_lens is None:
                raise fail("seq_lens", "the (B,) KV lengths that go with block_tables", None)
            seq_lens = normalise.vector("seq_lens", seq_lens, lens_q.shape[0], self._workspace.device, False)
            kv = dict(block_tables=block_tables, actual_seq_lens_kv=seq_lens)
            kv_host = seq_lens.tolist() if seq_lens.device.type == "cpu" else None
            _check_csr_beside_table(
                paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, seq_lens, block_tables, page_size
            )
        else:
            indptr = _beside_qo("paged_kv_indptr", paged_kv_indptr, qo_indptr, 0)
            last = _beside_qo("paged_kv_last_page_len", paged_kv_last_page_len, qo_indptr, 1)
            kv = dict(kv_indptr=indptr, kv_indices=paged_kv_indices, kv_last_page_len=last)
            kv_host = None
            if indptr.device.type == "cpu" and last.device.type == "cpu":
                kv_host = normalise.csr_kv_lens(indptr, last, page_size).tolist()
            if seq_lens is not None:  # (FlashInfer plans its KV lengths from them: they must be the pages')
                _check_seq_lens(seq_lens, kv_host, indptr, last, page_size, max_sequence_kv)
        q_host = lens_q.tolist() if lens_q.device.type == "cpu" else None
        if q_host is None and max_token_per_sequence is None:
            q_host = lens_q.tolist()  # (device indptr without bounds: one read-back, as FlashInfer does)
        if kv_host is None and max_sequence_kv is None:
            if block_tables is not None:
                kv_host = seq_lens.tolist()
            else:
                kv_host = normalise.csr_kv_lens(kv["kv_indptr"], kv["kv_last_page_len"], page_size).tolist()
        max_q, max_kv = self._bounds_for(max_token_per_sequence, max_sequence_kv, q_host or [], kv_host or [])
        if self._use_cuda_graph:  # (every tensor a run reads lives in this wrapper's buffers)
            qo_indptr = self._graph_vector("qo_indptr", qo_indptr)
            lens_q = self._graph_vector("qo_lens", lens_q)
            if "actual_seq_lens_kv" in kv:
                kv["actual_seq_lens_kv"] = self._graph_vector("kv_lens", kv["actual_seq_lens_kv"])
                kv["block_tables"] = self._graph_table(kv["block_tables"])
            if "kv_indptr" in kv:
                kv = dict(
                    kv_indptr=self._graph_vector("paged_kv_indptr", kv["kv_indptr"]),
                    kv_indices=self._graph_vector("paged_kv_indices", kv["kv_indices"]),
                    kv_last_page_len=self._graph_vector("paged_kv_last_page_len", kv["kv_last_page_len"]),
                )
        names = dict(
            kv_indptr="paged_kv_indptr",
            kv_indices="paged_kv_indices",
            kv_last_page_len="paged_kv_last_page_len",
            actual_seq_lens_kv="seq_lens",
            actual_seq_lens_q="qo_indptr",
            batch_offsets_q="qo_indptr",
            batch_offsets_stats="qo_indptr",
        )
        self._make_plan(
            locals(),
            names,
            qo_indptr,
            page_size,
            lens_q,
            max_q,
            max_kv,
            batch_offsets_q=qo_indptr,
            batch_offsets_stats=qo_indptr,
            **kv,
        )

    begin_forward = plan

    def run(
        self,
        q: Tensor,
        paged_kv_cache: Tensor | tuple[Tensor, Tensor],
        *args,
        q_scale: Tensor | float | None = None,
        k_scale: Tensor | float | None = None,
        v_scale: Tensor | float | None = None,
        out: Tensor | None = None,
        lse: Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: Tensor | None = None,
        kv_cache_sf: object = None,
        skip_softmax_threshold_scale_factor: float | None = None,
        use_fp16_softmax: bool | None = None,
        uses_spcompress: bool | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """FlashInfer's ``run``: ``paged_kv_cache`` is a ``(k_cache, v_cache)`` tuple of
        ``[pages, page_size, Hkv, D]`` (NHD) / ``[pages, Hkv, page_size, D]`` (HND) tensors, or one
        ``[pages, 2, page_size, Hkv, D]`` / ``[pages, 2, Hkv, page_size, D]`` tensor. Returns out, or
        (out, lse) with ``return_lse`` (lse base 2, ``(q.shape[0], Hq)``)."""
        if args:
            _positional_run_arguments(args)
        _refuse(
            kv_cache_sf=(kv_cache_sf, None),
            skip_softmax_threshold_scale_factor=(skip_softmax_threshold_scale_factor, None),
            use_fp16_softmax=(use_fp16_softmax, None) if use_fp16_softmax else (None, None),
            uses_spcompress=(uses_spcompress, None) if uses_spcompress else (None, None),
        )
        k, v = self._unpack(paged_kv_cache)
        return self._run(q, k, v, out, lse, return_lse, q_scale, k_scale, v_scale, window_left, sinks)

    def run_return_lse(self, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """FlashInfer's ``run_return_lse``: :meth:`run` with ``return_lse=True`` (out, base-2 lse) unless the
        call names ``return_lse`` itself (FlashInfer's ``partialmethod``)."""
        return self.run(*args, **{"return_lse": True, **kwargs})

    def forward(
        self,
        q: Tensor,
        paged_kv_cache: Tensor | tuple[Tensor, Tensor],
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale: Tensor | float | None = None,
        v_scale: Tensor | float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """FlashInfer's deprecated ``forward``: ``run`` with this call's causal / window / soft-cap /
        scale in place of the plan's; later runs keep them, as in FlashInfer, until the next plan."""
        p = self._forward_plan(locals())
        k, v = self._unpack(paged_kv_cache)
        return self._run(q, k, v, None, None, return_lse, None, k_scale, v_scale, None, None, p=p)

    def forward_return_lse(self, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """FlashInfer's deprecated ``forward_return_lse``: :meth:`forward` with ``return_lse=True``."""
        return self.forward(*args, return_lse=True, **kwargs)

    def workspace_size(self, *args, **kwargs):
        """FlashInfer's ``workspace_size``: not implemented; ``plan``/``run`` name the bytes a
        workspace lacks (``workspace_buffer: expected at least N bytes``)."""
        raise NotImplementedError(
            "pagedprefill does not implement FlashInfer's workspace_size; a run that needs more workspace "
            "raises with the bytes it needs"
        )

    def _unpack(self, cache) -> tuple[Tensor, Tensor]:
        """(k, v) as (pages, Hkv, page_size, D) views (FlashInfer's squeezed page-size-1 forms too: a
        tuple of 3-D tensors, or one 4-D tensor with K and V on dim 1)."""
        squeeze_at = -3 if self._kv_layout == "NHD" else -2  # (where FlashInfer's page dim of 1 goes)
        if isinstance(cache, (tuple, list)) and len(cache) == 2:
            k, v = (t.unsqueeze(squeeze_at) if isinstance(t, Tensor) and t.dim() == 3 else t for t in cache)
        elif isinstance(cache, Tensor) and cache.dim() in (4, 5):
            if cache.dim() == 4:
                cache = cache.unsqueeze(squeeze_at)
            if cache.shape[1] != 2:
                raise fail(
                    "paged_kv_cache", "a 5-D tensor with K and V on dim 1 (size 2)", f"shape {tuple(cache.shape)}"
                )
            k, v = cache[:, 0], cache[:, 1]
        else:
            raise fail("paged_kv_cache", "a (k_cache, v_cache) tuple or one 4-D / 5-D tensor", describe(cache))
        for name, t in (("paged_kv_cache (k)", k), ("paged_kv_cache (v)", v)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise fail(
                    name,
                    f"a 4-D {self._kv_layout} tensor",
                    t if not isinstance(t, Tensor) else f"shape {tuple(t.shape)}",
                )
        if self._kv_layout == "NHD":
            return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        return k, v


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    """FlashInfer's ragged prefill wrapper (contiguous K/V per sequence)."""

    _paged = False

    def __init__(
        self,
        float_workspace_buffer: Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Tensor | None = None,
        kv_indptr_buf: Tensor | None = None,
        custom_mask_buf: Tensor | None = None,
        mask_indptr_buf: Tensor | None = None,
        backend: str = "auto",
        jit_args: object = None,
        jit_kwargs: object = None,
    ) -> None:
        buffers = dict(qo_indptr=qo_indptr_buf, kv_indptr=kv_indptr_buf)
        super().__init__(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            backend,
            buffers,
            custom_mask_buf,
            mask_indptr_buf,
            jit_args,
            jit_kwargs,
        )

    @_all_or_nothing
    def plan(
        self,
        qo_indptr: Tensor,
        kv_indptr: Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        custom_mask: Tensor | None = None,
        packed_custom_mask: Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
        prefix_len_ptr: Tensor | None = None,
        token_pos_in_items_ptr: Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        seq_lens: Tensor | None = None,
        seq_lens_q: Tensor | None = None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        v_indptr: Tensor | None = None,
        o_indptr: Tensor | None = None,
    ) -> None:
        """FlashInfer's ``plan``: ``qo_indptr`` and ``kv_indptr`` (B+1,) token offsets of each sequence
        (``v_indptr`` / ``o_indptr`` when V / out rows start elsewhere)."""
        self._plan_args(locals(), "seq_lens")
        dev = self._workspace.device
        qo = normalise.vector("qo_indptr", qo_indptr, None, dev, False)
        kvp = _beside_qo("kv_indptr", kv_indptr, qo, 0, dev)
        _check_indptr("qo_indptr", qo)
        _check_indptr("kv_indptr", kvp)
        lens_q, lens_kv = qo[1:] - qo[:-1], kvp[1:] - kvp[:-1]
        q_host = lens_q.tolist() if lens_q.device.type == "cpu" or max_token_per_sequence is None else []
        kv_host = lens_kv.tolist() if lens_kv.device.type == "cpu" or max_sequence_kv is None else []
        max_q, max_kv = self._bounds_for(max_token_per_sequence, max_sequence_kv, q_host, kv_host)
        offs = dict(
            batch_offsets_q=qo,
            batch_offsets_o=o_indptr if o_indptr is not None else qo,
            batch_offsets_k=kvp,
            batch_offsets_v=v_indptr if v_indptr is not None else kvp,
            batch_offsets_stats=qo,
        )
        if self._use_cuda_graph:  # (every tensor a run reads lives in this wrapper's buffers)
            qo = self._graph_vector("qo_indptr", qo)
            kvp = self._graph_vector("kv_indptr", kvp)
            lens_q, lens_kv = self._graph_vector("qo_lens", lens_q), self._graph_vector("kv_lens", lens_kv)
            offs.update(batch_offsets_q=qo, batch_offsets_k=kvp, batch_offsets_stats=qo)
            offs["batch_offsets_o"] = qo if o_indptr is None else offs["batch_offsets_o"]
            offs["batch_offsets_v"] = kvp if v_indptr is None else offs["batch_offsets_v"]
        names = dict(
            actual_seq_lens_q="qo_indptr",
            actual_seq_lens_kv="kv_indptr",
            batch_offsets_q="qo_indptr",
            batch_offsets_o="o_indptr" if o_indptr is not None else "qo_indptr",
            batch_offsets_k="kv_indptr",
            batch_offsets_v="v_indptr" if v_indptr is not None else "kv_indptr",
            batch_offsets_stats="qo_indptr",
        )
        self._make_plan(locals(), names, qo, 0, lens_q, max_q, max_kv, actual_seq_lens_kv=lens_kv, **offs)
        self._o_rows_own = o_indptr is not None

    begin_forward = plan

    def run(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *args,
        q_scale: Tensor | float | None = None,
        k_scale: Tensor | float | None = None,
        v_scale: Tensor | float | None = None,
        o_scale: float | None = None,
        out: Tensor | None = None,
        lse: Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        kv_cache_sf: object = None,
        window_left: int | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """FlashInfer's ``run``: k, v ``[kv_indptr[-1], Hkv, D]`` (NHD) or ``[Hkv, kv_indptr[-1], D]``
        (HND). Returns out, or (out, lse) with ``return_lse`` (lse base 2, ``(q.shape[0], Hq)``)."""
        if args:
            _positional_run_arguments(args)
        _refuse(
            o_scale=(None if type(o_scale) in (int, float) and o_scale == 1 else o_scale, None),
            kv_cache_sf=(kv_cache_sf, None),
        )
        if self._kv_layout == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        return self._run(q, k, v, out, lse, return_lse, q_scale, k_scale, v_scale, window_left, sinks)

    def run_return_lse(self, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """FlashInfer's ``run_return_lse``: :meth:`run` with ``return_lse=True`` (out, base-2 lse) unless the
        call names ``return_lse`` itself (FlashInfer's ``partialmethod``)."""
        return self.run(*args, **{"return_lse": True, **kwargs})

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        return_lse: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """FlashInfer's deprecated ``forward``: ``run`` with this call's causal / window / soft-cap /
        scale in place of the plan's; later runs keep them, as in FlashInfer, until the next plan."""
        p = self._forward_plan(locals())
        if self._kv_layout == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        return self._run(q, k, v, None, None, return_lse, None, None, None, None, None, p=p)

    def forward_return_lse(self, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """FlashInfer's deprecated ``forward_return_lse``: :meth:`forward` with ``return_lse=True``."""
        return self.forward(*args, return_lse=True, **kwargs)


def _check_indptr(name: str, indptr: Tensor) -> None:
    """An indptr on the host: non-decreasing (its differences are the sequences' lengths)."""
    if indptr.device.type == "cpu" and indptr.numel() > 1:
        steps = indptr[1:] - indptr[:-1]
        if bool((steps < 0).any()):
            b = int((steps < 0).nonzero()[0])
            raise fail(name, "non-decreasing entries", f"{int(indptr[b])} then {int(indptr[b + 1])} at index {b}")


def _check_csr_beside_table(indptr, indices, last, seq_lens, table, page_size: int) -> None:
    """FlashInfer's CSR pages given beside ``seq_lens`` + ``block_tables`` (its cudnn backend's form,
    which these runs read) must describe the same batch: tensors of the batch's size, and where all
    of it is on the host, the same KV lengths and the same page ids."""
    if not isinstance(seq_lens, Tensor) or not isinstance(table, Tensor):
        return  # (the plan's own checks name them)
    bsz = seq_lens.numel()
    if table.dim() != 2 or table.shape[0] != bsz:
        raise fail("block_tables", f"a (B, width) tensor of page ids with B = {bsz} rows (seq_lens)", describe(table))
    indptr = normalise.vector("paged_kv_indptr", indptr, bsz + 1, seq_lens.device, False)
    last = normalise.vector("paged_kv_last_page_len", last, bsz, seq_lens.device, False)
    if not isinstance(indices, Tensor):
        raise fail("paged_kv_indices", "a tensor of page ids", describe(indices))
    tensors = (indptr, last, indices, seq_lens, table)
    if any(t.device.type != "cpu" for t in tensors):
        return
    _check_indptr("paged_kv_indptr", indptr)
    _check_seq_lens(seq_lens, None, indptr, last, page_size, None)
    flat = indices.reshape(-1)
    for b in range(bsz):
        lo, hi = int(indptr[b]), int(indptr[b + 1])
        ids = flat[lo:hi].long()
        if hi > flat.numel() or hi - lo > table.shape[1] or not torch.equal(ids, table[b, : hi - lo].long()):
            raise fail(
                "paged_kv_indices",
                f"sequence {b}'s page ids as in block_tables[{b}] (both given: they must describe one batch)",
                ids.tolist()[:8],
            )


def _check_seq_lens(seq_lens, kv_host, indptr: Tensor, last: Tensor, page_size: int, max_kv) -> None:
    """``seq_lens`` beside CSR pages must be the pages' KV lengths: compared on the host (read back
    where FlashInfer reads them too: no ``max_sequence_kv``); device lengths with ``max_sequence_kv``
    are not read (no host sync) and must match."""
    if not isinstance(seq_lens, Tensor):
        raise fail("seq_lens", "a (B,) integer tensor", type(seq_lens).__name__)
    if seq_lens.device.type != "cpu" and max_kv is not None:
        return
    given = seq_lens.reshape(-1).tolist()
    pages = kv_host if kv_host is not None else normalise.csr_kv_lens(indptr, last, page_size).tolist()
    if given != pages:
        raise fail(
            "seq_lens", f"the KV lengths of the CSR pages {pages[:8]}{'...' if len(pages) > 8 else ''}", given[:8]
        )
