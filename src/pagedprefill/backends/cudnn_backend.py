"""cuDNN backend: batched prefill attention as cuDNN SDPA graphs (``nvidia-cudnn-frontend``).

How a :class:`~pagedprefill.api.PrefillBatch` becomes one cuDNN graph
-------------------------------------------------------------------------
* q / out are described *ragged*: dims ``(Bb, H, Sq, D)``, strides ``(Sq*s0, s1, s0, 1)`` where
  ``s0, s1`` are the tensor's REAL token and head strides, plus a ragged-offset tensor holding each
  sequence's first row in ELEMENTS. Sequence b's rows always come from ``batch.meta`` / ``batch.host``
  (prefix sums when the caller gave no offsets), never from ``b * max_q`` (the anchor's "batch > 0
  reads the wrong rows" bug cannot happen).
* Paged K/V are the page containers ``(num_pages, Hkv, page_size, D)`` with their real strides (NHD,
  HND and two views of one interleaved buffer all differ and all key different graphs). cuDNN reads
  a page table of OUR width ``ceil(Skv_bucket / page_size)`` from ``batch.scratch``: entry (b, j) is
  the caller's ``block_tables[b, min(j, last_b)]`` with ``last_b = ceil(kv_len_b / page_size) - 1``,
  clamped to ``[0, num_pages)``. So the caller's table width never has to match
  ``max_sequence_kv / page_size`` (anchor bug 3), and entries past a sequence's last page (which the
  spec says are ignored, and which may name freed pages full of garbage) are never read.
  Ragged K/V are described like q, with their own offsets.
* LSE: cuDNN's Stats, natural log, ``(Bb, Hq, Sq, 1)`` token-major (strides ``(Sq*Hq, 1, Hq, 1)``)
  with a ragged offset in elements. One description serves both the padded ``(B, max_q, Hq)`` layout
  and the packed layout. Ragged tensors are written only for rows ``i < seq_len_q``, so padded LSE
  rows keep the caller's bytes (anchor bug 4). Ragged Stats need cuDNN >= 9.6; older libraries get a
  clear refusal from :func:`unsupported_reason` (there is no dense-Stats fallback).
* Masks: padding mask with per-sequence lengths; causal = ``diagonal_alignment=BOTTOM_RIGHT`` and
  ``diagonal_band_right_bound=0``.
* Rows with no visible key (kv_len 0, or causal rows ``i < q_len - kv_len``) are never handed to
  cuDNN (on cuDNN 9.19 it writes NaN for kv_len 0): the lengths and offsets cuDNN sees start each
  sequence ``skip = q_len - q_len'`` rows later, with ``q_len' = min(q_len, kv_len)`` (causal) or
  ``0`` when ``kv_len == 0``. Bottom-right alignment is unchanged by this shift. The skipped rows are
  written here (out 0, lse -inf) by the per-call Triton launch; with lengths known on the host only
  when some sequence has such rows.

Known cuDNN limitation (cannot be fixed here)
---------------------------------------------
cuDNN reads whole pages (whole key tiles): the slots past ``kv_len`` in a sequence's LAST page are
loaded and multiplied by a zero probability. NaN or Inf there gives NaN (0 * NaN) in that sequence's
output. Those slots must hold finite values (any finite garbage is fine); see ``README``.

Per-call path (host cost matters: a call must cost about what the built graph costs)
---------------------------------------------------------------------------------------
The api's call cache (``api._call_signature``) lets a call whose layouts, host lengths and device
inputs match an earlier call skip normalisation and backend selection; :func:`run` then finds its
plan (cuDNN graph, scratch layout, device constants), scratch views and static operands cached in
``batch.extras``. A call issues, besides the cuDNN graph, the api's metadata copy (or its one
metadata kernel in CUDA-graph mode) and ONE Triton launch (:func:`_prepare`) that writes cuDNN's
int32 metadata rows 0..6 (see ``_R_*``) and our page table from ``batch.meta`` and, where some row
sees no key, those rows (out 0, lse -inf). Measured on the H200 (``bench/results/h200-overhead.*``,
``docs/cudnn_overhead.md``): 110-280 us of host time per call (the bare graph: 20-50 us) and ~5 us
of device time per call over the bare graph, about what any one extra kernel costs.

Without Triton the same metadata comes from torch ops: lengths on the host, Python integer
arithmetic from ``batch.host`` and one pinned host-to-device copy; lengths on the device, 11 fixed
device ops (one integer linear map, :func:`_coefficients`); the page table takes 4 more (an index
grid, one ``index_select`` gather, a clamp), and rows without keys a masked fill after the graph.

Graph cache and bucketing
-------------------------
Graphs are cached under :class:`GraphSpec` (+ device, cuDNN handle, engine policy): every dtype, head
count, head dim, page size, page count, table width, every stride of q/out/K/V, the LSE layout,
``scale`` (baked into the graph as a float: a runtime scale tensor would force a device buffer and a
per-call copy, and serving engines keep one scale per model), causal, LSE on/off, paged/ragged, fp8,
and the bucketed batch size / max q length / max kv length. Nothing that changes from call to call in
a serving loop (lengths, page ids, the caller's table width, row counts of q/out) is in the key except
through these buckets. The CUDA stream is NOT part of the key: a built plan runs on whatever stream
``cudnn.set_stream`` gives its handle at execute time. Buckets: batch rounds up to a power of two;
lengths to 64 * 4**k up to 4096, then powers of two (see :func:`bucket_len`); the table width follows
the kv bucket. Padded batch entries (and sequences cuDNN skips) get length 0, offset 0 and the first
entry of the block table. A call whose exact bucket was never built runs on a built graph whose
max_q / max_kv buckets are at most 4x larger (:func:`_covering_plan`, ``COVER_RATIOS``) instead of
waiting ~0.05 s for a build.

CUDA graphs
-----------
A graph is never built during stream capture (cuDNN's build allocates and synchronises): call once
with the same shapes before capturing. Capture then records only device ops whose inputs are
``batch.meta``, the block table and constants created at build time, so a replay serves any lengths
<= the captured ``max_*`` values.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from pagedprefill.api import PrefillBatch

try:  # optional: the per-call metadata kernel (without it, a handful of torch ops do the same)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the environment
    triton = tl = None

NAME = "cudnn"

MIN_BACKEND_VERSION = 90500  # paged SDPA with ragged Q/O (cuDNN 9.5.0)
RAGGED_STATS_VERSION = 90600  # token-major ragged Stats (cuDNN 9.6.0)
INSTALL_HINT = "package nvidia-cudnn-frontend is not installed: pip install pagedprefill[cudnn]"
INT32_MAX = 2**31 - 1
ALIGN = 256  # bytes; every scratch region starts at this alignment
LEN_MIN = 64  # smallest length bucket
LEN_GEOMETRIC_UNTIL = 4096  # lengths bucket by x4 up to here, then by x2
# A built graph serves a call whose (batch, max_q, max_kv) buckets are up to these many times smaller
# (1: exact bucket only). Larger batch / max_q buckets launch CTAs that find no rows (measured on the
# H200 serving loop: covering all three by 4x cut builds from 31 to 7 per 1000 calls but cost +41%
# kernel time); a larger max_kv only widens the page table.
COVER_RATIOS = (1, 4, 4)
# "auto": the frontend's own routing (FROST python engines where they lead, else the cuDNN
# library); "backend": the cuDNN library's engines only. Read at each call, part of the key.
ENGINE_POLICY_ENV = "PAGEDPREFILL_CUDNN_ENGINES"
_FAST_CACHE_MAX = 4096  # call keys remembered (cleared when full; plans stay cached)

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_HALF = (torch.float16, torch.bfloat16)

# Rows of the int32 metadata block in scratch (each ``layout.row`` entries; padding entries are 0).
# 0..6 are bound to the cuDNN graph; 7..8 build the page table; 9..12 locate the rows to fix.
_R_SEQ_Q, _R_SEQ_KV, _R_OFF_Q, _R_OFF_O, _R_OFF_K, _R_OFF_V, _R_OFF_S = range(7)
_R_LAST = 7  # paged: index of the sequence's last page in its block-table row
_R_BASE = 8  # paged: flat element offset of the sequence's block-table row (b * row stride)
_R_FIX = 9  # 4 rows: [lo, hi) of the rows to fix in out, then in lse (viewed as (rows, Hq))
_ROWS = 13
# Columns of the (9, row) integer matrix the device path maps linearly onto the rows above.
_Z_LQ, _Z_LKV, _Z_QS, _Z_OS, _Z_KS, _Z_VS, _Z_LS, _Z_EFF, _Z_ONE = range(9)

# Debug knob for scripts/cudnn_smoke.py (lengths on the host only): hand cuDNN the rows with no
# visible key instead of skipping them, and do not fix them afterwards (to observe what cuDNN
# itself writes there).
_DEBUG_NATIVE_EMPTY_ROWS = False


# --------------------------------------------------------------------------------------------
# Pure-Python part: bucketing and the graph spec (no cudnn import; CPU-testable)
# --------------------------------------------------------------------------------------------


def bucket_batch(n: int) -> int:
    """Batch size the graph is built for: the next power of two >= n (at least 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def bucket_len(n: int) -> int:
    """Sequence length the graph is built for: 64, 256, 1024, 4096, then 8192, 16384, ... >= n."""
    b = LEN_MIN
    while b < n and b < LEN_GEOMETRIC_UNTIL:
        b *= 4
    while b < n:
        b *= 2
    return b


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _strides(t: Tensor) -> tuple[int, ...]:
    """The tensor's strides; a size-1 dim with stride 0 gets a never-stepped natural stride."""
    shape, st = tuple(t.shape), list(t.stride())
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == 1 and st[i] == 0:
            inner = st[i + 1] * shape[i + 1] if i + 1 < len(shape) else 1
            st[i] = max(inner, 1)
    return tuple(st)


@dataclass(frozen=True)
class GraphSpec:
    """Everything a built cuDNN graph depends on (the cache key, with device/handle/policy)."""

    q_dtype: str
    kv_dtype: str
    o_dtype: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    paged: bool
    page_size: int  # 0 when ragged
    num_pages: int  # 0 when ragged
    table_width: int  # columns of OUR page table = ceil(max_kv / page_size); 0 when ragged
    q_strides: tuple[int, ...]  # (token, head) element strides
    o_strides: tuple[int, ...]
    k_strides: tuple[int, ...]  # paged: all 4; ragged: (token, head)
    v_strides: tuple[int, ...]
    scale: float
    causal: bool
    lse: bool  # Stats written in place at ragged offsets
    lse_packed: bool
    fp8: bool
    batch: int  # bucketed batch size
    max_q: int  # bucketed max query length
    max_kv: int  # bucketed max kv length (paged: paged_attention_max_seq_len_kv)

    def describe(self) -> str:
        kv = (
            f"paged ps={self.page_size} pages={self.num_pages} table_w={self.table_width}"
            if self.paged
            else "ragged kv"
        )
        lse = ("packed" if self.lse_packed else "padded") if self.lse else "none"
        return (
            f"{self.q_dtype}/{self.kv_dtype}->{self.o_dtype} Hq={self.num_qo_heads} Hkv={self.num_kv_heads} "
            f"D={self.head_dim_qk}/{self.head_dim_vo} {kv} B={self.batch} Sq={self.max_q} Skv={self.max_kv} "
            f"causal={self.causal} lse={lse} scale={self.scale:.4g} strides q{self.q_strides} "
            f"o{self.o_strides} k{self.k_strides} v{self.v_strides}"
        )


def _kv_cap(batch: PrefillBatch) -> int:
    """The longest kv length a call can have: max_sequence_kv, capped by the block table's reach."""
    if batch.paged:
        return min(batch.max_kv, batch.block_tables.shape[1] * batch.page_size)
    return batch.max_kv


def graph_spec(batch: PrefillBatch) -> GraphSpec:
    """The :class:`GraphSpec` of a batch (pure function of shapes/strides/dtypes/flags)."""
    paged = batch.paged
    ps = batch.page_size if paged else 0
    max_kv = bucket_len(_kv_cap(batch))
    q_st, o_st = _strides(batch.q), _strides(batch.out)
    k_st, v_st = _strides(batch.k), _strides(batch.v)
    if not paged:
        k_st, v_st = k_st[:2], v_st[:2]
    lse = batch.lse is not None
    return GraphSpec(
        q_dtype=_dtype_name(batch.q.dtype),
        kv_dtype=_dtype_name(batch.k.dtype),
        o_dtype=_dtype_name(batch.out.dtype),
        num_qo_heads=batch.num_qo_heads,
        num_kv_heads=batch.num_kv_heads,
        head_dim_qk=batch.head_dim_qk,
        head_dim_vo=batch.head_dim_vo,
        paged=paged,
        page_size=ps,
        num_pages=batch.k.shape[0] if paged else 0,
        table_width=-(-max_kv // ps) if paged else 0,
        q_strides=q_st[:2],
        o_strides=o_st[:2],
        k_strides=k_st,
        v_strides=v_st,
        scale=float(batch.scale),
        causal=bool(batch.causal),
        lse=lse,
        lse_packed=bool(batch.lse_packed) if lse else False,
        fp8=batch.q.dtype in _FP8,
        batch=bucket_batch(batch.batch_size),
        max_q=bucket_len(batch.max_q),
        max_kv=max_kv,
    )


def _call_key(batch: PrefillBatch) -> tuple:
    """A cheap key that determines :func:`graph_spec` and the shape/stride part of
    :func:`static_unsupported_reason` (a superset of both: equal keys give equal answers)."""
    q, k, v, out = batch.q, batch.k, batch.v, batch.out
    return (
        q.dtype,
        k.dtype,
        v.dtype,
        out.dtype,
        q.shape[1:],
        k.shape if batch.paged else k.shape[1:],
        v.shape if batch.paged else v.shape[1:],
        q.stride(),
        out.stride(),
        k.stride(),
        v.stride(),
        min(q.shape[0], 2),  # 0 / 1 / more rows: what _strides and the numel() checks look at
        min(out.shape[0], 2),
        min(k.shape[0], 2),
        min(v.shape[0], 2),
        batch.paged,
        bucket_batch(batch.batch_size),
        bucket_len(batch.max_q),
        bucket_len(_kv_cap(batch)),
        batch.scale,
        batch.causal,
        batch.lse is not None,
        batch.lse_packed,
    )


def _call_key_of(batch: PrefillBatch) -> tuple:
    """:func:`_call_key`, computed once per call (kept in ``batch.extras``)."""
    key = batch.extras.get("cudnn_key")
    if key is None:
        key = batch.extras["cudnn_key"] = _call_key(batch)
    return key


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class ScratchLayout:
    """Byte offsets of this backend's regions inside ``batch.scratch`` (after an alignment pad)."""

    row: int  # int32 entries per metadata row (>= batch + 1, multiple of 16)
    ints: int  # _ROWS int32 metadata rows (see _R_*)
    table: int  # int32 (batch, table_width) page table
    floats: int  # fp8 constants + amax outputs (8 floats)
    workspace: int  # cuDNN workspace
    workspace_size: int
    total: int  # bytes needed including ALIGN slack for an unaligned scratch base


def scratch_layout(spec: GraphSpec, cudnn_workspace: int) -> ScratchLayout:
    row = _round_up(spec.batch + 1, 16)
    off = 0
    ints = off
    off = _round_up(off + _ROWS * row * 4, ALIGN)
    table = off
    if spec.paged:
        off = _round_up(off + spec.batch * spec.table_width * 4, ALIGN)
    floats = off
    if spec.fp8:
        off = _round_up(off + 8 * 4, ALIGN)
    workspace = off
    off = _round_up(off + max(int(cudnn_workspace), 0), ALIGN)
    return ScratchLayout(row, ints, table, floats, workspace, int(cudnn_workspace), off + ALIGN)


def _static_reason(batch: PrefillBatch) -> str | None:
    """The part of :func:`static_unsupported_reason` that depends only on :func:`_call_key`."""
    q, k, v, out = batch.q, batch.k, batch.v, batch.out
    if q.dtype == torch.float32:
        return (
            "cuDNN SDPA takes float16/bfloat16 (or fp8) q/k/v, not float32; use backend='triton' or 'torch'"
        )
    if q.dtype in _HALF and k.dtype != q.dtype:
        return (
            f"cuDNN SDPA needs q, k and v of one dtype; a {k.dtype} KV cache with {q.dtype} q is not "
            "served by cuDNN (use backend='triton')"
        )
    if q.dtype in _FP8 and k.dtype != q.dtype:
        return f"cuDNN fp8 SDPA needs q, k and v of one fp8 dtype; got q {q.dtype}, k/v {k.dtype}"
    dqk, dvo = batch.head_dim_qk, batch.head_dim_vo
    mult = 16 if q.dtype in _FP8 else 8
    if dqk % mult or dvo % mult:
        return f"cuDNN SDPA needs head dims that are multiples of {mult}; got Dqk={dqk}, Dvo={dvo}"
    if dqk > 256 or dvo > 256:
        return f"cuDNN SDPA serves head dims up to 256; got Dqk={dqk}, Dvo={dvo}"
    if dqk != dvo and (dqk, dvo) != (192, 128):
        return f"cuDNN SDPA serves Dqk == Dvo, or Dqk=192 with Dvo=128; got Dqk={dqk}, Dvo={dvo}"
    if batch.paged and (batch.page_size & (batch.page_size - 1)):
        return f"cuDNN paged attention needs a power-of-two page size; got {batch.page_size}"
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v), ("out", out)):
        if t.numel() == 0:
            continue
        esize = t.element_size()
        for d, (n, s) in enumerate(zip(t.shape[:-1], _strides(t)[:-1])):
            if n > 1 and s == 0:
                return (
                    f"cuDNN cannot read {name} with a broadcast (stride 0) dim {d}: "
                    f"strides {tuple(t.stride())}"
                )
            if n > 1 and (s * esize) % 16:
                return (
                    f"cuDNN needs 16-byte aligned strides; {name} has strides {tuple(t.stride())} "
                    f"({esize}-byte elements)"
                )
    if batch.paged and k.shape[0] > INT32_MAX:
        return "too many pages for int32 page tables"
    return None


