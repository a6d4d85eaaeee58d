"""Layers mode (``--layers N``): a serving engine's eager step, N attention layers over one batch.

Each case has ONE paged (or ragged) KV cache and, per layer, its own q and out tensors (so no call
sees the previous layer's buffers). Per backend the step runs

* ``plan.run``: :func:`pagedprefill.plan` once for the batch, then ``plan.run`` per layer;
* ``one-shot``: the public one-shot function per layer (its call cache makes the repeat cheap);
* the outside references (FA3 / FA2 varlen) per layer, on the same K/V stored contiguously.

Reported per call / layer: the host's time to queue a call while the GPU is busy (all N calls queued
behind a sleep kernel long enough that the host finishes first) beside a probe of the host's speed
taken just before (:func:`.timing.host_probe_us`: hosts of device calls differ), the wall time of the whole step
from an idle GPU with a sync at its end, the device time (events around the N calls), and
wall / device: how far the step is from running at the kernels' speed (1.0: the host never makes
the GPU wait).
"""

from __future__ import annotations

import argparse
import gc
import traceback
from collections.abc import Callable
from dataclasses import dataclass

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

DEFAULT_LAYERS = 32


@dataclass(frozen=True)
class LayerCase:
    """A batch of the layers mode: ``q_len`` / ``prefix`` fixed ints or ``(min, max)`` ranges drawn as
    the workloads' README draws them; ``page_size`` 0: ragged K/V; ``device_vectors``: lengths and
    ``batch_offsets_q/_o/_k/_v`` on the device (an engine that keeps its metadata on the GPU)."""

    name: str
    batch: int
    q_len: int | tuple[int, int]
    prefix: int | tuple[int, int]
    page_size: int = 16
    device_vectors: bool = False
    seed: int = 0

    def workload(self, heads_q: int, heads_kv: int, head_dim: int) -> dict:
        w: dict = {"name": self.name, "batch": self.batch, "seed": self.seed, "page_size": self.page_size}
        if isinstance(self.q_len, tuple):
            w.update(qo_min=self.q_len[0], qo_max=self.q_len[1])
        else:
            w["qo_len"] = self.q_len
        if isinstance(self.prefix, tuple):
            w["prefix_max"] = self.prefix[1]
        else:
            w["prefix"] = self.prefix
        w.update(heads_q=heads_q, heads_kv=heads_kv, head_dim_qk=head_dim, head_dim_vo=head_dim, causal=True)
        return w


# Llama-8B attention (heads 32/8, D 128), page 16, bf16, causal.
GPU_CASES = [
    LayerCase("b128_q128", 128, 128, 0),
    LayerCase("b16_q1k", 16, 1024, 0),
    LayerCase("b256_q64_p512", 256, 64, 512),
    LayerCase("ragged_b32_devoffsets", 32, (16, 512), (0, 1024), page_size=0, device_vectors=True, seed=3),
]
GPU_SHAPE = (32, 8, 128)
CPU_CASES = [
    LayerCase("cpu_b4_q16", 4, 16, 0),
    LayerCase("cpu_b2_q8_p24", 2, 8, 24),
    LayerCase("cpu_ragged_b3_devoffsets", 3, (4, 16), (0, 16), page_size=0, device_vectors=True, seed=3),
]
CPU_SHAPE = (4, 2, 64)


def known_cases() -> dict[str, LayerCase]:
    return {c.name: c for c in GPU_CASES + CPU_CASES}


def default_cases(device: torch.device) -> list[str]:
    return [c.name for c in (GPU_CASES if device.type == "cuda" else CPU_CASES)]


def default_backends(device: torch.device) -> list[str]:
    return ["triton", "cudnn", FA3, FA2] if device.type == "cuda" else ["torch"]


