"""The one description of a prefill call that every backend consumes.

:class:`PrefillBatch` says what the call is (sizes, dtypes, layouts, flags, and the per-sequence
metadata when it is known on the host); :class:`CallTensors` carries the tensors of one run.
Both are built by :mod:`pagedprefill.normalise`, never by a backend, and nothing below this module
parses a raw argument again.

The metadata table
------------------
Kernels read sequence ``b``'s rows from an int32 table ``meta`` of shape ``(len(META_FIELDS), B)``:

==========  ================================================================================
lens_q      query rows of sequence b (validated on the host, or clamped on the device)
lens_kv     keys of sequence b (likewise; clamped to the block table's reach)
q_start     first row of sequence b in ``q`` (token units)
o_start     first row of sequence b in ``out``
k_start     first row of sequence b in a ragged ``k_cache`` (0 when paged)
v_start     first row of sequence b in a ragged ``v_cache`` (0 when paged)
lse_start   element offset of sequence b's first LSE entry in the flat LSE buffer
bt_start    element offset of sequence b's first page id in the flat page list (paged)
==========  ================================================================================

Kernels trust every value of it except page ids, which they clamp to ``[0, num_pages)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

META_FIELDS = ("lens_q", "lens_kv", "q_start", "o_start", "k_start", "v_start", "lse_start", "bt_start")
INT32_MAX = 2**31 - 1
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here (no GPU, package missing, ...)."""


def visible_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    """Number of (query i, key j) pairs that attend (bottom-right aligned causal mask)."""
    if q_len <= 0 or kv_len <= 0:
        return 0
    if not causal:
        return q_len * kv_len
    # Row i sees clamp(kv_len - q_len + i + 1, 0, kv_len) keys; the upper clamp never binds.
    d = kv_len - q_len
    if d >= 0:
        return q_len * d + q_len * (q_len + 1) // 2
    return kv_len * (kv_len + 1) // 2


def fail(arg: str, expected: str, given: object) -> ValueError:
    """The library's error for a bad argument: names it, what was expected, what was given."""
    return ValueError(f"{arg}: expected {expected}, got {given}")


