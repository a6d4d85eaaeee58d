"""Public API and argument normalisation.

Every argument form the spec accepts (lengths on the CPU or the device, ``(B,)`` or ``(B,1,1,1)``
shapes, batch offsets absent / in elements / in tokens, paged or ragged K/V, padded or packed LSE)
is checked here and turned into ONE :class:`PrefillBatch`. Backends consume only that object; none
of them parses the raw arguments again.

Where each argument is checked: :func:`_normalise` (shapes, dtypes, devices), :func:`_host_metadata`
(lengths and offsets known on the host), :func:`_device_metadata` (CUDA-graph mode: lengths on the
device are clamped, never trusted), :func:`_select_backend` (backend choice and its limits).

A call whose signature (:func:`_call_signature`: every layout, host lengths by value, device inputs
by identity, every scalar) matches an earlier successful call reuses that call's checked batch and
backend (:class:`_CallPlan`): a serving engine's per-layer calls skip all of the above.
"""

from __future__ import annotations

import array
import importlib
import itertools
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import Tensor

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "PrefillBatch",
    "batch_prefill_with_kv_cache",
    "cudnn_batch_prefill_with_kv_cache",
    "last_backend",
]

BACKENDS = ("auto", "cudnn", "triton", "torch")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LENGTH_DTYPES = (torch.int32, torch.int64)

# Rows of the int32 metadata table that normalisation writes at the start of the workspace.
META_FIELDS = ("lens_q", "lens_kv", "q_start", "o_start", "k_start", "v_start", "lse_start")
META_ALIGN = 256  # bytes; backend scratch starts at this alignment after the metadata
INT32_MAX = 2**31 - 1


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (no GPU, package missing, ...)."""


@dataclass
class HostMetadata:
    """The batch metadata as Python lists, when it is known without a device sync."""

    lens_q: list[int]
    lens_kv: list[int]
    q_start: list[int]
    o_start: list[int]
    k_start: list[int]  # ragged K rows (all zeros when paged)
    v_start: list[int]
    lse_start: list[int]  # element offsets into the flat lse buffer (zeros when no lse)


@dataclass
class PrefillBatch:
    """One prefill call, normalised. Shapes use B = batch size.

    Tensors (all on ``q.device``):
      q        (rows_q, Hq, Dqk)                      any strides, last dim unit stride
      k, v     paged: (num_pages, Hkv, page_size, D)   any strides, last dim unit stride
               ragged: (rows_k, Hkv, D)
      out      (rows_o, Hq, Dvo), dtype ``out_dtype``, last dim unit stride
      lse      flat 1-D float32 view of the LSE buffer, or None; row i, head h of sequence b
               lives at ``lse[lse_start[b] + i * Hq + h]``
      meta     (7, B) int32 view of the workspace; rows in ``META_FIELDS`` order:
               lens_q, lens_kv: effective lengths (already clamped / validated: kernels may trust
               them, except block-table *contents*, which kernels clamp to [0, num_pages))
               q_start, o_start, k_start, v_start: first row of sequence b in q / out / k / v
               (token units; k/v only for ragged), lse_start: element offset into ``lse``
      work_counter (1,) int32 view of the workspace right after ``meta``, zeroed with it at every
               call: a kernel that hands out work items dynamically counts them here
      block_tables (B, max_pages_per_seq) int32 or None (ragged)
      q_scale, k_scale, v_scale  one-element float32 tensors or None (None means 1.0)
      scratch  1-D uint8 view of the workspace after the metadata, for backend use

    ``host`` holds the same metadata as lists when it was known without a device sync (lengths
    given on the CPU, or read back when ``is_cuda_graph_compatible`` is False); None in
    CUDA-graph mode, where backends must not sync.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor | None
    meta: Tensor
    block_tables: Tensor | None
    scratch: Tensor
    batch_size: int
    max_q: int
    max_kv: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int  # 0 for ragged K/V
    scale: float
    causal: bool
    out_dtype: torch.dtype
    q_scale: Tensor | None = None
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None
    lse_packed: bool = False  # True when batch_offsets_stats placed the rows (else (B, max_q, Hq))
    graph_mode: bool = False
    host: HostMetadata | None = None
    extras: dict = field(default_factory=dict)
    work_counter: Tensor | None = None

    @property
    def paged(self) -> bool:
        return self.block_tables is not None

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def device(self) -> torch.device:
        return self.q.device

    def meta_row(self, name: str) -> Tensor:
        """One (B,) int32 row of the metadata table, by name from ``META_FIELDS``."""
        return self.meta[META_FIELDS.index(name)]


