"""One call per named case, warmed up, between cudaProfilerStart/Stop, for Nsight Compute.

    ncu --profile-from-start off ... python scripts/ncu_case.py fp8kv_b8_q2k:fp8kv fp8kv_b8_q2k:bf16
    ncu --profile-from-start off ... python scripts/ncu_case.py d64_b16_q2k d64_b16_q2k@rowsum=0 fa3/d64_b16_q2k
    ncu --profile-from-start off ... python scripts/ncu_case.py --extra=scripts/varlen_shapes.json x_ragged_b32_q512

Each name (suffixes as in ``tune_hopper.py``: ``:fp8kv`` K/V quantized to e4m3, ``:fp8`` q, K and V, ``:bf16`` the
16-bit data of an fp8 workload) runs the Triton backend; ``@knob=v,knob=v`` runs it under those Hopper knobs
(``tuning.override``); the prefix ``fa3/`` runs FlashAttention-3's varlen forward on the same data stored
contiguously instead. ``--extra=FILE`` (first) adds the workloads of a JSON list to the names known (as in
``tune_hopper.py``). Each is called three times outside the profiled range (compilation, metadata, descriptor
caches), then once inside it, in the order given.
"""

from __future__ import annotations

import sys

import torch

import pagedprefill
from pagedprefill import tuning
from pagedprefill import workloads as wl
from pagedprefill.bench import references


def _call(spec: str, dev: torch.device):
    fa3 = spec.startswith("fa3/")
    name, _, knobs = spec.removeprefix("fa3/").partition("@")
    kw = wl.named_case(name, dev)
    if fa3:
        return references.reference_call(references.FA3, wl.dense_reference_inputs(kw))
    over = {k: int(v) for k, v in (kv.split("=") for kv in knobs.split(","))} if knobs else {}

    def call():
        with tuning.override("hopper", **over):
            return pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend="triton")

    return call


def main() -> int:
    dev = torch.device("cuda")
    argv = sys.argv[1:]
    if argv and argv[0].startswith("--extra="):
        wl.add_workloads(wl.read_workloads(argv.pop(0).split("=", 1)[1]))
    calls = []
    for spec in argv:
        call = _call(spec, dev)
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
