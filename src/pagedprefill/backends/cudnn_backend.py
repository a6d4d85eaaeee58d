"""cuDNN backend: batched prefill attention as cuDNN SDPA graphs (``nvidia-cudnn-frontend``).

How a :class:`~pagedprefill.api.PrefillBatch` becomes one cuDNN graph
-------------------------------------------------------------------------
* q / out are described *ragged*: dims ``(Bb, H, Sq, D)``, strides
  ``(Sq*s0, s1, s0, 1)`` where ``s0, s1`` are the tensor's REAL token and head strides, plus a
  ragged-offset tensor holding each sequence's first row in ELEMENTS (``start * s0``). Sequence b's
  rows therefore always come from ``batch.meta`` (prefix sums when the caller gave no offsets), never
  from ``b * max_q`` (the anchor's "batch > 0 reads the wrong rows" bug cannot happen).
* Paged K/V are the page containers ``(num_pages, Hkv, page_size, D)`` with their real strides (NHD,
  HND and two views of one interleaved buffer all differ and all key different graphs); the page
  table is a copy of ``batch.block_tables`` in ``batch.scratch`` with its own width
  ``ceil(Skv / page_size)`` (cuDNN requires exactly that width). Its row stride is ours, so the
  caller's table width never has to match ``max_sequence_kv / page_size`` (anchor bug 3). Entries are
  clamped to ``[0, num_pages)``. Ragged K/V are described like q, with their own offsets.
* LSE: cuDNN's Stats, natural log, ``(Bb, Hq, Sq, 1)`` token-major (strides ``(Sq*Hq, 1, Hq, 1)``)
  with a ragged offset = ``batch.meta`` ``lse_start`` (elements). One description serves both the
  padded ``(B, max_q, Hq)`` layout (offsets ``b*max_q*Hq``) and the packed layout. Ragged tensors are
  written only for rows ``i < seq_len_q``, so padded LSE rows keep the caller's bytes (anchor bug 4).
  If the cuDNN library refuses ragged Stats (older than 9.6), the backend falls back to a dense
  Stats scratch buffer and copies the covered rows with device ops (``stats_mode="scratch"``).
* Masks: padding mask with per-sequence lengths; causal = ``diagonal_alignment=BOTTOM_RIGHT`` and
  ``diagonal_band_right_bound=0``.
* Rows with no visible key (kv_len 0, or causal rows ``i < q_len - kv_len``) are never handed to
  cuDNN: the lengths and offsets cuDNN sees start each sequence ``skip = q_len - q_len'`` rows later,
  with ``q_len' = min(q_len, kv_len)`` (causal) or ``0`` when ``kv_len == 0``. Bottom-right alignment
  is unchanged by this shift. The skipped rows are then written here: out 0, lse -inf (device ops;
  with host metadata only when some sequence has such rows).

Graph cache and bucketing
-------------------------
Graphs are cached under :class:`GraphSpec` (+ device, cuDNN handle, engine policy): every dtype, head
count, head dim, page size, page count, table width, every stride of q/out/K/V, the Stats layout,
``scale`` (baked into the graph as a float: a runtime scale tensor would force a device buffer and a
per-call copy, and serving engines keep one scale per model), causal, LSE on/off, paged/ragged,
fp8 scales, and the bucketed batch size / max q length / max kv length. The CUDA stream is NOT part
of the key: a built plan runs on whatever stream ``cudnn.set_stream`` gives its handle at execute
time (keying on the stream would rebuild inside ``torch.cuda.graph`` capture, which uses a side
stream). Buckets: batch rounds up to a power of two; lengths to 64 * 4**k up to 4096, then powers of
two (see :func:`bucket_len`). Padded batch entries get length 0 and page 0 in every table slot.

CUDA graphs
-----------
Everything cuDNN reads (lengths, offsets, page table) is derived on the device from ``batch.meta`` and
``batch.block_tables`` into ``batch.scratch`` each call: no host sync, no allocation beyond torch
temporaries. A graph is never built during stream capture (cuDNN's build allocates and synchronises):
call once with the same shapes before capturing.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from pagedprefill.api import PrefillBatch

NAME = "cudnn"

MIN_BACKEND_VERSION = 90500  # paged SDPA with ragged Q/O (cuDNN 9.5.0)
RAGGED_STATS_VERSION = 90600  # token-major ragged Stats (cuDNN 9.6.0)
INSTALL_HINT = "package nvidia-cudnn-frontend is not installed: pip install pagedprefill[cudnn]"
INT32_MAX = 2**31 - 1
ALIGN = 256  # bytes; every scratch region starts at this alignment
LEN_MIN = 64  # smallest length bucket
LEN_GEOMETRIC_UNTIL = 4096  # lengths bucket by x4 up to here, then by x2
# "auto": the frontend's own routing (FROST python engines where they lead, else the cuDNN
# library); "backend": the cuDNN library's engines only. Read at each build, part of the key.
ENGINE_POLICY_ENV = "PAGEDPREFILL_CUDNN_ENGINES"

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_HALF = (torch.float16, torch.bfloat16)

# Debug knob for scripts/cudnn_smoke.py: hand cuDNN the rows with no visible key instead of
# skipping them, and do not fix them afterwards (to observe what cuDNN itself writes there).
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
    table_width: int  # columns of OUR page table copy = ceil(max_kv / page_size); 0 when ragged
    q_strides: tuple[int, ...]  # (token, head) element strides
    o_strides: tuple[int, ...]
    k_strides: tuple[int, ...]  # paged: all 4; ragged: (token, head)
    v_strides: tuple[int, ...]
    scale: float
    causal: bool
    lse: bool
    lse_packed: bool
    stats_mode: str  # "ragged" (Stats written in place) | "scratch" | "none"
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
        return (
            f"{self.q_dtype}/{self.kv_dtype}->{self.o_dtype} Hq={self.num_qo_heads} Hkv={self.num_kv_heads} "
            f"D={self.head_dim_qk}/{self.head_dim_vo} {kv} B={self.batch} Sq={self.max_q} Skv={self.max_kv} "
            f"causal={self.causal} lse={self.stats_mode}"
        )


def graph_spec(batch: PrefillBatch, stats_mode: str | None = None) -> GraphSpec:
    """The :class:`GraphSpec` of a batch (pure function of shapes/strides/dtypes/flags)."""
    paged = batch.paged
    ps = batch.page_size if paged else 0
    if paged:
        width = batch.block_tables.shape[1]
        kv_cap = min(batch.max_kv, width * ps)
    else:
        kv_cap = batch.max_kv
    max_kv = bucket_len(kv_cap)
    q_st, o_st = _strides(batch.q), _strides(batch.out)
    k_st, v_st = _strides(batch.k), _strides(batch.v)
    if not paged:
        k_st, v_st = k_st[:2], v_st[:2]
    lse = batch.lse is not None
    if stats_mode is None:
        stats_mode = "ragged" if lse else "none"
    elif not lse:
        stats_mode = "none"
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
        stats_mode=stats_mode,
        fp8=batch.q.dtype in _FP8,
        batch=bucket_batch(batch.batch_size),
        max_q=bucket_len(batch.max_q),
        max_kv=max_kv,
    )


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class ScratchLayout:
    """Byte offsets of this backend's regions inside ``batch.scratch`` (after an alignment pad)."""

    row: int  # int32 elements per metadata row (>= batch + 1, multiple of 16)
    ints: int  # 7 metadata rows: seq_q, seq_kv, off_q, off_o, off_k, off_v, off_stats
    table: int  # int32 (batch, table_width) page table
    floats: int  # fp8 constants + amax outputs (8 floats)
    stats: int  # float32 (batch, Hq, max_q) dense Stats (stats_mode == "scratch")
    workspace: int  # cuDNN workspace
    workspace_size: int
    total: int  # bytes needed including ALIGN slack for an unaligned scratch base


