"""pagedprefill-bench: prefill attention benchmark over the project's workloads.

Usage (``python -m pagedprefill.bench`` or ``pagedprefill-bench``)::

    pagedprefill-bench                                  # every workload, cudnn + triton + FA2 varlen
    pagedprefill-bench --workloads varlen_b32 --backends triton,cudnn --plot out.png --markdown t.md
    pagedprefill-bench --serving 1000                   # serving-loop mode
    pagedprefill-bench --device cpu                     # tiny CPU workloads, torch backend

Table mode: for each workload the case is built once (workloads.py: exact lengths, NHD pages
shuffled); for each backend the first call (graph builds, compilation) is made outside the timing,
the output is checked once against a reference (the torch backend on a GPU, float64 math on the
CPU: ``‖out−ref‖/‖ref‖ ≤ 2e-2`` and ``max |lse−ref| ≤ 5e-2``), then the call is timed (CUDA
events, L2 flushed before every run, median; or ``triton.testing.do_bench`` with ``--timer
do_bench``). ``fa2-varlen`` is PyTorch's FlashAttention-2 varlen op on the same data stored
contiguously (no paging), an outside reference.

Results are appended to ``--out-json`` as JSON Lines: one object per line and per (workload,
backend); a backend that could not run has ``"ms": null`` and ``"skipped"`` or ``"error"``.
Default ``bench/results/<gpu>.json`` (``cpu.json`` without a GPU; ``-serving`` added in serving
mode), relative to the current directory. The summary table is printed last.
SIGTERM / Ctrl-C stop the run early but still print the table of what was measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import platform
import re
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from pagedprefill import workloads as wl
from pagedprefill.api import BackendUnavailableError, cudnn_batch_prefill_with_kv_cache

LIBRARY_BACKENDS = ("cudnn", "triton", "torch", "auto")
FA2 = "fa2-varlen"
ALL_BACKENDS = LIBRARY_BACKENDS + (FA2,)
LABELS = {FA2: "fa2-varlen (dense KV)"}
OUT_REL_TOL = 2e-2
LSE_ABS_TOL = 5e-2
FLUSH_BYTES = 256 * 2**20  # > the L2 of any current GPU (H200: 60 MiB)
CPU_NOTE = "CPU figures (no GPU): not comparable to GPU numbers"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Skip(Exception):
    """A backend cannot run this case here (unavailable, unsupported): not an error."""


class Interrupted(BaseException):
    """SIGTERM received: stop measuring, report what was measured."""


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``: a file-name friendly GPU model name."""
    s = re.sub(r"\bnvidia\b", "", name.lower())
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "gpu"


def environment(device: torch.device) -> dict:
    """Versions and machine facts recorded with every result row."""
    env: dict = {
        "device": device.type,
        "gpu": "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": None,
        "cudnn": None,
        "cudnn_backend": None,
        "cudnn_torch": None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    try:
        from pagedprefill import __version__

        env["pagedprefill"] = __version__
    except Exception:
        pass
    if device.type == "cuda":
        try:
            env["gpu"] = torch.cuda.get_device_name(device)
        except Exception as e:  # pragma: no cover - GPU only
            env["gpu"] = f"cuda (name unknown: {e})"
        try:
            env["cudnn_torch"] = torch.backends.cudnn.version()
        except Exception:
            pass
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        pass
    try:
        import cudnn

        env["cudnn"] = getattr(cudnn, "__version__", "unknown")
        try:
            env["cudnn_backend"] = cudnn.backend_version()
        except Exception:
            pass
    except Exception:
        pass
    return env


def _say(msg: str) -> None:
    print(msg, flush=True)


class Progress:
    """tqdm on a terminal, plain flushed lines otherwise (logs, the GPU tool's tail)."""

    def __init__(self, total: int, desc: str):
        self.total, self.n, self.bar = total, 0, None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except Exception:
                self.bar = None

    def step(self, label: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        else:
            _say(f"[{self.n}/{self.total}] {label}")

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stdout)
            sys.stdout.flush()
        else:
            _say(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# --------------------------------------------------------------------------------------------
# Calls
# --------------------------------------------------------------------------------------------

_WORKSPACE_RE = re.compile(r"workspace_buffer: expected at least (\d+) bytes")


def _classify(e: BaseException, backend: str) -> Skip | None:
    """A Skip when exception ``e`` of a first call means "cannot run this here", else None."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, BackendUnavailableError):
        return Skip(f"unavailable: {msg}")
    if isinstance(e, ImportError):
        return Skip(f"backend module not importable: {msg}")
    if isinstance(e, NotImplementedError):
        return Skip(f"not implemented: {msg}")
    if isinstance(e, ValueError) and ("cannot serve this call" in msg or "no backend can serve" in msg):
        return Skip(f"unsupported: {msg}")
    return None


def library_call(case: dict, backend: str) -> Callable[[], tuple]:
    """The public function on ``case`` with ``backend`` (reads ``case`` at call time)."""

    def call():
        return cudnn_batch_prefill_with_kv_cache(**case, backend=backend)

    return call


def first_call(case: dict, backend: str, say: Callable[[str], None] = _say) -> float:
    """Make the first (warm-up, graph-building) call; seconds it took. Raises Skip when it cannot run.

    A workspace too small for the backend is grown once to the size the error names.
    """
    if backend in ("cudnn", "triton", "torch"):
        try:
            importlib.import_module(f"pagedprefill.backends.{backend}_backend")
        except Exception as e:  # a backend that cannot even be imported here is unavailable
            raise Skip(f"backend module not importable: {_short(e)}") from e
    for attempt in range(2):
        t0 = time.perf_counter()
        try:
            library_call(case, backend)()
            _sync(case["q"].device)
            return time.perf_counter() - t0
        except Exception as e:
            skip = _classify(e, backend)
            if skip is not None:
                raise skip from e
            m = _WORKSPACE_RE.search(str(e))
            if m and attempt == 0:
                need = -(-int(m.group(1)) // 2**20) * 2**20
                say(f"  {backend}: growing the workspace to {need / 2**20:.0f} MiB ({str(e)[:120]})")
                case["workspace_buffer"] = torch.empty(need, dtype=torch.uint8, device=case["q"].device)
                continue
            raise
    raise AssertionError("unreachable")


def fa2_call(dense: dict) -> Callable[[], tuple]:
    """PyTorch's FlashAttention-2 varlen forward on contiguous data; raises Skip where it cannot run."""
    q, k, v = dense["q"], dense["k"], dense["v"]
    if q.device.type != "cuda":
        raise Skip("FlashAttention-2 needs a CUDA GPU")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise Skip(f"FlashAttention-2 needs fp16/bf16, not {q.dtype}")
    if k.shape[-1] != v.shape[-1] or q.shape[-1] > 256 or q.shape[-1] % 8:
        raise Skip(f"FlashAttention-2 needs Dqk == Dvo <= 256 (got {q.shape[-1]}/{v.shape[-1]})")
    try:
        op = torch.ops.aten._flash_attention_forward
    except Exception as e:
        raise Skip(f"torch.ops.aten._flash_attention_forward missing: {e}") from e
    args = (
        q,
        k,
        v,
        dense["cu_seqlens_q"],
        dense["cu_seqlens_k"],
        dense["max_q"],
        dense["max_k"],
        0.0,
        dense["causal"],
        False,
    )
    scale = dense["scale"]

    def call():
        res = op(*args, scale=scale)
        return res[0], None

    return call


def capture_cuda_graph(fn: Callable[[], tuple]) -> Callable[[], tuple]:
    """Capture ``fn`` in a CUDA graph; returns a function that replays it and returns the captured
    outputs. Warm-up runs on a side stream first, as ``torch.cuda.graph`` requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    torch.cuda.synchronize()

    def replay(graph: torch.cuda.CUDAGraph = graph) -> tuple:  # the default keeps the graph alive
        graph.replay()
        return outs

    return replay


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_healthy() -> bool:
    """False once the CUDA context is broken (e.g. an illegal memory access)."""
    try:
        torch.cuda.synchronize()
        x = torch.ones(4, device="cuda")
        return float(x.sum().item()) == 4.0
    except Exception:
        return False


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def time_cpu(fn: Callable, reps: int | None) -> tuple[float, int]:
    """Median wall time in ms (time.perf_counter) after one warm-up call; (ms, reps).

    Default reps: about one second's worth, between 3 and 20."""
    t0 = time.perf_counter()
    fn()
    est = max(time.perf_counter() - t0, 1e-6)
    n = reps or max(3, min(20, int(1.0 / est)))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), n


def host_time_ms(fn: Callable, n: int = 20) -> float:
    """Host (CPU) time of one call in ms: ``n`` calls queued without a sync, perf_counter."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    ms = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return ms


def time_cuda_events(
    fn: Callable, reps: int | None, warmup_ms: float, rep_ms: float, preload_ms: float = 0.0
) -> tuple[float, int]:
    """Median ms over CUDA-event-timed runs, the L2 flushed (a 256 MiB memset) before each run.

    ``preload_ms`` > 0: a sleep kernel of that length is queued after the flush, before the start
    event, so that the host has queued the call before the GPU reaches it: the events then bracket
    the call's device work only (its host launch time is measured separately)."""
    cycles = int(preload_ms * (_SleepCalibration.get() or 0.0))
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(3):
        flush.zero_()
        fn()
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e) / 3, 1e-3)
    n_warm = max(1, min(200, int(warmup_ms / est)))
    n = reps or max(10, min(1000, int(rep_ms / est)))
    for _ in range(n_warm):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        if cycles:
            torch.cuda._sleep(cycles)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in zip(starts, ends)]
    del flush
    return statistics.median(times), n


