"""cuDNN SDPA graphs: what a built graph depends on, how it is declared, built and cached.

How a batch becomes one graph
-----------------------------
* q / out are described *ragged*: dims ``(Bb, H, Sq, D)``, strides ``(Sq*s0, s1, s0, 1)`` where
  ``s0, s1`` are the tensor's real token and head strides, plus a ragged-offset tensor holding each
  sequence's first row in elements, from the metadata table (never from ``b * max_q``).
* Paged K/V are the page containers ``(num_pages, Hkv, page_size, D)`` with their real strides (NHD,
  HND and two views of one interleaved buffer all differ and all key different graphs). cuDNN reads
  a page table of our width ``ceil(Skv_bucket / page_size)`` from the workspace, written at every
  run from the caller's pages (:mod:`.prepare`); ragged K/V are described like q.
* LSE: cuDNN's Stats, natural log, ``(Bb, Hq, Sq, 1)`` token-major with a ragged offset in elements
  (one description for the padded and the packed layouts; cuDNN >= 9.6).
* Masks: padding mask with per-sequence lengths; causal = ``diagonal_alignment=BOTTOM_RIGHT`` with
  right bound 0; a sliding window is the band's left bound (``window_left + 1`` keys).

Bucketing and the cache
-----------------------
Graphs are cached under :class:`GraphSpec` (+ device, cuDNN handle): every dtype, head
count, head dim, page size, page count, table width, stride, the LSE layout, ``scale`` (baked in),
causal, the window, fp8, and the bucketed batch size / max q length / max kv length. Buckets: batch
to a power of two; lengths to 64 * 4**k up to 4096, then powers of two. A call whose exact bucket was
never built runs on a built graph whose max_q / max_kv buckets are at most 4x larger
(:func:`covering_plan`) instead of waiting ~0.05 s for a build. A graph is never built during CUDA
stream capture.
"""

from __future__ import annotations

import array
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagedprefill.batch import INT32_MAX, PrefillBatch

MIN_BACKEND_VERSION = 90500  # paged SDPA with ragged Q/O (cuDNN 9.5.0)
RAGGED_STATS_VERSION = 90600  # token-major ragged Stats (cuDNN 9.6.0)
INSTALL_HINT = "package nvidia-cudnn-frontend is not installed: pip install nvidia-cudnn-frontend"
ALIGN = 256  # bytes; every scratch region starts at this alignment
LEN_MIN = 64  # smallest length bucket
LEN_GEOMETRIC_UNTIL = 4096  # lengths bucket by x4 up to here, then by x2
# A built graph serves a call whose (batch, max_q, max_kv) buckets are up to these many times smaller
# (1: exact bucket only). Larger batch / max_q buckets launch CTAs that find no rows (an H200 serving
# loop: covering all three by 4x cut builds from 31 to 7 per 1000 calls but cost +41% kernel time); a
# larger max_kv only widens the page table.
COVER_RATIOS = (1, 4, 4)
ROWS = 13  # int32 rows of the per-run metadata block (see prepare.R_*)


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


def _strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """The strides; a size-1 dim with stride 0 gets a never-stepped natural stride."""
    st = list(stride)
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == 1 and st[i] == 0:
            inner = st[i + 1] * shape[i + 1] if i + 1 < len(shape) else 1
            st[i] = max(inner, 1)
    return tuple(st)


@dataclass(frozen=True)
class GraphSpec:
    """Everything a built cuDNN graph depends on (the cache key, with device and handle)."""

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
    window_left: int  # -1: none
    sinks: bool
    lse: bool
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
            f"causal={self.causal} window={self.window_left} sinks={self.sinks} lse={lse} scale={self.scale:.4g} "
            f"strides q{self.q_strides} o{self.o_strides} k{self.k_strides} v{self.v_strides}"
        )


def kv_cap(batch: PrefillBatch) -> int:
    """The longest kv length a call can have: its bound, capped by the page table's reach."""
    if batch.pages == "table":
        return min(batch.work_kv, batch.table_width * batch.page_size)
    return batch.work_kv


