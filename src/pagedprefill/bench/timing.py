"""Timing, as the workloads' README prescribes.

GPU: CUDA events around one call; before it the L2 is flushed (a 256 MiB buffer write) and the GPU
queue is pre-loaded with a sleep kernel (``torch.cuda._sleep``, calibrated once per process) long
enough that the host has queued the call before the GPU reaches the start event: the events then
bracket the call's device work only. Median over runs after warm-up; graphs and kernels are built by
an earlier call, outside the timing. The table mode times a workload's systems together, run by run
(:func:`time_interleaved`). The host's own time per call is measured apart: calls queued
back to back, no sync. CPU: ``time.perf_counter`` around each call, median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

FLUSH_BYTES = 256 * 2**20  # > the L2 of any current GPU (H200: 60 MiB)


@dataclass
class TimingConfig:
    """``reps``: timed runs (None: about ``rep_ms`` worth, 10 to 1000); ``warmup_ms``: warm-up budget;
    ``timer``: ``"gpu"`` (events with the queue pre-loaded), ``"events"`` (the same without the
    pre-load: host launch time shows when it exceeds the flush) or ``"do_bench"`` (Triton's)."""

    reps: int | None = None
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    timer: str = "gpu"


class SleepCalibration:
    """Cycles of ``torch.cuda._sleep`` per ms, measured once (to pre-load the GPU queue)."""

    cycles_per_ms: float | None = None

    @classmethod
    def get(cls) -> float | None:
        if cls.cycles_per_ms is None:
            try:
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(100_000)  # the first launch loads the kernel: keep it out
                s.record()
                torch.cuda._sleep(1_000_000)
                e.record()
                torch.cuda.synchronize()
                cls.cycles_per_ms = 1_000_000 / max(s.elapsed_time(e), 1e-3)
            except Exception:
                cls.cycles_per_ms = 0.0
        return cls.cycles_per_ms or None


def preload(ms: float) -> None:
    """Queue a sleep kernel of about ``ms`` milliseconds (nothing if uncalibrated or ms <= 0)."""
    cpm = SleepCalibration.get()
    if cpm and ms > 0:
        torch.cuda._sleep(int(cpm * ms))


def time_cpu(fn: Callable, reps: int | None) -> tuple[float, int]:
    """Median wall time in ms (``time.perf_counter``) after one warm-up call; ``(ms, reps)``.

    Default reps: about a second's worth, between 3 and 20."""
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
    """Host time of one call in ms: ``n`` calls queued back to back without a sync (perf_counter)."""
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
    """Median ms over CUDA-event-timed runs of ``fn``, the L2 flushed before each run; ``(ms, runs)``.

    ``preload_ms`` > 0: a sleep kernel of that length is queued after the flush, before the start
    event, so that the events bracket the call's device work only."""
    ms, n = _runs_in_turn([fn], [preload_ms], reps, warmup_ms, rep_ms)
    return ms[0], n


def _runs_in_turn(
    fns: list[Callable], preload_ms: list[float], reps: int | None, warmup_ms: float, rep_ms: float
) -> tuple[list[float], int]:
    """Median ms of each of ``fns`` over CUDA-event-timed runs, step i running each once (in reverse
    order in odd steps), the L2 flushed and ``preload_ms[j]`` of sleep queued before call j's start
    event; ``(medians, runs each)``: ``reps``, or about ``rep_ms`` of the slowest call's (10 to 1000)."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    est = []
    for fn in fns:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(3):
            flush.zero_()
            fn()
        e.record()
        torch.cuda.synchronize()
        est.append(max(s.elapsed_time(e) / 3, 1e-3))
    for fn, t in zip(fns, est):
        for _ in range(max(1, min(200, int(warmup_ms / t)))):
            fn()
    n = reps or max(10, min(1000, int(rep_ms / max(est))))
    starts = [[torch.cuda.Event(enable_timing=True) for _ in range(n)] for _ in fns]
    ends = [[torch.cuda.Event(enable_timing=True) for _ in range(n)] for _ in fns]
    for i in range(n):
        for j in range(len(fns)) if i % 2 == 0 else reversed(range(len(fns))):
            flush.zero_()
            preload(preload_ms[j])
            starts[j][i].record()
            fns[j]()
            ends[j][i].record()
    torch.cuda.synchronize()
    del flush
    return [statistics.median(a.elapsed_time(b) for a, b in zip(starts[j], ends[j])) for j in range(len(fns))], n


class CallFailed(Exception):
    """Call ``index`` of :func:`time_interleaved` raised ``error`` (on the host, so it is that call's)."""

    def __init__(self, index: int, error: Exception):
        super().__init__(f"call {index}: {error}")
        self.index, self.error = index, error


def time_interleaved(fns: list[Callable], cfg: TimingConfig) -> tuple[list[float], int, str]:
    """Median ms of each of ``fns``, timed as :func:`time_cuda_events` with the queue pre-loaded times
    one, but run by run in turn: step i runs each call once (in reverse order in odd steps), so that
    a drift of the GPU's clocks or a warmer card reaches every call alike, instead of the ones timed
    later. ``(medians, runs each, timer used)``: ``cfg.reps`` runs, or about ``cfg.rep_ms`` of the slowest call's
    (10 to 1000). A call that raises on the host raises :class:`CallFailed` naming it; an error
    surfacing at a synchronisation propagates as it is (no one call can be named)."""

    def naming(j: int) -> Callable[[], None]:
        def call() -> None:
            try:
                fns[j]()
            except Exception as e:
                raise CallFailed(j, e) from e

        return call

    calls = [naming(j) for j in range(len(fns))]
    pre = [2 * host_time_ms(c) + 0.1 for c in calls]
    ms, n = _runs_in_turn(calls, pre, cfg.reps, cfg.warmup_ms, cfg.rep_ms)
    if not SleepCalibration.get():
        return ms, n, "cuda-events+l2-flush, runs interleaved (sleep kernel uncalibrated: no pre-load)"
    return ms, n, "cuda-events+l2-flush+preload, runs interleaved"


def time_gpu(fn: Callable, cfg: TimingConfig, say: Callable[[str], None]) -> tuple[float, int | None, str]:
    """``(median ms, runs or None, timer used)`` of ``fn`` on the GPU, per ``cfg.timer``."""
    if cfg.timer == "gpu":
        host_ms = host_time_ms(fn)
        ms, n = time_cuda_events(fn, cfg.reps, cfg.warmup_ms, cfg.rep_ms, preload_ms=2 * host_ms + 0.1)
        if not SleepCalibration.get():
            return ms, n, "cuda-events+l2-flush (sleep kernel uncalibrated: no pre-load)"
        return ms, n, "cuda-events+l2-flush+preload"
    if cfg.timer == "do_bench":
        try:
            import triton.testing

            ms = triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")
            return float(ms), None, "triton.testing.do_bench"
        except Exception as e:
            say(f"  do_bench failed ({type(e).__name__}: {e}); falling back to CUDA events")
    ms, n = time_cuda_events(fn, cfg.reps, cfg.warmup_ms, cfg.rep_ms)
    return ms, n, "cuda-events+l2-flush"


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


_PROBE = torch.empty((64, 8, 128))  # (a CPU tensor: the probe reads only its metadata)


def host_probe_us(n: int = 2000, reps: int = 5) -> float:
    """The host's speed now: µs per iteration of a fixed host-only loop (a tensor's shape, strides,
    dtype and address read into a tuple, looked up in a dict), the minimum over ``reps`` runs of
    ``n``. Host times measured on different machines, or while a host slows down, compare by it."""
    t, seen = _PROBE, {}
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            key = (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)
            seen.get(key)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


@dataclass
class Burst:
    """One timed step of ``n`` calls queued back to back (:func:`time_burst`), per call / layer, in µs:
    ``host_us`` (the host's time to queue a call while the GPU is busy), ``device_us`` (events around
    all calls, every call queued before the GPU reached the first), ``wall_us`` (the whole step with
    a sync at its end, from an idle GPU). ``preload_ok``: the host finished queueing before the
    sleep kernel ran out (else device_us includes host gaps)."""

    host_us: float
    device_us: float | None
    wall_us: float
    preload_ok: bool | None


def time_burst(step: Callable[[], None], n: int, device: torch.device, reps: int = 5, flush_l2: bool = True) -> Burst:
    """Median over ``reps`` of a step of ``n`` calls (``step`` runs all of them), see :class:`Burst`.

    On the CPU only the wall time is measured (host = wall, no device time)."""
    if device.type != "cuda":
        walls = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            walls.append((time.perf_counter() - t0) * 1e6 / n)
        w = statistics.median(walls)
        return Burst(w, None, w, None)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush_l2 else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    host_est_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    sleep_ms = 1.5 * host_est_ms + 0.5
    hosts, devices, walls, ok_all = [], [], [], True
    for _ in range(reps):
        # wall: the step from an idle GPU, synchronised at its end (what a serving engine waits for)
        if flush is not None:
            flush.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e6 / n)
        # host and device: every call queued behind a sleep kernel, then the events bracket device work
        for _attempt in range(3):
            if flush is not None:
                flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            preload(sleep_ms)
            s.record()
            h0 = time.perf_counter()
            step()
            h1 = time.perf_counter()
            e.record()
            early = s.query()  # the GPU already passed the start event: the sleep was too short
            torch.cuda.synchronize()
            if not early:
                break
            sleep_ms *= 2
        ok_all = ok_all and not early
        hosts.append((h1 - h0) * 1e6 / n)
        devices.append(s.elapsed_time(e) * 1e3 / n)
    del flush
    return Burst(statistics.median(hosts), statistics.median(devices), statistics.median(walls), ok_all)