def time_gpu(
    fn: Callable, args: argparse.Namespace, say: Callable[[str], None]
) -> tuple[float, int | None, str]:
    """(median ms, runs or None, timer used)."""
    if args.timer == "gpu":
        host_ms = host_time_ms(fn)
        ms, n = time_cuda_events(fn, args.reps, args.warmup_ms, args.rep_ms, preload_ms=2 * host_ms + 0.1)
        return ms, n, "cuda-events+l2-flush+preload"
    if args.timer == "do_bench":
        try:
            import triton.testing

            ms = triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
            return float(ms), None, "triton.testing.do_bench"
        except Exception as e:
            say(f"  do_bench failed ({type(e).__name__}: {e}); falling back to CUDA events")
    ms, n = time_cuda_events(fn, args.reps, args.warmup_ms, args.rep_ms)
    return ms, n, "cuda-events+l2-flush"


# --------------------------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------------------------


def lse_rows(lse: torch.Tensor, q_lens: list[int]) -> torch.Tensor:
    """(total_q, Hq) valid rows of a (B, max_q, Hq) LSE buffer."""
    parts = [lse[b, :n] for b, n in enumerate(q_lens) if n]
    if not parts:
        return lse.new_empty((0, lse.shape[-1]))
    return torch.cat(parts)


def compare(out: torch.Tensor, ref_out: torch.Tensor, lse=None, ref_lse=None) -> dict:
    """Errors of ``out`` (rows, H, D) against ``ref_out``, and of LSE rows against ``ref_lse``.

    ``rel_err = ‖out − ref‖₂ / ‖ref‖₂`` over all elements, ``max_err = max |out − ref|``,
    ``lse_err = max |lse − ref|`` (two -inf agree). Non-finite values make the error infinite.
    """
    dev = out.device
    acc = torch.float64 if dev.type == "cpu" else torch.float32
    num = den = 0.0
    max_err = 0.0
    finite = True
    rows = out.shape[0]
    per_row = max(1, out[0].numel() if rows else 1)
    chunk = max(1, 2**25 // per_row)
    for r0 in range(0, rows, chunk):
        a = out[r0 : r0 + chunk].to(acc)
        b = ref_out[r0 : r0 + chunk].to(device=dev, dtype=acc)
        if not bool(torch.isfinite(a).all()):
            finite = False
            break
        d = a - b
        num += float((d * d).sum(dtype=torch.float64))
        den += float((b * b).sum(dtype=torch.float64))
        max_err = max(max_err, float(d.abs().max())) if d.numel() else max_err
    if finite:
        rel = math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num)
    else:
        rel = max_err = math.inf
    res = {"rel_err": rel, "max_err": max_err, "lse_err": None}
    if lse is not None and ref_lse is not None:
        a = lse.double()
        b = ref_lse.to(device=lse.device, dtype=torch.float64)
        both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
        d = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
        d = torch.nan_to_num(d, nan=math.inf, posinf=math.inf)
        res["lse_err"] = float(d.max()) if d.numel() else 0.0
    ok = math.isfinite(rel) and rel <= OUT_REL_TOL
    if res["lse_err"] is not None:
        ok = ok and res["lse_err"] <= LSE_ABS_TOL
    res["ok"] = bool(ok)
    return res


def reference(case: dict, device: torch.device) -> dict:
    """{"out": (total_q, Hq, Dvo), "lse": (total_q, Hq), "kind": str} for the case.

    GPU: the torch backend (float32 math) into fresh buffers. CPU: float64 math on the data stored
    contiguously (independent of the library).
    """
    q_lens, _ = wl.case_lengths(case)
    if device.type == "cuda":
        out, lse = cudnn_batch_prefill_with_kv_cache(**{**case, "out": None, "lse": None}, backend="torch")
        torch.cuda.synchronize()
        return {"out": out, "lse": lse_rows(lse, q_lens), "kind": "torch backend (fp32 math)"}
    out, lses = wl.reference_fp64(wl.dense_reference_inputs(case))
    lse = torch.cat(lses) if lses else torch.empty((0, case["q"].shape[1]), dtype=torch.float64)
    return {"out": out, "lse": lse, "kind": "float64 math"}


# --------------------------------------------------------------------------------------------
# Table mode
# --------------------------------------------------------------------------------------------


def _append_json(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=str) + "\n")


def _short(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first}"[:400]


