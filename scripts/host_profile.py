"""Where a call's host time goes (GPU machine): per-stage times and a cProfile of public calls.

Usage: python scripts/host_profile.py [workload] [backend ...]   (default llama8b_b16_q1k cudnn triton)
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import torch

from pagedprefill import api, cudnn_batch_prefill_with_kv_cache
from pagedprefill import workloads as wl
from pagedprefill.bench import host_time_ms


def profile(name: str, case: dict, be: str) -> None:
    kw = dict(case, backend=be)

    def call():
        cudnn_batch_prefill_with_kv_cache(**kw)

    for _ in range(5):
        call()
    batch = api._normalise(**case)
    module = api._select_backend(be, batch)
    api._fill_metadata(batch, module)
    module.run(batch)
    # the later stages reuse this batch's resolved plan (cached in batch.extras); host time only:
    # "backend run" relaunches without rewriting the metadata, so a Gluon launch on the work-counter
    # schedule (max_q > 1024) finds the counter spent and does no device work after the first
    stages = {
        "public call": call,
        "_normalise": lambda: api._normalise(**case),
        "_select_backend": lambda: api._select_backend(be, batch),
        "_fill_metadata": lambda: api._fill_metadata(batch, module),
        "backend run": lambda: module.run(batch),
    }
    print(f"== {name} / {be}: host us per call")
    for label, fn in stages.items():
        print(f"  {label:16s} {host_time_ms(fn, 200) * 1e3:8.1f}")
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(300):
        call()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(28)
    print("\n".join(line[:160] for line in buf.getvalue().splitlines()[:60]))


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama8b_b16_q1k"
    case = wl.build_case(wl.get_workload(name), "cuda")
    for be in sys.argv[2:] or ["cudnn", "triton"]:
        profile(name, case, be)


if __name__ == "__main__":
    main()
