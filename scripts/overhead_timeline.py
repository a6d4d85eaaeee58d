"""Where the cuDNN call's back-to-back time goes (GPU machine): the kernel timeline of N queued
calls, from the PyTorch profiler (CUPTI), for the public call and its bare graph.

Usage: python scripts/overhead_timeline.py [workload ...]   (default llama8b_b16_q1k page1_b16_q1k)

Variants, each run N times behind a sleep kernel: long enough for all N to be queued before the
first runs (device time only), then short (the host queues calls while the GPU runs them):
  graph       the built cuDNN graph executed directly (cudnn_backend.bare_graph)
  graph+fill  the graph with one trivial torch kernel before each run
  backend.run the backend alone on a normalised batch: preparation kernel + graph, no api work
  call        the public call, backend="cudnn"
Per variant, µs per call: host time of the loop, period (first to last SDPA kernel end / N-1), SDPA
kernel time, time in the other kernels and copies, idle time between consecutive GPU operations;
and the largest idle gap.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pagedprefill import api, cudnn_batch_prefill_with_kv_cache
from pagedprefill import workloads as wl
from pagedprefill.backends import cudnn_backend as cb

N = 50
QUEUED, LIVE = int(80e6), int(1e6)  # sleep cycles before the loop: ~40 ms (all N queued), ~0.5 ms


def kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every GPU kernel, in start order."""
    out = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(out, key=lambda t: t[1])


def timeline(fn, sleep_cycles: int) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        host = (time.perf_counter() - t0) / N * 1e6
        torch.cuda.synchronize()
    ks = [k for k in kernels(prof) if "spin" not in k[0] and "sleep" not in k[0].lower()]
    sdpa = [k for k in ks if "sdpa" in k[0]]  # cuDNN's attention kernel, one per call
    gaps = [b[1] - a[2] for a, b in zip(ks, ks[1:])]
    return {
        "host": host,
        "period": (sdpa[-1][2] - sdpa[0][2]) / (len(sdpa) - 1),
        "cudnn": statistics.mean(k[2] - k[1] for k in sdpa),
        "other": sum(k[2] - k[1] for k in ks if "sdpa" not in k[0]) / len(sdpa),
        "gap": sum(gaps) / len(sdpa),
        "max_gap": max(gaps),
        "n_kernels": len(ks),
        "names": sorted({k[0][:40] for k in ks}),
    }


def run(name: str) -> None:
    case = wl.build_case(wl.get_workload(name), "cuda")
    kw = dict(case, backend="cudnn")

    def call():
        cudnn_batch_prefill_with_kv_cache(**kw)

    call()
    batch = api._normalise(**case)
    api._fill_metadata(batch, cb)
    cb.run(batch)
    graph = cb.bare_graph(batch)
    tiny = torch.zeros(1, device="cuda")

    def graph_fill():
        tiny.fill_(1.0)
        graph()

    def backend_run():  # preparation kernel + graph through the backend, no api work
        cb.run(batch)

    variants = {
        "graph": graph,
        "graph+fill": graph_fill,
        "backend.run": backend_run,
        "call": call,
        "graph-again": graph,
    }
    for mode, cycles in (("all queued first", QUEUED), ("queued while running", LIVE)):
        print(f"== {name}: {N} calls, {mode}; µs per call")
        cols = ("host", 6), ("period", 8), ("sdpa", 8), ("other", 7), ("idle", 7), ("max idle", 8)
        print(f"  {'variant':12s} " + " ".join(f"{c:>{w}s}" for c, w in cols))
        for label, fn in variants.items():
            try:
                r = timeline(fn, cycles)
            except Exception as e:  # keep going: one variant failing must not hide the others
                print(f"  {label:12s} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            print(
                f"  {label:12s} {r['host']:6.0f} {r['period']:8.1f} {r['cudnn']:8.1f} {r['other']:7.1f} "
                f"{r['gap']:7.1f} {r['max_gap']:8.1f}  {r['n_kernels']} ops"
            )


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name in sys.argv[1:] or ["llama8b_b16_q1k", "page1_b16_q1k"]:
        run(name)


if __name__ == "__main__":
    main()