def scratch_layout(spec: GraphSpec, cudnn_workspace: int) -> ScratchLayout:
    row = _round_up(spec.batch + 1, 16)
    off = 0
    ints = off
    off = _round_up(off + 7 * row * 4, ALIGN)
    table = off
    if spec.paged:
        off = _round_up(off + spec.batch * spec.table_width * 4, ALIGN)
    floats = off
    off = _round_up(off + 8 * 4, ALIGN)
    stats = off
    if spec.stats_mode == "scratch":
        off = _round_up(off + spec.batch * spec.num_qo_heads * spec.max_q * 4, ALIGN)
    workspace = off
    off = _round_up(off + max(int(cudnn_workspace), 0), ALIGN)
    return ScratchLayout(row, ints, table, floats, stats, workspace, int(cudnn_workspace), off + ALIGN)


def static_unsupported_reason(batch: PrefillBatch) -> str | None:
    """Why cuDNN cannot serve this call, from shapes/dtypes/strides alone (no cudnn, no GPU)."""
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
    names = (("q", q), ("k_cache", k), ("v_cache", v), ("out", out))
    for name, t in names:
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
        if t.data_ptr() % 16:
            return f"cuDNN needs 16-byte aligned tensors; {name} starts at an address that is not"
    for name, t in (("q", q), ("out", out)) + ((("k_cache", k), ("v_cache", v)) if not batch.paged else ()):
        span = t.shape[0] * _strides(t)[0]
        if span > INT32_MAX:
            return f"{name} spans {span} elements; cuDNN ragged offsets are int32"
    if batch.paged and batch.k.shape[0] > INT32_MAX:
        return "too many pages for int32 page tables"
    return None


