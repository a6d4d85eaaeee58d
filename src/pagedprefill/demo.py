"""pagedprefill-demo: one realistic paged prefill batch, checked against an independent float64 reference.

``python -m pagedprefill.demo`` (or ``pagedprefill-demo``):

* on a GPU: Llama-8B attention (32 query heads, 8 KV heads, head dim 128), a paged KV cache of page
  size 16 whose pages are shuffled across all sequences, 8 mixed chunked prefills (16 to 2048 new
  tokens over cached prefixes of up to 6144), bf16, causal, through ``backend="auto"`` (or
  ``--backend``);
* on the CPU: a smaller batch (8 / 2 heads, head dim 64) in float32 through the same call (``auto``
  is the torch backend there) and, when ``TRITON_INTERPRET=1`` was set before the start, the Triton
  kernels in float16 (never bfloat16: the interpreter computes bf16 dots wrongly).

Every output is compared with a float64 reference computed here, per sequence, on K/V gathered token
by token from the block table (no library code). The printout says what ran (heads, head dim,
dtype, the backend as ``pagedprefill.last_backend()`` reports it), the errors and the time per call.
Exit status: 0 when every error is within tolerance, 1 otherwise, 2 when the backend cannot run here.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import time

import torch
from torch import Tensor

import pagedprefill
from pagedprefill import workloads as wl

GPU_WORKLOAD = {
    "name": "demo_chunked_b8",
    "batch": 8,
    "qo_min": 16,
    "qo_max": 2048,
    "prefix_max": 6144,
    "seed": 1,
    "heads_q": 32,
    "heads_kv": 8,
    "head_dim_qk": 128,
    "head_dim_vo": 128,
    "page_size": 16,
    "causal": True,
}
CPU_WORKLOAD = {
    **GPU_WORKLOAD,
    "name": "demo_chunked_b4_cpu",
    "batch": 4,
    "qo_min": 4,
    "qo_max": 48,
    "prefix_max": 80,
    "heads_q": 8,
    "heads_kv": 2,
    "head_dim_qk": 64,
    "head_dim_vo": 64,
}
# (relative L2 error of out, max abs error of lse) allowed against float64, by the data type: the
# inputs are the same rounded values in both, so only the kernel's own rounding counts (the output's
# and, in 16-bit kernels, the probabilities' before the PV product).
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}
GPU_HINT = (
    "On a machine with a CUDA GPU, `python -m pagedprefill.demo` (or `pagedprefill-demo`) runs the Llama-8B "
    "batch (heads 32/8, head dim 128, page 16, bf16) through backend='auto'."
)


def reference_fp64(case: dict) -> tuple[Tensor, Tensor]:
    """Float64 attention of a paged ``case`` (from :func:`pagedprefill.workloads.build_case`).

    For each sequence b, its K/V are materialised token by token through the block table (token t is
    slot ``t % page_size`` of page ``block_tables[b, t // page_size]``), its rows of q are taken at the
    prefix sum of the q lengths, and softmax(scale·q·Kᵀ)·V is computed with the bottom-right aligned
    causal mask (query i sees keys j <= i + kv_len - q_len), query head h reading KV head
    h // (Hq / Hkv). Computed on the case's device, in chunks of query rows to bound memory.

    Returns ``out`` (total_q, Hq, Dvo) and ``lse`` (total_q, Hq), float64, natural log.
    """
    q_all, k_cache, v_cache = case["q"], case["k_cache"], case["v_cache"]
    table = case["block_tables"].long()
    lens_q = [int(x) for x in case["actual_seq_lens_q"].tolist()]
    lens_kv = [int(x) for x in case["actual_seq_lens_kv"].tolist()]
    hq, hkv, page = q_all.shape[1], k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    dev = q_all.device
    out = torch.zeros((q_all.shape[0], hq, v_cache.shape[-1]), dtype=torch.float64, device=dev)
    lse = torch.full((q_all.shape[0], hq), -math.inf, dtype=torch.float64, device=dev)
    row0 = 0
    for b, (lq, lkv) in enumerate(zip(lens_q, lens_kv)):
        t = torch.arange(lkv, device=dev)
        pages, slots = table[b, t // page], t % page
        k = k_cache[pages, :, slots, :].double().repeat_interleave(group, dim=1)  # (lkv, Hq, D)
        v = v_cache[pages, :, slots, :].double().repeat_interleave(group, dim=1)
        chunk = max(1, 2**26 // max(1, hq * lkv))  # score chunk: 64M float64 elements at most
        for r0 in range(0, lq, chunk):
            r1 = min(lq, r0 + chunk)
            q = q_all[row0 + r0 : row0 + r1].double()  # (c, Hq, D)
            s = torch.einsum("ihd,jhd->hij", q, k) * case["scale"]  # (Hq, c, lkv)
            i = torch.arange(r0, r1, device=dev).view(-1, 1)
            s = s.masked_fill(t.view(1, -1) > i + (lkv - lq), -math.inf)
            m = torch.logsumexp(s, dim=-1)  # (Hq, c)
            p = torch.exp(s - m.clamp(min=-1e300).unsqueeze(-1))  # a row with no visible key: p = 0
            out[row0 + r0 : row0 + r1] = torch.einsum("hij,jhd->ihd", p, v)
            lse[row0 + r0 : row0 + r1] = m.transpose(0, 1)
        row0 += lq
    return out, lse


def errors(out: Tensor, lse: Tensor, ref_out: Tensor, ref_lse: Tensor, lens_q: list[int]) -> dict:
    """``rel`` = ‖out − ref‖₂ / ‖ref‖₂, ``max`` = max |out − ref|, ``lse`` = max |lse − ref| over the
    valid rows of the (B, max_q, Hq) ``lse``. Non-finite outputs give infinite errors."""
    d = out.double() - ref_out
    rel = float(d.norm() / ref_out.norm()) if torch.isfinite(d).all() else math.inf
    rows = torch.cat([lse[b, :n] for b, n in enumerate(lens_q) if n]).double()
    lse_err = float((rows - ref_lse).abs().max()) if torch.isfinite(rows).all() else math.inf
    return {"rel": rel, "max": float(d.abs().max()) if math.isfinite(rel) else math.inf, "lse": lse_err}


def _time_per_call(fn, device: torch.device, reps: int) -> float:
    """Median ms per call: CUDA events on a GPU (one call at a time), time.perf_counter on the CPU."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_one(w: dict, device: torch.device, dtype: torch.dtype, backend: str, seed: int, reps: int) -> bool | None:
    """Build the batch in ``dtype``, run it with ``backend``, check it and time it; True when within
    tolerance, None when the backend cannot run here (printed)."""
    case = wl.build_case(w, device, dtype=dtype, seed=seed)
    lens_q = [int(x) for x in case["actual_seq_lens_q"].tolist()]
    k = case["k_cache"]
    print(f"q:           {tuple(case['q'].shape)} (total_q_tokens, Hq, D)")
    print(
        f"k_cache:     {tuple(k.shape)} (num_pages, Hkv, page_size, D), NHD storage, strides "
        f"{tuple(k.stride())}; block table {tuple(case['block_tables'].shape)} int32"
    )
    t0 = time.perf_counter()
    try:
        out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**case, backend=backend)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except (pagedprefill.BackendUnavailableError, ValueError) as e:
        print(f"backend {backend!r} cannot run here: {e}")
        return None
    first_s = time.perf_counter() - t0
    served = pagedprefill.last_backend()
    ran = f"backend={backend!r} -> {served}" if backend == "auto" else f"backend={served!r}"
    print(
        f"ran:         {ran} (pagedprefill.last_backend()), {_dtype_name(dtype)} q/k/v, heads "
        f"{w['heads_q']}/{w['heads_kv']}, head dim {w['head_dim_qk']}"
    )
    lse_about = f"{tuple(lse.shape)} {_dtype_name(lse.dtype)}"
    print(f"out:         {tuple(out.shape)} {_dtype_name(out.dtype)};  lse: {lse_about}")
    t0 = time.perf_counter()
    ref_out, ref_lse = reference_fp64(case)
    ref_s = time.perf_counter() - t0
    err = errors(out, lse, ref_out, ref_lse, lens_q)
    rel_tol, lse_tol = TOLERANCE[dtype]
    ok = err["rel"] <= rel_tol and err["lse"] <= lse_tol
    print(
        f"vs float64:  relative err {err['rel']:.3e} (tol {rel_tol:g}), max abs err {err['max']:.3e}, "
        f"lse max abs err {err['lse']:.3e} (tol {lse_tol:g})  [float64 reference, K/V gathered per sequence, "
        f"{ref_s:.2f} s]"
    )
    gflop = wl.flops(w) / 1e9
    ms = _time_per_call(lambda: pagedprefill.cudnn_batch_prefill_with_kv_cache(**case, backend=backend), device, reps)
    print(
        f"time:        {ms:.3f} ms per call (median of {reps}; first call {first_s:.2f} s), "
        f"{gflop / ms:.3g} TFLOP/s ({gflop:.3g} GFLOP)"
    )
    print("result:      OK" if ok else "result:      ERROR ABOVE TOLERANCE")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedprefill-demo", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=pagedprefill.BACKENDS, help="backend to demo (default auto)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 20 on a GPU, 3 on the CPU)")
    p.add_argument("--seed", type=int, default=0, help="data seed (the lengths are fixed)")
    args = p.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("pagedprefill-demo: --device cuda but no CUDA GPU is available", file=sys.stderr)
        return 2
    gpu = device.type == "cuda"
    w = GPU_WORKLOAD if gpu else CPU_WORKLOAD
    reps = args.reps if args.reps is not None else (20 if gpu else 3)
    # (backend, dtype) of each run: the GPU run in bf16; on the CPU float32, and the Triton kernels
    # in float16 when the interpreter is on (it was chosen when Triton first decorated the kernels)
    runs = [(args.backend, torch.bfloat16 if gpu else torch.float32)]
    interpret = not gpu and os.environ.get("TRITON_INTERPRET") == "1" and args.backend in ("auto", "torch")
    has_triton = importlib.util.find_spec("triton") is not None
    if interpret and has_triton:
        runs.append(("triton", torch.float16))

    q_lens, kv_lens = wl.lengths(w)
    dev_name = torch.cuda.get_device_name(device) if gpu else "cpu"
    print(f"device:      {dev_name} (torch {torch.__version__}, pagedprefill {pagedprefill.__version__})")
    print(
        f"batch:       {len(q_lens)} chunked prefills over cached prefixes, {w['heads_q']} query heads / "
        f"{w['heads_kv']} KV heads, head dim {w['head_dim_qk']}, page size {w['page_size']} (pages shuffled "
        f"across sequences), causal"
    )
    print(f"q lengths:   {q_lens}")
    print(f"kv lengths:  {kv_lens}")
    results = []
    for i, (backend, dtype) in enumerate(runs, 1):
        print(f"-- run {i}/{len(runs)}: backend={backend!r}, {_dtype_name(dtype)}")
        results.append(run_one(w, device, dtype, backend, args.seed, reps))
    if not gpu:
        print(f"note:        CPU run (smaller batch). {GPU_HINT}")
        if interpret and not has_triton:
            print('note:        TRITON_INTERPRET=1 is set but Triton is not installed: pip install -e ".[triton]"')
        elif os.environ.get("TRITON_INTERPRET") != "1":
            print("note:        with TRITON_INTERPRET=1 set before the start, the Triton kernels run too")
    if any(r is None for r in results):
        return 2
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
