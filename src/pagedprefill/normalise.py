"""Every argument check of the library, and the one batch description they produce.

Where each argument is checked:

* :func:`layer_tensors` — ``q``, ``k_cache``, ``v_cache`` (ranks, dtypes, devices, strides, heads,
  head dims, pages), ``out``, ``lse``, the fp8 scales, ``sinks``, ``o_data_type``;
* :func:`sequences` — ``actual_seq_lens_q/_kv``, ``max_token_per_sequence``, ``max_sequence_kv``,
  ``block_tables`` (or FlashInfer's ``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len``),
  ``batch_offsets_q/_o/_k/_v/_stats`` and their units, ``scale``, ``causal``, ``window_left``,
  ``logits_soft_cap``, ``return_lse``, ``is_cuda_graph_compatible``; it computes the host
  metadata (:class:`~pagedprefill.batch.HostMetadata`) when every length and offset is on the CPU;
* :func:`batch_for` — what needs both: row counts of q / out / ragged K/V / lse against the
  offsets, page ids of a CPU table, and the workspace;
* :func:`check_spans` — aliasing between the call's buffers, at every run (addresses change).

Nothing here launches a kernel or reads a device tensor back: lengths and offsets on the device
are never validated (that would need a host sync); the metadata computed from them on the device
is clamped instead (:mod:`pagedprefill.workspace`).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

try:  # numpy is optional (torch does not require it): checks of CPU tables run faster with it
    import numpy as np
except ImportError:  # pragma: no cover - depends on the environment
    np = None

from pagedprefill.batch import (
    FP8_DTYPES,
    INT32_MAX,
    DeviceVectors,
    HostMetadata,
    Layout,
    PrefillBatch,
    Sequences,
    fail,
    per_token,
)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LENGTH_DTYPES = (torch.int32, torch.int64)
OFFSET_NAMES = ("q", "o", "k", "v", "stats")
# |scale| beyond this would overflow float32 logits for 16-bit inputs (|q.k| <= 65504^2 * 256)
MAX_SCALE = 2.0**32
MIN_SCALE = 2.0**-126  # (float32's smallest normal number: Triton types a float below it as float64)


# --------------------------------------------------------------------------------------------
# Small checks
# --------------------------------------------------------------------------------------------


def describe(t: object) -> str:
    if isinstance(t, (tuple, list)) and any(isinstance(x, Tensor) for x in t):  # (shapes, never values)
        return f"{type(t).__name__} of {len(t)}: " + "; ".join(describe(x) for x in t[:4])
    if not isinstance(t, Tensor):
        return f"{type(t).__name__} {t!r:.60}"
    return f"tensor of shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(name: str, t: object, ndim: int, device: torch.device | None = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise fail(name, f"a torch.Tensor of rank {ndim}", type(t).__name__)
    if t.dim() != ndim:
        raise fail(name, f"rank {ndim}", f"rank {t.dim()} ({describe(t)})")
    if device is not None and not same_device(t.device, device):
        raise fail(name, f"a tensor on {device} (q's device)", f"one on {t.device}")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise fail(name, "unit stride on the last dimension", f"strides {tuple(t.stride())}")
    return t


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib


def csr_kv_lens(indptr: Tensor, last: Tensor, page_size: int) -> Tensor:
    """(B,) KV lengths of CSR pages, on their device: ``(pages - 1) * page_size + last`` (0 for a
    sequence of no page); the vectors are not checked here."""
    n = (indptr[1:] - indptr[:-1]).clamp(min=0)
    return torch.where(n > 0, (n - 1) * page_size + last, 0)


def vector(name: str, t: object, length: int | None, device: torch.device, graph_mode: bool) -> Tensor:
    """A (n,) or (n,1,1,1) int32/int64 tensor on the CPU or on q's device, flattened to (n,)."""
    if not isinstance(t, Tensor):
        raise fail(name, "an int32/int64 torch.Tensor of shape (n,) or (n,1,1,1)", type(t).__name__)
    if t.dtype not in LENGTH_DTYPES:
        raise fail(name, "dtype int32 or int64", t.dtype)
    if not (t.dim() == 1 or (t.dim() == 4 and tuple(t.shape[1:]) == (1, 1, 1))):
        raise fail(name, "shape (n,) or (n, 1, 1, 1)", f"shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise fail(name, f"{length} entries", f"{t.shape[0]} (shape {tuple(t.shape)})")
    if t.device.type != "cpu" and not same_device(t.device, device):
        raise fail(name, f"a tensor on the CPU or on q's device {device}", f"one on {t.device}")
    if graph_mode and device.type == "cuda" and t.device.type == "cpu":
        raise fail(
            name,
            "a tensor on q's device when is_cuda_graph_compatible=True (a CPU tensor would be baked "
            "into the captured graph)",
            "one on the CPU",
        )
    return t.reshape(-1)


def host_max(name: str, lens_name: str, lens: object) -> int:
    """The largest of host lengths ``lens`` (0 at least: a negative one is named by the lengths' own
    check), for a plan given no ``name``; the vector is checked first, so a bad one is named itself."""
    if lens is None:
        raise fail(lens_name, "a (B,) int32/int64 tensor of lengths", None)
    lens = _any_device_vector(lens_name, lens)
    if lens.device.type != "cpu":
        raise fail(name, "an int (required when the lengths are on the device: reading them would sync)", None)
    return max(int(lens.max()), 0) if lens.numel() else 0


def csr_max(indptr: object, last: object, page_size: int) -> int:
    """The largest KV length of host CSR pages (see :func:`host_max`); the vectors are checked first."""
    for name, t in (("kv_indptr", indptr), ("kv_last_page_len", last)):
        if t is None:
            raise fail(name, "a tensor (CSR pages need kv_indptr, kv_indices and kv_last_page_len)", None)
    indptr = _any_device_vector("kv_indptr", indptr)
    last = _any_device_vector("kv_last_page_len", last, indptr.shape[0] - 1)
    if indptr.device.type != "cpu" or last.device.type != "cpu":
        raise fail("max_sequence_kv", "an int (required when kv_indptr is on the device: reading it would sync)", None)
    lens = csr_kv_lens(indptr, last, page_size)
    return max(int(lens.max()), 0) if lens.numel() else 0


def _any_device_vector(name: str, t: object, length: int | None = None) -> Tensor:
    """``t`` checked as a length / offset vector (:func:`vector`) on whatever device it is on: the
    batch's device is checked later, with the rest of the batch."""
    return vector(name, t, length, t.device if isinstance(t, Tensor) else torch.device("cpu"), False)


def lengths_of(name: str, indptr: object) -> Tensor:
    """The lengths a (B+1,) token indptr gives (its differences), for a call that omits them; on the
    host, a decreasing indptr is named here (not the lengths the caller did not pass)."""
    t = _any_device_vector(name, indptr)
    if t.shape[0] < 1:
        raise fail(name, "B + 1 >= 1 token offsets (the lengths are their differences)", "an empty tensor")
    lens = t[1:] - t[:-1]
    if t.is_cpu and lens.numel() and int(lens.min()) < 0:
        raise fail(name, "non-decreasing token offsets (the lengths are their differences)", t.tolist()[:8])
    return lens


def finite(x: float) -> bool:
    """``math.isfinite`` by comparisons (NaN compares false), which torch.compile traces when it leaves
    a float argument unspecialised (``math.isfinite`` of it breaks a full graph)."""
    return -math.inf < x < math.inf


def number_scale(name: str, s: object) -> bool:
    """Whether a scale is a plain number (int or float); a non-finite one is refused by name."""
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        return False
    if not finite(s):
        raise fail(name, "a finite scale", s)
    return True


def scale_tensor(name: str, s: object, device: torch.device, graph_mode: bool) -> Tensor | None:
    """A one-element float32 scale on q's device (a float becomes one), or None."""
    if s is None:
        return None
    if number_scale(name, s):
        return torch.full((1,), float(s), dtype=torch.float32, device=device)
    if not isinstance(s, Tensor):
        raise fail(name, "a one-element float32 tensor or a float", type(s).__name__)
    if s.numel() != 1:
        raise fail(name, "a tensor of one element (shape (1,) or (1,1,1,1))", f"shape {tuple(s.shape)}")
    if s.dtype != torch.float32:
        raise fail(name, "dtype float32", s.dtype)
    if s.device.type == "cpu" and device.type != "cpu":
        if graph_mode:
            raise fail(name, "a tensor on q's device when is_cuda_graph_compatible=True", "one on the CPU")
        return s.reshape(1).to(device)
    if not same_device(s.device, device):
        raise fail(name, f"a tensor on q's device {device}", f"one on {s.device}")
    return s.reshape(1)


def int_arg(name: str, x: object, minimum: int) -> int:
    if isinstance(x, Tensor) and x.numel() == 1 and not x.dtype.is_floating_point and x.device.type == "cpu":
        x = int(x.item())
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):  # (numpy's integers too)
        raise fail(name, "a Python int", type(x).__name__)
    x = int(x)
    if x < minimum:
        raise fail(name, f"an int >= {minimum}", x)
    return x


