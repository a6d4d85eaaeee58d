"""SM clock and board power while each system runs a workload back to back, for ``--seconds`` each.

    python scripts/clock_probe.py llama8b_b1_q16k fp8_b2_q8k --seconds 3

A kernel that spends more energy per FLOP (more instructions, more shared-memory traffic) runs at a
lower clock once the board reaches its power limit; the eager table's medians include that. For each
workload and system (the Triton backend, cuDNN where it serves the data, FA3's varlen forward on the
same data stored contiguously) the calls are queued back to back; ``nvidia-smi`` samples the SM clock
and power every 50 ms meanwhile. Printed per phase: the mean time per call (CUDA events over the
phase's second half), the mean clock and power over that half, and the cycles per call they imply.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time

import torch

import pagedprefill
from pagedprefill import workloads as wl
from pagedprefill.bench import references


def _calls(name: str, dev: torch.device) -> list:
    kw = wl.named_case(name, dev)
    out = [("triton", lambda: pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend="triton"))]
    if kw["q"].element_size() == 2:
        out.append(("cudnn", lambda: pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend="cudnn")))
    try:
        out.append(("fa3", references.reference_call(references.FA3, wl.dense_reference_inputs(kw))))
    except Exception as e:
        print(f"{name}: FA3 skipped ({type(e).__name__}: {e})")
    return out


def _phase(fn, seconds: float) -> tuple[float, float, float, float]:
    """(t0, t_half, t_end, ms per call over the second half), calls queued back to back."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.time()
    while time.time() - t0 < seconds / 2:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    t_half = time.time()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 0
    start.record()
    while time.time() - t_half < seconds / 2:
        for _ in range(10):
            fn()
        n += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return t0, t_half, time.time(), start.elapsed_time(end) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=log,
    )
    phases = []
    try:
        time.sleep(0.5)
        for name in args.workloads:
            tf = wl.flops(wl.get_workload(name.split(":")[0])) / 1e9
            calls = _calls(name, dev)
            for _ in range(args.rounds):
                for who, fn in calls:
                    t0, th, te, ms = _phase(fn, args.seconds)
                    phases.append((name, who, th, te, ms, tf))
                    time.sleep(1.0)
    finally:
        smi.terminate()
        smi.wait()
    log.seek(0)
    samples = []
    for line in log:
        parts = [p.strip() for p in line.split(",")]
        try:
            whole, _, frac = parts[0].partition(".")
            ts = time.mktime(time.strptime(whole, "%Y/%m/%d %H:%M:%S")) + float("0." + (frac or "0"))
            samples.append((ts, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    print(f"{'workload':18s} {'system':7s} {'ms/call':>8s} {'TF/s':>7s} {'MHz':>6s} {'W':>6s} {'Mcycles/call':>12s}")
    for name, who, th, te, ms, tf in phases:
        sel = [(c, p) for ts, c, p in samples if th <= ts <= te]
        if not sel:
            print(f"{name:18s} {who:7s} {ms:8.3f} {tf / ms:7.1f}  (no clock samples in the phase)")
            continue
        mhz = sum(c for c, _ in sel) / len(sel)
        watts = sum(p for _, p in sel) / len(sel)
        print(f"{name:18s} {who:7s} {ms:8.3f} {tf / ms:7.1f} {mhz:6.0f} {watts:6.0f} {ms * mhz / 1e3:12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