class LayerBatch:
    """A layer case built on a device: the shared cache and batch arguments, and N layers' q / out."""

    def __init__(self, lc: LayerCase, n_layers: int, device: torch.device, dtype: torch.dtype, seed: int):
        shape = GPU_SHAPE if lc.name in {c.name for c in GPU_CASES} else CPU_SHAPE
        self.case = lc
        self.w = lc.workload(*shape)
        self.gflop = wl.flops(self.w) / 1e9
        kw = wl.build_case(self.w, device, dtype=dtype, seed=seed, lens_on_device=lc.device_vectors)
        hq, dqk = shape[0], shape[2]
        if lc.device_vectors and lc.page_size == 0:
            starts = [0]
            for n in wl.lengths(self.w)[0]:
                starts.append(starts[-1] + n)
            offs = torch.tensor([s * hq * dqk for s in starts], dtype=torch.int32, device=device)
            kw.update(batch_offsets_q=offs, batch_offsets_o=offs)  # Dvo = Dqk: one offset vector serves both
        self.q_lens, self.kv_lens = wl.lengths(self.w)
        q0, out0 = kw.pop("q"), kw.pop("out")
        kw.pop("lse")
        kw["return_lse"] = False  # a prefill step of a serving engine needs no LSE
        self.base = kw  # everything but the layer's q and out
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        self.q = [q0] + [torch.randn(q0.shape, generator=gen, device=device, dtype=dtype) for _ in range(n_layers - 1)]
        self.out = [out0] + [torch.empty_like(out0) for _ in range(n_layers - 1)]
        self.n = n_layers
        self.device = device
        self._dense: dict | None = None

    def layer_kwargs(self, i: int) -> dict:
        return {**self.base, "q": self.q[i], "out": self.out[i]}

    def dense(self) -> dict:
        """K/V stored contiguously, once for all layers (q is per layer)."""
        if self._dense is None:
            self._dense = wl.dense_reference_inputs({**self.base, "q": self.q[0]})
        return self._dense

    def plan(self, backend: str) -> pagedprefill.PrefillPlan:
        b, w = self.base, self.w
        offsets = {f"batch_offsets_{n}": b.get(f"batch_offsets_{n}") for n in ("q", "o", "k", "v")}
        return pagedprefill.plan(
            b["workspace_buffer"],
            num_qo_heads=w["heads_q"],
            num_kv_heads=w["heads_kv"],
            head_dim_qk=w["head_dim_qk"],
            head_dim_vo=w["head_dim_vo"],
            page_size=w["page_size"],
            actual_seq_lens_q=b["actual_seq_lens_q"],
            actual_seq_lens_kv=b["actual_seq_lens_kv"],
            max_token_per_sequence=b["max_token_per_sequence"],
            max_sequence_kv=b["max_sequence_kv"],
            block_tables=b.get("block_tables"),
            causal=True,
            scale=b["scale"],
            return_lse=False,
            backend=backend,
            **offsets,
        )


def _steps(lb: LayerBatch, backend: str, api: str) -> tuple[Callable[[], list], str | None]:
    """``(step, served_by)``: ``step()`` runs the N layers and returns their outputs."""
    n = lb.n
    if api == "reference":
        dense = lb.dense()
        calls = [references.reference_call(backend, {**dense, "q": lb.q[i]}) for i in range(n)]

        def ref_step() -> list:
            return [c()[0] for c in calls]

        return ref_step, backend
    if api == "plan.run":
        p = lb.plan(backend)
        k, v, qs, outs = lb.base["k_cache"], lb.base["v_cache"], lb.q, lb.out

        def plan_step() -> list:
            return [p.run(qs[i], k, v, out=outs[i])[0] for i in range(n)]

        step = plan_step
    else:
        kws = [lb.layer_kwargs(i) for i in range(n)]

        def one_shot_step() -> list:
            return [cases.prefill(**kw, backend=backend)[0] for kw in kws]

        step = one_shot_step
    try:
        step()
        sync(lb.device)
    except Exception as e:
        skip = cases.classify(e)
        if skip is not None:
            raise skip from e
        raise
    return step, pagedprefill.last_backend()


def _check(lb: LayerBatch, outs: list, api: str, backend: str) -> dict:
    """Layers 0 and N-1 against the reference (the torch backend on a GPU, float64 on the CPU)."""
    worst: dict = {"ok": True, "rel_err": 0.0}
    for i in sorted({0, lb.n - 1}):
        kw = {**lb.layer_kwargs(i), "out": None, "return_lse": True, "lse": None}
        ref = checks.reference(kw)
        tol = checks.rel_tol_for(lb.q[i], api == "reference" or backend in ("cudnn", "triton"))
        err = checks.compare(outs[i], ref["out"], rel_tol=tol)
        worst["ok"] = worst["ok"] and err["ok"]
        worst["rel_err"] = max(worst["rel_err"], err["rel_err"])
        worst["rel_tol"] = tol
    return worst


