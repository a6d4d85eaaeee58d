"""``pagedprefill-bench`` / ``python -m pagedprefill.bench``: the command line and ``main``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch

from pagedprefill import workloads as wl

from . import layers, references, serving, sweep, tables
from .common import DTYPES, LIBRARY_BACKENDS, Interrupted, environment, resolve_device, say
from .references import FA3, REFERENCES

ALL_BACKENDS = LIBRARY_BACKENDS + REFERENCES


class UsageError(Exception):
    """A bad combination of arguments: reported with exit status 2 before anything runs."""


def _csv(s: str | None) -> list[str] | None:
    if s is None:
        return None
    return [x.strip() for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedprefill-bench",
        description=(
            "Benchmark pagedprefill's backends beside FlashAttention-3 and -2 on the project's prefill "
            "workloads (table mode, the default), in a serving loop (--serving N) or as a serving "
            "engine's eager step of N layers (--layers N). Results are printed; files are written only "
            "where --out-json / --markdown / --plot say."
        ),
    )
    p.add_argument(
        "--workloads",
        help="comma list of workload names (table mode; default: all, on the CPU the cpu_* set) or of "
        "layer cases (--layers); --list shows them",
    )
    p.add_argument(
        "--backends",
        help=f"comma list from {', '.join(ALL_BACKENDS)} (default on a GPU: cudnn,triton,auto,fa3-varlen,"
        "fa2-varlen; --layers: triton,cudnn,fa3-varlen,fa2-varlen; on the CPU: torch)",
    )
    p.add_argument(
        "--workloads-file",
        metavar="PATH",
        help="table mode: a JSON list of workloads with workloads.json's keys (name, batch, qo_len or "
        "qo_min/qo_max, prefix or prefix_max, heads_q, heads_kv, head_dim_qk, page_size, causal; "
        "optional head_dim_vo, seed, dtype); they are run unless --workloads names others",
    )
    p.add_argument("--list", action="store_true", help="list the workloads and layer cases, then exit")
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="data type of q/K/V (default bf16; fp8 workloads are quantized from it)",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0, help="data seed (lengths come from each workload's seed)")
    g = p.add_argument_group("timing")
    g.add_argument(
        "--reps", type=int, default=None, help="timed runs per backend, split over --rounds (default: ~--rep-ms worth)"
    )
    g.add_argument("--warmup-ms", type=float, default=25.0, help="GPU warm-up budget per backend (ms)")
    g.add_argument("--rep-ms", type=float, default=100.0, help="GPU timing budget per backend when --reps unset")
    g.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="table mode on a GPU: each workload's backends are timed in this many rounds, run by run in turn "
        "(with --timer gpu), and each reads the median of its rounds (a clock drift then reaches all alike; default 3)",
    )
    g.add_argument(
        "--timer",
        choices=("gpu", "events", "do_bench"),
        default="gpu",
        help="'gpu' (default): CUDA events around one call, L2 flushed, the queue pre-loaded with a sleep "
        "kernel (device time only); 'events': the same without the pre-load; 'do_bench': Triton's",
    )
    g.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    g.add_argument(
        "--cuda-graph",
        action="store_true",
        help="table mode: capture each call in a CUDA graph and time the replays (implies --device-lengths; "
        "the torch backend stays eager)",
    )
    g.add_argument(
        "--device-lengths",
        action="store_true",
        help="lengths on the device and is_cuda_graph_compatible=True (default: lengths on the CPU)",
    )
    o = p.add_argument_group("output (nothing is written unless asked)")
    o.add_argument("--out-json", metavar="PATH", help="JSON Lines: one object per measurement")
    o.add_argument("--append", action="store_true", help="append to --out-json instead of replacing it")
    o.add_argument("--markdown", metavar="PATH", help="the summary table as markdown")
    o.add_argument("--plot", metavar="PATH", help="table mode: a PNG bar chart of TFLOP/s (needs matplotlib)")
    s = p.add_argument_group("serving mode")
    s.add_argument("--serving", type=int, default=None, metavar="N", help="serving loop of N measured calls")
    s.add_argument("--serving-warmup", type=int, default=50, help="warm-up calls before measuring (default 50)")
    s.add_argument("--serving-checks", type=int, default=5, help="measured calls checked for correctness")
    s.add_argument(
        "--serving-fixed-max",
        action="store_true",
        help="pass fixed caps as max_token_per_sequence / max_sequence_kv instead of per-call maxima",
    )
    s.add_argument("--serving-backends", help="comma list of library backends (default: --backends, else cudnn,triton)")
    lg = p.add_argument_group("layers mode")
    lg.add_argument(
        "--layers",
        type=int,
        nargs="?",
        const=layers.DEFAULT_LAYERS,
        default=None,
        metavar="N",
        help=f"a serving engine's eager step of N layers per case (default N {layers.DEFAULT_LAYERS})",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _describe(w: dict) -> str:
    q_lens, kv_lens = wl.lengths(w)
    dims = f"D {w['head_dim_qk']}/{w['head_dim_vo']}"
    return (
        f"  {w['name']:<24} batch {w['batch']:>3}, heads {w['heads_q']}/{w['heads_kv']}, {dims}, "
        f"page {w['page_size']}, {wl.data_kind(w)}, {sum(q_lens)} q / {sum(kv_lens)} kv tokens, "
        f"{wl.flops(w) / 1e9:.1f} GFLOP"
    )


def list_everything(workloads_file: str | None = None) -> None:
    say("workloads (table mode):")
    for w in wl.load_workloads():
        say(_describe(w))
    if workloads_file:
        say(f"workloads of {workloads_file}:")
        for w in wl.read_workloads(workloads_file):
            say(_describe(w))
    say("CPU workloads (the default without a GPU):")
    for w in wl.CPU_WORKLOADS:
        say(f"  {w['name']}")
    say("layer cases (--layers):")
    for c in layers.GPU_CASES + layers.CPU_CASES:
        say(
            f"  {c.name:<26} batch {c.batch}, q {c.q_len}, prefix {c.prefix}, "
            f"{'ragged' if c.page_size == 0 else f'page {c.page_size}'}"
            + (", lengths and offsets on the device" if c.device_vectors else "")
        )


def resolve(args: argparse.Namespace, device: torch.device) -> None:
    """Check the argument combination and fill in the defaults (``backend_names``, ``workload_names``,
    ``dtype``); raises :class:`UsageError`."""
    if args.serving is not None and args.layers is not None:
        raise UsageError("--serving and --layers are separate modes: give one")
    mode = "serving" if args.serving is not None else ("layers" if args.layers is not None else "table")
    if args.serving is not None and (args.serving < 1 or args.serving_warmup < 0):
        raise UsageError("--serving N needs N >= 1 and --serving-warmup >= 0")
    if args.layers is not None and args.layers < 1:
        raise UsageError("--layers N needs N >= 1")
    for flag, path in (("--out-json", args.out_json), ("--markdown", args.markdown), ("--plot", args.plot)):
        if path:  # (a path that cannot be written fails now, not after the whole run)
            target = Path(path)
            if target.is_dir():
                raise UsageError(f"{flag} {path}: a directory, not a file")
            parent = target.parent
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UsageError(f"{flag} {path}: cannot create its folder ({e.strerror})") from e
            if not os.access(parent, os.W_OK):
                raise UsageError(f"{flag} {path}: its folder is not writable")
    if args.reps is not None and args.reps < 1:
        raise UsageError("--reps must be >= 1")
    if args.plot and mode != "table":
        raise UsageError("--plot draws the table mode's TFLOP/s; it cannot be combined with --serving / --layers")
    if args.append and not args.out_json:
        raise UsageError("--append needs --out-json")
    if args.cuda_graph and mode != "table":
        raise UsageError("--cuda-graph applies to the table mode only")
    if args.workloads_file and mode != "table":
        raise UsageError("--workloads-file applies to the table mode only")
    if args.device_lengths and mode == "layers":
        raise UsageError("--device-lengths has no effect with --layers: each layer case says where its lengths live")
    if mode == "serving":
        listed = _csv(args.serving_backends) or [b for b in (_csv(args.backends) or []) if b in LIBRARY_BACKENDS]
        backends = listed or serving.default_backends(device)
        allowed = LIBRARY_BACKENDS
    elif mode == "layers":
        backends = _csv(args.backends) or layers.default_backends(device)
        allowed = ALL_BACKENDS
    else:
        backends = _csv(args.backends) or sweep.default_backends(device)
        allowed = ALL_BACKENDS
    bad = [b for b in backends if b not in allowed]
    if bad:
        raise UsageError(f"unknown backend(s) {bad} for this mode; choose from {', '.join(allowed)}")
    args.backend_names = list(dict.fromkeys(backends))
    if mode == "layers":
        known = layers.known_cases()
        names = _csv(args.workloads) or layers.default_cases(device)
    else:
        source = wl.load_workloads() if device.type == "cuda" else wl.CPU_WORKLOADS
        known = {w["name"] for w in wl.load_workloads() + wl.CPU_WORKLOADS}
        if args.workloads_file:
            try:
                added = wl.read_workloads(args.workloads_file)
                wl.add_workloads(added)
            except ValueError as e:
                raise UsageError(str(e)) from e
            source = added
            known |= {w["name"] for w in added}
        names = _csv(args.workloads) or [w["name"] for w in source]
    bad = [n for n in names if n not in known]
    if bad:
        raise UsageError(f"unknown workload(s) {bad}; known: {', '.join(sorted(known))} (--list)")
    args.workload_names = list(dict.fromkeys(names))
    cpu_triton = device.type == "cpu" and "triton" in args.backend_names
    if args.dtype is None:
        args.dtype = "fp16" if cpu_triton else "bf16"
        if cpu_triton:
            say("== CPU + triton: fp16 data (Triton's interpreter gets bf16 dots wrong); --dtype overrides")
    if cpu_triton and os.environ.get("TRITON_INTERPRET") != "1":
        say("== note: triton on the CPU needs TRITON_INTERPRET=1 in the environment before start")
    if args.cuda_graph:
        if device.type != "cuda":
            say("== --cuda-graph ignored: no CUDA GPU")
            args.cuda_graph = False
        else:
            args.device_lengths = True
    if args.plot:
        try:
            tables.require_matplotlib()
        except RuntimeError as e:
            raise UsageError(str(e)) from e
    args.mode = mode


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; the exit status: 0 ok, 1 a failed check or an error, 2 bad arguments,
    130 interrupted (SIGTERM / Ctrl-C; the table of what was measured is still printed)."""
    args = parse_args(argv)
    if args.list:
        try:
            list_everything(args.workloads_file)
            sys.stdout.flush()
        except BrokenPipeError:  # (`--list | head`: the reader left; nothing more to say)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except ValueError as e:
            print(f"pagedprefill-bench: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        device = resolve_device(args.device)
        resolve(args, device)
    except (UsageError, RuntimeError) as e:
        print(f"pagedprefill-bench: error: {e}", file=sys.stderr)
        return 2
    env = environment(device)
    if FA3 in args.backend_names:
        fn, about = references.fa3_status()
        env["fa3"] = about if fn is not None else None
    rows_out = tables.JsonRows(args.out_json, append=args.append)
    if args.out_json:
        say(f"== JSON rows -> {args.out_json}" + (" (appended)" if args.append else ""))

    def on_term(signum, frame):
        raise Interrupted()

    try:
        old = signal.signal(signal.SIGTERM, on_term)
    except (ValueError, OSError):  # not the main thread: Ctrl-C still works
        old = None
    try:
        if args.mode == "serving":
            code = serving.run_serving(args, device, env, rows_out)
        elif args.mode == "layers":
            code = layers.run_layers(args, device, env, rows_out)
        else:
            code = sweep.run_table(args, device, env, rows_out)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return code


if __name__ == "__main__":
    sys.exit(main())