@dataclass(frozen=True)
class Layout:
    """Shape, element strides and dtype of one tensor argument (what compiled kernels and cuDNN
    graphs depend on; never its address or contents)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: Tensor) -> Layout:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype)

    @property
    def rows(self) -> int:
        return self.shape[0]


@dataclass(frozen=True)
class HostMetadata:
    """The metadata table as Python tuples, when it is known without a device sync."""

    lens_q: tuple[int, ...]
    lens_kv: tuple[int, ...]
    q_start: tuple[int, ...]
    o_start: tuple[int, ...]
    k_start: tuple[int, ...]
    v_start: tuple[int, ...]
    lse_start: tuple[int, ...]
    bt_start: tuple[int, ...]

    def rows(self) -> tuple[tuple[int, ...], ...]:
        return tuple(getattr(self, f) for f in META_FIELDS)


@dataclass(frozen=True)
class Sequences:
    """What a batch's plan fixes, before any tensor of a layer is seen: lengths and offsets (as host
    metadata, or None when they live on the device), bounds, heads, head dims, paging and flags.

    ``pages`` is "none" (ragged K/V), "table" (a ``(B, width)`` block table) or "csr" (FlashInfer's
    ``kv_indptr`` / ``kv_indices``); ``lse`` the LSE layout when it is returned: "padded"
    ``(B, max_q, Hq)`` or "packed" (``batch_offsets_stats``).
    """

    batch_size: int
    max_q: int
    max_kv: int
    work_q: int
    work_kv: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    pages: str
    table_width: int
    causal: bool
    scale: float
    window_left: int
    logits_soft_cap: float
    lse: str
    graph_mode: bool
    host: HostMetadata | None
    table_stride: int  # row stride of the block table the kernels read (0 without one)
    # device offsets ("o", "stats") that may place rows past q's: a buffer they address cannot be
    # allocated with q's rows (the rows they place are not known without a device sync)
    placed_apart: tuple[str, ...]


@dataclass(frozen=True)
class PrefillBatch(Sequences):
    """One prefill call, checked: its :class:`Sequences` fields and the layouts of the layer's
    tensors (B = ``batch_size``).

    ``max_q`` / ``max_kv`` are the caller's bounds (``max_token_per_sequence``,
    ``max_sequence_kv``; the padded LSE layout is ``(B, max_q, Hq)``); ``work_q`` / ``work_kv``
    bound the lengths the kernels will meet (the real maxima when the lengths are on the host)
    and size grids and scratch. ``page_size`` 0 means ragged K/V. ``lse`` is "none" when no LSE is
    written, else its layout. ``host`` is the metadata when known on the host; None when it is
    computed on the device at every run (lengths or offsets given on the device).
    """

    num_pages: int
    q: Layout
    k: Layout
    v: Layout
    out: Layout
    lse_numel: int
    q_scaled: bool
    k_scaled: bool
    v_scaled: bool
    has_sinks: bool
    aligned: tuple[bool, bool, bool, bool]  # q, k, v, out start at 16-byte aligned addresses
    device: torch.device

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def has_lse(self) -> bool:
        return self.lse != "none"

    @property
    def device_metadata(self) -> bool:
        return self.host is None

    @property
    def out_dtype(self) -> torch.dtype:
        return self.out.dtype

    @property
    def fp8_q(self) -> bool:
        return self.q.dtype in FP8_DTYPES

    @property
    def fp8_kv(self) -> bool:
        return self.k.dtype in FP8_DTYPES

    @property
    def variants(self) -> bool:
        """A sliding window, soft-capping or sinks is on."""
        return self.window_left >= 0 or self.logits_soft_cap > 0 or self.has_sinks

    @property
    def empty(self) -> bool:
        """No query row to compute: nothing is written."""
        return self.batch_size == 0 or self.work_q == 0


@dataclass
class DeviceVectors:
    """Lengths / offsets / CSR pointers that live on the device: the metadata is computed from them
    on the device at every run (kernels clamp every value)."""

    lens_q: Tensor
    lens_kv: Tensor | None  # None with CSR pages (from kv_indptr and kv_last_page_len)
    offsets: dict[str, Tensor]  # name -> (B+1,) on the device
    kv_indptr: Tensor | None
    kv_last_page_len: Tensor | None
    units: str


def per_token(hq: int, hkv: int, dqk: int, dvo: int) -> dict[str, int]:
    """Elements of one token in each offset-addressed tensor (what an offset in elements of
    ``batch_offsets_<name>`` is divided by to give tokens)."""
    return {"q": hq * dqk, "o": hq * dvo, "k": hkv * dqk, "v": hkv * dvo, "stats": hq}


class CallTensors:
    """The tensors of one run, in the layouts the batch describes (all on ``batch.device``).

    ``lse`` is the flat float32 LSE buffer (None without LSE); ``meta`` the ``(8, B)`` int32 table
    (with ``vectors``: an int32 stand-in, never read);
    ``pages`` the int32 page ids (a 2-D block table, or FlashInfer's flat ``kv_indices``), None
    when ragged; scales are one-element float32 tensors (None: 1.0); ``sinks`` float32 ``(Hq,)``;
    ``scratch`` the workspace bytes a backend may use (aligned to 256 bytes); ``vectors`` the run's
    device lengths and offsets, for a backend plan that took them in place of the table (see
    ``PrefillPlan``: ``meta`` is then not written).
    """

    __slots__ = (
        "q",
        "k",
        "v",
        "out",
        "lse",
        "meta",
        "pages",
        "q_scale",
        "k_scale",
        "v_scale",
        "sinks",
        "scratch",
        "vectors",
    )

    def __init__(self, q, k, v, out, lse, meta, pages, q_scale, k_scale, v_scale, sinks, scratch, vectors=None):
        self.q, self.k, self.v, self.out, self.lse = q, k, v, out, lse
        self.meta, self.pages = meta, pages
        self.q_scale, self.k_scale, self.v_scale, self.sinks = q_scale, k_scale, v_scale, sinks
        self.scratch = scratch
        self.vectors = vectors
