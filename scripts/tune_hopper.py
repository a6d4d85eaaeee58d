"""Time the Hopper kernel under knob sets on shared workloads, beside cuDNN, in one process.

    python scripts/tune_hopper.py d256_b8_q2k "BLOCK_N=32,stages=4" "consumer_regs=232,load_regs=40"

Each knob set is ``name=value`` pairs (``tuning.override("hopper", ...)``); the first row is the
default config. Times: CUDA events around one call, L2 flushed before it, median of 30 runs; the
queue is not pre-loaded, so on calls shorter than their host time that time shows too (compare rows
of one run; the eager table of ``pagedprefill-bench`` is the measurement of record).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_variants as bv  # noqa: E402

import pagedprefill  # noqa: E402
from pagedprefill import tuning  # noqa: E402
from pagedprefill import workloads as wl  # noqa: E402


def main() -> int:
    names = sys.argv[1].split(",")
    sets = [{}] + [{k: int(v) for k, v in (kv.split("=") for kv in s.split(","))} for s in sys.argv[2:]]
    dev = torch.device("cuda")
    for name in names:
        w = wl.get_workload(name)
        kw = wl.build_case(w, dev, dtype=torch.bfloat16, seed=0)
        kw.pop("lse", None)
        kw["return_lse"] = False
        tf = wl.flops(w) / 1e9
        ref = None
        for backend, knobs in [("cudnn", {})] + [("triton", s) for s in sets]:
            with tuning.override("hopper", **knobs):
                try:
                    call = lambda b=backend, kw=kw: pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend=b)  # noqa: E731
                    out = call()[0].float()
                    ref = out if ref is None else ref
                    err = (out - ref).abs().max().item()
                    ms = bv.timed(call)
                    line = f"{name:22s} {backend:6s} {str(knobs):44s} {tf / ms:7.1f} TF/s {ms:8.3f} ms"
                    print(f"{line}  max|d| {err:.3g}")
                except Exception as e:
                    print(f"{name:22s} {backend:6s} {str(knobs):44s} ERROR {type(e).__name__}: {str(e)[:160]}")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