def bool_arg(name: str, x: object) -> bool:
    if not isinstance(x, bool):
        raise fail(name, "a bool", f"{x!r} ({type(x).__name__})")
    return x


def scale_arg(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):  # (numpy's floats too)
        raise fail("scale", "a Python float (the softmax scale, e.g. 1/sqrt(head_dim))", type(scale).__name__)
    scale = float(scale)
    if not finite(scale) or abs(scale) > MAX_SCALE or 0 < abs(scale) < MIN_SCALE:
        raise fail("scale", "a finite float, 0 or with 2^-126 <= |scale| <= 2^32 (typical: 1/sqrt(head_dim))", scale)
    return float(scale)


def variant_args(window_left: object, logits_soft_cap: object) -> tuple[int, float]:
    """``window_left`` (-1: off) and ``logits_soft_cap`` (0: off), checked."""
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise fail("window_left", "an int >= -1 (-1: no sliding window)", repr(window_left))
    cap = 0.0 if logits_soft_cap is None else logits_soft_cap
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not finite(cap) or cap < 0:
        raise fail("logits_soft_cap", "a finite float >= 0 (0: no soft-capping)", repr(logits_soft_cap))
    return window_left, float(cap)


def resolve_out_dtype(q_dtype: torch.dtype, o_data_type: object, out: object) -> torch.dtype:
    """The output dtype: ``o_data_type``, else ``out``'s, else q's (bf16 for fp8 q)."""
    if o_data_type in FP8_DTYPES or (o_data_type is None and isinstance(out, Tensor) and out.dtype in FP8_DTYPES):
        # (a value FlashInfer takes, not a wrong one: no backend here writes an 8-bit O)
        what = "o_data_type" if o_data_type is not None else "out"
        got = o_data_type if o_data_type is not None else out.dtype
        raise NotImplementedError(
            f"{what}: an 8-bit output ({got}) is not implemented; use float16, bfloat16 or float32"
        )
    if o_data_type is None:
        if isinstance(out, Tensor):
            if out.dtype not in OUT_DTYPES:
                raise fail("out", "dtype float16, bfloat16 or float32", out.dtype)
            return out.dtype
        return torch.bfloat16 if q_dtype in FP8_DTYPES else q_dtype
    if o_data_type not in OUT_DTYPES:
        raise fail("o_data_type", "torch.float16, torch.bfloat16 or torch.float32", o_data_type)
    return o_data_type


