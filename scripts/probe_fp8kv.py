"""Probe: fp8 K/V on the Hopper kernel against its 16-bit twins on workloads' shapes."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_variants as bv  # noqa: E402

import pagedprefill  # noqa: E402
from pagedprefill import workloads as wl  # noqa: E402

dev = torch.device("cuda")
for name in sys.argv[1].split(","):
    w = wl.get_workload(name)
    wide = wl.build_case(w, dev, dtype=torch.bfloat16, seed=0, fp8=False)
    fp8 = wl.quantize_case(wide, "fp8_kv")
    tf = wl.flops(w) / 1e9
    ms = {}
    for label, kw in (("bf16 kv", wide), ("fp8 kv", fp8)):
        call = lambda kw=kw: pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend="triton")  # noqa: E731
        out = call()[0].float()
        ms[label] = bv.timed(call)
        print(f"{name:22s} {label:8s} {tf / ms[label]:7.1f} TF/s {ms[label]:8.3f} ms", flush=True)
        if label == "bf16 kv":
            ref = out
    err = (out - ref).abs().max().item()
    print(f"{name:22s} fp8 / bf16 speed {ms['bf16 kv'] / ms['fp8 kv']:.3f}  max|fp8 - bf16| {err:.3g}", flush=True)