def address_reason(batch: PrefillBatch) -> str | None:
    """Why cuDNN cannot use these tensors' addresses (the api's call cache keys on the alignment,
    so a call at other addresses is checked again through the full path)."""
    for name, t in (("q", batch.q), ("k_cache", batch.k), ("v_cache", batch.v), ("out", batch.out)):
        if t.data_ptr() % 16 and t.numel():
            return f"cuDNN needs 16-byte aligned tensors; {name} starts at an address that is not"
    return None


def _per_call_reason(batch: PrefillBatch) -> str | None:
    """The part of :func:`static_unsupported_reason` that changes from call to call: addresses and
    row counts (int32 offsets)."""
    reason = address_reason(batch)
    if reason:
        return reason
    spans = [("q", batch.q), ("out", batch.out)]
    if not batch.paged:
        spans += [("k_cache", batch.k), ("v_cache", batch.v)]
    for name, t in spans:
        span = t.shape[0] * t.stride(0)
        if span > INT32_MAX:
            return f"{name} spans {span} elements; cuDNN ragged offsets are int32"
    if batch.paged:
        bt = batch.block_tables
        if bt.shape[0] and bt.shape[0] * max(bt.stride(0), bt.shape[1]) > INT32_MAX:
            return (
                f"block_tables spans more than {INT32_MAX} entries; our page-table copy indexes it in int32"
            )
    return None