# --------------------------------------------------------------------------------------------
# cudnn import, handles, availability
# --------------------------------------------------------------------------------------------

_CUDNN: Any = None
_CUDNN_ERROR: str | None = None
_TLS = threading.local()
_LOCK = threading.RLock()
_CACHE: dict[tuple, _Plan] = {}
_FAILED: dict[tuple, str] = {}
_RAGGED_STATS_REFUSED: set[int] = set()  # device indices whose cuDNN refused ragged Stats
_BUILDS = 0


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
    with _LOCK:
        _CACHE.clear()
        _FAILED.clear()
        _RAGGED_STATS_REFUSED.clear()


def cached_plans() -> list[_Plan]:
    """The built plans (for diagnostics: spec, engine name, workspace, build time)."""
    with _LOCK:
        return list(_CACHE.values())


# --------------------------------------------------------------------------------------------
# Graph construction
# --------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    spec: GraphSpec
    graph: Any
    tensors: dict[str, Any]
    layout: ScratchLayout
    engine: str
    build_seconds: float
    key: tuple = field(default=(), repr=False)


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
        if spec.stats_mode == "ragged":
            stats.set_ragged_offset(vec("off_stats", bb + 1))
        t["stats"] = stats
    return g, t


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
    return _Plan(spec, g, tensors, scratch_layout(spec, ws), _plan_name(g), time.perf_counter() - t0)


def _refusal(spec: GraphSpec, dev: int, exc: BaseException) -> str:
    msg = " ".join(str(exc).split()) or type(exc).__name__
    if len(msg) > 600:
        msg = msg[:600] + " ..."
    if spec.fp8:
        major, minor = torch.cuda.get_device_capability(dev)
        return f"cuDNN refuses fp8 attention on this GPU (sm{major}{minor}): {msg}"
    ver = backend_version()
    return (
        f"cuDNN {ver} could not build this attention graph ({spec.describe()}): {type(exc).__name__}: {msg}"
    )