def internal_overlap(t: Tensor) -> bool:
    """Whether two indices of ``t`` may address one element (a zero stride, or strides too small
    for the inner extents). Conservative: may say True for exotic non-overlapping layouts."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    reach = 0  # elements spanned by the inner dims, minus one
    for st, n in dims:
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


def byte_span(t: Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of ``t``'s elements (empty: (0, 0))."""
    if t.numel() == 0:
        return 0, 0
    lo = t.data_ptr()
    hi = lo + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) * t.element_size() + t.element_size()
    return lo, hi


def check_spans(spans: Sequence[tuple[str, int, int]], written: Sequence[str]) -> None:
    """Raise when a buffer the call writes (``written``: out, lse, workspace_buffer) shares bytes
    with any other buffer of the call, from their ``(name, first, last + 1)`` byte spans (empty
    tensors left out). By address extent: a conservative test (two interleaved but disjoint views of
    one buffer count as overlapping)."""
    for i, (a, alo, ahi) in enumerate(spans):
        for b, blo, bhi in spans[i + 1 :]:
            if (a in written or b in written) and alo < bhi and blo < ahi:
                w, o = (a, b) if a in written else (b, a)
                raise fail(
                    w,
                    f"a buffer whose memory range (first to last byte) does not meet {o}'s (the call "
                    f"writes {w}; an overlap would corrupt the result, and interleaved views of one buffer "
                    "count as meeting)",
                    f"{w}'s range meeting {o}'s",
                )