def static_unsupported_reason(batch: PrefillBatch) -> str | None:
    """Why cuDNN cannot serve this call, from shapes/dtypes/strides/addresses alone (no cudnn, no GPU)."""
    return _static_reason(batch) or _per_call_reason(batch)


# --------------------------------------------------------------------------------------------
# cudnn import, handles, availability
# --------------------------------------------------------------------------------------------

_CUDNN: Any = None
_CUDNN_ERROR: str | None = None
_TLS = threading.local()
_LOCK = threading.RLock()
_CACHE: dict[tuple, _Plan] = {}  # (GraphSpec, device, handle, policy) -> built plan
_FAILED: dict[tuple, str] = {}  # same key -> why cuDNN refused it
_FAST: dict[tuple, Any] = {}  # (_call_key, device, handle, policy) -> plan | refusal | static reason
_AVAILABLE: set[int] = set()  # device indices where unavailable_reason() said None
_BUILDS = 0
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _cudnn() -> Any:
    """The cudnn module (imported lazily once), or raise ImportError with the install hint."""
    global _CUDNN, _CUDNN_ERROR
    if _CUDNN is None and _CUDNN_ERROR is None:
        try:
            import cudnn  # noqa: PLC0415

            _CUDNN = cudnn
        except Exception as exc:  # ImportError, or OSError from a broken native library
            _CUDNN_ERROR = f"{INSTALL_HINT} ({type(exc).__name__}: {exc})"
    if _CUDNN is None:
        raise ImportError(_CUDNN_ERROR)
    return _CUDNN


def backend_version() -> int | None:
    """The cuDNN library version as an int (e.g. 91900), or None when it cannot be read."""
    try:
        return int(_cudnn().backend_version())
    except Exception:
        return None


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs a CUDA GPU"
    if device.index in _AVAILABLE:
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    try:
        cudnn = _cudnn()
    except ImportError as exc:
        return str(exc)
    try:
        ver = int(cudnn.backend_version())
    except Exception as exc:
        return f"the cuDNN library (libcudnn.so.9) could not be loaded: {exc}; pip install nvidia-cudnn-cu12"
    if ver < MIN_BACKEND_VERSION:
        return (
            f"cuDNN library {ver} is too old: paged prefill needs cuDNN >= "
            f"{MIN_BACKEND_VERSION // 10000}.{MIN_BACKEND_VERSION // 100 % 100}; "
            "pip install -U nvidia-cudnn-cu12"
        )
    _AVAILABLE.add(device.index)
    return None


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _handle(dev: int) -> Any:
    """This thread's cuDNN handle for device ``dev`` (cuDNN handles must not cross threads)."""
    handles = getattr(_TLS, "handles", None)
    if handles is None:
        handles = _TLS.handles = {}
    h = handles.get(dev)
    if h is None:
        with torch.cuda.device(dev):
            h = _cudnn().create_handle()
        handles[dev] = h
    return h


def _current_stream(dev: int) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(dev)
    return torch.cuda.current_stream(dev).cuda_stream


def _engine_policy() -> str:
    policy = os.environ.get(ENGINE_POLICY_ENV, "auto").strip().lower() or "auto"
    if policy not in ("auto", "backend"):
        raise ValueError(f"{ENGINE_POLICY_ENV}: expected 'auto' or 'backend', got {policy!r}")
    return policy


def graph_builds() -> int:
    """Number of cuDNN graphs this process has built (successfully) so far."""
    return _BUILDS


