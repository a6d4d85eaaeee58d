"""Correctness checks of timed outputs: the error measure and the references.

Reference: on a GPU the library's ``torch`` backend (float32 math) on the same call; on the CPU
float64 math on the data stored contiguously (:func:`pagedprefill.workloads.reference_fp64`, which
does not use the library).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import pagedprefill
from pagedprefill import workloads as wl

from .common import LSE_ABS_TOL, OUT_REL_TOL, OUT_REL_TOL_FP8

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def rel_tol_for(q: Tensor, fp8_probabilities: bool) -> float:
    """The output tolerance of a run on query ``q``: looser for a backend that may round the softmax
    probabilities to fp8 (FA3's and cuDNN's fp8 attention do, and Triton's Hopper kernel on 8-bit
    wgmmas), which it can only do with fp8 q. (Triton's portable kernel keeps them in 16 bits but
    reports the same backend name, so its fp8-q runs are checked at the looser tolerance too.)"""
    return OUT_REL_TOL_FP8 if fp8_probabilities and q.dtype in FP8 else OUT_REL_TOL


def lse_rows(lse: Tensor, q_lens: list[int]) -> Tensor:
    """(total_q, Hq) valid rows of a (B, max_q, Hq) LSE buffer."""
    parts = [lse[b, :n] for b, n in enumerate(q_lens) if n]
    if not parts:
        return lse.new_empty((0, lse.shape[-1]))
    return torch.cat(parts)


def compare(
    out: Tensor,
    ref_out: Tensor,
    lse: Tensor | None = None,
    ref_lse: Tensor | None = None,
    rel_tol: float = OUT_REL_TOL,
    lse_tol: float = LSE_ABS_TOL,
) -> dict:
    """Errors of ``out`` (rows, H, D) against ``ref_out``, and of LSE rows (rows, H) against ``ref_lse``.

    Returns ``rel_err = ‖out − ref‖₂ / ‖ref‖₂`` over all elements, ``max_err = max |out − ref|``,
    ``lse_err = max |lse − ref|`` (two equal infinities agree; None without LSE), and ``ok``
    (``rel_err <= rel_tol`` and ``lse_err <= lse_tol``). Non-finite outputs make the errors infinite.
    """
    dev = out.device
    acc = torch.float64 if dev.type == "cpu" else torch.float32
    num = den = 0.0
    max_err = 0.0
    finite = True
    rows = out.shape[0]
    per_row = max(1, out[0].numel() if rows else 1)
    chunk = max(1, 2**25 // per_row)  # bounded temporaries on long batches
    for r0 in range(0, rows, chunk):
        a = out[r0 : r0 + chunk].to(acc)
        b = ref_out[r0 : r0 + chunk].to(device=dev, dtype=acc)
        if not bool(torch.isfinite(a).all()):
            finite = False
            break
        d = a - b
        num += float((d * d).sum(dtype=torch.float64))
        den += float((b * b).sum(dtype=torch.float64))
        max_err = max(max_err, float(d.abs().max())) if d.numel() else max_err
    if finite:
        rel = math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num)
    else:
        rel = max_err = math.inf
    res = {"rel_err": rel, "max_err": max_err, "lse_err": None, "rel_tol": rel_tol}
    if lse is not None and ref_lse is not None:
        a = lse.double()
        b = ref_lse.to(device=lse.device, dtype=torch.float64)
        both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
        d = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
        d = torch.nan_to_num(d, nan=math.inf, posinf=math.inf)
        res["lse_err"] = float(d.max()) if d.numel() else 0.0
    ok = math.isfinite(rel) and rel <= rel_tol
    if res["lse_err"] is not None:
        ok = ok and res["lse_err"] <= lse_tol
    res["ok"] = bool(ok)
    return res


def reference(kwargs: dict) -> dict:
    """``{"out": (total_q, Hq, Dvo), "lse": (total_q, Hq), "kind": str}`` for the call ``kwargs``.

    GPU: the torch backend into fresh buffers. CPU: float64 math (independent of the library).
    """
    q_lens, _ = wl.case_lengths(kwargs)
    if kwargs["q"].device.type == "cuda":
        # the library itself, not the benchmark's (replaceable) timed function
        call = {**kwargs, "out": None, "lse": None, "return_lse": True}
        out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**call, backend="torch")
        torch.cuda.synchronize()
        return {"out": out, "lse": lse_rows(lse, q_lens), "kind": "torch backend (fp32 math)"}
    out, lses = wl.reference_fp64(wl.dense_reference_inputs(kwargs))
    lse = torch.cat(lses) if lses else torch.empty((0, kwargs["q"].shape[1]), dtype=torch.float64)
    return {"out": out, "lse": lse, "kind": "float64 math"}


def check_library_output(kwargs: dict, out: Tensor, lse: Tensor | None, ref: dict, served_by: str | None) -> dict:
    """:func:`compare` of one library call's ``out`` / ``lse`` against :func:`reference`
    (``served_by``: the backend that ran it, as :func:`pagedprefill.last_backend` says)."""
    q_lens, _ = wl.case_lengths(kwargs)
    tol = rel_tol_for(kwargs["q"], served_by in ("cudnn", "triton"))
    lse_r = lse_rows(lse, q_lens) if lse is not None else None
    return compare(out, ref["out"], lse_r, ref["lse"] if lse is not None else None, rel_tol=tol)