# --------------------------------------------------------------------------------------------
# The layer's tensors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerShape:
    """Heads, head dims and paging read off q / k_cache / v_cache."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int  # 0: ragged
    num_pages: int


def layer_tensors(q: object, k: object, v: object, paged: bool) -> tuple[Tensor, Tensor, Tensor, LayerShape]:
    """Check q, k_cache, v_cache and read their heads, head dims and paging."""
    q = check_tensor("q", q, 3)
    dev = q.device
    if q.dtype not in FLOAT_DTYPES + FP8_DTYPES:
        raise fail("q", "dtype float16, bfloat16, float32, float8_e4m3fn or float8_e5m2", q.dtype)
    _, hq, dqk = q.shape
    if hq == 0 or dqk == 0:
        raise fail("q", "at least one head and a head dim > 0", f"shape {tuple(q.shape)}")
    kv_rank = 4 if paged else 3
    layout = (
        "paged (num_pages, Hkv, page_size, D) because a page table is given"
        if paged
        else "ragged (total_kv_tokens, Hkv, D) because no page table is given"
    )
    for name, t in (("k_cache", k), ("v_cache", v)):
        if isinstance(t, Tensor) and t.dim() != kv_rank:
            raise fail(name, f"rank {kv_rank}: {layout}", f"rank {t.dim()} ({describe(t)})")
    k = check_tensor("k_cache", k, kv_rank, dev)
    v = check_tensor("v_cache", v, kv_rank, dev)
    hkv = k.shape[1]
    if v.shape[1] != hkv:
        raise fail("v_cache", f"{hkv} KV heads (as k_cache, dim 1)", f"{v.shape[1]} ({describe(v)})")
    if hkv == 0 or hq % hkv != 0:
        raise fail(
            "q", f"a number of query heads divisible by the {hkv} KV heads of k_cache (GQA/MQA)", f"{hq} query heads"
        )
    if k.shape[-1] != dqk:
        raise fail("k_cache", f"head dim {dqk} (q's last dim)", f"{k.shape[-1]} ({describe(k)})")
    dvo = v.shape[-1]
    if dvo == 0:
        raise fail("v_cache", "a head dim > 0", f"shape {tuple(v.shape)}")
    page_size = num_pages = 0
    if paged:
        if v.shape[0] != k.shape[0] or v.shape[2] != k.shape[2]:
            raise fail(
                "v_cache",
                f"(num_pages, page_size) = ({k.shape[0]}, {k.shape[2]}) as k_cache",
                f"({v.shape[0]}, {v.shape[2]})",
            )
        page_size, num_pages = k.shape[2], k.shape[0]
        if page_size == 0:
            raise fail("k_cache", "page_size >= 1 (dim 2)", f"shape {tuple(k.shape)}")
        if num_pages == 0:  # kernels clamp page ids to [0, num_pages): there must be one
            raise fail("k_cache", "at least one page (dim 0)", f"shape {tuple(k.shape)}")
    if k.dtype != v.dtype:
        raise fail("v_cache", f"dtype {k.dtype} (as k_cache)", v.dtype)
    if q.dtype in FP8_DTYPES and k.dtype not in FP8_DTYPES:
        raise fail("k_cache", "an fp8 cache when q is fp8", k.dtype)
    if k.dtype not in FP8_DTYPES and k.dtype != q.dtype:
        raise fail("k_cache", f"dtype {q.dtype} (as q) or an fp8 dtype", k.dtype)
    return q, k, v, LayerShape(hq, hkv, dqk, dvo, page_size, num_pages)


def scales(q_dtype, kv_dtype, q_scale, k_scale, v_scale, device, graph_mode) -> tuple:
    """The three scales as one-element float32 device tensors (None: 1.0); fp8 tensors need theirs."""
    out = tuple(
        scale_tensor(n, s, device, graph_mode)
        for n, s in zip(("q_scale", "k_scale", "v_scale"), (q_scale, k_scale, v_scale))
    )
    for name, dt, s in (("q_scale", q_dtype, out[0]), ("k_scale", kv_dtype, out[1]), ("v_scale", kv_dtype, out[2])):
        if dt in FP8_DTYPES and s is None:
            raise fail(name, f"a float32 scale tensor because {name[0]} is {dt}", None)
    return out


def sinks_arg(sinks: object, hq: int, device: torch.device) -> None:
    """``sinks``: None, or a float32 (Hq,) tensor on q's device (any strides: a run copies a strided one)."""
    if sinks is None:
        return
    if not isinstance(sinks, Tensor):
        raise fail("sinks", f"a float32 tensor of shape ({hq},) (one logit per query head)", type(sinks).__name__)
    if sinks.dtype != torch.float32 or tuple(sinks.shape) != (hq,):
        raise fail("sinks", f"a float32 tensor of shape ({hq},) (one logit per query head)", describe(sinks))
    if not same_device(sinks.device, device):
        raise fail("sinks", f"a tensor on q's device {device}", f"one on {sinks.device}")


# --------------------------------------------------------------------------------------------
# The batch's sequences
# --------------------------------------------------------------------------------------------


def _prefix(lens: Sequence[int]) -> list[int]:
    starts, acc = [], 0
    for n in lens:
        starts.append(acc)
        acc += n
    return starts