def graph_spec(batch: PrefillBatch) -> GraphSpec:
    """The :class:`GraphSpec` of a batch (a pure function of its description)."""
    paged = batch.paged
    ps = batch.page_size
    max_kv = bucket_len(kv_cap(batch))
    k_st = _strides(batch.k.shape, batch.k.stride)
    v_st = _strides(batch.v.shape, batch.v.stride)
    if not paged:
        k_st, v_st = k_st[:2], v_st[:2]
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
        num_pages=batch.num_pages,
        table_width=-(-max_kv // ps) if paged else 0,
        q_strides=_strides(batch.q.shape, batch.q.stride)[:2],
        o_strides=_strides(batch.out.shape, batch.out.stride)[:2],
        k_strides=k_st,
        v_strides=v_st,
        scale=float(batch.scale),
        causal=bool(batch.causal),
        window_left=batch.window_left,
        sinks=batch.has_sinks,
        lse=batch.has_lse,
        lse_packed=batch.lse == "packed",
        fp8=batch.q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2),
        batch=bucket_batch(batch.batch_size),
        max_q=bucket_len(batch.work_q),
        max_kv=max_kv,
    )


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class ScratchLayout:
    """Byte offsets of this backend's regions inside the scratch (after an alignment pad)."""

    row: int  # int32 entries per metadata row (>= batch + 1, multiple of 16)
    ints: int  # ROWS int32 metadata rows (see prepare.R_*)
    table: int  # int32 (batch, table_width) page table
    floats: int  # fp8 constants + amax outputs (8 floats)
    workspace: int  # cuDNN workspace
    workspace_size: int
    total: int  # bytes needed including ALIGN slack for an unaligned scratch base


def scratch_layout(spec: GraphSpec, cudnn_workspace: int) -> ScratchLayout:
    row = _round_up(spec.batch + 1, 16)
    off = 0
    ints = off
    off = _round_up(off + ROWS * row * 4, ALIGN)
    table = off
    if spec.paged:
        off = _round_up(off + spec.batch * spec.table_width * 4, ALIGN)
    floats = off
    if spec.fp8:
        off = _round_up(off + 8 * 4, ALIGN)
    workspace = off
    off = _round_up(off + max(int(cudnn_workspace), 0), ALIGN)
    return ScratchLayout(row, ints, table, floats, workspace, int(cudnn_workspace), off + ALIGN)


def static_reason(batch: PrefillBatch) -> str | None:
    """Why cuDNN cannot serve this batch, from its description alone (no cudnn, no GPU)."""
    q, k, v, out = batch.q, batch.k, batch.v, batch.out
    if q.dtype == torch.float32:
        return "cuDNN SDPA takes float16/bfloat16 (or fp8) q/k/v, not float32; use backend='triton' or 'torch'"
    if q.dtype in (torch.float16, torch.bfloat16) and k.dtype != q.dtype:
        return (
            f"cuDNN SDPA needs q, k and v of one dtype; a {k.dtype} KV cache with {q.dtype} q is not "
            "served by cuDNN (use backend='triton')"
        )
    if batch.fp8_q and k.dtype != q.dtype:
        return f"cuDNN fp8 SDPA needs q, k and v of one fp8 dtype; got q {q.dtype}, k/v {k.dtype}"
    if batch.fp8_q and (batch.window_left >= 0 or batch.has_sinks):
        return "the cuDNN fp8 graph here has no sliding window (window_left) or sinks; use backend='triton'"
    if batch.logits_soft_cap > 0:
        return "cuDNN SDPA has no logit soft-capping (logits_soft_cap); use backend='triton'"
    if batch.pages == "csr":
        return "cuDNN reads a (B, width) page table, not FlashInfer's CSR kv_indptr / kv_indices; use backend='triton'"
    dqk, dvo = batch.head_dim_qk, batch.head_dim_vo
    mult = 16 if batch.fp8_q else 8
    if dqk % mult or dvo % mult:
        return f"cuDNN SDPA needs head dims that are multiples of {mult}; got Dqk={dqk}, Dvo={dvo}"
    if dqk > 256 or dvo > 256:
        return f"cuDNN SDPA serves head dims up to 256; got Dqk={dqk}, Dvo={dvo}"
    if dqk != dvo and (dqk, dvo) != (192, 128):
        return f"cuDNN SDPA serves Dqk == Dvo, or Dqk=192 with Dvo=128; got Dqk={dqk}, Dvo={dvo}"
    if batch.paged and (batch.page_size & (batch.page_size - 1)):
        return f"cuDNN paged attention needs a power-of-two page size; got {batch.page_size}"
    for name, lay in (("q", q), ("k_cache", k), ("v_cache", v), ("out", out)):
        if 0 in lay.shape:
            continue
        esize = lay.dtype.itemsize
        for d, (n, s) in enumerate(zip(lay.shape[:-1], _strides(lay.shape, lay.stride)[:-1])):
            if n > 1 and s == 0:
                return f"cuDNN cannot read {name} with a broadcast (stride 0) dim {d}: strides {lay.stride}"
            if n > 1 and (s * esize) % 16:
                return f"cuDNN needs 16-byte aligned strides; {name} has strides {lay.stride} ({esize}-byte elements)"
    for name, aligned in zip(("q", "k_cache", "v_cache", "out"), batch.aligned):
        if not aligned:
            return f"cuDNN needs 16-byte aligned tensors; {name} starts at an address that is not"
    spans = [("q", q), ("out", out)] + ([] if batch.paged else [("k_cache", k), ("v_cache", v)])
    for name, lay in spans:
        span = lay.shape[0] * lay.stride[0]
        if span > INT32_MAX:
            return f"{name} spans {span} elements; cuDNN ragged offsets are int32"
    if batch.pages == "table" and batch.batch_size * max(batch.table_stride, batch.table_width) > INT32_MAX:
        return f"block_tables spans more than {INT32_MAX} entries; our page-table copy indexes it in int32"
    return None


