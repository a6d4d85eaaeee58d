"""Configuration and launches of the portable Triton kernel (:mod:`.fa2_kernel`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedprefill import tuning
from pagedprefill.batch import CallTensors, PrefillBatch
from pagedprefill.kernels.launch import INTERPRETED, fast_launch, grid_chunks, triton

from . import fa2_kernel as fk

LOG2E = 1.4426950408889634
KNOBS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "num_splits", "lazy", "hopper")


@dataclass(frozen=True)
class Config:
    """Launch knobs of the kernel (compile-time constants)."""

    BLOCK_M: int  # query rows (token x head-in-group pairs) per program
    BLOCK_N: int  # keys per iteration
    num_warps: int
    num_stages: int
    # 1: rescale the accumulators only when a row max grows by > 2^8 (unmasked loop): the best or
    # near-best config on every D 128 and Dqk 192 / Dvo 128 workload measured on the H200
    lazy: int = 0


@dataclass(frozen=True)
class SplitPolicy:
    """When and how much to split the KV range (a host decision from host ints only)."""

    min_programs: int = 264  # split when the unsplit grid has fewer programs (~2 waves on 132 SMs)
    max_splits: int = 16
    min_keys_per_split: int = 512
    max_scratch_bytes: int = 32 << 20  # cap on the float32 partials (also capped by the workspace)


SPLIT_POLICY = SplitPolicy()


def check_knobs(knobs: dict) -> dict:
    for key, val in knobs.items():
        if key not in KNOBS:
            raise ValueError(f"unknown Triton knob {key!r}; expected one of {KNOBS}")
        if key in ("BLOCK_M", "BLOCK_N") and (val < 16 or val & (val - 1)):
            raise ValueError(f"Triton knob {key} must be a power of two >= 16, got {val}")
        if key in ("num_warps", "num_stages", "num_splits") and val < 1:
            raise ValueError(f"Triton knob {key} must be >= 1, got {val}")
        if key in ("lazy", "hopper") and val not in (0, 1):
            raise ValueError(f"Triton knob {key} must be 0 or 1, got {val}")
    return knobs


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << (x - 1).bit_length()


def split_head_dim(d: int, eight_bit: bool = False) -> tuple[int, int, int, int]:
    """``(part0, real part0, part1, real part1)``: the head dim as up to two power-of-two parts.
    part0 is the largest power of two <= d and part1 the power of two holding the rest (padded
    when the rest is not one itself). With 8-bit K/V a second part narrower than 64 columns
    (96 = 64 + 32, 80 = 64 + 16) computed wrong results on the H200, so such dims run as one part
    padded to the next power of two."""
    d0 = _pow2_floor(d)
    rest = d - d0
    if not rest:
        return d0, d0, 0, 0
    if eight_bit and rest < 64:
        return _pow2_ceil(d), d, 0, 0
    return d0, d0, _pow2_ceil(rest), rest


def default_config(dqk: int, dvo: int, elem_bytes: int, eight_bit: bool, capability: tuple[int, int] | None) -> Config:
    """The config table, keyed by head dims, dot operand size and GPU (``capability`` None: the
    interpreter, where small tiles keep it fast and exercise tiling). Tuned on the H200 (sm_90,
    228 KB shared memory); smaller GPUs get fewer stages / rows."""
    if capability is None:
        return Config(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    q0, _, q1, _ = split_head_dim(dqk, eight_bit)
    v0, _, v1, _ = split_head_dim(dvo, eight_bit)
    d = max(q0 + q1, v0 + v1)
    if elem_bytes == 4:  # float32: IEEE dots run on FMA units, register hungry: small tiles
        cfg = Config(32, 16, 8, 2) if d <= 128 else Config(16, 16, 8, 2)
    elif d <= 64:
        cfg = Config(128, 64, 4, 3)
    elif d <= 192:
        cfg = Config(256, 64, 8, 3, lazy=1)
    else:
        cfg = Config(64, 64, 8, 2)
    if capability[0] < 9 and elem_bytes < 4:  # Ampere / Ada: mma.sync keeps operands in registers
        if 64 < d <= 192:
            cfg = Config(64, 64, 8, 2)
        elif d > 192:
            cfg = Config(64, 32, 8, 2)
    return cfg


def compute_dtype(batch: PrefillBatch) -> torch.dtype:
    """Dtype of the dot operands: q's dtype; fp8 q (with its fp8 K/V) computes in float16, which holds
    every e4m3 and e5m2 value exactly and keeps more mantissa than bfloat16 for P."""
    if batch.q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return batch.q.dtype
    return torch.float16


def capability(batch: PrefillBatch) -> tuple[int, int] | None:
    if INTERPRETED or batch.device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(batch.device)


def choose_config(batch: PrefillBatch) -> Config:
    """The launch knobs for this call: the table, then any tuning override."""
    cdt = compute_dtype(batch)
    cap = capability(batch)
    cfg = default_config(batch.head_dim_qk, batch.head_dim_vo, torch.finfo(cdt).bits // 8, batch.fp8_kv, cap)
    if batch.page_size == 1 and cfg.BLOCK_M == 256 and cap is not None:
        cfg = Config(128, 64, 4, 3)  # per-key gathers: the smaller tile wins (240 vs 213 TFLOP/s)
    over = check_knobs(dict(tuning.knobs("triton")))
    known = {k: over[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "lazy") if k in over}
    return replace(cfg, **known) if known else cfg


def num_m_blocks(batch: PrefillBatch, cfg: Config) -> int:
    return -(-batch.work_q * batch.group_size // cfg.BLOCK_M)


def partials_bytes(batch: PrefillBatch, splits: int) -> int:
    if splits <= 1:
        return 0
    rows = splits * batch.batch_size * batch.work_q * batch.num_qo_heads
    return rows * (batch.head_dim_vo + 1) * 4 + 256  # + alignment slack


def choose_splits(batch: PrefillBatch, cfg: Config, workspace_bytes: int | None) -> int:
    """KV splits (1 = none), from host ints only. The count is a runtime kernel argument; only split /
    no split compiles apart. An automatic split that does not fit in the workspace is reduced (or
    dropped) rather than failing the call."""
    over = tuning.knobs("triton")
    if "num_splits" in over:
        return max(1, int(over["num_splits"]))
    pol = SPLIT_POLICY
    if batch.empty:
        return 1
    programs = batch.num_kv_heads * batch.batch_size * num_m_blocks(batch, cfg)
    if programs >= pol.min_programs:
        return 1
    by_len = batch.work_kv // pol.min_keys_per_split
    by_grid = -(-pol.min_programs // programs)
    splits = min(pol.max_splits, by_len, by_grid)
    avail = pol.max_scratch_bytes if workspace_bytes is None else min(workspace_bytes, pol.max_scratch_bytes)
    while splits >= 2 and partials_bytes(batch, splits) > avail:
        splits -= 1
    return splits if splits >= 2 else 1


def _tl_dtype(dt: torch.dtype):
    tl = fk.tl
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dt]


def _fallback_config(cfg: Config) -> Config | None:
    """A smaller config after an out-of-resources compile error (None when nothing is left)."""
    if cfg.num_stages > 2:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.BLOCK_N > 32:
        return replace(cfg, BLOCK_N=cfg.BLOCK_N // 2)
    if cfg.BLOCK_M > 64:
        return replace(cfg, BLOCK_M=cfg.BLOCK_M // 2, num_warps=4)
    if cfg.num_stages > 1:
        return replace(cfg, num_stages=1)
    return None


_FALLBACKS: dict = {}  # (config, dims, dtypes) -> the config that compiled


class Fa2Plan:
    """The portable kernel's launches for one batch: config, split count and constexprs fixed at plan
    time; each run only binds the call's tensors."""

    name = "triton"

    def __init__(self, batch: PrefillBatch, workspace_bytes: int | None, splits: int | None = None):
        self.batch = batch
        cfg = choose_config(batch)
        self.splits = choose_splits(batch, cfg, workspace_bytes) if splits is None else splits
        key = (cfg, batch.device.type, batch.head_dim_qk, batch.head_dim_vo, batch.q.dtype, batch.k.dtype)
        self._fallback_key = key
        self._set_config(_FALLBACKS.get(key, cfg))
        self.workspace_bytes = partials_bytes(batch, self.splits)

    def _set_config(self, cfg: Config) -> None:
        batch, splits = self.batch, self.splits
        self.cfg = cfg
        eight = batch.fp8_kv or batch.fp8_q
        dq0, dq0r, dq1, dq1r = split_head_dim(batch.head_dim_qk, eight)
        dv0, dv0r, dv1, dv1r = split_head_dim(batch.head_dim_vo, eight)
        cdt = compute_dtype(batch)
        page = batch.page_size
        self.n_m = num_m_blocks(batch, cfg)
        self.kwargs = dict(
            GROUP=batch.group_size,
            PAGE_SIZE=page,
            PAGE_PER_TILE=bool(page and page % cfg.BLOCK_N == 0),
            DQ0=dq0,
            DQ0_REAL=dq0r,
            DQ1=dq1,
            DQ1_REAL=dq1r,
            DV0=dv0,
            DV0_REAL=dv0r,
            DV1=dv1,
            DV1_REAL=dv1r,
            BLOCK_M=cfg.BLOCK_M,
            BLOCK_N=cfg.BLOCK_N,
            CDT=_tl_dtype(cdt),
            PREC="ieee" if cdt == torch.float32 else "tf32",
            CAUSAL=batch.causal,
            HAS_LSE=batch.has_lse and splits == 1,
            HAS_Q_SCALE=batch.q_scaled,
            HAS_K_SCALE=batch.k_scaled,
            HAS_V_SCALE=batch.v_scaled and splits == 1,
            MAYBE_NEG_SCALE=batch.scale < 0 or batch.q_scaled or batch.k_scaled,
            SPLIT=splits > 1,
            LAZY_RESCALE=bool(cfg.lazy),
            WINDOW=batch.window_left >= 0,
            SOFTCAP=batch.logits_soft_cap > 0,
            HAS_SINKS=batch.has_sinks,
            FAST_TANH=not INTERPRETED,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        dv_p2 = _pow2_ceil(batch.head_dim_vo)
        block_h = min(_pow2_ceil(batch.num_qo_heads), 16)
        self.merge_kwargs = dict(
            DV=batch.head_dim_vo,
            DV_P2=dv_p2,
            BLOCK_H=block_h,
            HAS_LSE=batch.has_lse,
            HAS_V_SCALE=batch.v_scaled,
            HAS_SINKS=batch.has_sinks,
            num_warps=4,
            num_stages=1,
        )
        self.merge_grid_h = -(-batch.num_qo_heads // block_h)

    def launches(self, t: CallTensors) -> list:
        """The ``(kernel, grid, args, kwargs)`` of one run."""
        batch, splits = self.batch, self.splits
        bsz, hkv = batch.batch_size, batch.num_kv_heads
        meta = t.meta
        dummy = meta
        q, k, v, out = t.q, t.k, t.v, t.out
        bt = t.pages if batch.paged else meta
        if batch.paged:
            kstr, vstr = k.stride()[:3], v.stride()[:3]
        else:
            kstr, vstr = (*k.stride()[:2], 0), (*v.stride()[:2], 0)
        if splits > 1:
            nbytes = partials_bytes(batch, splits)
            if t.scratch.numel() < nbytes:
                raise ValueError(
                    f"workspace_buffer: expected at least {nbytes} bytes of backend scratch for {splits} KV "
                    f"splits, got {t.scratch.numel()}"
                )
            pad = (-t.scratch.data_ptr()) % 16
            rows = splits * bsz * batch.work_q * batch.num_qo_heads
            po = t.scratch[pad : pad + rows * batch.head_dim_vo * 4].view(torch.float32)
            pl_start = pad + rows * batch.head_dim_vo * 4
            pl = t.scratch[pl_start : pl_start + rows * 4].view(torch.float32)
        else:
            po = pl = dummy
        lse = t.lse if t.lse is not None else dummy
        scales = tuple(s if s is not None else dummy for s in (t.q_scale, t.k_scale, t.v_scale))
        sinks = t.sinks if t.sinks is not None else dummy
        plans = []
        for b0, nb, z0, nz in grid_chunks(bsz, self.n_m * splits):
            args = (
                q,
                k,
                v,
                out,
                lse,
                meta,
                bt,
                *scales,
                sinks,
                po,
                pl,
                float(batch.scale) * LOG2E,
                float(batch.logits_soft_cap),
                batch.window_left,
                meta.stride(0),
                b0,
                z0,
                self.n_m,
                batch.num_pages,
                q.stride(0),
                q.stride(1),
                *kstr,
                *vstr,
                out.stride(0),
                out.stride(1),
                batch.num_qo_heads,
                batch.work_q,
                splits,
            )
            plans.append((fk.prefill_kernel, (hkv, nb, nz), args, self.kwargs))
        if splits > 1:
            for b0 in range(0, bsz, 65535):
                nb = min(65535, bsz - b0)
                args = (
                    out,
                    lse,
                    meta,
                    scales[2],
                    sinks,
                    po,
                    pl,
                    meta.stride(0),
                    b0,
                    batch.work_q,
                    out.stride(0),
                    out.stride(1),
                    batch.num_qo_heads,
                    splits,
                )
                plans.append((fk.merge_kernel, (batch.work_q, nb, self.merge_grid_h), args, self.merge_kwargs))
        return plans

    def run(self, t: CallTensors) -> None:
        while True:
            try:
                for kernel, grid, args, kwargs in self.launches(t):
                    fast_launch(kernel, grid, args, kwargs)
                return
            except triton.runtime.errors.OutOfResources:
                smaller = _fallback_config(self.cfg)
                if smaller is None:
                    raise
                _FALLBACKS[self._fallback_key] = smaller
                self._set_config(smaller)