def run_one(lb: LayerBatch, backend: str, api: str, args: argparse.Namespace) -> dict:
    """Build, warm up, check and time one (backend, API) on one layer batch."""
    step, served_by = _steps(lb, backend, api)
    res: dict = {"served_by": served_by}
    if not args.no_check:
        if api != "reference":
            for o in lb.out:
                o.fill_(float("nan"))
        outs = step()
        sync(lb.device)
        res.update(_check(lb, outs, api, backend))
        del outs
    res["host_probe_us"] = timing.host_probe_us()
    burst = timing.time_burst(step, lb.n, lb.device, reps=args.reps or 5)
    res.update(host_us=burst.host_us, wall_us=burst.wall_us, device_us=burst.device_us, preload_ok=burst.preload_ok)
    if burst.device_us:
        res["wall_over_device"] = burst.wall_us / burst.device_us
        res["tflops"] = lb.gflop / (burst.device_us * 1e-3)  # GFLOP / ms = TFLOP/s
    else:
        res["tflops"] = lb.gflop / (burst.wall_us * 1e-3)
    return res


def variants(backends: list[str]) -> list[tuple[str, str]]:
    """``(backend, api)`` pairs: each library backend through plan.run and one-shot, each reference once."""
    out = []
    for be in backends:
        if be in REFERENCES:
            out.append((be, "reference"))
        else:
            out += [(be, "plan.run"), (be, "one-shot")]
    return out


BASE_HEADERS = [
    "case",
    "backend",
    "api",
    "host µs/call",
    "host probe µs",
    "wall µs/layer",
    "device µs/layer",
    "wall/device",
    "TF/s",
]


def _ok(r: dict | None) -> bool:
    return bool(r) and r.get("wall_us") is not None and not r.get("error") and r.get("ok") is not False