def sequences(
    *,
    device: torch.device,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim_qk: int,
    head_dim_vo: int,
    page_size: int,
    actual_seq_lens_q: object,
    actual_seq_lens_kv: object,
    max_token_per_sequence: object,
    max_sequence_kv: object,
    block_tables: object = None,
    kv_indptr: object = None,
    kv_indices: object = None,
    kv_last_page_len: object = None,
    offsets: dict[str, object],
    batch_offsets_units: object = "elements",
    scale: object,
    causal: object,
    return_lse: bool,
    window_left: object = -1,
    logits_soft_cap: object = 0.0,
    is_cuda_graph_compatible: object = False,
) -> tuple[Sequences, DeviceVectors | None, dict[str, Tensor | None]]:
    """Check everything a plan fixes. Returns (sequences, device vectors or None, page tensors:
    {"block_tables" | "kv_indices": tensor}); host metadata when every length/offset is on the CPU.

    ``page_size`` 0 means ragged K/V (no page table may be given); ``offsets`` maps "q", "o",
    "k", "v", "stats" to the caller's ``batch_offsets_*`` (None: absent)."""
    graph_mode = bool_arg("is_cuda_graph_compatible", is_cuda_graph_compatible)
    causal = bool_arg("causal", causal)
    scale = scale_arg(scale)
    window_left, soft_cap = variant_args(window_left, logits_soft_cap)
    max_q = int_arg("max_token_per_sequence", max_token_per_sequence, 0)
    max_kv = int_arg("max_sequence_kv", max_sequence_kv, 0)
    units = batch_offsets_units
    if units not in ("elements", "tokens"):
        raise fail("batch_offsets_units", '"elements" or "tokens"', repr(units))
    hq, hkv, dqk, dvo = num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo
    paged = page_size > 0
    csr = kv_indptr is not None or kv_indices is not None or kv_last_page_len is not None

    if actual_seq_lens_q is None:
        raise fail("actual_seq_lens_q", "a (B,) int tensor of query lengths", None)
    lens_q = vector("actual_seq_lens_q", actual_seq_lens_q, None, device, graph_mode)
    bsz = lens_q.shape[0]
    pages: dict[str, Tensor | None] = {}
    lens_kv = indptr = last = None
    if csr:
        if block_tables is not None:
            raise fail("block_tables", "None when kv_indptr / kv_indices give the pages (CSR)", "a block table too")
        if actual_seq_lens_kv is not None:
            raise fail(
                "actual_seq_lens_kv",
                "None with CSR pages (kv lengths come from kv_indptr and kv_last_page_len)",
                "a tensor",
            )
        for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
            if t is None:
                raise fail(name, "a tensor (CSR pages need kv_indptr, kv_indices and kv_last_page_len)", None)
        indptr = vector("kv_indptr", kv_indptr, bsz + 1, device, graph_mode)
        last = vector("kv_last_page_len", kv_last_page_len, bsz, device, graph_mode)
        pages["kv_indices"] = vector("kv_indices", kv_indices, None, device, graph_mode)
        table_width = 0
        table_stride = 0
        pages_kind = "csr"
    else:
        if actual_seq_lens_kv is None:
            raise fail("actual_seq_lens_kv", "a (B,) int tensor of KV lengths", None)
        lens_kv = vector("actual_seq_lens_kv", actual_seq_lens_kv, bsz, device, graph_mode)
        if paged:
            if block_tables is None:
                raise fail("block_tables", "a (B, max_pages) int32 block table with a paged cache", None)
            bt = check_tensor("block_tables", block_tables, 2)
            if bt.dtype not in LENGTH_DTYPES:
                raise fail("block_tables", "dtype int32 (or int64)", bt.dtype)
            if bt.shape[0] != bsz:
                raise fail("block_tables", f"{bsz} rows (one per sequence)", f"shape {tuple(bt.shape)}")
            if bt.device.type == "cpu" and device.type != "cpu":
                if graph_mode:
                    raise fail(
                        "block_tables", "a tensor on q's device when is_cuda_graph_compatible=True", "one on the CPU"
                    )
            elif not same_device(bt.device, device):
                raise fail("block_tables", f"a tensor on q's device {device}", f"one on {bt.device}")
            pages["block_tables"] = bt
            table_width = bt.shape[1]
            # the row stride of the table the kernels read: the caller's int32 device table itself,
            # or the contiguous int32 copy made at every run of any other table
            direct = bt.dtype == torch.int32 and bt.device.type == device.type
            table_stride = bt.stride(0) if direct and bsz > 1 else table_width
            pages_kind = "table"
        else:
            if block_tables is not None:
                raise fail("block_tables", "None with a ragged cache (rank-3 k_cache / v_cache)", "a block table")
            table_width = table_stride = 0
            pages_kind = "none"

    offs: dict[str, Tensor] = {}
    for name in OFFSET_NAMES:
        t = offsets.get(name)
        if t is None:
            continue
        arg = f"batch_offsets_{name}"
        if paged and name in ("k", "v"):
            raise fail(arg, "None with a paged cache (paged K/V rows come from the page table)", "a tensor")
        if name == "stats" and not return_lse:
            raise fail(arg, "None when return_lse=False (it places LSE rows)", "a tensor")
        offs[name] = vector(arg, t, bsz + 1, device, graph_mode)
    lse_mode = ("packed" if "stats" in offs else "padded") if return_lse else "none"

    vecs = [lens_q, lens_kv, indptr, last, *offs.values()]
    on_host = all(t is None or t.device.type == "cpu" for t in vecs)
    if on_host:
        host = _host_metadata(
            bsz,
            lens_q,
            lens_kv,
            indptr,
            last,
            offs,
            units,
            max_q,
            max_kv,
            page_size,
            table_width,
            pages_kind,
            lse_mode,
            per_token(hq, hkv, dqk, dvo),
            hq,
            table_stride,
        )
        if pages_kind == "csr" and host.bt_start and indptr[-1] > pages["kv_indices"].numel():
            raise fail(
                "kv_indptr",
                f"a last entry <= {pages['kv_indices'].numel()} (the page ids in kv_indices)",
                int(indptr[-1]),
            )
        work_q = max(host.lens_q, default=0)
        work_kv = max(host.lens_kv, default=0)
        dev_vecs = None
    else:
        host = None
        work_q = max_q
        work_kv = min(max_kv, table_width * page_size) if pages_kind == "table" else max_kv
        dev = {
            k: (t.to(device) if t is not None and t.device.type == "cpu" else t)
            for k, t in (("lens_q", lens_q), ("lens_kv", lens_kv), ("indptr", indptr), ("last", last))
        }
        dev_offs = {k: (t.to(device) if t.device.type == "cpu" else t) for k, t in offs.items()}
        dev_vecs = DeviceVectors(dev["lens_q"], dev["lens_kv"], dev_offs, dev["indptr"], dev["last"], units)
        placed_apart = tuple(n for n in ("o", "stats") if n in offs and not _rows_of_q(offs, n, units, dqk, dvo))
    seq = Sequences(
        batch_size=bsz,
        max_q=max_q,
        max_kv=max_kv,
        work_q=work_q,
        work_kv=work_kv,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim_qk=dqk,
        head_dim_vo=dvo,
        page_size=page_size,
        pages=pages_kind,
        table_width=table_width,
        causal=causal,
        scale=scale,
        window_left=window_left,
        logits_soft_cap=soft_cap,
        lse=lse_mode,
        graph_mode=graph_mode,
        host=host,
        table_stride=table_stride,
        placed_apart=() if host is not None else placed_apart,
    )
    if lse_mode == "padded" and bsz * max_q * hq > INT32_MAX:
        raise fail(
            "max_token_per_sequence",
            f"B x max_token_per_sequence x Hq <= {INT32_MAX} (the padded LSE layout's size)",
            f"{bsz} x {max_q} x {hq}",
        )
    return seq, dev_vecs, pages