def run_backend(
    case: dict,
    backend: str,
    args: argparse.Namespace,
    device: torch.device,
    get_ref: Callable[[], dict],
    get_dense: Callable[[], dict],
    say: Callable[[str], None],
) -> dict:
    """Warm up, check and time one backend on one case; a result dict (ms None when it did not run)."""
    res: dict = {"ms": None, "ok": None, "max_err": None, "rel_err": None, "lse_err": None}
    q_lens, _ = wl.case_lengths(case)
    if backend == FA2:
        fn = fa2_call(get_dense())
        t0 = time.perf_counter()
        try:
            fn()
            _sync(device)
        except Exception as e:
            if device.type == "cuda" and not cuda_healthy():
                raise
            raise Skip(f"FlashAttention-2 varlen op failed: {_short(e)}") from e
        res["first_call_s"] = time.perf_counter() - t0
    else:
        res["first_call_s"] = first_call(case, backend, say)
        fn = library_call(case, backend)
    graph = False
    if args.cuda_graph and device.type == "cuda":
        if backend == "torch":
            say("  torch: cannot be captured in a CUDA graph; timed eagerly")
        else:
            try:
                fn = capture_cuda_graph(fn)
                graph = True
            except Exception as e:
                if not cuda_healthy():
                    raise
                raise RuntimeError(f"CUDA graph capture failed: {_short(e)}") from e
    if not args.no_check:
        ref = get_ref()
        if backend == FA2:
            out, _ = fn()
            _sync(device)
            err = compare(out, ref["out"])
            del out
        else:
            case["out"].fill_(float("nan"))
            case["lse"].fill_(float("nan"))
            out, lse = fn()
            _sync(device)
            err = compare(out, ref["out"], lse_rows(lse, q_lens), ref["lse"])
        res.update(err)
    if device.type == "cuda":
        res["host_us"] = host_time_ms(fn) * 1e3
        ms, n, timer = time_gpu(fn, args, say)
        timer = f"cuda-graph replay, {timer}" if graph else timer
    else:
        ms, n = time_cpu(fn, args.reps)
        timer = "perf_counter"
    res.update(ms=ms, reps=n, timer=timer)
    return res


def default_backends(device: torch.device, serving: bool = False) -> list[str]:
    if device.type != "cuda":
        return ["torch"]
    return ["cudnn", "triton"] if serving else ["cudnn", "triton", FA2]