def table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the layers table: per (case, backend, api) the times, and the step's speed
    relative to cuDNN through ``plan.run`` (``×cuDNN``) and to FA3 (``×FA3``): their wall time per
    layer / this one's (> 1: faster), each where both ran; last, geomean rows of the ratios per
    (backend, api) over the cases where both passed their checks."""
    by = {(r["case"], r["backend"], r["api"]): r for r in results}
    has_cudnn = any(r["backend"] == "cudnn" and r["api"] == "plan.run" and _ok(r) for r in results)
    has_fa3 = any(r["backend"] == FA3 and _ok(r) for r in results)
    headers = list(BASE_HEADERS) + (["×cuDNN"] if has_cudnn else []) + (["×FA3"] if has_fa3 else []) + ["check"]
    rows, ratios = [], {}
    for r in results:
        bases = []
        if has_cudnn:
            bases.append(("cudnn", by.get((r["case"], "cudnn", "plan.run"))))
        if has_fa3:
            bases.append((FA3, by.get((r["case"], FA3, "reference"))))
        if r.get("skipped") or r.get("error") or r.get("wall_us") is None:
            cells = ["–"] * (len(BASE_HEADERS) - 3 + len(bases))
            rows.append([r["case"], r["backend"], r["api"], *cells, "ERROR" if r.get("error") else "skipped"])
            continue
        check = "–" if r.get("ok") is None else ("ok" if r["ok"] else f"FAILED rel {r['rel_err']:.1e}")
        ratio = r.get("wall_over_device")
        dev = fmt(r.get("device_us"), 1) + ("" if r.get("preload_ok") in (True, None) else " (host gaps)")
        line = [
            r["case"],
            r["backend"],
            r["api"],
            fmt(r["host_us"], 1),
            fmt(r.get("host_probe_us"), 3),
            fmt(r["wall_us"], 1),
            dev,
            f"{ratio:.2f}" if ratio else "–",
            fmt(r.get("tflops"), 1),
        ]
        for name, base in bases:
            if base is not None and base.get("wall_us") and not base.get("error"):
                x = base["wall_us"] / r["wall_us"]
                line.append(f"{x:.2f}")
                if _ok(r) and _ok(base):
                    ratios.setdefault((r["backend"], r["api"], name), []).append(x)
            else:
                line.append("–")
        rows.append([*line, check])
    if has_cudnn or has_fa3:
        for be, api in dict.fromkeys((r["backend"], r["api"]) for r in results):
            line = ["geomean", be, api, *[""] * (len(BASE_HEADERS) - 3)]
            for name, shown in (("cudnn", has_cudnn), (FA3, has_fa3)):
                if shown:
                    g = tables.geomean(ratios.get((be, api, name), []))
                    line.append(f"{g:.2f}" if g is not None else "–")
            rows.append([*line, ""])
    return headers, rows


def run_layers(args: argparse.Namespace, device: torch.device, env: dict, rows_out: tables.JsonRows) -> int:
    """Layers mode (see the module docstring); returns the exit status."""
    dtype = DTYPES[args.dtype]
    n = args.layers
    pairs = variants(args.backend_names)
    known = known_cases()
    names = args.workload_names
    if device.type == "cpu":
        say(f"== {CPU_NOTE}")
    say(
        f"== layers mode on {env['gpu']}: {n} layers per step (distinct q / out per layer, one KV cache), "
        f"causal, {args.dtype}; cases {', '.join(names)}; backends {', '.join(args.backend_names)}"
    )
    if FA3 in args.backend_names:
        fn, about = references.fa3_status()
        say(f"== {FA3}: {about}" if fn is not None else f"== {FA3} will be skipped: {about}")
    results: list[dict] = []
    interrupted = False
    progress = Progress(len(names) * len(pairs), "layers")
    try:
        for name in names:
            lc = known[name]
            lb = None
            try:
                lb = LayerBatch(lc, n, device, dtype, args.seed)
            except Exception as e:
                progress.write(f"{name}: could not build the case: {short(e)}")
            for be, api in pairs:
                progress.step(name, be, api)
                row = {"mode": "layers", "case": name, "backend": be, "api": api, "layers": n, **env}
                if lb is not None:
                    row.update(
                        batch=lc.batch,
                        page_size=lc.page_size,
                        device_vectors=lc.device_vectors,
                        gflop=lb.gflop,
                    )
                try:
                    if lb is None:
                        raise Skip("case not built")
                    row.update(run_one(lb, be, api, args))
                    progress.write(
                        f"  {name} / {be} {api}: host {row['host_us']:.1f} µs/call, wall "
                        f"{row['wall_us']:.1f} µs/layer, device {fmt(row['device_us'], 1)} µs/layer"
                    )
                except Skip as s:
                    row["skipped"] = str(s)
                    progress.write(f"  {name} / {be} {api}: skipped ({s})")
                except Exception as e:
                    row["error"] = short(e)
                    progress.write(f"  {name} / {be} {api}: ERROR {short(e)}")
                    progress.write("    " + "    ".join(traceback.format_exc().splitlines(True)[-6:]))
                    if device.type == "cuda" and not cuda_healthy():
                        rows_out.write(row)
                        results.append(row)
                        raise Interrupted() from e
                rows_out.write(row)
                results.append(row)
            del lb
            gc.collect()
    except (Interrupted, KeyboardInterrupt):
        interrupted = True
    finally:
        progress.close()
    if interrupted:
        say("== interrupted: partial results below")
    headers, rows = table(results)
    notes = [f"skipped: {r['case']} / {r['backend']} {r['api']}: {r['skipped']}" for r in results if r.get("skipped")]
    notes += [f"error: {r['case']} / {r['backend']} {r['api']}: {r['error']}" for r in results if r.get("error")]
    legend = (
        "host: µs to queue one call while the GPU is busy; host probe: µs per iteration of a fixed host-only "
        "loop timed just before the row (the host's speed then: compare host times of two runs by it); "
        "wall: µs per layer of the whole step from an idle "
        "GPU, synchronised; device: µs per layer between events around all N calls (all queued first); "
        "wall/device 1.00 = the host never made the GPU wait; TF/s from the device time; ×cuDNN / ×FA3: "
        "cuDNN's (plan.run) / FA3's wall time per layer over this one's (> 1: faster)"
        if device.type == "cuda"
        else "CPU: wall µs per layer of the whole step (host = wall, no device time)"
    )
    title = f"layers mode ({n} layers), {env['gpu']} | torch {env['torch']} | triton {env['triton']}"
    title += f" | {env['date']}"
    return tables.report_mode(args, device, title, legend, headers, rows, notes, results, interrupted)