def _plan_for(batch: PrefillBatch) -> _Plan | str:
    """The built plan for ``batch`` (cached), or the reason it cannot be built. Never raises for a
    build refusal; never builds during CUDA stream capture."""
    global _BUILDS
    dev = _device_index(batch.device)
    stats_mode = "scratch" if dev in _RAGGED_STATS_REFUSED else None
    spec = graph_spec(batch, stats_mode)
    handle = _handle(dev)
    policy = _engine_policy()
    key = (spec, dev, handle.backend_handle, policy)
    with _LOCK:
        plan = _CACHE.get(key)
        if plan is not None:
            return plan
        if key in _FAILED:
            return _FAILED[key]
        if torch.cuda.is_current_stream_capturing():
            return (
                "no cuDNN graph is built for this shape bucket yet, and cuDNN cannot build one during CUDA "
                "stream capture: run the call once with the same shapes before capturing "
                f"({spec.describe()})"
            )
        try:
            plan = _build(spec, dev, handle, policy)
        except Exception as exc:  # cudnnGraphNotSupportedError, ValueError, RuntimeError, ...
            if spec.stats_mode == "ragged":
                # Maybe only the ragged Stats layout is refused (cuDNN < 9.6): retry with scratch.
                alt = replace(spec, stats_mode="scratch")
                try:
                    plan = _build(alt, dev, handle, policy)
                except Exception:
                    plan = None
                if plan is not None:
                    _RAGGED_STATS_REFUSED.add(dev)
                    alt_key = (alt, dev, handle.backend_handle, policy)
                    plan.key = alt_key
                    _CACHE[alt_key] = plan
                    _BUILDS += 1
                    return plan
            reason = _refusal(spec, dev, exc)
            _FAILED[key] = reason
            return reason
        plan.key = key
        _CACHE[key] = plan
        _BUILDS += 1
        return plan


# --------------------------------------------------------------------------------------------
# Backend protocol
# --------------------------------------------------------------------------------------------


def unsupported_reason(batch: PrefillBatch) -> str | None:
    reason = static_unsupported_reason(batch)
    if reason is not None or batch.device.type != "cuda":
        return reason
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


def _region(scratch: Tensor, base: int, offset: int, nbytes: int, dtype: torch.dtype) -> Tensor:
    return scratch[base + offset : base + offset + nbytes].view(dtype)


@dataclass
class _Views:
    """What :func:`_write_metadata` derived for one call (all device tensors / addresses)."""

    base: int  # alignment pad at the start of batch.scratch
    ints: Tensor  # (7, row) int32: seq_q, seq_kv, off_q, off_o, off_k, off_v, off_stats
    table: Tensor | None  # (Bb, table_width) int32
    floats: Tensor  # (8,) float32
    stats: Tensor | None  # (Bb*Hq*Sq,) float32 dense Stats (stats_mode "scratch")
    skip: Tensor  # (B,) int64: leading rows of each sequence with no visible key
    lq_eff: Tensor  # (B,) int64: rows handed to cuDNN


