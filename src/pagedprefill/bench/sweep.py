"""Table mode: every workload x backend, side by side in one run.

For each workload the case is built once (:class:`~pagedprefill.bench.cases.Case`). For each backend
the first call (graph builds, compilation) is made outside the timing and the output is checked once
against a reference (:mod:`~pagedprefill.bench.checks`); then the workload's calls are timed
(:mod:`~pagedprefill.bench.timing`) in rounds, the backends run by run in turn (:func:`time_in_turn`). The
outside systems (:mod:`~pagedprefill.bench.references`) run the same batch stored contiguously. On an
fp8 workload each system runs the fp8 data when it has a kernel for it, else the 16-bit data it was
made from; the row says which (``data``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
from collections.abc import Callable

import torch

import pagedprefill
from pagedprefill import workloads as wl

from . import cases, checks, references, tables, timing
from .common import (
    CPU_NOTE,
    DTYPES,
    Interrupted,
    Progress,
    Skip,
    cuda_healthy,
    fmt,
    say,
    short,
    sync,
)
from .references import FA2, FA3, REFERENCES


def _capture(fn: Callable, backend: str, say_: Callable[[str], None]) -> tuple[Callable, bool]:
    """``fn`` captured in a CUDA graph (its replay), or ``fn`` itself for the torch backend."""
    if backend == "torch":
        say_("  torch: cannot be captured in a CUDA graph; timed eagerly")
        return fn, False
    try:
        return timing.capture_cuda_graph(fn), True
    except Exception as e:
        if not cuda_healthy():
            raise
        raise RuntimeError(f"CUDA graph capture failed: {short(e)}") from e


def run_backend(
    case: cases.Case, backend: str, args: argparse.Namespace, progress: Progress
) -> tuple[dict, list[tuple[str, Callable]]]:
    """Warm up and check ``backend`` on ``case``: a result dict and the calls still to be timed on the
    GPU (``(result key, call)``: ``ms``, and ``wide_ms`` for an fp8 run's 16-bit data), which
    :func:`time_in_turn` times beside the other backends'. On the CPU the call is timed here.
    Raises :class:`Skip` when the backend cannot run the case here."""
    device = case.device
    res: dict = {"ms": None, "ok": None, "max_err": None, "rel_err": None, "lse_err": None}
    if backend in REFERENCES:
        data = references.data_for(backend, case.kind, case.wide)
        dense = case.dense(data)
        fn = references.reference_call(backend, dense)
        t0 = time.perf_counter()
        try:
            fn()
            sync(device)
        except Exception as e:
            if device.type == "cuda" and not cuda_healthy():
                raise
            raise Skip(f"{backend} failed on this case: {short(e)}", "error") from e
        res["first_call_s"] = time.perf_counter() - t0
        served_by, kwargs = backend, None
    else:
        data = case.kind
        kwargs = case.kwargs(data)
        try:
            res["first_call_s"] = cases.first_call(kwargs, backend, progress.write)
        except Skip as s:
            if s.kind != "unsupported" or not case.fp8:
                raise
            # no fp8 path for this call (cuDNN refuses fp8 attention before Blackwell): the 16-bit
            # data, as the README has a system without fp8 do
            progress.write(f"  {backend}: {s}; running the {case.wide} data instead")
            res["fp8_skipped"] = str(s)
            data = case.wide
            kwargs = case.kwargs(data)
            res["first_call_s"] = cases.first_call(kwargs, backend, progress.write)
        served_by = pagedprefill.last_backend()
        fn = cases.library_call(kwargs, backend)
    res["data"], res["served_by"] = data, served_by
    graph = False
    if args.cuda_graph and device.type == "cuda":
        fn, graph = _capture(fn, backend, progress.write)
    if not args.no_check:
        ref = case.reference(data)
        if kwargs is None:
            out, _ = fn()
            sync(device)
            tol = checks.rel_tol_for(case.dense(data)["q"], fp8_probabilities=True)
            err = checks.compare(out, ref["out"], rel_tol=tol)
            del out
        else:
            kwargs["out"].fill_(float("nan"))
            kwargs["lse"].fill_(float("nan"))
            out, lse = fn()
            sync(device)
            err = checks.check_library_output(kwargs, out, lse, ref, served_by)
        res.update(err)
    if device.type != "cuda":
        ms, n = timing.time_cpu(fn, args.reps)
        res.update(ms=ms, reps=n, timer="perf_counter")
        return res, []
    res["host_us"] = timing.host_time_ms(fn) * 1e3
    res["timer"] = "cuda-graph replay" if graph else "eager"
    timed = [("ms", fn)]
    if case.fp8 and kwargs is not None and data == case.kind:
        # the same backend on the 16-bit data the fp8 data was made from: is quantising ever slower?
        wide = case.kwargs(case.wide)
        cases.first_call(wide, backend, progress.write)
        wfn = cases.library_call(wide, backend)
        if graph:
            wfn, _ = _capture(wfn, backend, progress.write)
        timed.append(("wide_ms", wfn))
    return res, timed


def time_in_turn(pending: list[tuple[dict, list]], args: argparse.Namespace, progress: Progress) -> None:
    """Time every pending call of one workload in ``args.rounds`` rounds, each backend in turn within a
    round (a slice of the budget each), and store the median of its rounds' medians in its row: a
    drift of the GPU's clocks over the workload's runs then reaches every backend alike, instead of
    the ones timed last. With the default timer a round runs the calls run by run in turn
    (:func:`~pagedprefill.bench.timing.time_interleaved`), not one call's runs after another's."""
    rounds = max(1, args.rounds)
    reps = None if args.reps is None else max(1, args.reps // rounds)
    cfg = timing.TimingConfig(reps, args.warmup_ms / rounds, args.rep_ms / rounds, args.timer)
    got: dict[tuple[int, str], list[float]] = {}
    runs: dict[int, int] = {}
    timers: dict[int, str] = {}

    def failed(rows: list[int], e: Exception) -> None:
        """These rows' calls failed while timed: each row carries the error; a broken context stops all."""
        for i in rows:
            row = pending[i][0]
            row.update(error=short(e), ms=None)
            progress.write(f"  {row['workload']} / {row['backend']}: ERROR while timing: {short(e)}")
        if isinstance(e, torch.cuda.OutOfMemoryError):
            gc.collect()
            torch.cuda.empty_cache()
        elif not cuda_healthy():
            raise e

    def measured(i: int, key: str, ms: float, n: int | None, timer: str) -> None:
        got.setdefault((i, key), []).append(ms)
        if key == "ms":
            runs[i] = None if n is None else (runs.get(i) or 0) + n
            timers[i] = timer

    try:
        for _ in range(rounds):
            live = [(i, key, fn) for i, (row, timed) in enumerate(pending) if not row.get("error") for key, fn in timed]
            while cfg.timer == "gpu" and len(live) > 1:
                try:
                    ms, n, timer = timing.time_interleaved([fn for _, _, fn in live], cfg)
                except timing.CallFailed as e:  # (that call's row fails; the round again without it)
                    bad = live[e.index][0]
                    failed([bad], e.error)
                    live = [x for x in live if x[0] != bad]
                    continue
                except Exception as e:  # (surfaced at a synchronisation: every row of the round)
                    failed(sorted({i for i, _, _ in live}), e)
                    live = []
                    break
                for (i, key, _), m in zip(live, ms):
                    measured(i, key, m, n, timer)
                live = []
            for i, key, fn in live:  # (other timers, or a single call)
                if pending[i][0].get("error"):
                    continue
                try:
                    ms1, n1, timer1 = timing.time_gpu(fn, cfg, progress.write)
                except Exception as e:
                    failed([i], e)
                    continue
                measured(i, key, ms1, n1, timer1)
    finally:  # (what was measured stays, also when the CUDA context broke)
        for i, (row, _timed) in enumerate(pending):
            if row.get("error"):
                continue
            for key in ("ms", "wide_ms"):
                if (i, key) in got:
                    row[key] = statistics.median(got[(i, key)])
            if (i, "ms") in got:
                row["round_ms"] = got[(i, "ms")]  # (each round's median, in order: the run's noise)
            row["reps"] = runs.get(i)
            if i in timers:
                prefix = "cuda-graph replay, " if row["timer"] == "cuda-graph replay" else ""
                row["timer"] = f"{prefix}{timers[i]}, {rounds} rounds in turn"


def round_spread_note(results: list[dict]) -> str | None:
    """How far a system's round medians spread in this run (slowest / fastest round of one row): the
    median over the rows and the largest, named; None with fewer than two rounds. Two figures of one
    table closer than this spread are level."""
    spreads = [
        (max(r["round_ms"]) / min(r["round_ms"]), r)
        for r in results
        if len(r.get("round_ms") or ()) > 1 and min(r["round_ms"]) > 0
    ]
    if not spreads:
        return None
    top, worst = max(spreads, key=lambda x: x[0])
    mid = statistics.median(x for x, _ in spreads)
    lo, hi = min(worst["round_ms"]), max(worst["round_ms"])
    return (
        f"round spread (slowest / fastest round median of one row): median {mid:.3f}x over {len(spreads)} rows, "
        f"largest {top:.3f}x ({worst['workload']} / {worst['backend']}: {lo:.3f}-{hi:.3f} ms)"
    )


def default_backends(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["torch"]
    return ["cudnn", "triton", "auto", FA3, FA2]


def _row_base(name: str, be: str, args: argparse.Namespace, env: dict) -> dict:
    w = wl.get_workload(name)
    q_lens, kv_lens = wl.lengths(w)
    return {
        "mode": "bench",
        "workload": name,
        "backend": be,
        "kind": wl.data_kind(w) if wl.data_kind(w) != "bf16" else args.dtype,
        "data": None,
        "gflop": round(wl.flops(w) / 1e9, 3),
        "batch": len(q_lens),
        "total_q": sum(q_lens),
        "total_kv": sum(kv_lens),
        "dtype": args.dtype,
        "lengths_on": "device" if args.device_lengths else "cpu",
        "cuda_graph": bool(args.cuda_graph),
        **env,
        "ms": None,
        "tflops": None,
        "ok": None,
        "max_err": None,
    }


def _result_line(name: str, be: str, row: dict) -> str:
    check = ""
    if row.get("ok") is not None:
        check = f" | {'ok' if row['ok'] else 'CHECK FAILED'} rel {row['rel_err']:.2e} (tol {row['rel_tol']:g})"
        if row.get("lse_err") is not None:
            check += f" lse {row['lse_err']:.2e}"
    served = f" -> {row['served_by']}" if be == "auto" and row.get("served_by") else ""
    host = f", host {row['host_us']:.0f} µs" if row.get("host_us") is not None else ""
    return (
        f"  {name} / {be}{served} on the {row['data']} data: {row['ms']:.4f} ms, "
        f"{fmt(row['tflops'], 1)} TFLOP/s{host} (first call {row['first_call_s']:.2f} s){check}"
    )


def run_table(args: argparse.Namespace, device: torch.device, env: dict, rows_out: tables.JsonRows) -> int:
    """Table mode (see the module docstring); returns the exit status (0, 1 on a failed check or an
    error, 130 when interrupted)."""
    names, backends = args.workload_names, args.backend_names
    dtype = DTYPES[args.dtype]
    results: list[dict] = []
    interrupted = False
    if device.type == "cpu":
        say(f"== {CPU_NOTE}")
    say(
        f"== pagedprefill-bench on {env['gpu']} | torch {env['torch']} | triton {env['triton']} | "
        f"cudnn-frontend {env['cudnn']} (cuDNN {env['cudnn_backend']}) | {args.dtype} | lengths on "
        f"{'device' if args.device_lengths else 'CPU'} | "
        f"{'CUDA-graph replays' if args.cuda_graph else 'eager calls'}"
    )
    say(f"== workloads: {', '.join(names)}; backends: {', '.join(backends)}")
    if FA3 in backends:
        fn, about = references.fa3_status()
        say(f"== {FA3}: {about}" if fn is not None else f"== {FA3} will be skipped: {about}")
    progress = Progress(len(names) * len(backends), "bench")
    broken = False
    try:
        for name in names:
            w = wl.get_workload(name)
            case = None
            try:
                case = cases.Case(w, device, dtype, args.seed, args.device_lengths)
            except Exception as e:
                progress.write(f"{name}: could not build the case: {short(e)}")
            rows, pending = [], []
            try:
                broken = _run_workload(case, name, backends, rows, pending, broken, args, env, progress)
            finally:
                for row in rows:
                    if row.get("ms") and not row.get("error"):
                        row["tflops"] = case.gflop / row["ms"]
                        progress.write(_result_line(name, row["backend"], row))
                    elif row.get("error") or row.get("skipped"):
                        row["tflops"] = None
                    elif row.get("data") is not None:  # (checked, then the run stopped before the timing)
                        row.update(tflops=None, skipped="not timed: the run stopped before this workload's timing")
                    else:  # (stopped inside its first call: nothing to report)
                        continue
                    rows_out.write(row)
                    results.append(row)
            del case
            gc.collect()
            if device.type == "cuda" and not broken:
                torch.cuda.empty_cache()
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
    finally:
        progress.close()
    return report(results, backends, args, device, env, interrupted)


def _run_workload(
    case: cases.Case | None,
    name: str,
    backends: list[str],
    rows: list[dict],
    pending: list,
    broken: bool,
    args: argparse.Namespace,
    env: dict,
    progress: Progress,
) -> bool:
    """Warm up and check each backend on one workload (its rows appended to ``rows`` as they start),
    then time them in turn; returns whether the CUDA context is broken."""
    device = case.device if case is not None else None
    for be in backends:
        progress.step(name, be)
        row = _row_base(name, be, args, env)
        rows.append(row)
        if case is None or broken:
            row["skipped"] = "case not built" if case is None else "CUDA context broken earlier"
            progress.write(f"  {name} / {be}: skipped ({row['skipped']})")
        else:
            try:
                res, timed = run_backend(case, be, args, progress)
                row.update(res)
                if timed:
                    pending.append((row, timed))
            except Skip as s:
                row["skipped"] = str(s)
                progress.write(f"  {name} / {be}: skipped ({s})")
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = short(e)
                progress.write(f"  {name} / {be}: OUT OF MEMORY ({short(e)[:200]})")
                gc.collect()
                torch.cuda.empty_cache()
            except Exception as e:
                row["error"] = short(e)
                progress.write(f"  {name} / {be}: ERROR {short(e)}")
                progress.write("    " + "    ".join(traceback.format_exc().splitlines(True)[-6:]))
                if device.type == "cuda" and not cuda_healthy():
                    broken = True
                    progress.write("  !! the CUDA context is broken; the remaining GPU runs are skipped")
    if pending and not broken:
        try:
            time_in_turn(pending, args, progress)
        except Exception as e:
            broken = True
            progress.write(f"  !! timing broke the CUDA context ({short(e)}); the remaining GPU runs are skipped")
    elif pending:
        for row, _timed in pending:
            row["skipped"] = "CUDA context broken before this workload's timing"
    return broken


def report(
    results: list[dict],
    backends: list[str],
    args: argparse.Namespace,
    device: torch.device,
    env: dict,
    interrupted: bool,
) -> int:
    """Print the summary (skips, errors, the table last) and write ``--markdown`` / ``--plot``."""
    if interrupted:
        say("== interrupted: partial results below")
    note_cpu = CPU_NOTE if device.type == "cpu" else None
    mode = (
        "CUDA-graph replays"
        if args.cuda_graph
        else f"eager calls, lengths on the {'device' if args.device_lengths else 'CPU'}"
    )
    failed = [r for r in results if r.get("ok") is False]
    errors = [r for r in results if r.get("error")]
    notes = []
    for r in results:
        if r.get("skipped"):
            notes.append(f"skipped: {r['workload']} / {r['backend']}: {r['skipped']}")
        if r.get("fp8_skipped"):
            notes.append(f"{r['workload']} / {r['backend']}: ran the {r['data']} data ({r['fp8_skipped']})")
        if r.get("wide_ms") and r.get("ms"):
            notes.append(
                f"{r['workload']} / {r['backend']}: {r['ms']:.3f} ms on the {r['data']} data, "
                f"{r['wide_ms']:.3f} ms on its 16-bit data ({r['wide_ms'] / r['ms']:.2f}x the 16-bit speed)"
            )
        if r.get("error"):
            notes.append(f"error: {r['workload']} / {r['backend']}: {r['error']}")
    for r in failed:
        notes.append(
            f"CHECK FAILED: {r['workload']} / {r['backend']} on the {r['data']} data: relative error "
            f"{r['rel_err']:.3e} (tolerance {r['rel_tol']:g})"
            + (f", lse error {r['lse_err']:.3e}" if r.get("lse_err") is not None else "")
        )
    spread = round_spread_note(results)
    if spread:
        notes.append(spread)
    legend = [
        "TF/s: FLOPs (2 x (Dqk + Dvo) per visible query-key pair per query head) / median time; ×cuDNN / ×FA3: that "
        "system's time / this one's (> 1: faster); host µs: host time per call, calls queued without a sync",
        "(bf16): the run used the bf16 data of an fp8 workload (no fp8 kernel for that call); FAILED: the "
        "output differs from the reference beyond tolerance (excluded from the geomean)",
    ]
    if FA2 in backends or FA3 in backends:
        legend.append(f"{FA3} / {FA2}: outside references on the same batch stored contiguously (no paging)")
    headers, rows = tables.summary_table(results, backends)
    title = (
        f"{env['gpu']} | torch {env['torch']} | triton {env['triton']} | cudnn-frontend {env['cudnn']} "
        f"| cuDNN {env['cudnn_backend']} | FA3 {env.get('fa3') or '–'} | {env['date']} | {args.dtype} "
        f"| {mode}"
    )
    if args.markdown:
        md_headers, md_rows = tables.summary_table(results, backends, markdown=True)
        md_title = (
            (f"_{note_cpu}_\n\n" if note_cpu else "")
            + title
            + ". Median time per call "
            + ("(wall clock)." if device.type == "cpu" else f"(L2 flushed; timer {args.timer}).")
        )
        tables.write_markdown(args.markdown, md_title, md_headers, md_rows, legend + notes)
        say(f"== wrote {args.markdown}")
    if args.plot:
        try:
            tables.write_plot(args.plot, results, backends, title + (f"\n{note_cpu}" if note_cpu else ""))
        except Exception as e:
            say(f"== could not write the plot {args.plot}: {short(e)}")
    for line in notes:
        say(line)
    say()
    if note_cpu:
        say(f"== {note_cpu}")
    say(f"== {title}")
    for line in legend:
        say(f"   {line}")
    if failed or errors:
        say(f"!! {len(failed)} run(s) FAILED the correctness check, {len(errors)} raised: see above")
    say(tables.format_text_table(headers, rows))
    measured = any(r.get("ms") for r in results)
    if not measured and not interrupted:
        say("!! nothing was measured: every cell was skipped (see the reasons above)")
    return 130 if interrupted else (1 if failed or errors or not measured else 0)
