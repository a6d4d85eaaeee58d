"""One Triton call of a workload, warmed up, between cudaProfilerStart/Stop, for Nsight Compute.

    ncu --profile-from-start off ... python scripts/ncu_case.py fp8kv_b8_q2k:fp8kv fp8kv_b8_q2k:bf16

Each name (suffixes as in ``tune_hopper.py``: ``:fp8kv`` K/V quantized to e4m3, ``:fp8`` q, K and V, ``:bf16`` the
16-bit data of an fp8 workload) is called three times outside the profiled range (compilation,
metadata, descriptor caches), then once inside it.
"""

from __future__ import annotations

import sys

import torch

import pagedprefill
from pagedprefill import workloads as wl


def main() -> int:
    dev = torch.device("cuda")
    calls = []
    for name in sys.argv[1:]:
        kw = wl.named_case(name, dev)
        call = lambda kw=kw: pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend="triton")  # noqa: E731
        for _ in range(3):
            call()
        calls.append(call)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
