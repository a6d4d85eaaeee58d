"""Serving-loop mode (``--serving N``): a continuous-batching scheduler's prefill steps.

Every step is a new batch (1 to 64 chunked prefills with cached prefixes, one shared paged cache),
all built before the timing. Per backend: warm-up calls, then N measured calls, each synchronised
(latency), with the cuDNN graph builds and Triton compilations counted during the measured calls,
and ``torch.cuda.memory_allocated()`` read after the warm-up and again after the last measured call,
with no ``gc.collect()`` between the two: a leak (a tensor kept per call, a reference cycle holding
device memory) shows as growth. A few measured calls are then checked against the torch backend
(float64 math on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import time
import traceback
from collections.abc import Callable

import torch

from pagedprefill import dispatch
from pagedprefill import workloads as wl

from . import cases, checks, tables, timing
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
    """``n`` steps of ``(q_lens, kv_lens)``: batch 1..batch_max, log-uniform chunks, token budget."""
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
    """Per-step call kwargs over ONE shared paged cache and q / out / lse buffers, built before timing."""
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
    ws_bytes = wl.GPU_WORKSPACE_BYTES if device.type == "cuda" else wl.CPU_WORKSPACE_BYTES
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=device)
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
    sync(device)
    return calls


_COUNTERS = {"cudnn_graph_builds": ("cudnn", "graph_builds"), "triton_compiles": ("triton", "compiled_variants")}


def counters() -> dict[str, int | None]:
    """cuDNN graphs built and Triton kernel variants compiled so far (None: not available here)."""
    got: dict[str, int | None] = {}
    for key, (backend, attr) in _COUNTERS.items():
        try:
            got[key] = int(getattr(dispatch.backend_module(backend), attr)())
        except Exception:
            got[key] = None
    return got


def percentile(xs: list[float], p: float) -> float:
    ys = sorted(xs)
    if not ys:
        return math.nan
    k = min(len(ys) - 1, max(0, math.ceil(p / 100 * len(ys)) - 1))
    return ys[k]


def gpu_time_preloaded(fn: Callable, host_ms: float) -> float:
    """Event time of one call with the GPU queue pre-loaded by a sleep kernel longer than the host's
    launch time, so that (unless the call syncs with the host) the events bracket device work only."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    timing.preload(2 * host_ms + 0.2)
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
    checks_n: int,
    say_: Callable[[str], None],
) -> dict:
    """Warm-up, measured loop, memory, device times and sampled checks of one backend."""
    cuda = device.type == "cuda"
    res: dict = {"backend": backend}

    def fn_for(kw):
        return cases.library_call(kw, backend)

    warm_calls, measured = calls[:warmup], calls[warmup:]
    c_start = counters()
    t0 = time.perf_counter()
    first_kw = warm_calls[0] if warm_calls else measured[0]
    ws = first_kw["workspace_buffer"]
    cases.first_call(first_kw, backend, say_)
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
            failures.append(short(e))
            if len(failures) == 1:
                say_(f"  {backend}: a call failed: {short(e)}")
            if len(failures) >= 20:
                raise RuntimeError(f"{len(failures)} calls failed; first: {failures[0]}") from e
            if cuda and not cuda_healthy():
                raise
            return False

    for kw in warm_calls[1:]:
        attempt(fn_for(kw))
    sync(device)
    res["warmup_s"] = time.perf_counter() - t0
    c0 = counters()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        res["mem_after_warmup_mib"] = torch.cuda.memory_allocated(device) / 2**20
    host, lat, done = [], [], []
    step = max(1, len(measured) // 10)
    for i, kw in enumerate(measured):
        fn = fn_for(kw)
        sync(device)
        t0 = time.perf_counter()
        if not attempt(fn):
            continue
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        lat.append((t2 - t0) * 1e3)
        done.append(i)
        if (i + 1) % step == 0:
            say_(f"  {backend}: {i + 1}/{len(measured)} calls, p50 so far {percentile(lat, 50):.3f} ms")
    if cuda:  # before anything else allocates: the measured calls' own footprint
        res["mem_end_mib"] = torch.cuda.memory_allocated(device) / 2**20
        res["mem_growth_mib"] = res["mem_end_mib"] - res["mem_after_warmup_mib"]
        peak = torch.cuda.max_memory_allocated(device)
        res["peak_mem_gib"] = peak / 2**30
    c1 = counters()
    for key in c0:
        res[f"{key}_warmup"] = None if c0[key] is None or c_start[key] is None else c0[key] - c_start[key]
        res[f"{key}_after_warmup"] = None if c0[key] is None or c1[key] is None else c1[key] - c0[key]
    if not done:
        raise RuntimeError(f"every measured call failed; first: {failures[0] if failures else '?'}")
    total_flop = sum(flops_per_call[warmup + i] for i in done)
    res.update(
        failed_calls=len(failures),
        first_error=failures[0] if failures else None,
        calls=len(done),
        warmup_calls=len(warm_calls),
        p50_ms=percentile(lat, 50),
        p99_ms=percentile(lat, 99),
        mean_ms=statistics.fmean(lat),
        host_p50_ms=percentile(host, 50),
        host_mean_ms=statistics.fmean(host),
        tflops_effective=total_flop / (sum(lat) * 1e-3) / 1e12 if sum(lat) > 0 else None,
    )
    if cuda:
        # Steady-state device time of the same (now cached) calls, up to 200 spread over the run.
        sel = sorted(set(range(0, len(done), max(1, len(done) // 200))))
        gpu = [gpu_time_preloaded(fn_for(measured[done[j]]), host[j]) for j in sel]
        res["gpu_p50_ms"] = percentile(gpu, 50)
        res["gpu_mean_ms"] = statistics.fmean(gpu)
        flop = sum(flops_per_call[warmup + done[j]] for j in sel)
        res["gpu_tflops"] = flop / (sum(gpu) * 1e-3) / 1e12 if sum(gpu) > 0 else None
    # Correctness of a few measured calls (cached graphs / kernels reused on new data and shapes).
    errs = []
    if checks_n > 0:
        picks = sorted({done[round(j * (len(done) - 1) / max(1, checks_n - 1))] for j in range(checks_n)})
        for i in picks:
            kw = measured[i]
            kw["out"].fill_(float("nan"))
            try:
                out, lse = fn_for(kw)()
                sync(device)
            except Exception as e:
                failures.append(short(e))
                if cuda and not cuda_healthy():
                    raise
                continue
            errs.append(checks.check_library_output(kw, out, lse, checks.reference(kw), backend))
        res["ok"] = bool(errs) and all(e["ok"] for e in errs) and not failures
        res["max_rel_err"] = max((e["rel_err"] for e in errs), default=None)
        res["max_lse_err"] = max(((e["lse_err"] or 0.0) for e in errs), default=None)
        res["checked_calls"] = len(errs)
        res["failed_calls"] = len(failures)
        res["first_error"] = failures[0] if failures else None
    else:
        res["ok"] = False if failures else None
    return res


def _verdict(r: dict) -> str:
    if r.get("failed_calls"):
        return f"FAIL: {r['failed_calls']} calls raised"
    if r.get("ok") is None:
        return "–"
    rel = r.get("max_rel_err")
    return "ok" if r["ok"] else f"FAILED rel {rel if rel is not None else math.nan:.1e}"


def default_backends(device: torch.device) -> list[str]:
    return ["cudnn", "triton"] if device.type == "cuda" else ["torch"]


def run_serving(args: argparse.Namespace, device: torch.device, env: dict, rows_out: tables.JsonRows) -> int:
    """Serving mode (see the module docstring); returns the exit status."""
    cfg = ServingConfig() if device.type == "cuda" else ServingConfig.cpu()
    dtype = DTYPES[args.dtype]
    n, warm = args.serving, args.serving_warmup
    steps = serving_lengths(cfg, warm + n, args.seed)
    flops_per_call = [wl.flops((q, k), cfg.causal, cfg.heads_q, cfg.head_dim, cfg.head_dim) for q, k in steps]
    if device.type == "cpu":
        say(f"== {CPU_NOTE}")
    say(
        f"== serving loop on {env['gpu']}: {warm} warm-up + {n} measured calls, batch 1..{cfg.batch_max}, "
        f"q chunks {cfg.q_min}..{cfg.q_max} (budget {cfg.token_budget} tokens/step), prefixes "
        f"0..{cfg.prefix_max} ({cfg.new_fraction:.0%} new), page {cfg.page_size}, heads "
        f"{cfg.heads_q}/{cfg.heads_kv}, D {cfg.head_dim}, {args.dtype}, "
        f"{'fixed max_* caps' if args.serving_fixed_max else 'per-call max_*'}, lengths on "
        f"{'device (CUDA-graph mode)' if args.device_lengths else 'CPU'}; "
        f"backends {', '.join(args.backend_names)}"
    )
    t0 = time.perf_counter()
    calls = build_serving_calls(cfg, steps, device, dtype, args.seed, args.device_lengths, args.serving_fixed_max)
    tokens = [sum(q) for q, _ in steps[warm:]]
    say(
        f"== inputs prebuilt in {time.perf_counter() - t0:.1f} s; measured calls: mean "
        f"{statistics.fmean(tokens):.0f} new tokens, mean "
        f"{statistics.fmean(flops_per_call[warm:]) / 1e9:.1f} GFLOP per call"
    )
    results = []
    interrupted = False
    progress = Progress(len(args.backend_names), "serving")
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
            progress.step("serving", be)
            try:
                row.update(
                    run_serving_backend(be, calls, warm, flops_per_call, device, args.serving_checks, progress.write)
                )
            except Skip as s:
                row["skipped"] = str(s)
                progress.write(f"  {be}: skipped ({s})")
            except Exception as e:
                row["error"] = short(e)
                progress.write(f"  {be}: ERROR {short(e)}")
                progress.write("    " + "    ".join(traceback.format_exc().splitlines(True)[-6:]))
                if device.type == "cuda" and not cuda_healthy():
                    progress.write("  !! the CUDA context is broken; stopping")
                    rows_out.write(row)
                    results.append(row)
                    break
            rows_out.write(row)
            results.append(row)
            gc.collect()  # between backends only: never between a backend's two memory readings
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
        say("== interrupted: partial results below")
    finally:
        progress.close()
    return report(results, args, device, env, interrupted)


HEADERS = [
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
    "mem warm MiB",
    "mem end MiB",
    "growth MiB",
    "peak GiB",
    "check",
]


def table_rows(results: list[dict]) -> list[list[str]]:
    rows = []
    for r in results:
        if r.get("skipped") or r.get("error"):
            rows.append([r["backend"], *["–"] * (len(HEADERS) - 2), "ERROR (above)" if r.get("error") else "skipped"])
            continue

        def num(key, digits=3, r=r):
            v = r.get(key)
            return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt(v, digits)

        def cnt(key, r=r):
            v = r.get(key)
            return "n/a" if v is None else str(v)

        growth = f"{r['mem_growth_mib']:+.3f}" if r.get("mem_growth_mib") is not None else "–"
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
                num("mem_after_warmup_mib", 1),
                num("mem_end_mib", 1),
                growth,
                num("peak_mem_gib", 2),
                _verdict(r),
            ]
        )
    return rows


def report(results: list[dict], args: argparse.Namespace, device: torch.device, env: dict, interrupted: bool) -> int:
    rows = table_rows(results)
    notes = []
    for r in results:
        if r.get("skipped"):
            notes.append(f"skipped: {r['backend']}: {r['skipped']}")
        if r.get("error"):
            notes.append(f"error: {r['backend']}: {r['error']}")
        if r.get("first_error"):
            notes.append(f"failed calls: {r['backend']}: {r['failed_calls']}, first: {r['first_error']}")
    legend = (
        "builds / compiles: cuDNN graph builds / Triton compilations during the measured calls (after "
        "warm-up); p50/p99: host wall time of a call incl. sync; host: time to return without sync; gpu: "
        "event time with the queue pre-loaded; mem: torch.cuda.memory_allocated() after the warm-up and "
        "after the last measured call (no gc.collect() between), growth = end - warm"
    )
    title = (
        f"serving loop, {env['gpu']} | torch {env['torch']} | triton {env['triton']} | cudnn-frontend "
        f"{env['cudnn']} | cuDNN {env['cudnn_backend']} | {env['date']}"
    )
    return tables.report_mode(args, device, title, legend, HEADERS, rows, notes, results, interrupted)