def _write_metadata(batch: PrefillBatch, plan: _Plan) -> _Views:
    """Fill this call's lengths, ragged offsets (elements), page table and constants into
    ``batch.scratch``. Device ops only: no host sync, nothing but torch temporaries allocated."""
    spec, lay, scratch = plan.spec, plan.layout, batch.scratch
    base = (-scratch.data_ptr()) % ALIGN
    bsz, bb, row, hq = batch.batch_size, spec.batch, lay.row, spec.num_qo_heads
    meta = batch.meta.to(torch.int64)
    lq, lkv, q_start, o_start, k_start, v_start, l_start = meta.unbind(0)
    zeros = torch.zeros_like(lq)
    if _DEBUG_NATIVE_EMPTY_ROWS:
        lq_eff = lq
    elif spec.causal:
        lq_eff = torch.minimum(lq, lkv)
    else:
        lq_eff = torch.where(lkv > 0, lq, zeros)
    skip = lq - lq_eff
    lkv_eff = torch.where(lq_eff > 0, lkv, zeros)
    pad = bb + 1 - bsz

    def ext(x: Tensor, fill: int) -> Tensor:
        return torch.nn.functional.pad(x, (0, pad), value=fill)

    def offsets(start: Tensor, rows: int, stride: int) -> Tensor:
        end = rows * stride
        return ext(start.clamp(0, rows) * stride, end)

    fields = [
        ext(lq_eff, 0),
        ext(lkv_eff, 0),
        offsets(q_start + skip, batch.q.shape[0], spec.q_strides[0]),
        offsets(o_start + skip, batch.out.shape[0], spec.o_strides[0]),
    ]
    if spec.paged:
        fields += [ext(zeros, 0), ext(zeros, 0)]
    else:
        fields.append(offsets(k_start, batch.k.shape[0], spec.k_strides[0]))
        fields.append(offsets(v_start, batch.v.shape[0], spec.v_strides[0]))
    if spec.stats_mode == "ragged":
        lse_n = batch.lse.numel()
        fields.append(ext((l_start + skip * hq).clamp(0, lse_n), lse_n))
    else:
        fields.append(ext(zeros, 0))
    ints = _region(scratch, base, lay.ints, 7 * row * 4, torch.int32).view(7, row)
    ints[:, : bb + 1].copy_(torch.stack(fields))

    table = None
    if spec.paged:
        w = spec.table_width
        table = _region(scratch, base, lay.table, bb * w * 4, torch.int32).view(bb, w)
        cols = min(w, batch.block_tables.shape[1])
        if cols < w or bsz < bb:
            table.zero_()  # padding entries: page 0, never read for keys past kv_len
        if cols:
            table[:bsz, :cols].copy_(batch.block_tables[:, :cols].clamp(0, spec.num_pages - 1))

    floats = _region(scratch, base, lay.floats, 8 * 4, torch.float32)
    if spec.fp8:
        s_scale = 256.0  # P in [0, 1] is stored as fp8 P * 256 for the P.V product
        floats[0:1].fill_(1.0 / s_scale)  # descale_s (fill_ with a Python scalar: capture-safe)
        floats[1:2].fill_(s_scale)  # scale_s
        floats[2:3].fill_(1.0)  # scale_o
    stats = None
    if spec.stats_mode == "scratch":
        stats = _region(scratch, base, lay.stats, bb * hq * spec.max_q * 4, torch.float32)
    return _Views(base, ints, table, floats, stats, skip, lq_eff)


def _execute_cudnn(plan: _Plan, batch: PrefillBatch, views: _Views) -> None:
    """Bind every operand by address and run the built cuDNN plan on torch's current stream."""
    spec, lay, tn = plan.spec, plan.layout, plan.tensors
    origin = batch.scratch.data_ptr() + views.base
    row4 = lay.row * 4
    pack: dict[Any, int] = {}

    def bind(name: str, ptr: int) -> None:
        pack[tn[name]] = ptr

    bind("q", batch.q.data_ptr())
    bind("k", batch.k.data_ptr())
    bind("v", batch.v.data_ptr())
    bind("o", batch.out.data_ptr())
    bind("seq_q", origin + lay.ints)
    bind("seq_kv", origin + lay.ints + row4)
    bind("off_q", origin + lay.ints + 2 * row4)
    bind("off_o", origin + lay.ints + 3 * row4)
    if spec.paged:
        bind("table_k", origin + lay.table)
        bind("table_v", origin + lay.table)
    else:
        bind("off_k", origin + lay.ints + 4 * row4)
        bind("off_v", origin + lay.ints + 5 * row4)
    if spec.stats_mode == "ragged":
        bind("stats", batch.lse.data_ptr())
        bind("off_stats", origin + lay.ints + 6 * row4)
    elif spec.stats_mode == "scratch":
        bind("stats", origin + lay.stats)
    if spec.fp8:
        for name, src in (
            ("descale_q", batch.q_scale),
            ("descale_k", batch.k_scale),
            ("descale_v", batch.v_scale),
        ):
            bind(name, src.data_ptr())
        for i, name in enumerate(("descale_s", "scale_s", "scale_o", "amax_s", "amax_o")):
            bind(name, origin + lay.floats + 4 * i)
    cudnn = _cudnn()
    dev = batch.device
    handle = _handle(_device_index(dev))
    cudnn.set_stream(handle, torch.cuda.current_stream(dev).cuda_stream)
    plan.graph.execute(pack, workspace=origin + lay.workspace, handle=handle)


_EXECUTE = _execute_cudnn  # replaced by a pure-torch emulation in the CPU tests


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
    views = _write_metadata(batch, plan)
    _EXECUTE(plan, batch, views)
    if plan.spec.stats_mode == "scratch":
        _copy_scratch_stats(batch, plan.spec, views)
    if not _DEBUG_NATIVE_EMPTY_ROWS:
        _fill_empty_rows(batch, plan.spec, views.skip)


