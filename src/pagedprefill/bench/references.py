"""Outside systems timed beside the library, each on the same batch stored contiguously (no paging):

* ``fa2-varlen``: FlashAttention-2, PyTorch's varlen op ``torch.ops.aten._flash_attention_forward``;
  fp16 / bf16 only, so an fp8 workload runs its bf16 data.
* ``fa3-varlen``: FlashAttention-3's ``flash_attn_varlen_func``, the kernel vLLM and SGLang run on
  Hopper, from the ``fa3-fwd`` wheel (``fa3_fwd_interface``; FA3's forward built for sm_90 without
  fp16, paged KV or local attention) or the official ``flash_attn_interface``. Its fp8 path takes
  e4m3 q, K and V with per-(sequence, KV head) descales: the ``fp8`` workload runs it on its fp8
  data (descales 0.5); ``fp8_kv`` (bf16 q with an fp8 cache) has no FA3 kernel and runs the bf16 data.

Each ``*_call`` returns a callable ``() -> (out, None)`` or raises :class:`Skip` saying why the system
cannot run the case here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from .common import Skip

FA2 = "fa2-varlen"
FA3 = "fa3-varlen"
REFERENCES = (FA3, FA2)
LABELS = {FA2: "FA2 varlen (torch op, contiguous KV)", FA3: "FA3 varlen (contiguous KV)"}
FA3_MODULES = ("fa3_fwd_interface", "flash_attn_interface")
_FA3: dict = {}


def fa3_status() -> tuple[Callable | None, str]:
    """``(flash_attn_varlen_func or None, description)``: the first importable FA3 module, or why
    none is (each module tried and its error)."""
    if "status" not in _FA3:
        errors = []
        for name in FA3_MODULES:
            try:
                mod = importlib.import_module(name)
                fn = mod.flash_attn_varlen_func
            except Exception as e:  # ImportError, or OSError from its CUDA extension
                errors.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
                continue
            version = _dist_version("fa3-fwd" if name == "fa3_fwd_interface" else "flash-attn-3")
            _FA3["status"] = (fn, f"{name}" + (f" ({version})" if version else ""))
            _FA3["module"] = name
            break
        else:
            _FA3["status"] = (
                None,
                "FlashAttention-3 is not importable (" + "; ".join(errors) + "); pip install fa3-fwd==0.0.3",
            )
    return _FA3["status"]


def _dist_version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return f"{dist} {version(dist)}"
    except Exception:
        return None


def data_for(name: str, kind: str, wide: str) -> str:
    """Which data reference ``name`` runs for a workload whose data is ``kind`` (``wide``: its 16-bit
    data): FA3 runs the ``fp8`` kind on its fp8 data, everything else the 16-bit data."""
    if name == FA3 and kind == "fp8":
        return kind
    return wide


def _common_checks(dense: dict, who: str) -> None:
    q = dense["q"]
    if q.device.type != "cuda":
        raise Skip(f"{who} needs a CUDA GPU")
    if dense["k"].shape[0] == 0 or q.shape[0] == 0:
        raise Skip(f"{who}: empty batch")


def fa2_call(dense: dict) -> Callable[[], tuple]:
    """FlashAttention-2 varlen forward (PyTorch's op) on the data of
    :func:`pagedprefill.workloads.dense_reference_inputs`."""
    _common_checks(dense, "FlashAttention-2")
    q, k, v = dense["q"], dense["k"], dense["v"]
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise Skip(f"FlashAttention-2 needs fp16/bf16, not {q.dtype}", "unsupported")
    if k.shape[-1] != v.shape[-1] or q.shape[-1] > 256 or q.shape[-1] % 8:
        raise Skip(f"FlashAttention-2 needs Dqk == Dvo <= 256 (got {q.shape[-1]}/{v.shape[-1]})", "unsupported")
    try:
        op = torch.ops.aten._flash_attention_forward
    except Exception as e:
        raise Skip(f"torch.ops.aten._flash_attention_forward missing: {e}") from e
    args = (q, k, v, dense["cu_seqlens_q"], dense["cu_seqlens_k"], dense["max_q"], dense["max_k"], 0.0)
    causal, scale = dense["causal"], dense["scale"]

    def call():
        return op(*args, causal, False, scale=scale)[0], None

    return call


def fa3_call(dense: dict) -> Callable[[], tuple]:
    """FlashAttention-3 varlen forward on :func:`pagedprefill.workloads.dense_reference_inputs`
    (bf16, or e4m3 q/K/V with descales of shape (B, Hkv))."""
    fn, about = fa3_status()
    if fn is None:  # said first: a missing FA3 is what a user has to fix, on any machine
        raise Skip(about)
    _common_checks(dense, "FlashAttention-3")
    q, k, v = dense["q"], dense["k"], dense["v"]
    fa3_fwd = _FA3.get("module") == "fa3_fwd_interface"
    if fa3_fwd and torch.cuda.get_device_capability(q.device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(q.device)
        raise Skip(f"the fa3-fwd wheel is built for sm_90 only (this GPU is sm_{major}{minor})")
    fp8 = q.dtype == torch.float8_e4m3fn
    if fp8 and not (k.dtype == v.dtype == torch.float8_e4m3fn):
        raise Skip("FlashAttention-3's fp8 path needs e4m3 q, K and V", "unsupported")
    if not fp8:
        allowed = (torch.bfloat16,) if fa3_fwd else (torch.float16, torch.bfloat16)
        if q.dtype not in allowed or k.dtype != q.dtype:
            raise Skip(f"FlashAttention-3 ({about}) has no kernels for {q.dtype} / {k.dtype}", "unsupported")
    kw: dict = dict(softmax_scale=dense["scale"], causal=dense["causal"])
    if fp8:
        bsz, hkv = len(dense["q_lens"]), k.shape[1]

        def descale(s: float | None) -> torch.Tensor:
            return torch.full((bsz, hkv), 1.0 if s is None else s, dtype=torch.float32, device=q.device)

        kw.update(
            q_descale=descale(dense["q_scale"]),
            k_descale=descale(dense["k_scale"]),
            v_descale=descale(dense["v_scale"]),
        )
    args = (q, k, v, dense["cu_seqlens_q"], dense["cu_seqlens_k"], dense["max_q"], dense["max_k"])

    def call():
        res = fn(*args, **kw)
        return (res[0] if isinstance(res, tuple) else res), None

    return call


def reference_call(name: str, dense: dict) -> Callable[[], tuple]:
    """The call of outside system ``name`` (``fa2-varlen`` / ``fa3-varlen``)."""
    if name == FA2:
        return fa2_call(dense)
    if name == FA3:
        return fa3_call(dense)
    raise ValueError(f"unknown outside reference {name!r}; known: {', '.join(REFERENCES)}")