# --------------------------------------------------------------------------------------------
# cudnn import, handles
# --------------------------------------------------------------------------------------------

_CUDNN: Any = None
_CUDNN_ERROR: str | None = None
_TLS = threading.local()
LOCK = threading.RLock()
CACHE: dict[tuple, Plan] = {}  # (GraphSpec, device, handle) -> built plan
FAILED: dict[tuple, str] = {}  # same key -> why cuDNN refused it
_BUILDS = 0
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def cudnn_module() -> Any:
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
        return int(cudnn_module().backend_version())
    except Exception:
        return None


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def handle(dev: int) -> Any:
    """This thread's cuDNN handle for device ``dev`` (cuDNN handles must not cross threads)."""
    handles = getattr(_TLS, "handles", None)
    if handles is None:
        handles = _TLS.handles = {}
    h = handles.get(dev)
    if h is None:
        with torch.cuda.device(dev):
            h = cudnn_module().create_handle()
        handles[dev] = h
    return h


def current_stream(dev: int) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(dev)
    return torch.cuda.current_stream(dev).cuda_stream


def graph_builds() -> int:
    """Number of cuDNN graphs this process has built (successfully) so far."""
    return _BUILDS


# --------------------------------------------------------------------------------------------
# Graph construction
# --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """A built graph and the scratch layout it needs."""

    spec: GraphSpec
    graph: Any
    tensors: dict[str, Any]
    layout: ScratchLayout
    key: tuple = field(default=(), repr=False)
    consts: Any = field(default=None, repr=False)  # prepare.Consts, made once (before any capture)
    binding: str = "tensors"  # how operands reach graph.execute: "tensors" | "addresses"
    binding_error: str | None = None  # why "tensors" was given up, if it was
    raw: Any = None  # RawExecute after the first execute (False: not available for this graph)


# the frontend internals RawExecute relies on, as read in nvidia-cudnn-frontend 1.32 (_pygraph.py):
# the backend path of Graph._execute hands C++ an array of pointers in the ascending-uid order of
# _variant_pack_uids() through _lowered_graph._execute_with_raw_ptrs
RAW_FRONTEND = "1.32."