def _lse_rows(batch: PrefillBatch) -> Tensor | None:
    """The flat lse buffer as (rows, Hq); every covered entry lies in it (lse_start % Hq == 0)."""
    if batch.lse is None:
        return None
    hq = batch.num_qo_heads
    n = batch.lse.numel() // hq
    return batch.lse[: n * hq].view(n, hq)


def _row_mask(n_rows: int, starts: Tensor, counts: Tensor, grid: int) -> Tensor:
    """Bool (n_rows,): True on rows ``starts[b] + i`` for ``0 <= i < counts[b]`` (device ops only)."""
    i = torch.arange(grid, device=starts.device)
    rows = starts[:, None] + i[None, :]
    ok = (i[None, :] < counts[:, None]) & (rows >= 0) & (rows < n_rows)
    idx = torch.where(ok, rows, torch.full_like(rows, n_rows)).reshape(-1)
    mask = torch.zeros(n_rows + 1, dtype=torch.uint8, device=starts.device)
    mask.index_fill_(0, idx, 1)
    return mask[:n_rows].bool()


def _fill_empty_rows(batch: PrefillBatch, spec: GraphSpec, skip: Tensor) -> None:
    """out = 0 and lse = -inf on the rows no key is visible to (the first ``skip[b]`` rows)."""
    lse_rows = _lse_rows(batch)
    hq = batch.num_qo_heads
    h = batch.host
    if h is not None:  # lengths known on the host: touch only the rows that need it
        for b in range(batch.batch_size):
            lq, lkv = h.lens_q[b], h.lens_kv[b]
            n = lq if lkv == 0 else (max(0, lq - lkv) if spec.causal else 0)
            if n <= 0:
                continue
            batch.out[h.o_start[b] : h.o_start[b] + n].zero_()
            if lse_rows is not None:
                r0 = h.lse_start[b] // hq
                lse_rows[r0 : r0 + n].fill_(-math.inf)
        return
    o_start = batch.meta_row("o_start").to(torch.int64)
    mask = _row_mask(batch.out.shape[0], o_start, skip, spec.max_q)
    batch.out.masked_fill_(mask[:, None, None], 0)
    if lse_rows is not None:
        l_row = torch.div(batch.meta_row("lse_start").to(torch.int64), hq, rounding_mode="floor")
        lse_rows.masked_fill_(_row_mask(lse_rows.shape[0], l_row, skip, spec.max_q)[:, None], -math.inf)


def _copy_scratch_stats(batch: PrefillBatch, spec: GraphSpec, views: _Views) -> None:
    """stats_mode "scratch": copy cuDNN's dense Stats (Bb, Hq, Sq) into lse, covered rows only."""
    lse_rows = _lse_rows(batch)
    hq, sq, bsz = spec.num_qo_heads, spec.max_q, batch.batch_size
    src = views.stats.view(spec.batch, hq, sq).transpose(1, 2).reshape(spec.batch * sq, hq)
    dev = src.device
    i = torch.arange(sq, device=dev)
    l_row = torch.div(batch.meta_row("lse_start").to(torch.int64), hq, rounding_mode="floor")
    dst = l_row[:, None] + views.skip[:, None] + i[None, :]  # (B, Sq) destination lse rows
    n = lse_rows.shape[0]
    ok = (i[None, :] < views.lq_eff[:, None]) & (dst >= 0) & (dst < n)
    src_row = (torch.arange(bsz, device=dev) * sq)[:, None] + i[None, :]
    owner = torch.full((n + 1,), -1, dtype=torch.int64, device=dev)
    owner.scatter_(0, torch.where(ok, dst, torch.full_like(dst, n)).reshape(-1), src_row.reshape(-1))
    owner = owner[:n]
    gathered = src.index_select(0, owner.clamp(min=0))
    lse_rows.copy_(torch.where((owner >= 0)[:, None], gathered, lse_rows))
