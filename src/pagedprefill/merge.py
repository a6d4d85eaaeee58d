"""``merge_state`` / ``merge_states``: the exact combination of attention results over disjoint key
sets (split-KV, shared-prefix cascades, context parallelism). FlashInfer's names and shapes.

Each input is an attention output ``v`` (tokens, H, D) with its log-sum-exp ``s`` (tokens, H) over
its keys. The merge is exact: the result is what attention over the union of the key sets gives. A
state whose ``s`` is -inf (no key) contributes nothing (its ``v`` is not read: NaN there is
harmless); if every state of a row has none, the row is 0 with s = -inf. This library's LSEs are
natural-log (``lse_base="e"``, the default); FlashInfer's wrappers (and
:class:`pagedprefill.BatchPrefillWithPagedKVCacheWrapper`) return base-2 LSEs: pass ``lse_base=2``
for those (``pagedprefill.flashinfer.merge_state`` does by default).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from pagedprefill.batch import fail
from pagedprefill.kernels import launch
from pagedprefill.kernels.merge import merge_kernel

__all__ = ["merge_state", "merge_states"]
_VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _base2(lse_base: object) -> bool:
    if lse_base in ("e", math.e):
        return False
    if lse_base == 2:
        return True
    raise fail("lse_base", "\"e\" (natural log, this library's LSEs) or 2 (FlashInfer's wrappers)", repr(lse_base))


def _check_state(nv: str, v: object, ns: str, s: object, stacked: bool) -> None:
    rank = 4 if stacked else 3
    if not isinstance(v, Tensor) or v.dim() != rank:
        shape = "(tokens, states, H, D)" if stacked else "(tokens, H, D)"
        raise fail(nv, f"a rank-{rank} tensor {shape}", v if not isinstance(v, Tensor) else f"shape {tuple(v.shape)}")
    if v.dtype not in _VALUE_DTYPES:
        raise fail(nv, "dtype float16, bfloat16 or float32", v.dtype)
    if v.shape[-1] == 0:
        raise fail(nv, "a head dim D >= 1", f"shape {tuple(v.shape)}")
    if stacked and v.shape[1] == 0:
        raise fail(nv, "at least one state to merge (dim 1 >= 1)", f"shape {tuple(v.shape)}")
    if v.numel() and v.stride(-1) != 1:
        raise fail(nv, "unit stride on the last dimension", f"strides {tuple(v.stride())}")
    if not isinstance(s, Tensor) or tuple(s.shape) != tuple(v.shape[:-1]):
        got = f"shape {tuple(s.shape)}" if isinstance(s, Tensor) else type(s).__name__
        raise fail(ns, f"a float32 tensor of shape {tuple(v.shape[:-1])} (the LSE of {nv})", got)
    if s.dtype != torch.float32:
        raise fail(ns, "dtype float32", s.dtype)
    if s.device != v.device:
        raise fail(ns, f"a tensor on {v.device} (as {nv})", f"one on {s.device}")


def _merge(states: list[tuple[Tensor, Tensor]], stacked: bool, base2: bool) -> tuple[Tensor, Tensor]:
    """``states``: [(v_a, s_a), (v_b, s_b)] (pair), or [(v, s)] stacked on dim 1. Returns the merged
    (tokens, H, D) output and (tokens, H) LSE."""
    v0, s0 = states[0]
    tokens, heads, d = v0.shape[0], v0.shape[-2], v0.shape[-1]
    n_states = v0.shape[1] if stacked else 2
    out = torch.empty((tokens, heads, d), dtype=v0.dtype, device=v0.device)
    lse = torch.empty((tokens, heads), dtype=torch.float32, device=v0.device)
    if tokens * heads == 0:
        return out, lse
    if launch.unavailable_reason(v0.device) is None and not (launch.INTERPRETED and v0.dtype == torch.bfloat16):
        rows = tokens * heads
        block_d = min(1 << (d - 1).bit_length(), 128)
        block_r = max(1, 4096 // block_d)
        grid = (-(-rows // block_r), -(-d // block_d))
        if stacked:
            va, sa = v0, s0
            vb, sb = v0, s0  # (unused)
            a = (va.stride(0), va.stride(1), va.stride(2), sa.stride(0), sa.stride(1), sa.stride(2))
            b = (0, 0, 0, 0)
        else:
            (va, sa), (vb, sb) = states
            a = (va.stride(0), 0, va.stride(1), sa.stride(0), 0, sa.stride(1))
            b = (vb.stride(0), vb.stride(1), sb.stride(0), sb.stride(1))
        args = (
            va,
            sa,
            vb,
            sb,
            out,
            lse,
            rows,
            heads,
            n_states,
            *a,
            *b,
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            lse.stride(1),
        )
        kwargs = dict(D=d, BLOCK_D=block_d, BLOCK_R=block_r, BASE2=base2, PAIR=not stacked, num_warps=4)
        with torch.cuda.device(v0.device) if v0.is_cuda else contextlib.nullcontext():
            launch.fast_launch(merge_kernel, grid, args, kwargs)
        return out, lse
    # the definition, in float32 torch ops (a CPU without the interpreter)
    if stacked:
        v, s = v0.float(), s0
    else:
        v = torch.stack([x.float() for x, _ in states], dim=1)
        s = torch.stack([y for _, y in states], dim=1)
    v = torch.where(torch.isneginf(s)[..., None], 0.0, v)  # (a state with no key adds nothing, NaN O included)
    s = s * (math.log(2.0) if base2 else 1.0)
    m = s.amax(dim=1, keepdim=True)
    m_use = torch.where(torch.isfinite(m), m, 0.0)
    w = torch.exp(s - m_use)
    total = w.sum(dim=1)
    out.copy_((w[..., None] * v).sum(dim=1) / torch.where(total > 0, total, 1.0)[..., None])
    res = torch.where(total > 0, m_use[:, 0] + torch.log(torch.where(total > 0, total, 1.0)), -math.inf)
    lse.copy_(res / math.log(2.0) if base2 else res)
    return out, lse


def merge_state(
    v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor, *, lse_base: str | int = "e"
) -> tuple[Tensor, Tensor]:
    """Merge two attention results over disjoint key sets.

    Args:
        v_a, v_b: (tokens, H, D) fp16 / bf16 / fp32 outputs (the same shape and dtype).
        s_a, s_b: (tokens, H) float32 log-sum-exps of their logits (natural log; ``lse_base=2``
            for base 2).

    Returns:
        (v, s): (tokens, H, D) in v_a's dtype and (tokens, H) float32, in the same base.
    """
    return merge_pair(v_a, s_a, v_b, s_b, _base2(lse_base))


def merge_pair(
    v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor, base2: bool, names: tuple = ("v_a", "s_a", "v_b", "s_b")
) -> tuple[Tensor, Tensor]:
    """:func:`merge_state` (``base2``: the LSEs' base is 2), its errors naming the arguments by
    ``names`` (the caller's own names for them)."""
    nva, nsa, nvb, nsb = names
    _check_state(nva, v_a, nsa, s_a, False)
    _check_state(nvb, v_b, nsb, s_b, False)
    if v_b.shape != v_a.shape or v_b.dtype != v_a.dtype or v_b.device != v_a.device:
        raise fail(
            nvb,
            f"shape {tuple(v_a.shape)}, dtype {v_a.dtype}, device {v_a.device} (as {nva})",
            f"shape {tuple(v_b.shape)}, dtype {v_b.dtype}, device {v_b.device}",
        )
    return _merge([(v_a, s_a), (v_b, s_b)], False, base2)


def merge_states(v: Tensor, s: Tensor, *, lse_base: str | int = "e") -> tuple[Tensor, Tensor]:
    """Merge N attention results over disjoint key sets, stacked along dim 1.

    Args:
        v: (tokens, N, H, D) fp16 / bf16 / fp32 outputs; s: (tokens, N, H) float32 log-sum-exps
            (natural log; ``lse_base=2`` for base 2).

    Returns:
        (v, s): (tokens, H, D) in v's dtype and (tokens, H) float32.
    """
    _check_state("v", v, "s", s, True)
    return _merge([(v, s)], True, _base2(lse_base))