class RawExecute:
    """A built graph's execution through the frontend's own last step: an array of operand addresses
    in the graph's variant-pack order, handed to its C++ side. The frontend's per-call work above it
    (the tensor dict, uid lookups, the operand descriptions it re-derives each call) is skipped, since
    a plan's operands keep their declared shapes and only their addresses change.

    ``slots``: each slot's operand name, in order, or the address of an operand the graph binds itself."""

    __slots__ = ("fn", "slots", "n", "index")

    def __init__(self, fn: Any, slots: tuple, index: int):
        self.fn, self.slots, self.n, self.index = fn, slots, len(slots), index

    @classmethod
    def of(cls, plan: Plan) -> RawExecute | None:
        """The raw execution of ``plan``'s built graph, or None where this frontend, engine or graph
        does not take it (the public execute serves those)."""
        g = plan.graph
        if not getattr(cudnn_module(), "__version__", "").startswith(RAW_FRONTEND):
            return None
        try:
            if g.selected_engine is not None or not g._is_built:  # (a python engine: another path)
                return None
            order = g._variant_pack_uids()
            lowered = g._lowered_graph
            if not order or lowered is None:
                return None
            index = g._materialize_backend_plan(g._plan_index).cpp_index if g._plans else None
            name_of = {tn.get_uid(): n for n, tn in plan.tensors.items()}
            slots = []
            for uid in order:
                if uid in name_of:
                    slots.append(name_of[uid])
                elif uid in g._data_bindings:
                    data = g._data_bindings[uid]
                    slots.append(data if type(data) is int else data.data_ptr())
                else:
                    return None
            return cls(lowered._execute_with_raw_ptrs, tuple(slots), -1 if index is None else index)
        except Exception:  # (internals other than those read)
            return None

    def template(self, fixed: dict) -> tuple[array.array, tuple]:
        """``(addresses, holes)``: the address array with ``fixed``'s operands (name -> address) and the
        graph's own in place, and ``(slot, name)`` of each operand left to fill per call."""
        vals, holes = [], []
        for i, x in enumerate(self.slots):
            if type(x) is not str:
                vals.append(x)
            elif x in fixed:
                vals.append(fixed[x])
            else:
                vals.append(0)
                holes.append((i, x))
        return array.array("q", vals), tuple(holes)

    def __call__(self, addrs: array.array, workspace: int, handle: Any) -> None:
        """Run with every operand's address in ``addrs`` (slot order, as :meth:`template` gives) and the
        workspace address, on the handle's stream."""
        self.fn(addrs.buffer_info()[0], self.n, workspace, handle.backend_handle, self.index)


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
        name="pagedprefill_sdpa", io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, **graph_kwargs
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
            name="k", dim=[spec.num_pages, hkv, spec.page_size, dqk], stride=list(spec.k_strides), data_type=kv_io
        )
        v = t["v"] = g.tensor(
            name="v", dim=[spec.num_pages, hkv, spec.page_size, dvo], stride=list(spec.v_strides), data_type=kv_io
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
        if spec.causal or spec.window_left >= 0:
            kwargs["diagonal_alignment"] = cudnn.diagonal_alignment.BOTTOM_RIGHT
        if spec.causal:
            kwargs["diagonal_band_right_bound"] = 0
        if spec.window_left >= 0:
            kwargs["diagonal_band_left_bound"] = spec.window_left + 1  # a band of window_left + 1 keys
        if spec.sinks:
            t["sinks"] = g.tensor(name="sinks", dim=[1, hq, 1, 1], stride=[hq, 1, 1, 1], data_type=f32)
            kwargs["sink_token"] = t["sinks"]
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


def _build(spec: GraphSpec, dev: int, h: Any) -> Plan:
    cudnn = cudnn_module()
    with torch.cuda.device(dev):
        g, tensors = make_graph(spec, cudnn, handle=h)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        ws = int(g.get_workspace_size())
    return Plan(spec, g, tensors, scratch_layout(spec, ws))


def _refusal(spec: GraphSpec, dev: int, exc: BaseException) -> str:
    msg = " ".join(str(exc).split()) or type(exc).__name__
    if len(msg) > 600:
        msg = msg[:600] + " ..."
    if spec.fp8:
        major, minor = torch.cuda.get_device_capability(dev)
        return f"cuDNN refuses fp8 attention on this GPU (sm{major}{minor}): {msg}"
    hint = " (return_lse=False or backend='triton' may serve the call)" if spec.lse else ""
    built = f"cuDNN {backend_version()} could not build this attention graph ({spec.describe()})"
    return f"{built}: {type(exc).__name__}: {msg}{hint}"


def covering_plan(key: tuple) -> Plan | None:
    """A built plan that can serve ``key``'s spec: identical but for batch / max_q / max_kv buckets
    that are each at least the needed one and at most ``COVER_RATIOS`` times it (extra batch entries
    get length 0; longer maxima only bound the lengths). The smallest such plan, or None."""
    spec = key[0]
    best, best_cost = None, None
    for (other, *rest), plan in CACHE.items():
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


def plan_for_spec(spec: GraphSpec, dev: int, make_consts) -> Plan | str:
    """The built plan for ``spec`` on device ``dev`` (cached), or the reason it cannot be built.
    Never raises for a build refusal; never builds during CUDA stream capture."""
    global _BUILDS
    h = handle(dev)
    key = (spec, dev, h.backend_handle)
    with LOCK:
        plan = CACHE.get(key) or covering_plan(key)
        if plan is not None:
            return plan
        if key in FAILED:
            return FAILED[key]
        if spec.lse:
            ver = backend_version()
            if ver is not None and ver < RAGGED_STATS_VERSION:
                reason = (
                    f"cuDNN {ver} cannot write the LSE per sequence at ragged offsets (ragged Stats need cuDNN "
                    ">= 9.6); call with return_lse=False, use backend='triton', or upgrade cuDNN"
                )
                FAILED[key] = reason
                return reason
        if torch.cuda.is_current_stream_capturing():
            return (
                "no cuDNN graph is built for this shape bucket yet, and cuDNN cannot build one during CUDA stream "
                f"capture: run the call once with the same shapes before capturing ({spec.describe()})"
            )
        try:
            plan = _build(spec, dev, h)
        except Exception as exc:  # cudnnGraphNotSupportedError, ValueError, RuntimeError, ...
            reason = FAILED[key] = _refusal(spec, dev, exc)
            return reason
        with torch.cuda.device(dev):
            plan.consts = make_consts(spec, plan.layout, torch.device("cuda", dev))
        plan.key = key
        CACHE[key] = plan
        _BUILDS += 1
        return plan


def clear() -> None:
    """Forget every built graph and every recorded refusal (do not call this while a captured CUDA
    graph that replays one of them is still in use)."""
    with LOCK:
        CACHE.clear()
        FAILED.clear()