def run_table(args: argparse.Namespace, device: torch.device, env: dict, out_json: Path) -> int:
    names = args.workload_names
    backends = args.backend_names
    dtype = DTYPES[args.dtype]
    results: list[dict] = []
    interrupted = False
    if device.type == "cpu":
        _say(f"== {CPU_NOTE}")
    _say(
        f"== pagedprefill-bench on {env['gpu']} | torch {env['torch']} | triton {env['triton']} | "
        f"cudnn-frontend {env['cudnn']} (cuDNN {env['cudnn_backend']}) | dtype {args.dtype} | "
        f"lengths on {'device' if args.device_lengths else 'CPU'}"
        + (" | CUDA-graph replays" if args.cuda_graph else " | eager calls")
    )
    _say(f"== workloads: {', '.join(names)}; backends: {', '.join(backends)}; results -> {out_json}")
    progress = Progress(len(names) * len(backends), "bench")
    broken = False
    try:
        for name in names:
            w = wl.get_workload(name)
            gflop = wl.flops(w) / 1e9
            q_lens, kv_lens = wl.lengths(w)
            case = None
            try:
                case = wl.build_case(
                    w, device, dtype=dtype, seed=args.seed, lens_on_device=args.device_lengths
                )
            except Exception as e:
                progress.write(f"{name}: could not build the case: {_short(e)}")
            cache: dict = {}

            def get_ref(case=case, cache=cache):
                if "ref" not in cache:
                    t0 = time.perf_counter()
                    cache["ref"] = reference(case, device)
                    progress.write(
                        f"  reference ({cache['ref']['kind']}) in {time.perf_counter() - t0:.2f} s"
                    )
                return cache["ref"]

            def get_dense(case=case, cache=cache):
                if "dense" not in cache:
                    cache["dense"] = wl.dense_reference_inputs(case)
                return cache["dense"]

            for be in backends:
                progress.step(f"{name} / {be}")
                row = {
                    "mode": "bench",
                    "workload": name,
                    "backend": be,
                    "gflop": round(gflop, 3),
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
                if case is None or broken:
                    row["skipped"] = "case not built" if case is None else "CUDA context broken earlier"
                    _append_json(out_json, row)
                    results.append(row)
                    continue
                try:
                    res = run_backend(case, be, args, device, get_ref, get_dense, progress.write)
                    row.update(res)
                    row["tflops"] = gflop / res["ms"] if res["ms"] else None
                    check = (
                        ""
                        if res["ok"] is None
                        else f" | {'ok' if res['ok'] else 'CHECK FAILED'} rel {res['rel_err']:.2e}"
                        + (f" lse {res['lse_err']:.2e}" if res["lse_err"] is not None else "")
                    )
                    progress.write(
                        f"  {name} / {be}: {res['ms']:.4f} ms, {_fmt(row['tflops'], 1)} TFLOP/s "
                        f"(first call {res['first_call_s']:.2f} s){check}"
                    )
                    _append_json(out_json, row)
                except Skip as s:
                    row["skipped"] = str(s)
                    progress.write(f"  {name} / {be}: skipped ({s})")
                    _append_json(out_json, row)
                except torch.cuda.OutOfMemoryError as e:
                    row["error"] = _short(e)
                    progress.write(f"  {name} / {be}: OUT OF MEMORY ({_short(e)[:200]})")
                    _append_json(out_json, row)
                    gc.collect()
                    torch.cuda.empty_cache()
                except Exception as e:
                    row["error"] = _short(e)
                    progress.write(f"  {name} / {be}: ERROR {_short(e)}")
                    progress.write("    " + "    ".join(traceback.format_exc().splitlines(True)[-6:]))
                    _append_json(out_json, row)
                    if device.type == "cuda" and not cuda_healthy():
                        broken = True
                        progress.write("  !! the CUDA context is broken; the remaining GPU runs are skipped")
                results.append(row)
            cache.clear()
            del case, cache, get_ref, get_dense
            gc.collect()
            if device.type == "cuda" and not broken:
                torch.cuda.empty_cache()
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
    finally:
        progress.close()
    if interrupted:
        _say("== interrupted: partial results below")
    headers, rows = summary_table(results, backends)
    note = CPU_NOTE if device.type == "cpu" else None
    if args.markdown:
        try:
            md_headers, md_rows = summary_table(results, backends, long_labels=True)
            mode = (
                "CUDA-graph replays"
                if args.cuda_graph
                else f"eager calls, lengths on the {'device' if args.device_lengths else 'CPU'}"
            )
            write_markdown(
                Path(args.markdown),
                md_headers,
                md_rows,
                {**env, "mode": mode, "timer": args.timer},
                note,
                results,
            )
            _say(f"== wrote {args.markdown}")
        except Exception as e:
            _say(f"== could not write {args.markdown}: {_short(e)}")
    if args.plot:
        write_plot(Path(args.plot), results, backends, env, note)
    for r in results:
        if r.get("skipped"):
            _say(f"skipped: {r['workload']} / {r['backend']}: {r['skipped']}")
        if r.get("error"):
            _say(f"error: {r['workload']} / {r['backend']}: {r['error']}")
    _say("")
    if note:
        _say(f"== {note}")
    _say(
        f"== {env['gpu']} | torch {env['torch']} | triton {env['triton']} | cudnn-frontend {env['cudnn']} "
        f"| cuDNN {env['cudnn_backend']} | {env['date']} | {args.dtype} | median ms, TFLOP/s "
        f"| JSON: {out_json}"
    )
    if FA2 in backends:
        _say(
            f"   {FA2}: PyTorch's FlashAttention-2 varlen op on the same data stored contiguously "
            "(outside reference)"
        )
    if any(r.get("ok") is False for r in results):
        _say("   (BAD): output differs from the reference beyond tolerance")
    _say(format_text_table(headers, rows))
    failed = [r for r in results if r.get("ok") is False or r.get("error")]
    if failed:
        _say(f"== {len(failed)} run(s) failed the correctness check or raised: see above")
    return 130 if interrupted else (1 if failed else 0)


def _fmt(x: float | None, digits: int) -> str:
    """``digits`` decimals, or 3 significant digits for small values (CPU figures)."""
    if x is None:
        return "–"
    return f"{x:.{digits}f}" if abs(x) >= 10 ** (1 - digits) or x == 0 else f"{x:.3g}"


def summary_table(
    results: list[dict], backends: list[str], long_labels: bool = False
) -> tuple[list[str], list[list[str]]]:
    """Header and rows: workload, GFLOP, then per backend ms, TFLOP/s and speed ratio to cudnn
    (``cudnn ms / backend ms``: > 1 is faster than cuDNN), and a geomean row of the ratios."""
    by = {(r["workload"], r["backend"]): r for r in results}
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    has_cudnn = "cudnn" in backends and any(r["backend"] == "cudnn" and r.get("ms") for r in results)
    has_host = any(r.get("host_us") is not None for r in results)
    headers = ["workload", "GFLOP"]
    for be in backends:
        label = LABELS.get(be, be) if long_labels else be
        headers += [f"{label} ms", f"{label} TFLOP/s" if long_labels else f"{label} TF/s"]
        if has_host:
            headers.append(f"{label} host µs")
        if has_cudnn and be != "cudnn":
            headers.append(f"{label} ×cuDNN")
    rows = []
    ratios: dict[str, list[float]] = {be: [] for be in backends}
    for wname in workloads:
        gflop = next(r["gflop"] for r in results if r["workload"] == wname)
        line = [wname, _fmt(gflop, 1)]
        base = by.get((wname, "cudnn"), {}).get("ms")
        for be in backends:
            r = by.get((wname, be), {})
            ms = r.get("ms")
            tf = r.get("tflops")
            mark = " (BAD)" if r.get("ok") is False else ""
            if r.get("error"):
                line += ["error", "–"]
            else:
                line += [_fmt(ms, 3), _fmt(tf, 1) + mark]
            if has_host:
                line.append(_fmt(r.get("host_us"), 0))
            if has_cudnn and be != "cudnn":
                if ms and base:
                    ratios[be].append(base / ms)
                    line.append(f"{base / ms:.2f}")
                else:
                    line.append("–")
        rows.append(line)
    if has_cudnn and len(workloads) > 0:
        line = ["geomean", ""]
        for be in backends:
            line += ["", ""] + ([""] if has_host else [])
            if be != "cudnn":
                vals = ratios[be]
                line.append(f"{math.exp(sum(map(math.log, vals)) / len(vals)):.2f}" if vals else "–")
        rows.append(line)
    return headers, rows


def format_text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def write_markdown(
    path: Path, headers: list[str], rows: list[list[str]], env: dict, note: str | None, results: list[dict]
) -> None:
    lines = []
    if note:
        lines += [f"_{note}_", ""]
    lines.append(
        f"{env['gpu']}, {env['date']}: torch {env['torch']}, triton {env['triton']}, "
        f"nvidia-cudnn-frontend {env['cudnn']}, cuDNN {env['cudnn_backend']}. Median time per call "
        + ("(wall clock)" if env["device"] == "cpu" else f"(L2 flushed; timer {env.get('timer', 'events')})")
        + ", TFLOP/s, and speed relative to cuDNN (×cuDNN > 1 is faster)"
        + (f"; {env['mode']}." if env.get("mode") else ".")
    )
    lines.append("")
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    for r in rows:
        lines.append("| " + " | ".join(c if c else " " for c in r) + " |")
    notes = [
        f"- {r['workload']} / {r['backend']}: "
        + (f"skipped ({r['skipped']})" if r.get("skipped") else r["error"])
        for r in results
        if r.get("skipped") or r.get("error")
    ]
    if notes:
        lines += ["", *notes]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_plot(path: Path, results: list[dict], backends: list[str], env: dict, note: str | None) -> None:
    """Grouped bar chart of TFLOP/s per workload and backend (skipped when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        _say(f"== no plot: matplotlib unavailable ({_short(e)}); pip install matplotlib")
        return
    try:
        workloads = list(dict.fromkeys(r["workload"] for r in results))
        by = {(r["workload"], r["backend"]): r.get("tflops") for r in results}
        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(workloads) + 2), 5))
        width = 0.8 / max(1, len(backends))
        for i, be in enumerate(backends):
            xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(workloads))]
            ys = [by.get((wn, be)) or 0.0 for wn in workloads]
            bars = ax.bar(xs, ys, width, label=LABELS.get(be, be))
            for b, y in zip(bars, ys):
                if y:
                    ax.annotate(
                        f"{y:.0f}",
                        (b.get_x() + b.get_width() / 2, y),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s (median)")
        title = f"pagedprefill prefill attention, {env['gpu']}, torch {env['torch']}"
        if note:
            title += f"\n{note}"
        ax.set_title(title, fontsize=10)
        top = max([y for (_, _), y in by.items() if y] + [1.0])
        ax.set_ylim(0, top * 1.2)  # room for the legend above the bars
        ax.legend(fontsize=8, ncol=max(1, len(backends)), loc="upper left")
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        _say(f"== wrote {path}")
    except Exception as e:
        _say(f"== could not write the plot {path}: {_short(e)}")


# --------------------------------------------------------------------------------------------
# Serving-loop mode
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ServingConfig:
    """A continuous-batching scheduler's prefill steps: chunked prefills with cached prefixes."""

    batch_max: int = 64
    q_min: int = 16
    q_max: int = 2048
    prefix_max: int = 8192
    new_fraction: float = 0.3  # share of sequences with no cached prefix
    token_budget: int = 16384  # max new tokens per step (vLLM's max_num_batched_tokens)
    page_size: int = 16
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    causal: bool = True

    @classmethod
    def cpu(cls) -> ServingConfig:
        return cls(
            batch_max=4,
            q_min=4,
            q_max=48,
            prefix_max=96,
            token_budget=128,
            heads_q=4,
            heads_kv=2,
            head_dim=64,
        )


def serving_lengths(cfg: ServingConfig, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` steps of (q_lens, kv_lens): batch 1..batch_max, log-uniform chunks, token budget."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    lo, hi = math.log(cfg.q_min), math.log(cfg.q_max + 1)
    for _ in range(n):
        b = int(torch.randint(1, cfg.batch_max + 1, (1,), generator=g))
        u = torch.rand(b, generator=g).tolist()
        qs = [min(cfg.q_max, max(cfg.q_min, int(math.exp(lo + x * (hi - lo))))) for x in u]
        new = (torch.rand(b, generator=g) < cfg.new_fraction).tolist()
        pre = torch.randint(0, cfg.prefix_max + 1, (b,), generator=g).tolist()
        q_lens, kv_lens, used = [], [], 0
        for q, is_new, p in zip(qs, new, pre):
            if used >= cfg.token_budget:
                break
            q = min(q, cfg.token_budget - used)  # the scheduler chunks the last prompt to fit
            used += q
            q_lens.append(q)
            kv_lens.append(q + (0 if is_new else p))
        steps.append((q_lens, kv_lens))
    return steps


def build_serving_calls(
    cfg: ServingConfig,
    steps: list[tuple[list[int], list[int]]],
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    lens_on_device: bool,
    fixed_max: bool,
) -> list[dict]:
    """Per-step call kwargs over ONE shared paged cache, q/out/lse buffers; built before timing."""
    page, hq, hkv, d = cfg.page_size, cfg.heads_q, cfg.heads_kv, cfg.head_dim
    pool = max(sum(-(-k // page) for k in kv) for _, kv in steps)
    max_rows = max(sum(q) for q, _ in steps)
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed + 1)
    k_store = torch.randn((pool, page, hkv, d), generator=gen, device=device, dtype=dtype)
    v_store = torch.randn((pool, page, hkv, d), generator=gen, device=device, dtype=dtype)
    k_cache, v_cache = k_store.permute(0, 2, 1, 3), v_store.permute(0, 2, 1, 3)
    q_buf = torch.randn((max_rows, hq, d), generator=gen, device=device, dtype=dtype)
    out_buf = torch.zeros((max_rows, hq, d), device=device, dtype=dtype)
    cap_q, cap_kv = cfg.q_max, cfg.q_max + cfg.prefix_max
    if fixed_max:
        lse_elems = max(len(q) * cap_q for q, _ in steps) * hq
    else:
        lse_elems = max(len(q) * max(q) for q, _ in steps) * hq
    lse_buf = torch.full((lse_elems,), float("-inf"), device=device, dtype=torch.float32)
    ws = torch.empty(
        wl.GPU_WORKSPACE_BYTES if device.type == "cuda" else wl.CPU_WORKSPACE_BYTES,
        dtype=torch.uint8,
        device=device,
    )
    lens_dev = device if lens_on_device else torch.device("cpu")
    calls = []
    for q_lens, kv_lens in steps:
        bsz, rows = len(q_lens), sum(q_lens)
        max_q, max_kv = (cap_q, cap_kv) if fixed_max else (max(q_lens), max(kv_lens))
        per_seq = [-(-k // page) for k in kv_lens]
        perm = torch.randperm(pool, generator=cpu_gen)[: sum(per_seq)]
        table = torch.zeros((bsz, max(per_seq)), dtype=torch.int32)
        s = 0
        for b, n in enumerate(per_seq):
            table[b, :n] = perm[s : s + n]
            s += n
        calls.append(
            dict(
                q=q_buf[:rows],
                k_cache=k_cache,
                v_cache=v_cache,
                scale=1.0 / math.sqrt(d),
                workspace_buffer=ws,
                max_token_per_sequence=max_q,
                max_sequence_kv=max_kv,
                actual_seq_lens_q=torch.tensor(q_lens, dtype=torch.int32, device=lens_dev),
                actual_seq_lens_kv=torch.tensor(kv_lens, dtype=torch.int32, device=lens_dev),
                block_tables=table.to(device),
                causal=cfg.causal,
                return_lse=True,
                out=out_buf[:rows],
                lse=lse_buf[: bsz * max_q * hq].view(bsz, max_q, hq),
                is_cuda_graph_compatible=bool(lens_on_device and device.type == "cuda"),
            )
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    return calls


def _counter(module: str, attr: str) -> int | None:
    """A backend's build/compile counter, when the module exposes it (else None)."""
    try:
        mod = importlib.import_module(module)
    except Exception:
        return None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        return None
    try:
        return int(fn())
    except Exception:
        return None


def _counters() -> dict:
    return {
        "cudnn_graph_builds": _counter("pagedprefill.backends.cudnn_backend", "graph_builds"),
        "triton_compiles": _counter("pagedprefill.backends.triton_backend", "compile_count"),
    }


def _pct(xs: list[float], p: float) -> float:
    ys = sorted(xs)
    if not ys:
        return math.nan
    k = min(len(ys) - 1, max(0, math.ceil(p / 100 * len(ys)) - 1))
    return ys[k]


class _SleepCalibration:
    """Cycles of ``torch.cuda._sleep`` per ms, measured once (to pre-load the GPU queue)."""

    cycles_per_ms: float | None = None

    @classmethod
    def get(cls) -> float | None:
        if cls.cycles_per_ms is None:
            try:
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                torch.cuda._sleep(1_000_000)
                e.record()
                torch.cuda.synchronize()
                cls.cycles_per_ms = 1_000_000 / max(s.elapsed_time(e), 1e-3)
            except Exception:
                cls.cycles_per_ms = 0.0
        return cls.cycles_per_ms or None


def gpu_time_preloaded(fn: Callable, host_ms: float) -> float:
    """Event time of one call with the GPU queue pre-loaded by a sleep kernel longer than the host's
    launch time, so that (unless the call syncs with the host) the events bracket device work only."""
    cpm = _SleepCalibration.get()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if cpm:
        torch.cuda._sleep(int(cpm * (2 * host_ms + 0.2)))
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e)


def run_serving_backend(
    backend: str,
    calls: list[dict],
    warmup: int,
    flops_per_call: list[int],
    device: torch.device,
    checks: int,
    say: Callable[[str], None],
) -> dict:
    cuda = device.type == "cuda"
    res: dict = {"backend": backend}
    fn_for = lambda kw: lambda: cudnn_batch_prefill_with_kv_cache(**kw, backend=backend)
    warm_calls, measured = calls[:warmup], calls[warmup:]
    c_start = _counters()
    t0 = time.perf_counter()
    first_kw = warm_calls[0] if warm_calls else measured[0]
    ws = first_kw["workspace_buffer"]
    first_call(first_kw, backend, say)
    if first_kw["workspace_buffer"] is not ws:  # grown for this backend: use it everywhere
        for kw in calls:
            kw["workspace_buffer"] = first_kw["workspace_buffer"]
    failures: list[str] = []

    def attempt(fn: Callable) -> bool:
        """Run one call; a failing call is counted (and the loop goes on) instead of ending the run."""
        try:
            fn()
            return True
        except Exception as e:
            failures.append(_short(e))
            if len(failures) == 1:
                say(f"  {backend}: a call failed: {_short(e)}")
            if len(failures) >= 20:
                raise RuntimeError(f"{len(failures)} calls failed; first: {failures[0]}") from e
            if cuda and not cuda_healthy():
                raise
            return False

    for kw in warm_calls[1:]:
        attempt(fn_for(kw))
    _sync(device)
    res["warmup_s"] = time.perf_counter() - t0
    c0 = _counters()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base_mem = torch.cuda.memory_allocated(device)
    host, lat, done = [], [], []
    step = max(1, len(measured) // 10)
    for i, kw in enumerate(measured):
        fn = fn_for(kw)
        _sync(device)
        t0 = time.perf_counter()
        if not attempt(fn):
            continue
        t1 = time.perf_counter()
        _sync(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        lat.append((t2 - t0) * 1e3)
        done.append(i)
        if (i + 1) % step == 0:
            say(f"  {backend}: {i + 1}/{len(measured)} calls, p50 so far {_pct(lat, 50):.3f} ms")
    c1 = _counters()
    for key in c0:
        res[f"{key}_warmup"] = None if c0[key] is None or c_start[key] is None else c0[key] - c_start[key]
        res[f"{key}_after_warmup"] = None if c0[key] is None or c1[key] is None else c1[key] - c0[key]
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        res["peak_mem_gib"] = peak / 2**30
        res["extra_mem_gib"] = (peak - base_mem) / 2**30
    if not done:
        raise RuntimeError(f"every measured call failed; first: {failures[0] if failures else '?'}")
    total_flop = sum(flops_per_call[warmup + i] for i in done)
    res.update(
        failed_calls=len(failures),
        first_error=failures[0] if failures else None,
        calls=len(done),
        warmup_calls=len(warm_calls),
        p50_ms=_pct(lat, 50),
        p99_ms=_pct(lat, 99),
        mean_ms=statistics.fmean(lat),
        host_p50_ms=_pct(host, 50),
        host_mean_ms=statistics.fmean(host),
        tflops_effective=total_flop / (sum(lat) * 1e-3) / 1e12 if sum(lat) > 0 else None,
    )
    if cuda:
        # Steady-state device time of the same (now cached) calls, up to 200 spread over the run.
        sel = sorted(set(range(0, len(done), max(1, len(done) // 200))))
        gpu = [gpu_time_preloaded(fn_for(measured[done[j]]), host[j]) for j in sel]
        res["gpu_p50_ms"] = _pct(gpu, 50)
        res["gpu_mean_ms"] = statistics.fmean(gpu)
        res["gpu_tflops"] = (
            sum(flops_per_call[warmup + done[j]] for j in sel) / (sum(gpu) * 1e-3) / 1e12
            if sum(gpu) > 0
            else None
        )
    # Correctness of a few measured calls (cached graphs/kernels reused on new data and shapes).
    errs = []
    if checks > 0:
        picks = sorted({done[round(j * (len(done) - 1) / max(1, checks - 1))] for j in range(checks)})
        for i in picks:
            kw = measured[i]
            kw["out"].fill_(float("nan"))
            try:
                out, lse = fn_for(kw)()
                _sync(device)
            except Exception as e:
                failures.append(_short(e))
                if cuda and not cuda_healthy():
                    raise
                continue
            q_lens = [int(x) for x in kw["actual_seq_lens_q"].tolist()]
            if cuda:
                ref_out, ref_lse = cudnn_batch_prefill_with_kv_cache(
                    **{**kw, "out": None, "lse": None}, backend="torch"
                )
                errs.append(compare(out, ref_out, lse_rows(lse, q_lens), lse_rows(ref_lse, q_lens)))
            else:
                ref_out, ref_lses = wl.reference_fp64(wl.dense_reference_inputs(kw))
                errs.append(compare(out, ref_out, lse_rows(lse, q_lens), torch.cat(ref_lses)))
        res["ok"] = bool(errs) and all(e["ok"] for e in errs) and not failures
        res["max_rel_err"] = max((e["rel_err"] for e in errs), default=None)
        res["max_lse_err"] = max(((e["lse_err"] or 0.0) for e in errs), default=None)
        res["checked_calls"] = len(errs)
        res["failed_calls"] = len(failures)
        res["first_error"] = failures[0] if failures else None
    else:
        res["ok"] = False if failures else None
    return res


def _serving_verdict(r: dict) -> str:
    if r.get("failed_calls"):
        return f"FAIL: {r['failed_calls']} calls raised"
    if r.get("ok") is None:
        return "–"
    rel = r.get("max_rel_err")
    return "ok" if r["ok"] else f"FAIL rel {rel if rel is not None else math.nan:.1e}"


def run_serving(args: argparse.Namespace, device: torch.device, env: dict, out_json: Path) -> int:
    cfg = ServingConfig() if device.type == "cuda" else ServingConfig.cpu()
    dtype = DTYPES[args.dtype]
    n, warm = args.serving, args.serving_warmup
    steps = serving_lengths(cfg, warm + n, args.seed)
    flops_per_call = [wl.flops((q, k), cfg.causal, cfg.heads_q, cfg.head_dim, cfg.head_dim) for q, k in steps]
    if device.type == "cpu":
        _say(f"== {CPU_NOTE}")
    _say(
        f"== serving loop on {env['gpu']}: {warm} warm-up + {n} measured calls, batch 1..{cfg.batch_max}, "
        f"q chunks {cfg.q_min}..{cfg.q_max} (budget {cfg.token_budget} tokens/step), prefixes "
        f"0..{cfg.prefix_max} ({cfg.new_fraction:.0%} new), page {cfg.page_size}, heads "
        f"{cfg.heads_q}/{cfg.heads_kv}, D {cfg.head_dim}, {args.dtype}, "
        f"{'fixed max_* caps' if args.serving_fixed_max else 'per-call max_*'}, lengths on "
        f"{'device (CUDA-graph mode)' if args.device_lengths else 'CPU'}"
    )
    t0 = time.perf_counter()
    calls = build_serving_calls(
        cfg, steps, device, dtype, args.seed, args.device_lengths, args.serving_fixed_max
    )
    tokens = [sum(q) for q, _ in steps[warm:]]
    _say(
        f"== inputs prebuilt in {time.perf_counter() - t0:.1f} s; measured calls: mean "
        f"{statistics.fmean(tokens):.0f} new tokens, mean "
        f"{statistics.fmean(flops_per_call[warm:]) / 1e9:.1f} GFLOP per call"
    )
    results = []
    interrupted = False
    try:
        for be in args.backend_names:
            row = {
                "mode": "serving",
                "backend": be,
                "dtype": args.dtype,
                "config": dataclasses.asdict(cfg),
                "fixed_max": bool(args.serving_fixed_max),
                "lengths_on": "device" if args.device_lengths else "cpu",
                **env,
            }
            if be == FA2:
                row["skipped"] = "serving mode runs the library's backends only"
                results.append(row)
                continue
            _say(f"-- {be}")
            try:
                row.update(
                    run_serving_backend(be, calls, warm, flops_per_call, device, args.serving_checks, _say)
                )
                _append_json(out_json, row)
            except Skip as s:
                row["skipped"] = str(s)
                _say(f"  {be}: skipped ({s})")
                _append_json(out_json, row)
            except Exception as e:
                row["error"] = _short(e)
                _say(f"  {be}: ERROR {_short(e)}")
                _say("    " + "    ".join(traceback.format_exc().splitlines(True)[-6:]))
                _append_json(out_json, row)
                if device.type == "cuda" and not cuda_healthy():
                    _say("  !! the CUDA context is broken; stopping")
                    results.append(row)
                    break
            results.append(row)
            gc.collect()
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
        _say("== interrupted: partial results below")
    headers = [
        "backend",
        "calls",
        "builds",
        "compiles",
        "p50 ms",
        "p99 ms",
        "host p50 ms",
        "gpu p50 ms",
        "eff TFLOP/s",
        "gpu TFLOP/s",
        "peak GiB",
        "ok",
    ]
    rows = []
    for r in results:
        if r.get("skipped") or r.get("error"):
            rows.append([r["backend"], *["–"] * 10, "ERROR (above)" if r.get("error") else "skipped"])
            continue

        def num(key, digits=3, r=r):
            v = r.get(key)
            return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else _fmt(v, digits)

        def cnt(key, r=r):
            v = r.get(key)
            return "n/a" if v is None else str(v)

        rows.append(
            [
                r["backend"],
                str(r["calls"]),
                cnt("cudnn_graph_builds_after_warmup"),
                cnt("triton_compiles_after_warmup"),
                num("p50_ms"),
                num("p99_ms"),
                num("host_p50_ms"),
                num("gpu_p50_ms"),
                num("tflops_effective", 1),
                num("gpu_tflops", 1),
                num("peak_mem_gib", 2),
                _serving_verdict(r),
            ]
        )
    for r in results:
        if r.get("skipped"):
            _say(f"skipped: {r['backend']}: {r['skipped']}")
        if r.get("error"):
            _say(f"error: {r['backend']}: {r['error']}")
        if r.get("first_error"):
            _say(f"failed calls: {r['backend']}: {r['failed_calls']}, first: {r['first_error']}")
    _say("")
    if device.type == "cpu":
        _say(f"== {CPU_NOTE}")
    _say(
        f"== serving loop, {env['gpu']} | torch {env['torch']} | triton {env['triton']} | cudnn-frontend "
        f"{env['cudnn']} | cuDNN {env['cudnn_backend']} | {env['date']} | JSON: {out_json}"
    )
    _say(
        "   builds/compiles: cuDNN graph builds / Triton compilations during the measured calls (after "
        "warm-up); p50/p99: host wall time of a call incl. sync; host: time to return without sync; "
        "gpu: event time with the queue pre-loaded (includes host work after any host sync inside the call)"
    )
    _say(format_text_table(headers, rows))
    failed = [r for r in results if r.get("ok") is False or r.get("error")]
    return 130 if interrupted else (1 if failed else 0)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Overhead mode: the cudnn backend against its own built graph
# --------------------------------------------------------------------------------------------


ROUNDS = 8  # overhead mode: measurement rounds per workload


def back_to_back_ms(fn: Callable, n: int, preload_ms: float) -> float:
    """ms per call of ``n`` calls queued back to back (the first call's host time hidden behind a
    sleep kernel; after that, a call whose host time exceeds its device time shows it)."""
    cycles = int(preload_ms * (_SleepCalibration.get() or 0.0))
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if cycles:
        torch.cuda._sleep(cycles)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


B2B_CALLS = 50


def measure_overhead(fn: Callable, args: argparse.Namespace, host_ms: float) -> dict:
    """One round: back-to-back ms per call of B2B_CALLS calls, with the host queueing them while the
    GPU runs (b2b) and with all of them queued before the first runs (b2bq: device time only), and
    the median pre-loaded single-call GPU ms (L2 flushed) of 10 calls."""
    b2b = back_to_back_ms(fn, B2B_CALLS, 2 * host_ms + 0.1)
    b2bq = back_to_back_ms(fn, B2B_CALLS, 1.5 * B2B_CALLS * host_ms + 0.2)
    gpu, _n = time_cuda_events(fn, 10, args.warmup_ms, args.rep_ms, preload_ms=2 * host_ms + 0.1)
    return {"b2b_ms": b2b, "b2bq_ms": b2bq, "gpu_ms": gpu}


def run_overhead(args: argparse.Namespace, device: torch.device, env: dict, out_json: Path) -> int:
    """For each workload: a call through the cudnn backend (public function, backend="cudnn") against
    executing the same built cuDNN graph directly with operands bound once (cudnn_backend.bare_graph).
    Both (and the graph with one trivial kernel between runs, for scale) are measured in ROUNDS
    rounds of alternating order; medians."""
    if device.type != "cuda":
        _say("== --overhead needs a CUDA GPU")
        return 2
    from pagedprefill import api
    from pagedprefill.backends import cudnn_backend as cb

    dtype = DTYPES[args.dtype]
    mode = "CUDA-graph replays" if args.cuda_graph else "eager calls"
    lens = "device" if args.device_lengths else "CPU"
    _say(f"== cudnn call vs its bare graph on {env['gpu']}: {mode}, lengths on {lens}, {args.dtype}")
    if not _SleepCalibration.get():
        _say("   (the sleep kernel could not be calibrated: 'all queued' is then the same as back to back)")
    results = []
    progress = Progress(len(args.workload_names), "overhead")
    try:
        for name in args.workload_names:
            progress.step(name)
            w = wl.get_workload(name)
            case = wl.build_case(w, device, dtype, args.seed, lens_on_device=args.device_lengths)
            row: dict = {"mode": "overhead", "workload": name, "graph_mode": mode, "lengths_on": lens, **env}
            try:
                first_call(case, "cudnn", progress.write)
                public = library_call(case, "cudnn")
                batch = api._normalise(**case)
                api._fill_metadata(batch, cb)
                cb.run(batch)
                graph = cb.bare_graph(batch)
                if args.cuda_graph:
                    public, graph = capture_cuda_graph(public), capture_cuda_graph(graph)
                tiny = torch.zeros(1, device=device)

                def graph_and_one_op(graph=graph, tiny=tiny):  # any kernel between two graph runs
                    tiny.fill_(1.0)
                    graph()

                fns = {"graph": graph, "call": public, "graph_op": graph_and_one_op}
                host = {}
                for label, fn in fns.items():
                    for _ in range(3):
                        fn()
                    host[label] = host_time_ms(fn)
                    row[f"{label}_host_ms"] = host[label]
                got: dict = {label: [] for label in fns}
                for r in range(ROUNDS):  # alternate the order: drifting clocks favour neither
                    for label in fns if r % 2 == 0 else reversed(fns):
                        got[label].append(measure_overhead(fns[label], args, host[label]))
                for label, runs in got.items():
                    for key in ("b2b_ms", "b2bq_ms", "gpu_ms"):
                        row[f"{label}_{key}"] = statistics.median(r[key] for r in runs)
                row["b2b_ratio"] = row["call_b2b_ms"] / row["graph_b2b_ms"]
                row["b2bq_ratio"] = row["call_b2bq_ms"] / row["graph_b2bq_ms"]
                row["gpu_ratio"] = row["call_gpu_ms"] / row["graph_gpu_ms"]
                row["plan"] = batch.extras["cudnn_plan"].spec.describe()
            except Skip as e:
                row["skipped"] = str(e)
            except Exception as e:
                row["error"] = _short(e)
                progress.write(f"  {name}: ERROR {_short(e)}")
            _append_json(out_json, row)
            results.append(row)
            del case
            gc.collect()
    except (Interrupted, KeyboardInterrupt):
        _say("== interrupted: partial results below")
    finally:
        progress.close()
    headers = [
        "workload",
        "graph ms",
        "call ms",
        "call/graph",
        "all queued",
        "graph+1 op ms",
        "graph gpu ms",
        "call gpu ms",
        "call/graph gpu",
        "graph host µs",
        "call host µs",
        "≤ 1.03",
    ]
    rows = []
    for r in results:
        if "b2b_ratio" not in r:
            rows.append([r["workload"], *["–"] * 10, r.get("skipped") or "ERROR"])
            continue
        ok = max(r["b2b_ratio"], r["gpu_ratio"]) <= 1.03
        rows.append(
            [
                r["workload"],
                _fmt(r["graph_b2b_ms"], 3),
                _fmt(r["call_b2b_ms"], 3),
                f"{r['b2b_ratio']:.3f}",
                f"{r['b2bq_ratio']:.3f}",
                _fmt(r["graph_op_b2b_ms"], 3),
                _fmt(r["graph_gpu_ms"], 3),
                _fmt(r["call_gpu_ms"], 3),
                f"{r['gpu_ratio']:.3f}",
                _fmt(r["graph_host_ms"] * 1e3, 0),
                _fmt(r["call_host_ms"] * 1e3, 0),
                "yes" if ok else "NO",
            ]
        )
    _say("")
    _say(
        f"== {env['gpu']} | cudnn-frontend {env['cudnn']} | cuDNN {env['cudnn_backend']} | {env['date']} | "
        f"{mode}, lengths on {lens} | ms per call: back to back ({B2B_CALLS} calls; all queued: every call "
        f"queued before the first runs), and one call with the L2 flushed and the GPU queue pre-loaded "
        f"(gpu) | JSON: {out_json}"
    )
    _say(format_text_table(headers, rows))
    if args.markdown:
        lines = [
            f"{env['gpu']}, {env['date']}: cudnn-frontend {env['cudnn']}, cuDNN {env['cudnn_backend']}; "
            f'{mode}, lengths on {lens}. `call` = the public function with backend="cudnn"; '
            "`graph` = the same built cuDNN graph executed directly, operands bound once.",
            "",
            "| " + " | ".join(headers) + " |",
            "|" + "|".join("---" for _ in headers) + "|",
            *("| " + " | ".join(r) + " |" for r in rows),
        ]
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text("\n".join(lines) + "\n", encoding="utf-8")
    bad = [r for r in results if "b2b_ratio" not in r and not r.get("skipped")]
    return 1 if bad else 0


def _csv(s: str | None) -> list[str] | None:
    if s is None:
        return None
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pagedprefill-bench",
        description="Benchmark pagedprefill's backends (and FA2 varlen) on the project's prefill workloads.",
    )
    p.add_argument(
        "--workloads", help="comma list of workload names (default: all; on CPU the tiny cpu_* set)"
    )
    p.add_argument(
        "--backends",
        help=f"comma list from {', '.join(ALL_BACKENDS)} (default GPU: cudnn,triton,{FA2}; CPU: torch). "
        "On a GPU the torch backend serves as the correctness reference and is timed only when listed.",
    )
    p.add_argument("--reps", type=int, default=None, help="timed runs per backend (default: ~--rep-ms worth)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="GPU warm-up budget per backend (ms)")
    p.add_argument(
        "--rep-ms", type=float, default=100.0, help="GPU timing budget per backend when --reps unset"
    )
    p.add_argument(
        "--timer",
        choices=("gpu", "events", "do_bench"),
        default="gpu",
        help="GPU timer: 'gpu' (default) events around one call with the queue pre-loaded, so only the "
        "call's device work is timed (its host time is the 'host us' column); 'events' the same without "
        "the pre-load (a call whose host time exceeds the flush's GPU time shows it); 'do_bench' Triton's",
    )
    p.add_argument("--out-json", help="JSON Lines file to append to (default bench/results/<gpu>.json)")
    p.add_argument("--plot", help="write a PNG bar chart of TFLOP/s here (needs matplotlib)")
    p.add_argument("--markdown", help="write the table as markdown here")
    p.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--serving", type=int, default=0, metavar="N", help="serving-loop mode: N measured calls")
    p.add_argument(
        "--serving-warmup", type=int, default=50, help="warm-up calls before measuring (serving mode)"
    )
    p.add_argument("--serving-checks", type=int, default=5, help="measured calls checked for correctness")
    p.add_argument(
        "--serving-fixed-max",
        action="store_true",
        help="pass fixed caps as max_token_per_sequence/max_sequence_kv instead of per-call maxima",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="table mode: capture each call in a CUDA graph and time the replays (pure GPU time; "
        "implies --device-lengths; the torch backend stays eager)",
    )
    p.add_argument(
        "--device-lengths",
        action="store_true",
        help="lengths on the device and is_cuda_graph_compatible=True (default: lengths on the CPU)",
    )
    p.add_argument(
        "--overhead",
        action="store_true",
        help="cudnn backend only: time each workload's call against its built cuDNN graph run directly",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="data type (default bf16)")
    p.add_argument("--seed", type=int, default=0, help="data seed (lengths come from each workload's seed)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    return p.parse_args(argv)


def _resolve(args: argparse.Namespace, device: torch.device, p_error: Callable[[str], None]) -> None:
    backends = _csv(args.backends) or default_backends(device, serving=bool(args.serving))
    bad = [b for b in backends if b not in ALL_BACKENDS]
    if bad:
        p_error(f"unknown backend(s) {bad}; choose from {', '.join(ALL_BACKENDS)}")
    args.backend_names = list(dict.fromkeys(backends))
    if args.workloads:
        names = _csv(args.workloads)
        known = {w["name"] for w in wl.load_workloads() + wl.CPU_WORKLOADS}
        bad = [n for n in names if n not in known]
        if bad:
            p_error(f"unknown workload(s) {bad}; known: {', '.join(sorted(known))}")
        args.workload_names = list(dict.fromkeys(names))
    else:
        source = wl.load_workloads() if device.type == "cuda" else wl.CPU_WORKLOADS
        args.workload_names = [w["name"] for w in source]
    if args.dtype is None:
        args.dtype = "bf16"
        if device.type == "cpu" and "triton" in args.backend_names:
            args.dtype = "fp16"
            _say(
                "== CPU + triton: using fp16 (Triton's interpreter cannot do bf16 dots); --dtype to override"
            )
    if device.type == "cpu" and "triton" in args.backend_names and os.environ.get("TRITON_INTERPRET") != "1":
        _say("== note: triton on the CPU needs TRITON_INTERPRET=1 in the environment (set before start)")
    if args.cuda_graph:
        if device.type != "cuda":
            _say("== --cuda-graph ignored: no CUDA GPU")
            args.cuda_graph = False
        else:
            args.device_lengths = True
    if args.reps is not None and args.reps < 1:
        p_error("--reps must be >= 1")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("pagedprefill-bench: --device cuda but no CUDA GPU is available", file=sys.stderr)
            return 2
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())

    def p_error(msg: str) -> None:
        print(f"pagedprefill-bench: error: {msg}", file=sys.stderr)
        raise SystemExit(2)

    _resolve(args, device, p_error)
    env = environment(device)
    slug = gpu_slug(env["gpu"]) if device.type == "cuda" else "cpu"
    if args.out_json:
        out_json = Path(args.out_json)
    else:
        suffix = "-serving" if args.serving else ("-overhead" if args.overhead else "")
        out_json = Path("bench") / "results" / f"{slug}{suffix}.json"

    def on_term(signum, frame):
        raise Interrupted()

    old = None
    try:
        old = signal.signal(signal.SIGTERM, on_term)
    except (ValueError, OSError):  # not the main thread
        old = None
    try:
        if args.serving:
            if args.serving < 1 or args.serving_warmup < 0:
                p_error("--serving N needs N >= 1 and --serving-warmup >= 0")
            return run_serving(args, device, env, out_json)
        if args.overhead:
            return run_overhead(args, device, env, out_json)
        return run_table(args, device, env, out_json)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    sys.exit(main())