def clear_graph_cache() -> None:
    """Forget every built graph and every recorded build failure (graphs are rebuilt on demand).

    Do not call this while a captured CUDA graph that replays one of these plans is still in use."""
    from pagedprefill import api

    with _LOCK:
        _CACHE.clear()
        _FAILED.clear()
        _FAST.clear()
    api.clear_call_cache()  # cached calls hold plans


def cached_plans() -> list[_Plan]:
    """The built plans (for diagnostics: spec, engine name, workspace, build time)."""
    with _LOCK:
        return list(_CACHE.values())


# --------------------------------------------------------------------------------------------
# Graph construction
# --------------------------------------------------------------------------------------------


@dataclass
class _Consts:
    """Device constants of a plan (created once, before any capture; never written)."""

    coef: Tensor  # (_ROWS, 9, 1) int64: the linear map of the device path (see _coefficients)
    ones: Tensor  # (1, row) int64
    arange: Tensor  # (row,) int64: batch index
    cols: Tensor  # (1, table_width) int64: page-table column index
    signs: Tensor  # (2, 2 * row) int32: +1 for the range starts, -1 for the range ends (fix-up)
    fp8: Tensor  # (3,) float32: descale_s, scale_s, scale_o


@dataclass
class _Plan:
    spec: GraphSpec
    graph: Any
    tensors: dict[str, Any]
    layout: ScratchLayout
    engine: str
    build_seconds: float
    key: tuple = field(default=(), repr=False)
    consts: _Consts | None = field(default=None, repr=False)
    binding: str = "tensors"  # how operands reach graph.execute: "tensors" | "addresses"
    binding_error: str | None = None  # why "tensors" was given up, if it was
    packer: struct.Struct | None = field(default=None, repr=False)  # the host path's int32 packer


def _cudnn_dtype(cudnn: Any, name: str) -> Any:
    return {
        "float16": cudnn.data_type.HALF,
        "bfloat16": cudnn.data_type.BFLOAT16,
        "float32": cudnn.data_type.FLOAT,
        "float8_e4m3fn": cudnn.data_type.FP8_E4M3,
        "float8_e5m2": cudnn.data_type.FP8_E5M2,
    }[name]


