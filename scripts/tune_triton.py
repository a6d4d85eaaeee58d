"""Sweep the Triton kernel's launch knobs on the GPU, side by side with cuDNN, in one process.

    python scripts/tune_triton.py --workloads llama8b_b1_q16k,page1_b16_q1k:page_size=8 \
        --configs "128,64,8,3;128,128,8,2" [--graph]

A workload is a name from workloads.json, optionally with ``:key=value`` overrides.

Each config is ``BLOCK_M,BLOCK_N,num_warps,num_stages[,lazy[,num_splits]]`` or ``key=value`` pairs
(e.g. ``gluon=0`` for the Triton kernel, ``gluon=1`` (the default) for the Gluon kernel where it
serves; the Gluon kernel's own knobs as ``g.<knob>``, e.g. ``gluon=1,g.chunk=8``, replace
``PAGEDPREFILL_GLUON_CONFIG`` for that config, not merged with it; ``g.rule=1`` applies them on top
of the kernel's shape rule instead of ``DEFAULT``); "default" means the
backend's own choice. Times are do_bench medians (L2 flushed); with --graph the call is captured in a CUDA
graph first so host overhead is excluded. Every timed output is checked against cuDNN's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

from pagedprefill import cudnn_batch_prefill_with_kv_cache as prefill
from pagedprefill.backends import triton_backend as tb
from pagedprefill.workloads import build_case, flops, get_workload


def timed(fn, graph: bool) -> float:
    fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    return triton.testing.do_bench(run, warmup=30, rep=150, return_mode="median")


def parse_configs(text: str) -> list[dict | None]:
    out: list[dict | None] = []
    for item in text.split(";"):
        item = item.strip()
        if item == "default":
            out.append(None)
            continue
        if "=" in item:  # key=value form, e.g. BLOCK_M=128,lazy=1
            out.append({k: int(v) for k, v in (kv.split("=") for kv in item.split(","))})
            continue
        vals = [int(x) for x in item.split(",")]
        keys = ["BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "lazy", "num_splits"]
        out.append(dict(zip(keys, vals)))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="llama8b_b1_q16k")
    p.add_argument("--configs", default="default")
    p.add_argument("--graph", action="store_true")
    p.add_argument("--no-cudnn", action="store_true")
    p.add_argument(
        "--gluon-diag",
        type=int,
        default=0,
        help="gluon_sm90.DIAGNOSTIC_SKIP (bits: 1 no K/V copies, 2 no softmax, 4 no V copies, 8 no Q copies, "
        "16 no O/LSE stores); wrong results",
    )
    args = p.parse_args()
    from pagedprefill.backends import gluon_sm90

    gluon_sm90.DIAGNOSTIC_SKIP = args.gluon_diag
    gluon_env = os.environ.get("PAGEDPREFILL_GLUON_CONFIG", "")
    rows = []
    for name in args.workloads.split(","):
        base, *over = name.split(":")  # e.g. page1_b16_q1k:page_size=8
        w = get_workload(base)
        w.update({k: int(v) for k, v in (o.split("=") for o in over)})
        kw = build_case(w, "cuda", lens_on_device=args.graph)
        gflop = flops(w) / 1e9
        ref = None
        if not args.no_cudnn:
            try:
                ref = prefill(**kw, backend="cudnn")[0].float().clone()
                ms = timed(lambda kw=kw: prefill(**kw, backend="cudnn"), args.graph)
                rows.append((name, "cudnn", ms, gflop / ms, 0.0))
                print(f"{name:24s} cudnn            {ms:8.3f} ms {gflop / ms:7.1f} TF/s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name:24s} cudnn failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        for cfg in parse_configs(args.configs):
            label = "default" if cfg is None else ",".join(str(v) for v in cfg.values())
            if cfg and (len(label) > 12 or any(k.startswith("g.") for k in cfg)):
                # triton knobs as 2 letters + value (gl1: gluon=1), Gluon knobs as up to 6 letters
                label = ",".join(f"{k[2:8] if k.startswith('g.') else k[:2]}{v}" for k, v in cfg.items())
            cfg = cfg or {}
            knobs = ",".join(f"{k[2:]}={v}" for k, v in cfg.items() if k.startswith("g.") and k != "g.rule")
            if cfg.get("g.rule"):
                knobs = "+" + knobs
            os.environ["PAGEDPREFILL_GLUON_CONFIG"] = knobs or gluon_env
            cfg = {k: v for k, v in cfg.items() if not k.startswith("g.")}
            try:
                with tb.config_override(**cfg):
                    out = prefill(**kw, backend="triton")[0].float()
                    err = 0.0
                    if ref is not None:
                        err = ((out - ref).norm() / ref.norm()).item()
                    ms = timed(lambda kw=kw: prefill(**kw, backend="triton"), args.graph)
                rows.append((name, label, ms, gflop / ms, err))
                print(
                    f"{name:24s} triton {label:10s} {ms:8.3f} ms {gflop / ms:7.1f} TF/s err {err:.1e}",
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001
                print(f"{name:24s} triton {label:10s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"\nSUMMARY (graph={args.graph})")
    for r in rows:
        print(f"{r[0]:24s} {r[1]:12s} {r[2]:8.3f} ms {r[3]:7.1f} TF/s err {r[4]:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
