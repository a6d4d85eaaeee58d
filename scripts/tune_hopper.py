"""Time the Hopper kernel under knob sets on shared workloads, beside cuDNN, in one process.

    python scripts/tune_hopper.py d256_b8_q2k "BLOCK_N=32,stages=4" "consumer_regs=232,load_regs=40"

A workload name with the suffix ``:fp8kv`` runs its data with K/V quantized to e4m3 (q unchanged,
scales 0.5); ``:fp8`` q, K and V quantized; ``:bf16`` runs an fp8 workload's 16-bit data.
``--extra=FILE`` adds the workloads of a JSON list (the keys of ``workloads.json``'s entries, as
``pagedprefill-bench --workloads-file`` takes them) to the names the run knows. ``--alternate``
times the knob sets in reverse order in odd rounds, so that a set is not always the one timed last
in a workload (a drift of the clocks over a workload's runs then reaches each set in both places).

Each knob set is ``name=value`` pairs (``tuning.override("hopper", ...)``); the first row is the
default config. Times: the eager benchmark's timer (CUDA events around one call, L2 flushed before
it, the queue pre-loaded so that host time does not show; median over ~100 ms), ``--rounds`` times
in turn over the knob sets so that drift shows (the eager table of ``pagedprefill-bench`` is the
measurement of record).
"""

from __future__ import annotations

import sys

import torch

import pagedprefill
from pagedprefill import tuning
from pagedprefill import workloads as wl
from pagedprefill.bench import timing


def main() -> int:
    argv = sys.argv[1:]
    rounds = 1
    alternate = False
    while argv and argv[0].startswith("--"):
        opt = argv.pop(0)
        if opt.startswith("--rounds="):
            rounds = int(opt.split("=")[1])
        elif opt.startswith("--extra="):
            wl.add_workloads(wl.read_workloads(opt.split("=", 1)[1]))
        elif opt == "--alternate":
            alternate = True
        else:
            print(f"unknown option {opt!r}", file=sys.stderr)
            return 2
    names = argv[0].split(",")
    sets = [{}] + [{k: int(v) for k, v in (kv.split("=") for kv in s.split(","))} for s in argv[1:]]
    cfg = timing.TimingConfig()
    dev = torch.device("cuda")
    for name in names:
        kw = wl.named_case(name, dev)
        tf = wl.flops(wl.get_workload(name.split(":")[0])) / 1e9
        ref = None
        order = [sets[::-1] if alternate and r % 2 else sets for r in range(rounds)]
        for backend, knobs in [("cudnn", {})] + [("triton", s) for ss in order for s in ss]:
            with tuning.override("hopper", **knobs):
                try:
                    call = lambda b=backend, kw=kw: pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend=b)  # noqa: E731
                    out = call()[0].float()
                    ref = out if ref is None else ref
                    err = (out - ref).abs().max().item()
                    ms, _, _ = timing.time_gpu(call, cfg, lambda _msg: None)
                    line = f"{name:22s} {backend:6s} {str(knobs):44s} {tf / ms:7.1f} TF/s {ms:8.3f} ms"
                    print(f"{line}  max|d| {err:.3g}")
                except Exception as e:
                    print(f"{name:22s} {backend:6s} {str(knobs):44s} ERROR {type(e).__name__}: {str(e)[:160]}")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