def make_graph(spec: GraphSpec, cudnn: Any, **graph_kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """Declare the SDPA graph of ``spec`` (not validated or built). Returns (graph, named tensors).

    ``graph_kwargs`` go to ``cudnn.pygraph`` (``handle=``, or ``device_property=`` for deviceless
    checks)."""
    f32, i32 = cudnn.data_type.FLOAT, cudnn.data_type.INT32
    io = _cudnn_dtype(cudnn, spec.q_dtype)
    g = cudnn.pygraph(
        name="pagedprefill_sdpa",
        io_data_type=io,
        intermediate_data_type=f32,
        compute_data_type=f32,
        **graph_kwargs,
    )
    bb, sq, skv = spec.batch, spec.max_q, spec.max_kv
    hq, hkv, dqk, dvo = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim_qk, spec.head_dim_vo
    t: dict[str, Any] = {}

    def vec(name: str, n: int) -> Any:
        t[name] = g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
        return t[name]

    def ragged(name: str, heads: int, s: int, d: int, strides: tuple[int, ...], dtype: Any) -> Any:
        s0, s1 = strides
        off = vec(f"off_{name}", bb + 1)
        t[name] = g.tensor(
            name=name, dim=[bb, heads, s, d], stride=[s * s0, s1, s0, 1], data_type=dtype, ragged_offset=off
        )
        return t[name]

    q = ragged("q", hq, sq, dqk, spec.q_strides, io)
    kv_io = _cudnn_dtype(cudnn, spec.kv_dtype)
    if spec.paged:
        k = t["k"] = g.tensor(
            name="k",
            dim=[spec.num_pages, hkv, spec.page_size, dqk],
            stride=list(spec.k_strides),
            data_type=kv_io,
        )
        v = t["v"] = g.tensor(
            name="v",
            dim=[spec.num_pages, hkv, spec.page_size, dvo],
            stride=list(spec.v_strides),
            data_type=kv_io,
        )
        w = spec.table_width
        for name in ("table_k", "table_v"):  # two descriptors of the same buffer
            t[name] = g.tensor(name=name, dim=[bb, 1, w, 1], stride=[w, w, 1, 1], data_type=i32)
    else:
        k = ragged("k", hkv, skv, dqk, spec.k_strides, kv_io)
        v = ragged("v", hkv, skv, dvo, spec.v_strides, kv_io)
    seq_q, seq_kv = vec("seq_q", bb), vec("seq_kv", bb)

    kwargs: dict[str, Any] = dict(
        attn_scale=spec.scale,
        generate_stats=spec.lse,
        use_padding_mask=True,
        seq_len_q=seq_q,
        seq_len_kv=seq_kv,
        compute_data_type=f32,
        name="sdpa",
    )
    if spec.paged:
        kwargs.update(
            paged_attention_k_table=t["table_k"],
            paged_attention_v_table=t["table_v"],
            paged_attention_max_seq_len_kv=skv,
        )
    if spec.fp8:
        for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
            t[name] = g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
        if spec.causal:
            kwargs["use_causal_mask_bottom_right"] = True
        o, stats, amax_s, amax_o = g.sdpa_fp8(
            q,
            k,
            v,
            t["descale_q"],
            t["descale_k"],
            t["descale_v"],
            t["descale_s"],
            t["scale_s"],
            t["scale_o"],
            **kwargs,
        )
        for name, a in (("amax_s", amax_s), ("amax_o", amax_o)):
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
            t[name] = a
    else:
        if spec.causal:
            kwargs.update(
                diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0
            )
        o, stats = g.sdpa(q, k, v, **kwargs)
    so0, so1 = spec.o_strides
    o.set_output(True).set_dim([bb, hq, sq, dvo]).set_stride([sq * so0, so1, so0, 1])
    o.set_data_type(_cudnn_dtype(cudnn, spec.o_dtype)).set_ragged_offset(vec("off_o", bb + 1))
    t["o"] = o
    if spec.lse:
        stats.set_output(True).set_dim([bb, hq, sq, 1]).set_stride([sq * hq, 1, hq, 1]).set_data_type(f32)
        stats.set_ragged_offset(vec("off_stats", bb + 1))
        t["stats"] = stats
    return g, t


def _coefficients(spec: GraphSpec) -> list[list[int]]:
    """The (_ROWS, 9) integer matrix C of the device path: ``rows = C @ Z`` where Z's rows are
    lens_q, lens_kv, q_start, o_start, k_start, v_start, lse_start (``batch.meta``), q_len' (rows
    handed to cuDNN) and 1, one column per sequence. ``skip = lens_q - q_len'``."""
    c = [[0] * 9 for _ in range(_ROWS)]

    def shifted(r: int, start: int, scale: int, step: int) -> None:  # scale * start + step * skip
        c[r][start] = scale
        c[r][_Z_LQ] += step
        c[r][_Z_EFF] -= step

    sq0, so0 = spec.q_strides[0], spec.o_strides[0]
    c[_R_SEQ_Q][_Z_EFF] = 1
    c[_R_SEQ_KV][_Z_LKV] = 1
    shifted(_R_OFF_Q, _Z_QS, sq0, sq0)
    shifted(_R_OFF_O, _Z_OS, so0, so0)
    if not spec.paged:
        c[_R_OFF_K][_Z_KS] = spec.k_strides[0]
        c[_R_OFF_V][_Z_VS] = spec.v_strides[0]
    else:  # kv_len - 1; the device path floor-divides by page_size (base: b * row stride, added there)
        c[_R_LAST][_Z_LKV] = 1
        c[_R_LAST][_Z_ONE] = -1
    hq = spec.num_qo_heads
    if spec.lse:
        shifted(_R_OFF_S, _Z_LS, 1, hq)
    shifted(_R_FIX, _Z_OS, 1, 0)
    shifted(_R_FIX + 1, _Z_OS, 1, 1)
    if spec.lse:  # in lse elements here; the device path divides by Hq
        shifted(_R_FIX + 2, _Z_LS, 1, 0)
        shifted(_R_FIX + 3, _Z_LS, 1, hq)
    return c


def _make_consts(spec: GraphSpec, layout: ScratchLayout, device: torch.device) -> _Consts:
    """Build on the CPU, then blocking copies: complete on the device before any stream uses them."""
    row = layout.row
    cpu = _Consts(
        coef=torch.tensor(_coefficients(spec), dtype=torch.int64).unsqueeze(-1),
        ones=torch.ones((1, row), dtype=torch.int64),
        arange=torch.arange(row, dtype=torch.int64),
        cols=torch.arange(max(spec.table_width, 1), dtype=torch.int64).unsqueeze(0),
        signs=torch.tensor([1, -1], dtype=torch.int32).repeat_interleave(row).repeat(2, 1),
        fp8=torch.tensor([1.0 / 256.0, 256.0, 1.0], dtype=torch.float32),
    )
    return _Consts(*(getattr(cpu, f).to(device) for f in cpu.__dataclass_fields__))


def _consts(plan: _Plan, device: torch.device) -> _Consts:
    if plan.consts is None:  # plans built by _build already have them; CPU test plans get them here
        plan.consts = _make_consts(plan.spec, plan.layout, device)
    return plan.consts


def _plan_name(g: Any) -> str:
    try:
        eng = g.selected_engine
        if eng is not None:
            return f"frost:{eng.name}"
        return f"cudnn:{g.get_plan_name_at_index(g._plan_index)}"
    except Exception as exc:  # diagnostics only
        return f"unknown ({type(exc).__name__})"


def _build(spec: GraphSpec, dev: int, handle: Any, policy: str) -> _Plan:
    cudnn = _cudnn()
    t0 = time.perf_counter()
    with torch.cuda.device(dev):
        g, tensors = make_graph(spec, cudnn, handle=handle)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        if policy == "backend":
            g.deselect_engines(["sdpa_fwd_prefill"])  # the FROST python engines' names
        g.check_support()
        g.build_plans()
        ws = int(g.get_workspace_size())
        layout = scratch_layout(spec, ws)
        consts = _make_consts(spec, layout, torch.device("cuda", dev))
    plan = _Plan(spec, g, tensors, layout, _plan_name(g), time.perf_counter() - t0)
    plan.consts = consts
    return plan


def _refusal(spec: GraphSpec, dev: int, exc: BaseException) -> str:
    msg = " ".join(str(exc).split()) or type(exc).__name__
    if len(msg) > 600:
        msg = msg[:600] + " ..."
    if spec.fp8:
        major, minor = torch.cuda.get_device_capability(dev)
        return f"cuDNN refuses fp8 attention on this GPU (sm{major}{minor}): {msg}"
    ver = backend_version()
    hint = (
        " (the graph writes the LSE through ragged Stats offsets; return_lse=False or backend='triton' "
        "may serve the call)"
        if spec.lse
        else ""
    )
    return (
        f"cuDNN {ver} could not build this attention graph ({spec.describe()}): "
        f"{type(exc).__name__}: {msg}{hint}"
    )


def _covering_plan(key: tuple) -> _Plan | None:
    """A built plan that can serve ``key``'s spec: identical but for batch / max_q / max_kv buckets
    that are each at least the needed one and at most ``COVER_RATIOS`` times it (extra batch entries
    get length 0; longer maxima only bound the lengths). The smallest such plan, or None. This is
    what keeps a serving loop at a handful of builds: a step whose exact bucket was never seen runs
    on a slightly larger graph instead of paying a ~0.05 s build."""
    spec = key[0]
    best, best_cost = None, None
    for (other, *rest), plan in _CACHE.items():
        if tuple(rest) != key[1:]:
            continue
        pairs = ((spec.batch, other.batch), (spec.max_q, other.max_q), (spec.max_kv, other.max_kv))
        if not all(need <= have <= r * need for (need, have), r in zip(pairs, COVER_RATIOS)):
            continue
        buckets = dict(batch=spec.batch, max_q=spec.max_q, max_kv=spec.max_kv, table_width=spec.table_width)
        if replace(other, **buckets) != spec:
            continue
        cost = other.batch * other.max_q * other.max_kv
        if best_cost is None or cost < best_cost:
            best, best_cost = plan, cost
    return best


def _plan_for_spec(spec: GraphSpec, dev: int) -> _Plan | str:
    """The built plan for ``spec`` on device ``dev`` (cached), or the reason it cannot be built.
    Never raises for a build refusal; never builds during CUDA stream capture."""
    global _BUILDS
    handle = _handle(dev)
    key = (spec, dev, handle.backend_handle, _engine_policy())
    with _LOCK:
        plan = _CACHE.get(key)
        if plan is not None:
            return plan
        plan = _covering_plan(key)
        if plan is not None:
            return plan
        if key in _FAILED:
            return _FAILED[key]
        if spec.lse:
            ver = backend_version()
            if ver is not None and ver < RAGGED_STATS_VERSION:
                reason = (
                    f"cuDNN {ver} cannot write the LSE per sequence at ragged offsets (ragged Stats "
                    f"need cuDNN >= {RAGGED_STATS_VERSION // 10000}.{RAGGED_STATS_VERSION // 100 % 100}); "
                    "call with return_lse=False, use backend='triton', or pip install -U nvidia-cudnn-cu12"
                )
                _FAILED[key] = reason
                return reason
        if torch.cuda.is_current_stream_capturing():
            return (
                "no cuDNN graph is built for this shape bucket yet, and cuDNN cannot build one during CUDA "
                "stream capture: run the call once with the same shapes before capturing "
                f"({spec.describe()})"
            )
        try:
            plan = _build(spec, dev, handle, key[3])
        except Exception as exc:  # cudnnGraphNotSupportedError, ValueError, RuntimeError, ...
            reason = _refusal(spec, dev, exc)
            _FAILED[key] = reason
            return reason
        plan.key = key
        _CACHE[key] = plan
        _BUILDS += 1
        return plan


def _remember(key: tuple, value: Any) -> None:
    if len(_FAST) >= _FAST_CACHE_MAX:
        _FAST.clear()
    _FAST[key] = value


def _plan_for(batch: PrefillBatch) -> _Plan | str:
    """The plan serving ``batch`` or the reason there is none; resolved once per call (kept in
    ``batch.extras``) and through a cheap key across calls."""
    got = batch.extras.get("cudnn_plan")
    if got is not None:
        if not isinstance(got, _Plan) or not got.key:
            return got
        dev = _device_index(batch.device)
        if got.key[1:3] == (dev, _handle(dev).backend_handle):
            return got
        # built for another thread's cuDNN handle (the api reused a call plan after its thread
        # ended and the thread id was recycled): resolve it again for this thread
    dev = _device_index(batch.device)
    fast = (_call_key_of(batch), dev, _handle(dev).backend_handle, _engine_policy())
    got = _FAST.get(fast)
    if got is None:
        got = _plan_for_spec(graph_spec(batch), dev)
        if isinstance(got, _Plan) or not torch.cuda.is_current_stream_capturing():
            _remember(fast, got)
    batch.extras["cudnn_plan"] = got
    return got


# --------------------------------------------------------------------------------------------
# Backend protocol
# --------------------------------------------------------------------------------------------


_NO_REASON = ""


def unsupported_reason(batch: PrefillBatch) -> str | None:
    key = ("static", _call_key_of(batch))
    reason = _FAST.get(key)
    if reason is None:
        reason = _static_reason(batch) or _NO_REASON
        _remember(key, reason)
    reason = reason or _per_call_reason(batch)
    if reason or batch.device.type != "cuda":
        return reason or None
    if batch.batch_size == 0 or batch.max_q == 0:
        return None  # no query rows: nothing to build or run
    if unavailable_reason(batch.device) is not None:
        return None  # the caller reports unavailability separately
    got = _plan_for(batch)
    return got if isinstance(got, str) else None


def workspace_bytes(batch: PrefillBatch) -> int:
    if batch.batch_size == 0 or batch.max_q == 0:
        return 0
    got = _plan_for(batch)
    if isinstance(got, str):
        raise ValueError(f"backend='cudnn' cannot serve this call: {got}")
    return got.layout.total


@dataclass
class _Views:
    """This call's regions of ``batch.scratch``."""

    ints: Tensor  # (_ROWS, row) int32
    table: Tensor | None  # (Bb, table_width) int32
    floats: Tensor | None  # (8,) float32 (fp8 only)
    workspace: Tensor  # uint8 cuDNN workspace


def _views(batch: PrefillBatch, plan: _Plan) -> _Views:
    """This call's scratch regions; cached in ``batch.extras`` (shared by the calls of one api call
    plan) while the plan and the scratch address stay the same."""
    got = batch.extras.get("cudnn_views")
    ptr = batch.scratch.data_ptr()
    if got is not None and got[0] is plan and got[1] == ptr:
        return got[2]
    views = _make_views(batch, plan)
    batch.extras["cudnn_views"] = (plan, ptr, views)
    return views


def _make_views(batch: PrefillBatch, plan: _Plan) -> _Views:
    lay, spec, scratch = plan.layout, plan.spec, batch.scratch
    base = (-scratch.data_ptr()) % ALIGN
    i32 = scratch[base : base + lay.workspace].view(torch.int32)
    ints = i32[: _ROWS * lay.row].view(_ROWS, lay.row)
    table = floats = None
    if spec.paged:
        t0 = lay.table // 4
        table = i32[t0 : t0 + spec.batch * spec.table_width].view(spec.batch, spec.table_width)
    if spec.fp8:
        floats = i32[lay.floats // 4 : lay.floats // 4 + 8].view(torch.float32)
    ws = scratch[base + lay.workspace : base + lay.workspace + lay.workspace_size]
    return _Views(ints, table, floats, ws)


def _host_rows(batch: PrefillBatch, plan: _Plan) -> tuple[list[int], bool]:
    """The metadata block (``_ROWS`` rows of ``layout.row``, flattened) from ``batch.host``: the same
    values the device path computes, by Python integer arithmetic (no torch op per sequence).
    Returns (values, whether some rows need the empty-row fix-up)."""
    spec, h, row, n = plan.spec, batch.host, plan.layout.row, batch.batch_size
    lq, lkv = h.lens_q, h.lens_kv
    if _DEBUG_NATIVE_EMPTY_ROWS:
        eff = list(lq)
    elif spec.causal:
        eff = list(map(min, lq, lkv))
    else:
        eff = [a if b > 0 else 0 for a, b in zip(lq, lkv)]
    skip = [a - e for a, e in zip(lq, eff)]
    fix = not _DEBUG_NATIVE_EMPTY_ROWS and any(skip)
    pad = [0] * (row - n)
    zero = [0] * row
    sq0, so0, hq = spec.q_strides[0], spec.o_strides[0], spec.num_qo_heads
    v = eff + pad
    v += [b if e else 0 for b, e in zip(lkv, eff)] + pad
    v += [(s + d) * sq0 if e else 0 for s, d, e in zip(h.q_start, skip, eff)] + pad
    v += [(s + d) * so0 if e else 0 for s, d, e in zip(h.o_start, skip, eff)] + pad
    if spec.paged:
        v += zero + zero
    else:
        v += [s * spec.k_strides[0] if e else 0 for s, e in zip(h.k_start, eff)] + pad
        v += [s * spec.v_strides[0] if e else 0 for s, e in zip(h.v_start, eff)] + pad
    if spec.lse:
        v += [s + d * hq if e else 0 for s, d, e in zip(h.lse_start, skip, eff)] + pad
    else:
        v += zero
    if spec.paged:
        ps, s0 = spec.page_size, batch.block_tables.stride(0)
        v += [max(b - 1, 0) // ps if e else 0 for b, e in zip(lkv, eff)] + pad
        v += [b * s0 if e else 0 for b, e in enumerate(eff)] + pad
    else:
        v += zero + zero
    if not fix:
        return v + zero * 4, False
    top = _fix_extent(batch)
    v += [min(s, top) for s in h.o_start] + pad
    v += [min(s + d, top) for s, d in zip(h.o_start, skip)] + pad
    if spec.lse:
        v += [min(s // hq, top) for s in h.lse_start] + pad
        v += [min(s // hq + d, top) for s, d in zip(h.lse_start, skip)] + pad
    else:
        v += zero + zero
    return v, True


def _write_host_metadata(batch: PrefillBatch, plan: _Plan, views: _Views) -> Tensor | None:
    """Lengths on the host: one (pinned) host-to-device copy. Returns the fix-up rows or None."""
    values, fix = _host_rows(batch, plan)
    packer = plan.packer
    if packer is None:
        packer = plan.packer = struct.Struct(f"={len(values)}i")
    staged = torch.frombuffer(bytearray(packer.pack(*values)), dtype=torch.int32)
    cuda = views.ints.is_cuda
    if cuda:
        staged = staged.pin_memory()
    views.ints.view(-1).copy_(staged, non_blocking=cuda)
    return views.ints[_R_FIX:] if fix else None


def _write_device_metadata(batch: PrefillBatch, plan: _Plan, views: _Views) -> Tensor:
    """Lengths on the device (CUDA-graph mode): the rows from ``batch.meta`` by fixed device ops
    (no host sync; nothing here depends on the lengths' values). Returns the fix-up rows (4, row)."""
    spec, k, row = plan.spec, _consts(plan, batch.device), plan.layout.row
    meta = torch.nn.functional.pad(batch.meta, (0, row - batch.batch_size))  # (7, row) int32
    lq, lkv = meta[0], meta[1]
    eff = torch.minimum(lq, lkv) if spec.causal else torch.where(lkv > 0, lq, 0)
    z = torch.cat((meta, eff[None], k.ones))  # (9, row) int64
    y = (k.coef * z).sum(1)  # (_ROWS, row) int64
    if spec.paged:
        y[_R_LAST].div_(spec.page_size, rounding_mode="floor")
        torch.mul(k.arange, batch.block_tables.stride(0), out=y[_R_BASE])
    torch.mul(y[:_R_FIX], eff > 0, out=views.ints[:_R_FIX])  # sequences cuDNN skips: all 0
    fx = y[_R_FIX:]
    if spec.lse:
        fx[2:].div_(spec.num_qo_heads, rounding_mode="floor")
    return fx.clamp_(0, _fix_extent(batch))


def _write_table(batch: PrefillBatch, plan: _Plan, views: _Views) -> None:
    """Our page table: entry (b, j) = block_tables[b, min(j, last page of b)], clamped to real pages;
    rows of padded or skipped sequences repeat the table's first entry. An index grid (2 ops), one
    gather, one clamp; ``block_tables`` may have any row stride."""
    bt, table = batch.block_tables, views.table
    width = bt.shape[1]
    if width == 0:  # then every kv_len is 0: any valid page id will do
        table.zero_()
        return
    flat = bt.as_strided(((batch.batch_size - 1) * bt.stride(0) + width,), (1,))
    bb, ints = plan.spec.batch, views.ints
    idx = torch.minimum(_consts(plan, batch.device).cols, ints[_R_LAST, :bb, None])
    idx += ints[_R_BASE, :bb, None]
    torch.index_select(flat, 0, idx.view(-1), out=table.view(-1))
    table.clamp_(0, plan.spec.num_pages - 1)


def _fix_extent(batch: PrefillBatch) -> int:
    """Row count of the fix-up's marks: ranges are clamped into [0, this]."""
    n_l = batch.lse.numel() // batch.num_qo_heads if batch.lse is not None else 0
    return max(batch.out.shape[0], n_l)


def _fill_empty_rows(batch: PrefillBatch, plan: _Plan, fx: Tensor) -> None:
    """out = 0 and lse = -inf on the rows no key is visible to. ``fx`` (4, n) holds, per sequence,
    the [lo, hi) row range to fix in out (rows 0-1) and in lse viewed as (rows, Hq) (rows 2-3).
    Difference arrays mark them: +1 at each lo, -1 at each hi, prefix sum > 0 inside a range."""
    rows_o, lse, hq = batch.out.shape[0], batch.lse, batch.num_qo_heads
    if fx.dtype != torch.int64:
        fx = fx.long()
    marks = torch.zeros((2, _fix_extent(batch) + 1), dtype=torch.int32, device=batch.device)
    marks.scatter_add_(1, fx.view(2, -1), _consts(plan, batch.device).signs)
    inside = marks.cumsum(1) > 0
    batch.out.masked_fill_(inside[0, :rows_o, None, None], 0)
    if lse is not None:
        n_l = lse.numel() // hq
        lse[: n_l * hq].view(n_l, hq).masked_fill_(inside[1, :n_l, None], -math.inf)


# --------------------------------------------------------------------------------------------
# Per-call metadata in one Triton launch
# --------------------------------------------------------------------------------------------

if triton is not None:
    _PREP_INTS = [
        "meta_stride", "n_seq", "n_table", "row", "bt_stride", "bt_width", "width", "num_pages",
        "page_size", "sq0", "so0", "sk0", "sv0", "num_heads", "stride_ot", "stride_oh",
    ]  # fmt: skip

    @triton.jit(do_not_specialize=_PREP_INTS)
    def _prepare_kernel(
        META, meta_stride, n_seq, n_table,
        INTS, row,
        BT, bt_stride, bt_width, TABLE, width, num_pages, page_size,
        sq0, so0, sk0, sv0, num_heads,
        Out, stride_ot, stride_oh, LSE,
        PAGED: tl.constexpr, CAUSAL: tl.constexpr, HAS_LSE: tl.constexpr, FIX: tl.constexpr,
        BLOCK_W: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        """Program (b, r), b < ``row``: with r == 0, entry b of metadata rows 0..6 (zeros past the
        batch) and, b < ``n_table``, row b of our page table; every r: the rows of sequence b that
        see no key (out 0, lse -inf), rows r, r + R, ... of them. Those rows are exactly the ones
        cuDNN is told to skip, so this may run before the graph."""
        b = tl.program_id(0)
        r = tl.program_id(1)
        real = b < n_seq
        lq = tl.load(META + b, mask=real, other=0)
        lkv = tl.load(META + meta_stride + b, mask=real, other=0)
        if CAUSAL:
            eff = tl.minimum(lq, lkv)
        else:
            eff = tl.where(lkv > 0, lq, 0)
        skip = lq - eff
        e = eff > 0
        if r == 0:
            qs = tl.load(META + 2 * meta_stride + b, mask=real, other=0).to(tl.int64)
            os_ = tl.load(META + 3 * meta_stride + b, mask=real, other=0).to(tl.int64)
            ls = tl.load(META + 6 * meta_stride + b, mask=real, other=0).to(tl.int64)
            sk = skip.to(tl.int64)
            tl.store(INTS + b, eff)
            tl.store(INTS + row + b, tl.where(e, lkv, 0))
            tl.store(INTS + 2 * row + b, tl.where(e, (qs + sk) * sq0, 0).to(tl.int32))
            tl.store(INTS + 3 * row + b, tl.where(e, (os_ + sk) * so0, 0).to(tl.int32))
            if PAGED:
                tl.store(INTS + 4 * row + b, 0)
                tl.store(INTS + 5 * row + b, 0)
                if b < n_table:
                    last = tl.where(e, tl.maximum(lkv - 1, 0) // page_size, 0)
                    last = tl.minimum(last, tl.maximum(bt_width - 1, 0))
                    base = tl.where(e, b.to(tl.int64) * bt_stride, 0)
                    for j0 in range(0, width, BLOCK_W):
                        j = j0 + tl.arange(0, BLOCK_W)
                        use = (j < width) & (bt_width > 0)
                        page = tl.load(BT + base + tl.minimum(j, last), mask=use, other=0)
                        page = tl.minimum(tl.maximum(page, 0), num_pages - 1)
                        tl.store(TABLE + b * width + j, page, mask=j < width)
            else:
                ks = tl.load(META + 4 * meta_stride + b, mask=real, other=0).to(tl.int64)
                vs = tl.load(META + 5 * meta_stride + b, mask=real, other=0).to(tl.int64)
                tl.store(INTS + 4 * row + b, tl.where(e, ks * sk0, 0).to(tl.int32))
                tl.store(INTS + 5 * row + b, tl.where(e, vs * sv0, 0).to(tl.int32))
            if HAS_LSE:
                tl.store(INTS + 6 * row + b, tl.where(e, ls + sk * num_heads, 0).to(tl.int32))
            else:
                tl.store(INTS + 6 * row + b, 0)
        if FIX:
            o_start = tl.load(META + 3 * meta_stride + b, mask=real, other=0)
            lse_start = tl.load(META + 6 * meta_stride + b, mask=real, other=0)
            d = tl.arange(0, BLOCK_D)
            for i in range(r, skip, tl.num_programs(1)):
                o_row = (o_start + i).to(tl.int64) * stride_ot
                for h0 in range(0, num_heads, BLOCK_H):
                    h = h0 + tl.arange(0, BLOCK_H)
                    ptr = Out + o_row + h[:, None].to(tl.int64) * stride_oh + d[None, :]
                    zero = tl.zeros([BLOCK_H, BLOCK_D], Out.dtype.element_ty)
                    tl.store(ptr, zero, mask=(h[:, None] < num_heads) & (d[None, :] < DV))
                    if HAS_LSE:
                        off = lse_start.to(tl.int64) + i * num_heads + h  # < lse.numel() <= 2^31 - 1
                        tl.store(LSE + off, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h < num_heads)

else:
    _prepare_kernel = None

_FIX_PROGRAMS = 16  # programs per sequence for the rows without keys


def _needs_fix(batch: PrefillBatch) -> bool:
    """Whether some row sees no key (always assumed with lengths on the device)."""
    h = batch.host
    if h is None:
        return True
    if batch.causal:
        return any(a > b for a, b in zip(h.lens_q, h.lens_kv))
    return any(a and not b for a, b in zip(h.lens_q, h.lens_kv))


_TRITON_RUNS: dict[torch.device, bool] = {}  # device -> whether the Triton kernels can run there


def _prepare(batch: PrefillBatch, plan: _Plan, views: _Views) -> bool:
    """cuDNN's metadata rows 0..6, our page table and the rows without keys, from ``batch.meta``
    (filled by the api) in ONE launch. False (nothing done) when Triton cannot run here."""
    if _prepare_kernel is None or _DEBUG_NATIVE_EMPTY_ROWS:
        return False
    runs = _TRITON_RUNS.get(batch.device)
    if runs is None:
        from pagedprefill.backends import triton_backend

        runs = _TRITON_RUNS[batch.device] = triton_backend.unavailable_reason(batch.device) is None
    if not runs:
        return False
    got = batch.extras.get("cudnn_prep")
    if got is None or got[0] is not plan or got[1] is not views:
        got = batch.extras["cudnn_prep"] = (plan, views, *_prepare_constants(batch, plan, views))
    _, _, head, tail, consts = got
    fix = _needs_fix(batch)
    out, meta = batch.out, batch.meta
    bt = batch.block_tables if plan.spec.paged else meta
    grid = (plan.layout.row, min(_FIX_PROGRAMS, max(batch.max_q, 1)) if fix else 1)
    args = (
        meta, meta.stride(0), batch.batch_size, *head,
        bt, bt.stride(0) if plan.spec.paged else 0, bt.shape[1] if plan.spec.paged else 0, *tail,
        out, out.stride(0), out.stride(1), batch.lse if batch.lse is not None else meta,
    )  # fmt: skip
    from pagedprefill.backends import triton_backend

    dev = batch.device.index
    other = dev is not None and dev != torch.cuda.current_device()  # Triton launches on the current one
    with torch.cuda.device(dev) if other else contextlib.nullcontext():
        triton_backend.fast_launch(_prepare_kernel, grid, args, consts[fix])
    return True


def _prepare_constants(batch: PrefillBatch, plan: _Plan, views: _Views) -> tuple[tuple, tuple, dict]:
    """The arguments of :func:`_prepare`'s launch that depend only on the plan and its scratch."""
    spec = plan.spec
    block_d = triton.next_power_of_2(spec.head_dim_vo)
    block_h = max(1, min(triton.next_power_of_2(spec.num_qo_heads), 4096 // block_d))
    head = (spec.batch, views.ints, plan.layout.row)
    tail = (
        views.table if spec.paged else views.ints, spec.table_width, spec.num_pages, max(spec.page_size, 1),
        spec.q_strides[0], spec.o_strides[0], spec.k_strides[0], spec.v_strides[0], spec.num_qo_heads,
    )  # fmt: skip
    consts = dict(
        PAGED=spec.paged, CAUSAL=spec.causal, HAS_LSE=spec.lse, BLOCK_W=1024, DV=spec.head_dim_vo,
        BLOCK_D=block_d, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return head, tail, {fix: dict(consts, FIX=fix) for fix in (False, True)}


def _operands(plan: _Plan, batch: PrefillBatch, views: _Views) -> dict[str, Any]:
    rows = views.ints
    ops: dict[str, Any] = {
        "q": batch.q,
        "k": batch.k,
        "v": batch.v,
        "o": batch.out,
        "seq_q": rows[_R_SEQ_Q],
        "seq_kv": rows[_R_SEQ_KV],
        "off_q": rows[_R_OFF_Q],
        "off_o": rows[_R_OFF_O],
    }
    spec = plan.spec
    if spec.paged:
        ops["table_k"] = ops["table_v"] = views.table
    else:
        ops["off_k"], ops["off_v"] = rows[_R_OFF_K], rows[_R_OFF_V]
    if spec.lse:
        ops["stats"], ops["off_stats"] = batch.lse, rows[_R_OFF_S]
    if spec.fp8:
        ops.update(descale_q=batch.q_scale, descale_k=batch.k_scale, descale_v=batch.v_scale)
        f = views.floats
        ops.update(descale_s=f[0], scale_s=f[1], scale_o=f[2], amax_s=f[3], amax_o=f[4])
    return ops


_PER_CALL_OPERANDS = ("q", "k", "v", "o", "stats", "descale_q", "descale_k", "descale_v")


def _static_pack(plan: _Plan, batch: PrefillBatch, views: _Views) -> dict:
    """The operands that stay bound across calls of one plan on one scratch (metadata rows, page
    table, fp8 constants), keyed by graph tensor."""
    ops = _operands(plan, batch, views)
    return {t: ops[n] for n, t in plan.tensors.items() if n not in _PER_CALL_OPERANDS}


def _execute_cudnn(plan: _Plan, batch: PrefillBatch, views: _Views) -> None:
    """Bind every operand and run the built cuDNN plan on torch's current stream."""
    if plan.spec.fp8:
        views.floats[:3].copy_(_consts(plan, batch.device).fp8)
    dev = _device_index(batch.device)
    handle = _handle(dev)
    _cudnn().set_stream(handle, _current_stream(dev))
    if plan.binding == "tensors":
        bound = batch.extras.get("cudnn_static")
        if bound is None or bound[0] is not views:
            bound = batch.extras["cudnn_static"] = (views, _static_pack(plan, batch, views))
        pack = bound[1].copy()
        named = plan.tensors
        pack[named["q"]], pack[named["k"]] = batch.q, batch.k
        pack[named["v"]], pack[named["o"]] = batch.v, batch.out
        if plan.spec.lse:
            pack[named["stats"]] = batch.lse
        if plan.spec.fp8:
            pack[named["descale_q"]], pack[named["descale_k"]] = batch.q_scale, batch.k_scale
            pack[named["descale_v"]] = batch.v_scale
        try:
            plan.graph.execute(pack, views.workspace, handle=handle)
            return
        except Exception as exc:  # the frontend could not take torch tensors: bind addresses instead
            if plan.binding_error is not None:
                raise
            plan.binding, plan.binding_error = "addresses", f"{type(exc).__name__}: {exc}"
    ops = _operands(plan, batch, views)
    pack = {t: ops[n].data_ptr() for n, t in plan.tensors.items()}
    plan.graph.execute(pack, views.workspace.data_ptr(), handle=handle)


_EXECUTE = _execute_cudnn  # replaced by a pure-torch emulation in the CPU tests


def bare_graph(batch: PrefillBatch) -> Any:
    """For benchmarks: a callable that executes ``batch``'s built cuDNN graph with the operands
    bound once, i.e. what the call costs without any per-call work of this library. ``batch`` must
    have been run once by :func:`run` (its metadata and page table are then in place)."""
    plan = batch.extras["cudnn_plan"]
    views = _views(batch, plan)
    ops = _operands(plan, batch, views)
    dev = _device_index(batch.device)
    handle = _handle(dev)
    if plan.binding == "tensors":
        pack, ws = {t: ops[n] for n, t in plan.tensors.items()}, views.workspace
    else:
        pack, ws = {t: ops[n].data_ptr() for n, t in plan.tensors.items()}, views.workspace.data_ptr()

    def execute() -> None:
        _cudnn().set_stream(handle, _current_stream(dev))
        plan.graph.execute(pack, ws, handle=handle)

    return execute


def run(batch: PrefillBatch) -> None:
    if batch.batch_size == 0 or batch.max_q == 0:
        return  # every q_len is 0: nothing is written
    got = _plan_for(batch)
    if isinstance(got, str):  # nothing has been written yet
        raise RuntimeError(f"backend='cudnn' cannot serve this call: {got}")
    plan = got
    if batch.scratch.numel() < plan.layout.total:
        raise ValueError(
            f"workspace_buffer: expected {plan.layout.total} bytes of cuDNN scratch, "
            f"got {batch.scratch.numel()}"
        )
    views = _views(batch, plan)
    if _prepare(batch, plan, views):
        _EXECUTE(plan, batch, views)
        return
    # Without Triton: the same metadata by torch ops, and a masked fill of the rows without keys
    # (a read-modify-write of the whole out / lse) after the graph.
    if batch.host is not None:
        fx = _write_host_metadata(batch, plan, views)
    else:
        fx = _write_device_metadata(batch, plan, views)
    if plan.spec.paged:
        _write_table(batch, plan, views)
    _EXECUTE(plan, batch, views)
    if fx is not None:
        _fill_empty_rows(batch, plan, fx)