def _disjoint(arg: str, starts: list[int], lens: list[int], what: str) -> None:
    """Sequences' row ranges [start, start + len) of an output that no two share (two sequences
    writing one row would leave whichever wrote last)."""
    spans = sorted((s, s + n, b) for b, (s, n) in enumerate(zip(starts, lens)) if n)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise fail(
                arg,
                f"offsets whose sequences' {what} do not overlap",
                f"sequences {min(a, b)} and {max(a, b)} both at row {start}",
            )


def _host_metadata(
    bsz,
    lens_q_t,
    lens_kv_t,
    indptr_t,
    last_t,
    offs,
    units,
    max_q,
    max_kv,
    page_size,
    width,
    pages_kind,
    lse_mode,
    unit,
    hq,
    table_stride,
) -> HostMetadata:
    """The metadata table from host lengths and offsets, every value validated."""
    lens_q = lens_q_t.tolist()
    if pages_kind == "csr":
        indptr, last = indptr_t.tolist(), last_t.tolist()
        lens_kv = []
        for b in range(bsz):
            n = indptr[b + 1] - indptr[b]
            if indptr[b] < 0 or n < 0:
                raise fail(
                    "kv_indptr", "non-negative, non-decreasing page offsets", f"{indptr[b]}, {indptr[b + 1]} at {b}"
                )
            if n and not 1 <= last[b] <= page_size:
                raise fail("kv_last_page_len", f"values in [1, page_size = {page_size}]", f"{last[b]} at index {b}")
            lens_kv.append((n - 1) * page_size + last[b] if n else 0)
        bt_start = indptr[:bsz]
    else:
        lens_kv = lens_kv_t.tolist()
        bt_start = None
    for name, lens, limit, limit_name in (
        ("actual_seq_lens_q", lens_q, max_q, "max_token_per_sequence"),
        (
            "kv_indptr / kv_last_page_len" if pages_kind == "csr" else "actual_seq_lens_kv",
            lens_kv,
            max_kv,
            "max_sequence_kv",
        ),
    ):
        for b, n in enumerate(lens):
            if n < 0:
                raise fail(name, "non-negative lengths", f"{n} at index {b}")
            if n > limit:
                raise fail(name, f"lengths <= {limit_name} = {limit}", f"{n} at index {b}")
            if n > INT32_MAX:  # (the metadata table is int32)
                raise fail(name, f"lengths <= {INT32_MAX} (int32 metadata)", f"{n} at index {b}")

    def starts(name: str) -> list[int] | None:
        t = offs.get(name)
        if t is None:
            return None
        vals = t.tolist()
        if units == "elements":
            u = unit[name]
            for b, x in enumerate(vals):
                if x % u:
                    raise fail(
                        f"batch_offsets_{name}",
                        f"element offsets that are whole tokens (multiples of {u} = H x D of that tensor)",
                        f"{x} at index {b}",
                    )
            vals = [x // u for x in vals]
        for b, x in enumerate(vals):
            if x < 0:
                raise fail(f"batch_offsets_{name}", "non-negative offsets", f"{x} at index {b}")
        return vals[:bsz]

    q_start = starts("q") or _prefix(lens_q)
    o_start = starts("o") or q_start
    if "o" in offs or "q" in offs:
        _disjoint("batch_offsets_o" if "o" in offs else "batch_offsets_q", o_start, lens_q, "output rows")
    if page_size > 0:
        k_start = v_start = [0] * bsz
    else:
        k_start = starts("k") or _prefix(lens_kv)
        v_start = starts("v") or k_start
    if lse_mode == "packed":
        stats_start = starts("stats")
        _disjoint("batch_offsets_stats", stats_start, lens_q, "LSE rows")
        lse_start = [s * hq for s in stats_start]
    elif lse_mode == "padded":
        lse_start = [b * max_q * hq for b in range(bsz)]
    else:
        lse_start = [0] * bsz
    if pages_kind == "table":
        for b in range(bsz):
            need = -(-lens_kv[b] // page_size)
            if need > width:
                raise fail(
                    "actual_seq_lens_kv",
                    f"at most block_tables width x page_size = {width} x {page_size} = {width * page_size} keys",
                    f"{lens_kv[b]} at index {b}",
                )
        bt_start = [b * table_stride for b in range(bsz)]
    elif bt_start is None:
        bt_start = [0] * bsz
    for name, vals in (("q", q_start), ("o", o_start), ("k", k_start), ("v", v_start), ("stats", lse_start)):
        if vals and max(vals) > INT32_MAX:
            raise fail(f"batch_offsets_{name}", f"offsets below {INT32_MAX}", max(vals))
    return HostMetadata(*(tuple(x) for x in (lens_q, lens_kv, q_start, o_start, k_start, v_start, lse_start, bt_start)))


# --------------------------------------------------------------------------------------------
# Sequences x layer tensors
# --------------------------------------------------------------------------------------------


def batch_for(
    seq: Sequences,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor | None,
    shape: LayerShape,
    scaled: tuple[bool, bool, bool],
    has_sinks: bool,
    out_allocated: bool,
) -> PrefillBatch:
    """The batch of one layout: the layer's tensors checked against the plan (heads, dims, paging,
    and, with host metadata, every sequence's rows)."""
    for name, have, want in (
        ("q", shape.num_qo_heads, seq.num_qo_heads),
        ("k_cache", shape.num_kv_heads, seq.num_kv_heads),
    ):
        if have != want:
            raise fail(name, f"{want} heads (as planned)", have)
    if shape.head_dim_qk != seq.head_dim_qk or shape.head_dim_vo != seq.head_dim_vo:
        raise fail(
            "q / v_cache",
            f"head dims Dqk={seq.head_dim_qk}, Dvo={seq.head_dim_vo} (as planned)",
            f"{shape.head_dim_qk}, {shape.head_dim_vo}",
        )
    if shape.page_size != seq.page_size:
        raise fail("k_cache", f"page size {seq.page_size} (as planned; 0 = ragged)", shape.page_size)
    hq, dvo = seq.num_qo_heads, seq.head_dim_vo
    if tuple(out.shape[1:]) != (hq, dvo):
        raise fail("out", f"shape (rows, {hq}, {dvo}) = (rows, Hq, Dvo)", f"shape {tuple(out.shape)}")
    if internal_overlap(out):
        raise fail(
            "out",
            "a tensor without overlapping elements (no zero or overlapping strides)",
            f"strides {tuple(out.stride())}",
        )
    lse_numel = 0
    if lse is not None:
        lse_numel = lse.numel()
        if lse_numel > INT32_MAX:
            raise fail("lse", f"at most {INT32_MAX} elements", lse_numel)
    h = seq.host
    if h is not None:
        _check_rows(seq, h, q, k, v, out, lse_numel if lse is not None else None, out_allocated)
    # (a window of at least every key hides none: off, so that no kernel's int32 bound arithmetic
    # sees a huge window_left)
    window_left = -1 if seq.window_left >= seq.work_kv else seq.window_left
    return PrefillBatch(
        **{f.name: getattr(seq, f.name) for f in fields(seq)}
        | {"lse": seq.lse if lse is not None else "none", "window_left": window_left},
        num_pages=shape.num_pages,
        q=Layout.of(q),
        k=Layout.of(k),
        v=Layout.of(v),
        out=Layout.of(out),
        lse_numel=lse_numel,
        q_scaled=scaled[0],
        k_scaled=scaled[1],
        v_scaled=scaled[2],
        has_sinks=has_sinks,
        aligned=tuple(t.data_ptr() % 16 == 0 or t.numel() == 0 for t in (q, k, v, out)),
        device=q.device,
    )


def _check_rows(seq, h: HostMetadata, q, k, v, out, lse_numel, out_allocated) -> None:
    hq = seq.num_qo_heads

    def check(arg: str, what: str, start, lens, rows: int) -> None:
        for b in range(seq.batch_size):
            if lens[b] and start[b] + lens[b] > rows:
                raise fail(
                    arg,
                    f"{what} with at least {start[b] + lens[b]} rows for sequence {b} "
                    f"(starts at row {start[b]}, length {lens[b]})",
                    f"{rows} rows",
                )

    check("q", "a q", h.q_start, h.lens_q, q.shape[0])
    check("batch_offsets_o" if out_allocated else "out", "an out", h.o_start, h.lens_q, out.shape[0])
    if not seq.page_size:
        check("k_cache", "a ragged k_cache", h.k_start, h.lens_kv, k.shape[0])
        check("v_cache", "a ragged v_cache", h.v_start, h.lens_kv, v.shape[0])
    if lse_numel is not None:
        for b in range(seq.batch_size):
            if h.lens_q[b] and h.lse_start[b] + h.lens_q[b] * hq > lse_numel:
                raise fail(
                    "lse",
                    f"a buffer of at least {h.lse_start[b] + h.lens_q[b] * hq} elements for sequence {b}",
                    f"{lse_numel} elements",
                )


def _rows_of_q(offs: dict, name: str, units: str, dqk: int, dvo: int) -> bool:
    """Whether offsets ``name`` place each sequence's rows where q's offsets place its q rows: the
    same vector as q's, read in the same tokens (o: tokens, or elements with Dvo = Dqk; stats:
    tokens)."""
    t, q = offs.get(name), offs.get("q")
    if q is None or not (t is q or (t.device == q.device and t.data_ptr() == q.data_ptr() and t.dtype == q.dtype)):
        return False
    if t.shape != q.shape or t.stride() != q.stride():
        return False
    return units == "tokens" or (name == "o" and dqk == dvo)


def alloc_rows(seq: Sequences, rows_q: int, which: str) -> int:
    """Rows of an out ("o") / packed lse ("stats") buffer the function allocates itself: q's rows,
    or more where host offsets place sequences further. Device offsets of its own (not q's) could
    place rows past q's, which the device metadata would clamp away unseen: refused."""
    h = seq.host
    if h is None:
        if which in seq.placed_apart:
            arg = "out" if which == "o" else "lse"
            raise fail(
                arg,
                f"a buffer of the caller's when batch_offsets_{which} is on the device and is not q's offsets "
                f"(an allocated {arg} has q's rows; the rows device offsets place are not known without a device "
                "sync, and rows past the buffer would be dropped)",
                None,
            )
        return rows_q
    starts = h.o_start if which == "o" else [s // seq.num_qo_heads for s in h.lse_start]
    need = max([rows_q, *(s + n for s, n in zip(starts, h.lens_q) if n)])
    per_row = seq.num_qo_heads * (seq.head_dim_vo if which == "o" else 1)
    if need * per_row > INT32_MAX:
        arg = "batch_offsets_o" if which == "o" else "batch_offsets_stats"
        raise fail(
            arg,
            f"offsets that place every row within {INT32_MAX} elements when {'out' if which == 'o' else 'lse'} "
            "is allocated by the call (pass the buffer to place rows that far)",
            f"rows up to {need}",
        )
    return need


@functools.lru_cache(maxsize=64)
def _used_pages(lens_kv: tuple[int, ...], page_size: int, width: int):
    """(B, width) bool: the block-table entries sequences with these key counts use."""
    need = np.array([-(-n // page_size) for n in lens_kv], dtype=np.int64).reshape(-1, 1)
    return np.arange(width).reshape(1, -1) < need


def check_page_ids(pages: Tensor, seq: Sequences, num_pages: int) -> None:
    """Page ids of a CPU page table / index list that some sequence uses, in [0, num_pages)."""
    h = seq.host
    if h is None or pages.device.type != "cpu":
        return
    ps = seq.page_size
    if np is not None and seq.pages == "table" and pages.dtype in (torch.int32, torch.int64) and pages.dim() == 2:
        used = _used_pages(h.lens_kv, ps, pages.shape[1])  # (numpy on a small table: no per-op dispatch)
        ids = pages.numpy()[used]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
            bad = np.argwhere(used & ((pages.numpy() < 0) | (pages.numpy() >= num_pages)))[0]
            b, j = int(bad[0]), int(bad[1])
            raise fail("block_tables", f"page ids in [0, {num_pages})", f"{int(pages[b, j])} at [{b}, {j}]")
        return
    need = torch.tensor([-(-n // ps) for n in h.lens_kv], dtype=torch.int64)
    if seq.pages == "table":
        used = torch.arange(pages.shape[1]).view(1, -1) < need.view(-1, 1)
        bad = used & ((pages < 0) | (pages >= num_pages))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise fail("block_tables", f"page ids in [0, {num_pages})", f"{int(pages[b, j])} at [{b}, {j}]")
    else:
        flat = pages.reshape(-1)
        for b in range(seq.batch_size):
            lo, n = h.bt_start[b], int(need[b])
            if lo + n > flat.numel():
                raise fail("kv_indices", f"at least {lo + n} page ids (kv_indptr[{b + 1}])", f"{flat.numel()}")
            ids = flat[lo : lo + n]
            bad = (ids < 0) | (ids >= num_pages)
            if bool(bad.any()):
                j = int(bad.nonzero()[0])
                raise fail("kv_indices", f"page ids in [0, {num_pages})", f"{int(ids[j])} at {lo + j}")


def check_workspace(ws: object, device: torch.device) -> Tensor:
    """The workspace as a flat uint8 tensor on ``device``."""
    if not isinstance(ws, Tensor):
        raise fail("workspace_buffer", "a torch.Tensor byte buffer", type(ws).__name__)
    if not same_device(ws.device, device):
        raise fail("workspace_buffer", f"a buffer on q's device {device}", f"one on {ws.device}")
    if not ws.is_contiguous():
        raise fail("workspace_buffer", "a contiguous buffer", f"strides {tuple(ws.stride())}")
    if ws.numel() and ws.data_ptr() % 16:
        # (the metadata table and the split last round's partials are int32 and float32 views of it)
        raise fail("workspace_buffer", "a buffer starting at a 16-byte aligned address", f"address {ws.data_ptr():#x}")
    return ws.view(-1).view(torch.uint8) if ws.numel() else ws.view(torch.uint8)
