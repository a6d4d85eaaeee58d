"""The metadata table on the device, the page ids the kernels read, and the caller's workspace.

With host metadata (lengths and offsets on the CPU) a plan owns its table: staged in pinned memory
and copied once, when the plan is made (:func:`host_table`). With device lengths or offsets the
table is computed on the device at every run (:func:`write_device_table`), into the first bytes of
the workspace (:func:`carve`), whatever the device tensors hold (every value clamped); the backend's
scratch follows it (where a backend reads the vectors itself no table is written and the scratch is
the whole workspace). A workspace serves one call at a time (one stream, one thread): two calls that
share one race on its bytes, so :func:`acquire` refuses a second concurrent call.
"""

from __future__ import annotations

import array
import itertools
import threading

import torch
from torch import Tensor

from pagedprefill.batch import META_FIELDS, DeviceVectors, HostMetadata, PrefillBatch, Sequences, fail, per_token
from pagedprefill.kernels import launch
from pagedprefill.kernels.metadata import Bounds, device_table_torch, device_table_triton, launch_tensors

META_ALIGN = 256  # bytes; the backend scratch starts at this alignment after a carved table


def meta_bytes(batch_size: int) -> int:
    """Workspace bytes taken by a batch's metadata table when it is computed on the device."""
    raw = len(META_FIELDS) * max(batch_size, 1) * 4
    return -(-raw // META_ALIGN) * META_ALIGN


def host_table(host: HostMetadata, device: torch.device) -> Tensor:
    """The plan-owned ``(8, B)`` int32 table on ``device``, copied from pinned host memory (the copy is
    ordered on the current stream)."""
    bsz = len(host.lens_q)
    if not bsz:
        return torch.empty((len(META_FIELDS), 0), dtype=torch.int32, device=device)
    staged = torch.frombuffer(array.array("i", itertools.chain(*host.rows())), dtype=torch.int32)
    if device.type != "cuda":
        return staged.view(len(META_FIELDS), max(bsz, 0)).clone()
    meta = torch.empty((len(META_FIELDS), bsz), dtype=torch.int32, device=device)
    meta.view(-1).copy_(staged.pin_memory(), non_blocking=True)
    return meta


def bounds(batch: PrefillBatch, vecs: DeviceVectors, num_indices: int) -> Bounds:
    """What device lengths are clamped to, from the batch's shapes."""
    units = per_token(batch.num_qo_heads, batch.num_kv_heads, batch.head_dim_qk, batch.head_dim_vo)
    if vecs.units == "tokens":
        units = dict.fromkeys(units, 1)
    lse_mode = {"none": 0, "padded": 1, "packed": 2}[batch.lse]
    return Bounds(
        max_q=batch.max_q,
        max_kv=batch.max_kv,
        rows_q=batch.q.rows,
        rows_o=batch.out.rows,
        rows_k=0 if batch.paged else batch.k.rows,
        rows_v=0 if batch.paged else batch.v.rows,
        lse_numel=batch.lse_numel,
        lse_mode=lse_mode,
        pages={"none": 0, "table": 1, "csr": 2}[batch.pages],
        table_width=batch.table_width,
        table_stride=batch.table_stride,
        num_indices=num_indices,
        page_size=batch.page_size,
        num_heads=batch.num_qo_heads,
        units=units,
    )


def write_device_table(
    bd: Bounds,
    vecs: DeviceVectors,
    meta: Tensor,
    slot: launch.LaunchSlot | None = None,
) -> None:
    """Fill ``meta`` from device vectors without a host sync (one Triton launch where Triton runs);
    ``slot``: see :func:`~pagedprefill.kernels.metadata.device_table_triton`."""
    args = (bd, vecs.lens_q, vecs.lens_kv, vecs.offsets, vecs.kv_indptr, vecs.kv_last_page_len, meta)
    if meta.is_cuda and launch.unavailable_reason(meta.device) is None:
        device_table_triton(*args, slot=slot)
    else:
        device_table_torch(*args)


def table_tensors(vecs: DeviceVectors, meta: Tensor) -> tuple:
    """What the device table's launch, once bound to a :class:`~pagedprefill.kernels.launch.LaunchSlot`,
    takes for these tensors (a plan keeps it for its own workspace)."""
    return launch_tensors(vecs.lens_q, vecs.lens_kv, vecs.offsets, vecs.kv_indptr, vecs.kv_last_page_len, meta)


def carve(ws: Tensor, bsz: int, device_meta: bool) -> tuple[Tensor | None, Tensor]:
    """``(meta, scratch)``: the device table's view at the start of the workspace (device metadata
    only) and the bytes after it."""
    if not device_meta:
        return None, ws
    mb = meta_bytes(bsz)
    meta = ws[: len(META_FIELDS) * bsz * 4].view(torch.int32).view(len(META_FIELDS), bsz)
    return meta, ws[mb:]


def check_size(ws: Tensor, need_meta: int, need_backend: int, backend: str) -> None:
    need = need_meta + need_backend
    if ws.numel() < need:
        raise fail(
            "workspace_buffer",
            f"at least {need} bytes for this call "
            f"({need_meta} for metadata + {need_backend} for the {backend} backend)",
            f"{ws.numel()} bytes",
        )


def pages_as_is(seq: Sequences, pages: Tensor, device: torch.device) -> bool:
    """Whether the kernels read ``pages`` as it is (int32 on the device; CSR indices contiguous)."""
    same = pages.dtype == torch.int32 and pages.device.type == device.type
    return same and (seq.pages == "table" or pages.is_contiguous())


def device_pages(seq: Sequences, pages: Tensor | None, device: torch.device) -> Tensor | None:
    """The int32 page ids on the device that the kernels read: the caller's int32 device tensor as it
    is, else a converted copy (made at every run: the contents may change between runs)."""
    if pages is None or pages_as_is(seq, pages, device):
        return pages
    if pages.dtype == torch.int32 and pages.device.type == device.type:
        return pages.contiguous()
    if pages.device.type == "cpu" and device.type == "cuda":
        return pages.to(torch.int32).contiguous().pin_memory().to(device, non_blocking=True)
    return pages.to(device=device, dtype=torch.int32).contiguous()


_HELD: dict[int, int] = {}  # workspace address -> id of the thread whose call holds it


def acquire(ws: Tensor) -> bool:
    """Hold ``ws`` for this thread's call; raises while another thread's call holds it (the two would
    overwrite each other's metadata and scratch). Calls on one thread are ordered by their stream.
    Returns whether this thread already held it (a nested call: :func:`release` only the outer).
    (dict.setdefault is atomic under the GIL: of two threads racing for one address, one wins.)
    An empty workspace holds nothing to overwrite (and every empty tensor has address 0): never held."""
    if ws.numel() == 0:
        return True
    ptr = ws.data_ptr()
    me = threading.get_ident()
    owner = _HELD.get(ptr)
    if owner == me:
        return True
    if owner is None:
        owner = _HELD.setdefault(ptr, me)
    if owner != me:
        raise fail(
            "workspace_buffer",
            "a workspace no other thread is using (give each thread, or each CUDA stream, its own)",
            "one that another thread's call is using right now",
        )
    return False


def release(ws: Tensor) -> None:
    _HELD.pop(ws.data_ptr(), None)
