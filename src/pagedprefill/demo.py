"""pagedprefill-demo: one realistic paged prefill batch, checked against the reference backend.

``python -m pagedprefill.demo`` (or ``pagedprefill-demo``) builds a batch of mixed chunked prefills
(Llama-8B heads 32/8, head dim 128, page size 16, pages of all sequences shuffled; a smaller batch
on the CPU so that it finishes in seconds), runs it with ``backend="auto"`` (or ``--backend``),
compares the result with the ``torch`` reference backend and prints the device, the backend,
the shapes, the errors and the time per call. Exit status 1 when the error is above tolerance.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pagedprefill import api
from pagedprefill import workloads as wl
from pagedprefill.bench import LSE_ABS_TOL, OUT_REL_TOL, compare, lse_rows

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
    "name": "demo_chunked_b8_cpu",
    "qo_min": 4,
    "qo_max": 96,
    "prefix_max": 160,
    "heads_q": 8,
    "heads_kv": 2,
    "head_dim_qk": 64,
    "head_dim_vo": 64,
}


def _time_per_call(fn, device: torch.device, reps: int) -> float:
    """Median ms per call: CUDA events on a GPU, time.perf_counter on the CPU."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _resolved_backend(backend: str) -> str:
    """The backend that served the last call (what ``auto`` picked)."""
    used = api.last_backend()
    return f"auto -> {used}" if backend == "auto" and used else backend


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedprefill-demo", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="auto", choices=api.BACKENDS, help="backend to demo (default auto)")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 20 on a GPU, 3 on the CPU)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("pagedprefill-demo: --device cuda but no CUDA GPU is available", file=sys.stderr)
        return 2
    w = GPU_WORKLOAD if device.type == "cuda" else CPU_WORKLOAD
    dtype = torch.bfloat16
    reps = args.reps or (20 if device.type == "cuda" else 3)

    q_lens, kv_lens = wl.lengths(w)
    case = wl.build_case(w, device, dtype=dtype, seed=args.seed)
    gflop = wl.flops(w) / 1e9
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device:      {dev_name} (torch {torch.__version__})")
    print(
        f"batch:       {len(q_lens)} chunked prefills, heads {w['heads_q']}/{w['heads_kv']}, "
        f"head dim {w['head_dim_qk']}, page {w['page_size']} (pages shuffled), {str(dtype)[6:]}, causal"
    )
    print(f"q lengths:   {q_lens}")
    print(f"kv lengths:  {kv_lens}")
    print(f"q:           {tuple(case['q'].shape)}")
    print(
        f"k_cache:     {tuple(case['k_cache'].shape)} (num_pages, Hkv, page_size, D), NHD storage, "
        f"strides {tuple(case['k_cache'].stride())}"
    )
    print(f"block table: {tuple(case['block_tables'].shape)}")

    t0 = time.perf_counter()
    try:
        out, lse = api.cudnn_batch_prefill_with_kv_cache(**case, backend=args.backend)
        if device.type == "cuda":
            torch.cuda.synchronize()
    except (api.BackendUnavailableError, ValueError) as e:
        print(f"backend {args.backend!r} cannot run here: {e}", file=sys.stderr)
        return 2
    first_s = time.perf_counter() - t0
    print(f"backend:     {_resolved_backend(args.backend)}")
    print(f"out:         {tuple(out.shape)} {out.dtype}")
    print(f"lse:         {tuple(lse.shape)} {lse.dtype}")
    ref_out, ref_lse = api.cudnn_batch_prefill_with_kv_cache(
        **{**case, "out": None, "lse": None}, backend="torch"
    )
    err = compare(out, ref_out, lse_rows(lse, q_lens), lse_rows(ref_lse, q_lens))
    ok = err["ok"]
    print(
        f"vs torch:    max abs err {err['max_err']:.3e}, relative err {err['rel_err']:.3e} "
        f"(tol {OUT_REL_TOL:g}), lse max abs err {err['lse_err']:.3e} (tol {LSE_ABS_TOL:g})"
    )
    if device.type == "cpu":  # auto is the torch backend here: also check against float64 math
        ref64, lse64 = wl.reference_fp64(wl.dense_reference_inputs(case))
        err64 = compare(out, ref64, lse_rows(lse, q_lens), torch.cat(lse64))
        ok = ok and err64["ok"]
        print(
            f"vs float64:  max abs err {err64['max_err']:.3e}, relative err {err64['rel_err']:.3e}, "
            f"lse max abs err {err64['lse_err']:.3e}"
        )
    ms = _time_per_call(
        lambda: api.cudnn_batch_prefill_with_kv_cache(**case, backend=args.backend), device, reps
    )
    print(
        f"time:        {ms:.3f} ms per call (median of {reps}; first call {first_s:.2f} s), "
        f"{gflop / ms:.2f} TFLOP/s ({gflop:.1f} GFLOP)"
    )
    print("result:      OK" if ok else "result:      ERROR ABOVE TOLERANCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