def meta_bytes(batch_size: int) -> int:
    """Workspace bytes taken by the normalised metadata of a batch of ``batch_size``."""
    raw = (len(META_FIELDS) * max(batch_size, 1) + 1) * 4  # (+ the work counter)
    return -(-raw // META_ALIGN) * META_ALIGN


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def cudnn_batch_prefill_with_kv_cache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
    workspace_buffer: Tensor,
    *,
    max_token_per_sequence: int,
    max_sequence_kv: int,
    actual_seq_lens_q: Tensor | None = None,
    actual_seq_lens_kv: Tensor | None = None,
    block_tables: Tensor | None = None,
    causal: bool,
    return_lse: bool,
    q_scale: Tensor | float | None = None,
    k_scale: Tensor | float | None = None,
    v_scale: Tensor | float | None = None,
    batch_offsets_q: Tensor | None = None,
    batch_offsets_o: Tensor | None = None,
    batch_offsets_k: Tensor | None = None,
    batch_offsets_v: Tensor | None = None,
    batch_offsets_stats: Tensor | None = None,
    batch_offsets_units: str = "elements",
    out: Tensor | None = None,
    lse: Tensor | None = None,
    is_cuda_graph_compatible: bool = False,
    backend: str | None = None,
    o_data_type: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Batched prefill attention over a paged (or ragged) KV cache.

    Drop-in for FlashInfer's ``flashinfer.prefill.cudnn_batch_prefill_with_kv_cache``.

    Args:
        q: (total_q_tokens, Hq, Dqk) fp16 / bf16 / fp32 / fp8; last dim unit stride.
        k_cache, v_cache: paged (num_pages, Hkv, page_size, Dqk / Dvo) when ``block_tables`` is
            given (NHD storage as ``.permute(0, 2, 1, 3)``, HND, or two views of one interleaved
            buffer all work), else ragged (total_kv_tokens, Hkv, Dqk / Dvo).
        scale: softmax scale applied to q·kᵀ (typically 1/sqrt(Dqk)).
        workspace_buffer: byte buffer on q's device for metadata and backend scratch
            (128 MiB is plenty); too small raises ``ValueError`` with the bytes needed.
        max_token_per_sequence: upper bound of ``actual_seq_lens_q`` (s_qo_max).
        max_sequence_kv: upper bound of ``actual_seq_lens_kv`` (s_kv_max).
        actual_seq_lens_q, actual_seq_lens_kv: (B,) or (B,1,1,1) int32/int64, CPU or device.
        block_tables: (B, max_pages_per_seq) int32; row b lists sequence b's pages in order.
        causal: bottom-right aligned causal mask (query i sees keys j <= i + kv_len - q_len).
        return_lse: also return the natural-log log-sum-exp of the scaled logits.
        q_scale, k_scale, v_scale: one-element float32 tensors (or floats): real = stored × scale.
            Required for fp8 tensors.
        batch_offsets_q/_o/_k/_v/_stats: (B+1,) or (B+1,1,1,1) int32/int64 start offsets of each
            sequence, in ``batch_offsets_units``: "elements" (token × H × D of that tensor; stats:
            token × Hq) or "tokens". Absent: prefix sums of the lengths (o defaults to q's, v to
            k's offsets).
        out: optional (rows, Hq, Dvo) output; rows that belong to no sequence are never written.
        lse: optional float32 LSE buffer: (B, max_token_per_sequence, Hq), or any contiguous
            buffer addressed by ``batch_offsets_stats``.
        is_cuda_graph_compatible: lengths/offsets/tables live on the device; no host sync, and
            no allocation when out (and lse) are given; safe to capture with ``torch.cuda.graph``.
        backend: "auto" / None (fastest correct backend for the call), "cudnn", "triton", "torch".
        o_data_type: output dtype; default q.dtype (bf16 for fp8 q).

    Returns:
        (out, lse): lse is None unless ``return_lse``. Rows with no visible key get out 0 and
        lse -inf.
    """
    key = _call_signature(
        q, k_cache, v_cache, scale, workspace_buffer, max_token_per_sequence, max_sequence_kv,
        actual_seq_lens_q, actual_seq_lens_kv, block_tables, causal, return_lse,
        (q_scale, k_scale, v_scale),
        (batch_offsets_q, batch_offsets_o, batch_offsets_k, batch_offsets_v, batch_offsets_stats),
        batch_offsets_units, out, lse, is_cuda_graph_compatible, backend, o_data_type,
    )  # fmt: skip
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        return plan.run(q, k_cache, v_cache, out, lse)
    batch = _normalise(
        q, k_cache, v_cache, scale, workspace_buffer,
        max_token_per_sequence=max_token_per_sequence, max_sequence_kv=max_sequence_kv,
        actual_seq_lens_q=actual_seq_lens_q, actual_seq_lens_kv=actual_seq_lens_kv,
        block_tables=block_tables, causal=causal, return_lse=return_lse,
        q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        batch_offsets_q=batch_offsets_q, batch_offsets_o=batch_offsets_o,
        batch_offsets_k=batch_offsets_k, batch_offsets_v=batch_offsets_v,
        batch_offsets_stats=batch_offsets_stats, batch_offsets_units=batch_offsets_units,
        out=out, lse=lse, is_cuda_graph_compatible=is_cuda_graph_compatible, o_data_type=o_data_type,
    )  # fmt: skip
    module = _select_backend(backend, batch)
    _carve_workspace(batch, module)
    staged = _stage_metadata(batch)
    _write_metadata(batch, staged)
    module.run(batch)
    _LAST.backend = module.NAME
    if key is not None:
        keep = (
            workspace_buffer,
            actual_seq_lens_q,
            actual_seq_lens_kv,
            block_tables,
            q_scale,
            k_scale,
            v_scale,
        )
        keep += (batch_offsets_q, batch_offsets_o, batch_offsets_k, batch_offsets_v, batch_offsets_stats)
        _remember_plan(key, _CallPlan.of(batch, module, staged, out is None, lse is None, keep))
    lse_ret = batch.extras["lse_user_view"] if return_lse else None
    return batch.extras["out_user_view"], lse_ret


_LAST = threading.local()


# --------------------------------------------------------------------------------------------
# Call cache: a call whose signature matches an earlier one skips normalisation and selection
# --------------------------------------------------------------------------------------------
#
# A serving engine calls the function once per layer with the same lengths, tables and workspace
# and only new q / K / V / out tensors of the same layout. Everything _normalise checks and
# _select_backend decides depends only on what _call_signature records: the layouts (shape,
# strides, dtype, device) of every tensor, the host-side CONTENTS of lengths and offsets given on
# the host (and device ones read without CUDA graphs, which _host_metadata reads anyway), the
# identity of device-side inputs whose contents only kernels read (block tables, scale tensors;
# lengths/offsets in CUDA-graph mode), the workspace's address and size, and every scalar argument.
# A matching call then costs a metadata copy (from the pinned staging made the first time) and the
# backend's launches. Calls the signature cannot describe (a block table or a scale tensor on the
# CPU, scalar-tensor max_* values, anything that is not a tensor where one is expected) are not
# cached. The cached plan holds no q / K / V / out / lse of the first call.

_PLANS: dict[tuple, _CallPlan] = {}
_PLANS_MAX = 32  # the cache is cleared when full


def _layout(t: object) -> tuple | None:
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


def _device_sig(t: Tensor) -> tuple:
    """A device tensor whose contents only kernels read: its identity (the cached plan keeps the
    object alive, so the id cannot be recycled), address and layout."""
    return (id(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _vector_sig(t: object, graph_mode: bool) -> tuple | None:
    if t is None:
        return ()
    if not isinstance(t, Tensor):
        return None
    if t.is_cuda and graph_mode:
        return _device_sig(t)
    if t.dim() not in (1, 4) or t.dtype not in LENGTH_DTYPES:
        return None
    return (t.dtype, t.device, t.shape, tuple(t.reshape(-1).tolist()))


def _call_signature(
    q, k, v, scale, ws, max_q, max_kv, lens_q, lens_kv, bt, causal, return_lse, scales, offsets, units,
    out, lse, graph_mode, backend, o_data_type,
) -> tuple | None:  # fmt: skip
    """The key of a call in the call cache, or None when the call must take the full path."""
    if type(max_q) is not int or type(max_kv) is not int or type(scale) not in (float, int):
        return None
    if type(causal) is not bool or type(return_lse) is not bool or type(graph_mode) is not bool:
        return None
    if type(units) is not str or not (backend is None or type(backend) is str):
        return None
    if not (o_data_type is None or isinstance(o_data_type, torch.dtype)):
        return None
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    if not isinstance(ws, Tensor) or (out is not None and not isinstance(out, Tensor)):
        return None
    if lse is not None and not isinstance(lse, Tensor):
        return None
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing and not graph_mode:
        return None  # the full path raises its capture error (and nothing may sync here)
    sig_s = []
    for sc in scales:
        if isinstance(sc, Tensor):
            if not sc.is_cuda:
                return None
            sig_s.append(_device_sig(sc))
        elif sc is None or type(sc) in (float, int):
            sig_s.append(sc)
        else:
            return None
    if bt is not None:
        if not isinstance(bt, Tensor) or not bt.is_cuda:
            return None
        sig_bt = _device_sig(bt)
        offsets = (*offsets[:2], None, None, offsets[4])  # paged: K/V offsets are ignored unchecked
    else:
        sig_bt = None
    vecs = tuple(_vector_sig(t, graph_mode) for t in (lens_q, lens_kv, *offsets))
    if None in vecs:
        return None
    aligned = tuple(t is not None and t.data_ptr() % 16 == 0 for t in (q, k, v, out))  # cuDNN needs 16
    return (
        _layout(q), _layout(k), _layout(v), _layout(out), _layout(lse) if return_lse else None, aligned,
        id(ws), ws.data_ptr(), ws.numel(), ws.dtype, ws.device, float(scale), max_q, max_kv, causal,
        return_lse, tuple(sig_s), sig_bt, vecs, units, graph_mode, backend, o_data_type, capturing,
        threading.get_ident(),  # a cuDNN plan is built for one thread's handle
        os.environ.get("PAGEDPREFILL_CUDNN_ENGINES"), os.environ.get("PAGEDPREFILL_TRITON_CONFIG"),
        os.environ.get("TRITON_INTERPRET"),
    )  # fmt: skip


def _remember_plan(key: tuple, plan: _CallPlan) -> None:
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[key] = plan


def clear_call_cache() -> None:
    """Forget every cached call plan (tests; after changing backend knobs in-process)."""
    _PLANS.clear()


@dataclass
class _CallPlan:
    """What a call resolved once: its normalised batch without the per-call tensors, the backend
    module, and the staged metadata."""

    template: PrefillBatch  # q / k / v / out / lse are replaced at each run
    module: ModuleType
    staged: Tensor | None  # the host path's int32 (7 * B + 1) metadata (pinned on CUDA); None: device path
    out_shape: tuple[int, ...] | None  # allocate out like this when the caller gives none
    lse_shape: tuple[int, ...] | None  # allocate lse like this when the caller gives none
    return_lse: bool
    keep: tuple  # the call's arguments keyed by id(): alive while the plan is, so ids stay unique

    @classmethod
    def of(
        cls, batch: PrefillBatch, module: ModuleType, staged: Tensor | None, own_out: bool, own_lse: bool,
        keep: tuple,
    ) -> _CallPlan:  # fmt: skip
        ex = batch.extras
        lse_user = ex["lse_user_view"]
        template = object.__new__(PrefillBatch)
        template.__dict__.update(batch.__dict__)
        template.q = template.k = template.v = template.out = template.lse = None
        template.extras = {k: v for k, v in ex.items() if k not in ("out_user_view", "lse_user_view")}
        return cls(
            template,
            module,
            staged,
            tuple(ex["out_user_view"].shape) if own_out else None,
            tuple(lse_user.shape) if own_lse and lse_user is not None else None,
            lse_user is not None,
            keep,
        )

    def run(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor | None, lse: Tensor | None):
        """Run on new tensors of the planned layout. Everything the full path would check is equal
        by the signature: layouts, 16-byte alignment (cuDNN's address rule), capture state."""
        t = self.template
        batch = object.__new__(PrefillBatch)
        batch.__dict__.update(t.__dict__)
        dev = q.device
        if out is None:
            out = torch.zeros(self.out_shape, dtype=t.out_dtype, device=dev)
        batch.q, batch.k, batch.v, batch.out = q, k, v, out
        if self.return_lse:
            if lse is None:
                lse = torch.full(self.lse_shape, -math.inf, dtype=torch.float32, device=dev)
            batch.lse = lse.view(-1)
        else:
            lse = None
        _write_metadata(batch, self.staged)
        self.module.run(batch)
        _LAST.backend = self.module.NAME
        return out, lse


def last_backend() -> str | None:
    """The backend that served the most recent successful call in this thread (e.g. what "auto"
    picked), or None before the first call."""
    return getattr(_LAST, "backend", None)


def batch_prefill_with_kv_cache(
    *args, backend: str | None = "auto", **kwargs
) -> tuple[Tensor, Tensor | None]:
    """:func:`cudnn_batch_prefill_with_kv_cache` with ``backend="auto"`` by default."""
    return cudnn_batch_prefill_with_kv_cache(*args, backend=backend, **kwargs)


# --------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------


def _fail(arg: str, expected: str, given: object) -> ValueError:
    return ValueError(f"{arg}: expected {expected}, got {given}")


def _describe(t: Tensor) -> str:
    return f"tensor of shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_tensor(name: str, t: object, ndim: int, device: torch.device | None = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise _fail(name, f"a torch.Tensor of rank {ndim}", type(t).__name__)
    if t.dim() != ndim:
        raise _fail(name, f"rank {ndim}", f"rank {t.dim()} ({_describe(t)})")
    if device is not None and t.device != device:
        raise _fail(name, f"a tensor on {device} (q's device)", f"one on {t.device}")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise _fail(name, "unit stride on the last dimension", f"strides {tuple(t.stride())}")
    return t


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib


def _vector(name: str, t: object, length: int | None, device: torch.device, graph_mode: bool) -> Tensor:
    """A (n,) or (n,1,1,1) int32/int64 tensor on the CPU or on q's device, flattened to (n,)."""
    if not isinstance(t, Tensor):
        raise _fail(name, "an int32/int64 torch.Tensor of shape (n,) or (n,1,1,1)", type(t).__name__)
    if t.dtype not in LENGTH_DTYPES:
        raise _fail(name, "dtype int32 or int64", t.dtype)
    if not (t.dim() == 1 or (t.dim() == 4 and tuple(t.shape[1:]) == (1, 1, 1))):
        raise _fail(name, "shape (n,) or (n, 1, 1, 1)", f"shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise _fail(name, f"{length} entries", f"{t.shape[0]} (shape {tuple(t.shape)})")
    if t.device.type != "cpu" and not _same_device(t.device, device):
        raise _fail(name, f"a tensor on the CPU or on q's device {device}", f"one on {t.device}")
    if graph_mode and device.type == "cuda" and t.device.type == "cpu":
        raise _fail(
            name,
            "a tensor on q's device when is_cuda_graph_compatible=True "
            "(a CPU tensor would be baked into the captured graph)",
            "one on the CPU",
        )
    return t.reshape(-1)


def _scale_tensor(name: str, s: object, device: torch.device, graph_mode: bool) -> Tensor | None:
    if s is None:
        return None
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return torch.full((1,), float(s), dtype=torch.float32, device=device)
    if not isinstance(s, Tensor):
        raise _fail(name, "a one-element float32 tensor or a float", type(s).__name__)
    if s.numel() != 1:
        raise _fail(name, "a tensor of one element (shape (1,) or (1,1,1,1))", f"shape {tuple(s.shape)}")
    if s.dtype != torch.float32:
        raise _fail(name, "dtype float32", s.dtype)
    if s.device.type == "cpu" and device.type != "cpu":
        if graph_mode:
            raise _fail(name, "a tensor on q's device when is_cuda_graph_compatible=True", "one on the CPU")
        return s.reshape(1).to(device)
    if not _same_device(s.device, device):
        raise _fail(name, f"a tensor on q's device {device}", f"one on {s.device}")
    return s.reshape(1)


def _int_arg(name: str, x: object, minimum: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        if isinstance(x, Tensor) and x.numel() == 1 and not x.dtype.is_floating_point:
            x = int(x.item())
        else:
            raise _fail(name, "a Python int", type(x).__name__)
    if x < minimum:
        raise _fail(name, f"an int >= {minimum}", x)
    return x


def _normalise(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
    workspace_buffer: Tensor,
    *,
    max_token_per_sequence: int,
    max_sequence_kv: int,
    actual_seq_lens_q: Tensor | None = None,
    actual_seq_lens_kv: Tensor | None = None,
    block_tables: Tensor | None = None,
    causal: bool,
    return_lse: bool,
    q_scale: Tensor | float | None = None,
    k_scale: Tensor | float | None = None,
    v_scale: Tensor | float | None = None,
    batch_offsets_q: Tensor | None = None,
    batch_offsets_o: Tensor | None = None,
    batch_offsets_k: Tensor | None = None,
    batch_offsets_v: Tensor | None = None,
    batch_offsets_stats: Tensor | None = None,
    batch_offsets_units: str = "elements",
    out: Tensor | None = None,
    lse: Tensor | None = None,
    is_cuda_graph_compatible: bool = False,
    o_data_type: torch.dtype | None = None,
) -> PrefillBatch:
    """The public function's arguments (all but ``backend``), checked, as one PrefillBatch."""
    k, v, workspace = k_cache, v_cache, workspace_buffer
    max_q, max_kv = max_token_per_sequence, max_sequence_kv
    lens_q, lens_kv = actual_seq_lens_q, actual_seq_lens_kv
    scales = (q_scale, k_scale, v_scale)
    offsets = (batch_offsets_q, batch_offsets_o, batch_offsets_k, batch_offsets_v, batch_offsets_stats)
    units, graph_mode = batch_offsets_units, is_cuda_graph_compatible
    q = _check_tensor("q", q, 3)
    dev = q.device
    if q.dtype not in FLOAT_DTYPES + FP8_DTYPES:
        raise _fail("q", "dtype float16, bfloat16, float32, float8_e4m3fn or float8_e5m2", q.dtype)
    rows_q, hq, dqk = q.shape
    if hq == 0 or dqk == 0:
        raise _fail("q", "at least one head and a head dim > 0", f"shape {tuple(q.shape)}")
    paged = block_tables is not None
    kv_rank = 4 if paged else 3
    layout = (
        "paged (num_pages, Hkv, page_size, D) because block_tables is given"
        if paged
        else "ragged (total_kv_tokens, Hkv, D) because block_tables is None"
    )
    for name, t in (("k_cache", k), ("v_cache", v)):
        if isinstance(t, Tensor) and t.dim() != kv_rank:
            raise _fail(name, f"rank {kv_rank}: {layout}", f"rank {t.dim()} ({_describe(t)})")
    k = _check_tensor("k_cache", k, kv_rank, dev)
    v = _check_tensor("v_cache", v, kv_rank, dev)
    hkv = k.shape[1]
    if v.shape[1] != hkv:
        raise _fail("v_cache", f"{hkv} KV heads (as k_cache, dim 1)", f"{v.shape[1]} ({_describe(v)})")
    if hkv == 0 or hq % hkv != 0:
        raise _fail(
            "q",
            f"a number of query heads divisible by the {hkv} KV heads of k_cache (GQA/MQA)",
            f"{hq} query heads",
        )
    if k.shape[-1] != dqk:
        raise _fail("k_cache", f"head dim {dqk} (q's last dim)", f"{k.shape[-1]} ({_describe(k)})")
    dvo = v.shape[-1]
    if dvo == 0:
        raise _fail("v_cache", "a head dim > 0", f"shape {tuple(v.shape)}")
    if paged:
        if v.shape[0] != k.shape[0] or v.shape[2] != k.shape[2]:
            raise _fail(
                "v_cache",
                f"(num_pages, page_size) = ({k.shape[0]}, {k.shape[2]}) as k_cache",
                f"({v.shape[0]}, {v.shape[2]})",
            )
        page_size = k.shape[2]
        if page_size == 0:
            raise _fail("k_cache", "page_size >= 1 (dim 2)", f"shape {tuple(k.shape)}")
        if k.shape[0] == 0:  # kernels clamp page ids to [0, num_pages): there must be one
            raise _fail("k_cache", "at least one page (dim 0)", f"shape {tuple(k.shape)}")
    else:
        page_size = 0

    # dtypes
    q_fp8, k_fp8, v_fp8 = (t.dtype in FP8_DTYPES for t in (q, k, v))
    if k.dtype != v.dtype:
        raise _fail("v_cache", f"dtype {k.dtype} (as k_cache)", v.dtype)
    if q_fp8 and not k_fp8:
        raise _fail("k_cache", "an fp8 cache when q is fp8", k.dtype)
    if not k_fp8 and k.dtype != q.dtype:
        raise _fail("k_cache", f"dtype {q.dtype} (as q) or an fp8 dtype", k.dtype)
    q_scale, k_scale, v_scale = (
        _scale_tensor(n, s, dev, graph_mode) for n, s in zip(("q_scale", "k_scale", "v_scale"), scales)
    )
    for name, is_fp8, s, t in (
        ("q_scale", q_fp8, q_scale, q),
        ("k_scale", k_fp8, k_scale, k),
        ("v_scale", v_fp8, v_scale, v),
    ):
        if is_fp8 and s is None:
            raise _fail(name, f"a float32 scale tensor because {name[0]} is {t.dtype}", None)
    if o_data_type is None:
        if isinstance(out, Tensor) and out.dtype not in OUT_DTYPES:
            raise _fail("out", "dtype float16, bfloat16 or float32", out.dtype)
        o_data_type = out.dtype if isinstance(out, Tensor) else (torch.bfloat16 if q_fp8 else q.dtype)
    if o_data_type not in OUT_DTYPES:
        raise _fail("o_data_type", "torch.float16, torch.bfloat16 or torch.float32", o_data_type)

    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise _fail("scale", "a finite Python float", scale)
    if not isinstance(causal, bool):
        raise _fail("causal", "a bool", causal)
    max_q = _int_arg("max_token_per_sequence", max_q, 0)
    max_kv = _int_arg("max_sequence_kv", max_kv, 0)
    if units not in ("elements", "tokens"):
        raise _fail("batch_offsets_units", '"elements" or "tokens"', repr(units))

    # lengths and batch size
    if lens_q is None:
        raise _fail("actual_seq_lens_q", "a (B,) int tensor of query lengths", None)
    if lens_kv is None:
        raise _fail("actual_seq_lens_kv", "a (B,) int tensor of KV lengths", None)
    lens_q = _vector("actual_seq_lens_q", lens_q, None, dev, graph_mode)
    bsz = lens_q.shape[0]
    lens_kv = _vector("actual_seq_lens_kv", lens_kv, bsz, dev, graph_mode)
    if paged:
        block_tables = _check_tensor("block_tables", block_tables, 2)
        if block_tables.dtype not in LENGTH_DTYPES:
            raise _fail("block_tables", "dtype int32", block_tables.dtype)
        if block_tables.shape[0] != bsz:
            raise _fail(
                "block_tables", f"{bsz} rows (one per sequence)", f"shape {tuple(block_tables.shape)}"
            )
        if block_tables.device.type == "cpu" and dev.type != "cpu":
            if graph_mode:
                raise _fail(
                    "block_tables",
                    "a tensor on q's device when is_cuda_graph_compatible=True",
                    "one on the CPU",
                )
        elif not _same_device(block_tables.device, dev):
            raise _fail("block_tables", f"a tensor on q's device {dev}", f"one on {block_tables.device}")
    offs = {}
    for name, t in zip(("q", "o", "k", "v", "stats"), offsets):
        if t is not None:
            if not paged or name not in ("k", "v"):
                offs[name] = _vector(f"batch_offsets_{name}", t, bsz + 1, dev, graph_mode)
            else:
                offs[name] = None  # paged K/V is addressed through the block table; ignored
    if not return_lse and "stats" in offs:
        del offs["stats"]

    # out
    if out is not None:
        out = _check_tensor("out", out, 3, dev)
        if tuple(out.shape[1:]) != (hq, dvo):
            raise _fail("out", f"shape (rows, {hq}, {dvo}) = (rows, Hq, Dvo)", f"shape {tuple(out.shape)}")
        if out.dtype != o_data_type:
            raise _fail("out", f"dtype {o_data_type} (o_data_type)", out.dtype)
        out_user = out
    else:
        rows_o = _alloc_rows(
            rows_q, offs.get("o"), lens_q, hq * dvo, units, graph_mode and dev.type == "cuda"
        )
        out_user = torch.zeros((rows_o, hq, dvo), dtype=o_data_type, device=dev)
        out = out_user

    # lse
    lse_flat = None
    lse_user = None
    if return_lse:
        if lse is not None:
            if not isinstance(lse, Tensor):
                raise _fail("lse", "a float32 torch.Tensor", type(lse).__name__)
            if lse.dtype != torch.float32:
                raise _fail("lse", "dtype float32", lse.dtype)
            if not _same_device(lse.device, dev):
                raise _fail("lse", f"a tensor on q's device {dev}", f"one on {lse.device}")
            if not lse.is_contiguous():
                raise _fail("lse", "a contiguous tensor", f"strides {tuple(lse.stride())}")
            if "stats" not in offs and tuple(lse.shape) != (bsz, max_q, hq):
                raise _fail(
                    "lse",
                    f"shape (B, max_token_per_sequence, Hq) = ({bsz}, {max_q}, {hq})",
                    f"shape {tuple(lse.shape)}",
                )
            lse_user = lse
        elif "stats" in offs:
            rows_l = _alloc_rows(rows_q, offs["stats"], lens_q, hq, units, graph_mode and dev.type == "cuda")
            lse_user = torch.full((rows_l, hq), -math.inf, dtype=torch.float32, device=dev)
        else:
            lse_user = torch.full((bsz, max_q, hq), -math.inf, dtype=torch.float32, device=dev)
        lse_flat = lse_user.view(-1)
        if lse_flat.numel() > INT32_MAX:
            raise _fail("lse", f"at most {INT32_MAX} elements", lse_flat.numel())

    # workspace
    if not isinstance(workspace, Tensor):
        raise _fail("workspace_buffer", "a torch.Tensor byte buffer", type(workspace).__name__)
    if not _same_device(workspace.device, dev):
        raise _fail("workspace_buffer", f"a buffer on q's device {dev}", f"one on {workspace.device}")
    if not workspace.is_contiguous():
        raise _fail("workspace_buffer", "a contiguous buffer", f"strides {tuple(workspace.stride())}")
    ws = workspace.view(-1).view(torch.uint8) if workspace.numel() else workspace.view(torch.uint8)

    batch = PrefillBatch(
        q=q,
        k=k,
        v=v,
        out=out,
        lse=lse_flat,
        meta=ws[:0],
        block_tables=block_tables,
        scratch=ws[:0],
        batch_size=bsz,
        max_q=max_q,
        max_kv=max_kv,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim_qk=dqk,
        head_dim_vo=dvo,
        page_size=page_size,
        scale=float(scale),
        causal=causal,
        out_dtype=o_data_type,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        lse_packed="stats" in offs,
        graph_mode=graph_mode,
    )
    batch.extras.update(
        out_user_view=out_user,
        lse_user_view=lse_user,
        workspace=ws,
        raw_lens=(lens_q, lens_kv),
        raw_offsets=offs,
        units=units,
    )
    if graph_mode and dev.type == "cuda":
        batch.host = None
    else:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise _fail(
                "is_cuda_graph_compatible",
                "True (with lengths, offsets and tables on the device) when the call is captured in a "
                "CUDA graph; host lengths would be baked into the graph",
                False,
            )
        batch.host = _host_metadata(batch)
    return batch


def _alloc_rows(rows: int, offsets: Tensor | None, lens_q: Tensor, unit: int, units: str, graph: bool) -> int:
    """Rows of an out / packed-lse buffer the function allocates itself: q's rows, or more where
    the given batch offsets place sequences further (not known without a sync in CUDA-graph mode,
    where the device metadata clamps instead)."""
    if offsets is None or graph:
        return rows
    starts = offsets[:-1].cpu().to(torch.int64)
    if units == "elements":
        starts = torch.div(starts, unit, rounding_mode="floor")  # non-whole tokens are rejected later
    lens = lens_q.cpu().to(torch.int64)
    need = max([rows, *(starts + lens)[lens > 0].tolist()])
    return need if need * unit <= INT32_MAX else rows  # absurd offsets: let validation name them


def _prefix(lens: Sequence[int]) -> list[int]:
    starts, acc = [], 0
    for n in lens:
        starts.append(acc)
        acc += n
    return starts


def elements_per_token(batch: PrefillBatch) -> dict[str, int]:
    """Elements of one token in each offset-addressed tensor: what an offset "in elements" of
    ``batch_offsets_<name>`` is divided by to give tokens."""
    hq, hkv = batch.num_qo_heads, batch.num_kv_heads
    return {
        "q": hq * batch.head_dim_qk,
        "o": hq * batch.head_dim_vo,
        "k": hkv * batch.head_dim_qk,
        "v": hkv * batch.head_dim_vo,
        "stats": hq,
    }


def _host_metadata(batch: PrefillBatch) -> HostMetadata:
    """Read lengths/offsets to the host (one sync when they live on the device) and validate."""
    ex = batch.extras
    lens_q_t, lens_kv_t = ex["raw_lens"]
    offs, units = ex["raw_offsets"], ex["units"]
    bsz, hq = batch.batch_size, batch.num_qo_heads
    lens_q, lens_kv = lens_q_t.tolist(), lens_kv_t.tolist()
    for name, lens, limit, limit_name in (
        ("actual_seq_lens_q", lens_q, batch.max_q, "max_token_per_sequence"),
        ("actual_seq_lens_kv", lens_kv, batch.max_kv, "max_sequence_kv"),
    ):
        for b, n in enumerate(lens):
            if n < 0:
                raise _fail(name, "non-negative lengths", f"{n} at index {b}")
            if n > limit:
                raise _fail(name, f"lengths <= {limit_name} = {limit}", f"{n} at index {b}")

    per_token = elements_per_token(batch)

    def starts(name: str) -> list[int] | None:
        t = offs.get(name)
        if t is None:
            return None
        vals = t.tolist()
        if units == "elements":
            unit = per_token[name]
            for b, x in enumerate(vals):
                if x % unit:
                    raise _fail(
                        f"batch_offsets_{name}",
                        f"element offsets that are whole tokens (multiples of {unit} = H x D of that tensor)",
                        f"{x} at index {b}",
                    )
            vals = [x // unit for x in vals]
        for b, x in enumerate(vals):
            if x < 0:
                raise _fail(f"batch_offsets_{name}", "non-negative offsets", f"{x} at index {b}")
        return vals[:bsz]

    q_start = starts("q") or _prefix(lens_q)
    o_start = starts("o") or q_start
    if batch.paged:
        k_start = v_start = [0] * bsz
    else:
        k_start = starts("k") or _prefix(lens_kv)
        v_start = starts("v") or k_start
    if batch.lse is None:
        lse_start = [0] * bsz
    elif batch.lse_packed:
        lse_start = [s * hq for s in starts("stats")]
    else:
        lse_start = [b * batch.max_q * hq for b in range(bsz)]

    def check_rows(arg: str, what: str, start: list[int], lens: list[int], rows: int) -> None:
        for b in range(bsz):
            if lens[b] and start[b] + lens[b] > rows:
                raise _fail(
                    arg,
                    f"{what} with at least {start[b] + lens[b]} rows for sequence {b} "
                    f"(starts at row {start[b]}, length {lens[b]})",
                    f"{rows} rows",
                )

    check_rows("q", "a q", q_start, lens_q, batch.q.shape[0])
    check_rows("out", "an out", o_start, lens_q, batch.out.shape[0])
    if not batch.paged:
        check_rows("k_cache", "a ragged k_cache", k_start, lens_kv, batch.k.shape[0])
        check_rows("v_cache", "a ragged v_cache", v_start, lens_kv, batch.v.shape[0])
    if batch.lse is not None:
        n = batch.lse.numel()
        for b in range(bsz):
            if lens_q[b] and lse_start[b] + lens_q[b] * hq > n:
                raise _fail(
                    "lse",
                    f"a buffer of at least {lse_start[b] + lens_q[b] * hq} elements for sequence {b}",
                    f"{n} elements",
                )
    if batch.paged:
        width = batch.block_tables.shape[1]
        for b in range(bsz):
            need = -(-lens_kv[b] // batch.page_size)
            if need > width:
                raise _fail(
                    "actual_seq_lens_kv",
                    f"at most block_tables width x page_size = "
                    f"{width} x {batch.page_size} = {width * batch.page_size} keys",
                    f"{lens_kv[b]} at index {b}",
                )
        if batch.block_tables.device.type == "cpu":
            num_pages = batch.k.shape[0]
            need = torch.tensor([-(-n // batch.page_size) for n in lens_kv], dtype=torch.int64)
            used = torch.arange(width).view(1, -1) < need.view(-1, 1)
            bad = used & ((batch.block_tables < 0) | (batch.block_tables >= num_pages))
            if bool(bad.any()):
                b, j = (int(x) for x in bad.nonzero()[0])
                raise _fail(
                    "block_tables",
                    f"page ids in [0, {num_pages})",
                    f"{int(batch.block_tables[b, j])} at [{b}, {j}]",
                )
    for name, vals in (("q", q_start), ("o", o_start), ("k", k_start), ("v", v_start), ("stats", lse_start)):
        if vals and max(vals) > INT32_MAX:
            raise _fail(f"batch_offsets_{name}", f"offsets below {INT32_MAX}", max(vals))
    return HostMetadata(lens_q, lens_kv, q_start, o_start, k_start, v_start, lse_start)


def _device_metadata(batch: PrefillBatch, meta: Tensor) -> None:
    """CUDA-graph mode: compute the metadata on the device without a host sync.

    Nothing here is trusted: lengths are clamped to [0, max_*], to the rows of q / out / K / V /
    lse after each start offset and to the block table's reach, so kernels never touch memory
    outside the given tensors whatever the device tensors hold.
    """
    ex = batch.extras
    offs, units = ex["raw_offsets"], ex["units"]
    hq = batch.num_qo_heads
    lens_q_raw, lens_kv_raw = (t.to(device=meta.device, dtype=torch.int64) for t in ex["raw_lens"])
    lens_q = lens_q_raw.clamp(0, batch.max_q)
    lens_kv = lens_kv_raw.clamp(0, batch.max_kv)
    per_token = elements_per_token(batch)

    def starts(name: str, lens: Tensor) -> Tensor:
        t = offs.get(name)
        if t is None:
            return torch.cumsum(lens, 0) - lens
        t = t[:-1].to(torch.int64)
        if units == "elements":
            t = torch.div(t, per_token[name], rounding_mode="floor")
        return t.clamp(0, INT32_MAX)

    q_start = starts("q", lens_q)
    o_start = starts("o", lens_q) if "o" in offs else q_start
    lens_q = torch.minimum(lens_q, (batch.q.shape[0] - q_start).clamp(min=0))
    lens_q = torch.minimum(lens_q, (batch.out.shape[0] - o_start).clamp(min=0))
    zeros = torch.zeros_like(lens_q)
    if batch.paged:
        k_start = v_start = zeros
        lens_kv = lens_kv.clamp(max=batch.block_tables.shape[1] * batch.page_size)
    else:
        k_start = starts("k", lens_kv)
        v_start = starts("v", lens_kv) if offs.get("v") is not None else k_start
        lens_kv = torch.minimum(lens_kv, (batch.k.shape[0] - k_start).clamp(min=0))
        lens_kv = torch.minimum(lens_kv, (batch.v.shape[0] - v_start).clamp(min=0))
    if batch.lse is None:
        lse_start = zeros
    elif batch.lse_packed:
        lse_start = starts("stats", lens_q) * hq
        lens_q = torch.minimum(
            lens_q, torch.div(batch.lse.numel() - lse_start, hq, rounding_mode="floor").clamp(min=0)
        )
    else:
        lse_start = torch.arange(batch.batch_size, device=meta.device, dtype=torch.int64) * (batch.max_q * hq)
    rows = (lens_q, lens_kv, q_start, o_start, k_start, v_start, lse_start)
    meta.copy_(torch.stack([r.clamp(max=INT32_MAX) for r in rows]))
    batch.work_counter.zero_()


def _triton_device_metadata(batch: PrefillBatch) -> bool:
    """:func:`_device_metadata` as one Triton launch where Triton runs (CUDA graphs replay 1 kernel,
    not ~25); False when it cannot (the torch ops above then do it)."""
    if batch.device.type != "cuda":
        return False
    try:
        from pagedprefill.backends import triton_backend
    except Exception:  # pragma: no cover - triton missing or broken: the torch path serves
        return False
    return triton_backend.device_metadata(batch)


def _fill_metadata(batch: PrefillBatch, module: ModuleType) -> None:
    """Carve the metadata and the backend's scratch out of the workspace and fill the metadata."""
    _carve_workspace(batch, module)
    _write_metadata(batch, _stage_metadata(batch))


def _carve_workspace(batch: PrefillBatch, module: ModuleType) -> None:
    """``batch.meta`` and ``batch.scratch`` as views of the workspace (checked large enough)."""
    ws = batch.extras["workspace"]
    mbytes = meta_bytes(batch.batch_size)
    need = mbytes + int(module.workspace_bytes(batch))
    if ws.numel() < need:
        raise _fail(
            "workspace_buffer",
            f"at least {need} bytes for this call "
            f"({mbytes} for metadata + {need - mbytes} for the {module.NAME} backend)",
            f"{ws.numel()} bytes",
        )
    bsz = batch.batch_size
    flat = ws[: (len(META_FIELDS) * bsz + 1) * 4].view(torch.int32)  # the table, then the work counter
    batch.meta = flat[:-1].view(len(META_FIELDS), bsz)
    batch.work_counter = flat[-1:]
    batch.extras["meta_flat"] = flat
    batch.scratch = ws[mbytes:]
    if batch.paged and batch.block_tables.device != batch.device:
        batch.block_tables = batch.block_tables.to(batch.device, non_blocking=False)
    if batch.paged and batch.block_tables.dtype != torch.int32:
        batch.extras["block_tables_source"] = batch.block_tables  # converted by _write_metadata


def _stage_metadata(batch: PrefillBatch) -> Tensor | None:
    """The host path's int32 metadata, the (7, B) table flattened and a zero work counter, as a host
    tensor (pinned on CUDA: the copy to the device is then asynchronous); None on the device path."""
    h = batch.host
    if h is None or not batch.batch_size:
        return None
    rows = (h.lens_q, h.lens_kv, h.q_start, h.o_start, h.k_start, h.v_start, h.lse_start)
    table = torch.frombuffer(array.array("i", itertools.chain(*rows, (0,))), dtype=torch.int32)
    return table.pin_memory() if batch.meta.is_cuda else table


def _write_metadata(batch: PrefillBatch, staged: Tensor | None) -> None:
    """Fill ``batch.meta`` (per call): copy the staged host metadata (never written after staging,
    so copies still in flight read the right bytes), or compute it on the device (CUDA-graph mode).
    Kernels never read the pinned staging buffer directly: the copy records its use with PyTorch's
    pinned-memory allocator, so a buffer freed before the GPU reached the call is not reused early
    (and on the H200 hosts a kernel reading host memory ran 5 µs longer than copy + kernel). An int64
    block table is converted to int32 here, at every call (its contents may change between calls)."""
    if batch.host is None:
        if batch.batch_size and not _triton_device_metadata(batch):
            _device_metadata(batch, batch.meta)
    elif staged is not None:
        batch.extras["meta_flat"].copy_(staged, non_blocking=batch.meta.is_cuda)
    src = batch.extras.get("block_tables_source")
    if src is not None:
        batch.block_tables = src.to(torch.int32)


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------

_BACKEND_MODULES = {
    "torch": "pagedprefill.backends.torch_backend",
    "triton": "pagedprefill.backends.triton_backend",
    "cudnn": "pagedprefill.backends.cudnn_backend",
}


def _backend_module(name: str) -> ModuleType:
    return importlib.import_module(_BACKEND_MODULES[name])


def backend_support(name: str, batch: PrefillBatch) -> str | None:
    """Why backend ``name`` cannot serve ``batch`` (None when it can)."""
    module = _backend_module(name)
    reason = module.unavailable_reason(batch.device)
    return reason if reason is not None else module.unsupported_reason(batch)


def _select_backend(backend: str | None, batch: PrefillBatch) -> ModuleType:
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise _fail("backend", f"one of {BACKENDS} or None", repr(backend))
    if backend != "auto":
        module = _backend_module(backend)
        reason = module.unavailable_reason(batch.device)
        if reason is not None:
            raise BackendUnavailableError(f"backend={backend!r} is unavailable: {reason}")
        reason = module.unsupported_reason(batch)
        if reason is not None:
            raise ValueError(f"backend={backend!r} cannot serve this call: {reason}")
        return module
    reasons = []
    for name in _auto_order(batch):
        reason = backend_support(name, batch)
        if reason is None:
            return _backend_module(name)
        reasons.append(f"{name}: {reason}")
    raise ValueError("backend='auto': no backend can serve this call (" + "; ".join(reasons) + ")")


def _auto_order(batch: PrefillBatch) -> list[str]:
    """Backends in the order ``auto`` tries them for this call (fastest first)."""
    if batch.device.type != "cuda":
        return ["torch"]
    from pagedprefill.backends import auto_policy

    return auto_policy.order(batch)
