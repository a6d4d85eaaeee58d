"""Triton backend: this project's own kernels.

* :mod:`.hopper` / :mod:`.hopper_kernel` — the sm_90 kernel (Gluon: warp-specialised, TMA,
  asynchronous wgmma) for 16-bit q with K/V in its dtype or fp8, Dqk = Dvo in {64, 96, 128, 256} or
  Dqk 192 / Dvo 128, e4m3 q, k and v at D 64 / 128 (8-bit wgmmas), and the attention variants;
* :mod:`.fa2` / :mod:`.fa2_kernel` — the portable kernel for everything else: other GPUs, other
  head dims, other fp8 q, split-KV for short queries over long prefixes, and the CPU interpreter.

:func:`plan` picks one per batch from host ints only; neither reads lengths on the host.
"""

from __future__ import annotations

import torch

from pagedprefill import tuning
from pagedprefill.batch import PrefillBatch
from pagedprefill.kernels import launch

from . import fa2, hopper

NAME = "triton"
MAX_HEAD_DIM = 256


def unavailable_reason(device: torch.device) -> str | None:
    return launch.unavailable_reason(device)


def _served_dim(d: int) -> bool:
    return 16 <= d <= MAX_HEAD_DIM and d % 16 == 0


def unsupported_reason(batch: PrefillBatch) -> str | None:
    dqk, dvo = batch.head_dim_qk, batch.head_dim_vo
    if not (_served_dim(dqk) and _served_dim(dvo)):
        return (
            f"head dims Dqk={dqk}, Dvo={dvo} are not served: the Triton kernels serve head dims that are "
            f"multiples of 16 from 16 to {MAX_HEAD_DIM} (e.g. 64, 96, 128, 256, and Dqk=192 with Dvo=128)"
        )
    if launch.INTERPRETED and fa2.compute_dtype(batch) == torch.bfloat16:
        return (
            "Triton's CPU interpreter (TRITON_INTERPRET=1) cannot compute bfloat16 dots (it returns wrong "
            "values): on the CPU use float16 or float32 q / k_cache / v_cache, or backend='torch'"
        )
    if launch.INTERPRETED and batch.out_dtype == torch.bfloat16:
        # (its float32 -> bfloat16 cast truncates instead of rounding: half the outputs one bf16 step off)
        return (
            "Triton's CPU interpreter (TRITON_INTERPRET=1) cannot round to a bfloat16 output (it truncates): "
            "on the CPU pass o_data_type=torch.float16 or torch.float32 (fp8 q's output is bfloat16 by default), "
            "or backend='torch'"
        )
    if batch.fp8_kv and batch.device.type == "cuda" and not launch.INTERPRETED:
        if torch.cuda.get_device_capability(batch.device) < (8, 9):
            return "fp8 K/V needs CUDA compute capability >= 8.9 in the Triton kernels"
    return None


def uses_hopper_kernel(batch: PrefillBatch, workspace_bytes: int | None = None) -> bool:
    """Whether :func:`plan` takes the Hopper kernel for this batch: wherever it serves the call and no
    split-KV is chosen (it was faster than the portable kernel on every shape measured on the H200;
    knob ``hopper=0`` turns it off)."""
    if tuning.knobs("triton").get("hopper") == 0 or hopper.unavailable_reason(batch) is not None:
        return False
    return fa2.choose_splits(batch, fa2.choose_config(batch), workspace_bytes) == 1


def hopper_config(batch: PrefillBatch) -> hopper.Config:
    """The Hopper kernel's launch knobs for this batch (its tiles, stages and register split)."""
    return hopper.config(batch)


def few_tiles(batch: PrefillBatch) -> bool:
    """Whether the Hopper kernel would have few key tiles per program for this call (see
    :func:`.hopper.few_tiles`): a handful of short prompts at D 128, where cuDNN measured faster."""
    return hopper.few_tiles(batch)


def plan(batch: PrefillBatch, workspace_bytes: int | None):
    """The launches of this batch (``workspace_bytes``: the caller's scratch, which bounds split-KV and
    the Hopper kernel's split last round; 0 where the caller disables both)."""
    if uses_hopper_kernel(batch, workspace_bytes):
        return hopper.HopperPlan(batch, workspace_bytes)
    return fa2.Fa2Plan(batch, workspace_bytes)


def compiled_kernels() -> list:
    """This backend's Triton/Gluon kernels (the portable ones, the device table's, and on a Triton with
    Gluon the Hopper kernel and its merge)."""
    from pagedprefill.kernels import metadata

    kernels = [fa2.fk.prefill_kernel, fa2.fk.merge_kernel, metadata._metadata_kernel]
    if hopper.hk is not None:
        kernels += [hopper.hk.attention_kernel, hopper.hk.share_merge_kernel]
    return [k for k in kernels if k is not None]


def compiled_variants() -> int:
    """Kernel variants compiled so far in this process (all devices); 0 under the interpreter."""
    return launch.compiled_variants(*compiled_kernels())
