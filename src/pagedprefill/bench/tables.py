"""Reporting: the summary tables (text and markdown), JSON Lines rows, and the plot.

Nothing is written anywhere the user did not name: :class:`JsonRows` writes ``--out-json``,
:func:`write_markdown` ``--markdown``, :func:`write_plot` ``--plot``.
"""

from __future__ import annotations

import importlib
import json
import math
import textwrap
from pathlib import Path

from .common import CPU_NOTE, fmt, say, short
from .references import FA3, LABELS

Header = tuple[str, str]  # (group: a backend, or "" for the leading columns; metric)


class JsonRows:
    """``--out-json``: one JSON object per line, written as each measurement ends (an interrupted run
    keeps what it measured). The file is truncated when the run starts, unless ``append``."""

    def __init__(self, path: str | Path | None, append: bool = False):
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append:
                self.path.write_text("", encoding="utf-8")

    def write(self, row: dict) -> None:
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _ran(r: dict | None) -> bool:
    return bool(r) and bool(r.get("ms")) and not r.get("error")


def workload_label(r: dict) -> str:
    """The workload's name, with its data kind for fp8 workloads (``fp8_b2_q8k [fp8]``)."""
    kind = r.get("kind")
    return f"{r['workload']} [{kind}]" if kind in ("fp8", "fp8_kv") else r["workload"]


def summary_table(
    results: list[dict], backends: list[str], markdown: bool = False
) -> tuple[list[Header], list[list[str]]]:
    """Headers and rows of the table-mode summary: workload, GFLOP, then per backend its TFLOP/s,
    its speed ratio to cuDNN (``×cuDNN`` = cuDNN's time / its time: > 1 is faster than cuDNN) and
    to FA3 (``×FA3``), and its host µs per call; ``markdown`` adds each backend's ms. Last, a
    geomean row of the ratios over the workloads where both ran and both passed their checks.

    A cell that ran another data than the workload's own (the bf16 data of an fp8 workload) says
    ``(bf16)``; a run that failed its check says ``FAILED``; one that raised, ``ERROR``."""
    by = {(r["workload"], r["backend"]): r for r in results}
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    ran_cudnn = any(r["backend"] == "cudnn" and _ran(r) for r in results)
    ran_fa3 = any(r["backend"] == FA3 and _ran(r) for r in results)
    has_host = any(r.get("host_us") is not None for r in results)
    headers: list[Header] = [("", "workload"), ("", "GFLOP")]
    for be in backends:
        if markdown:
            headers.append((be, "ms"))
        headers.append((be, "TFLOP/s" if markdown else "TF/s"))
        if ran_cudnn and be != "cudnn":
            headers.append((be, "×cuDNN"))
        if ran_fa3 and be != FA3:
            headers.append((be, "×FA3"))
        if has_host:
            headers.append((be, "host µs"))
    rows = []
    ratios: dict[tuple[str, str], list[float]] = {}
    for wname in workloads:
        first = next(r for r in results if r["workload"] == wname)
        line = [workload_label(first), fmt(first.get("gflop"), 1)]
        bases = {"cudnn": by.get((wname, "cudnn")), FA3: by.get((wname, FA3))}
        for be in backends:
            r = by.get((wname, be)) or {}
            ms = r.get("ms")
            if r.get("error"):
                cell = "ERROR"
            elif not ms:
                cell = "skip" if r.get("skipped") else "–"
            else:
                cell = fmt(r.get("tflops"), 1)
                if r.get("data") and r.get("kind") and r["data"] != r["kind"]:
                    cell += f" ({r['data']})"
                if r.get("ok") is False:
                    cell += " FAILED"
            if markdown:
                line.append(fmt(ms, 3) if _ran(r) else "–")
            line.append(cell)
            for base_name, shown in (("cudnn", ran_cudnn), (FA3, ran_fa3)):
                if not shown or be == base_name:
                    continue
                base = bases[base_name]
                if _ran(r) and _ran(base):
                    ratio = base["ms"] / ms
                    line.append(f"{ratio:.2f}")
                    if r.get("ok") is not False and base.get("ok") is not False:
                        ratios.setdefault((be, base_name), []).append(ratio)
                else:
                    line.append("–")
            if has_host:
                line.append(fmt(r.get("host_us"), 0) if _ran(r) else "–")
        rows.append(line)
    if workloads and (ran_cudnn or ran_fa3):
        line = ["geomean", ""]
        for be in backends:
            line += [""] * (2 if markdown else 1)
            for base_name, shown in (("cudnn", ran_cudnn), (FA3, ran_fa3)):
                if shown and be != base_name:
                    g = geomean(ratios.get((be, base_name), []))
                    line.append(f"{g:.2f}" if g is not None else "–")
            if has_host:
                line.append("")
        rows.append(line)
    return headers, rows


def format_text_table(headers: list[Header] | list[str], rows: list[list[str]]) -> str:
    """A right-aligned text table (first column left-aligned). ``(group, metric)`` headers print on
    two lines: each group's name (a backend) once, left-aligned over its columns, then the metrics,
    so that a table of several backends stays narrow."""
    two = bool(headers) and isinstance(headers[0], tuple)
    names = [h[1] for h in headers] if two else list(headers)
    widths = [max([len(name), *(len(r[i]) for r in rows if i < len(r))]) for i, name in enumerate(names)]
    groups: list[tuple[str, list[int]]] = []  # (name, its column indices), in order
    if two:
        for i, (g, _) in enumerate(headers):
            if groups and groups[-1][0] == g:
                groups[-1][1].append(i)
            else:
                groups.append((g, [i]))
        for g, cols in groups:  # a name longer than its columns widens the group's last column
            span = sum(widths[i] for i in cols) + 2 * (len(cols) - 1)
            widths[cols[-1]] += max(0, len(g) - span)

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = []
    if two:
        top = ""
        for g, cols in groups:
            span = sum(widths[i] for i in cols) + 2 * (len(cols) - 1)
            top += ("  " if top else "") + g.ljust(span)
        out.append(top.rstrip())
    out.append(line(names))
    out.append("  ".join("-" * w for w in widths))
    out += [line(r) for r in rows]
    return "\n".join(out)


def write_markdown(path: str | Path, title: str, headers: list, rows: list[list[str]], notes: list[str]) -> None:
    """A markdown file: ``title`` (a paragraph), the table, then ``notes`` (one bullet each)."""
    names = [f"{h[0]} {h[1]}".strip() if isinstance(h, tuple) else h for h in headers]
    lines = [title, "", "| " + " | ".join(names) + " |", "|" + "|".join("---" for _ in names) + "|"]
    lines += ["| " + " | ".join(c if c else " " for c in r) + " |" for r in rows]
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def require_matplotlib() -> None:
    """Raise ``RuntimeError`` with the fix when matplotlib cannot be imported (checked before a run
    that was asked for a plot, so that the run is not wasted)."""
    try:
        importlib.import_module("matplotlib")
    except Exception as e:
        raise RuntimeError(
            f"--plot needs matplotlib, which cannot be imported ({short(e)}); pip install matplotlib"
        ) from e


def write_plot(path: str | Path, results: list[dict], backends: list[str], title: str) -> None:
    """Grouped bar chart of TFLOP/s per workload and backend (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in results))
    by = {(r["workload"], r["backend"]): r.get("tflops") for r in results if _ran(r)}
    fig_w = max(8, 1.3 * len(workloads) + 2)
    fig, ax = plt.subplots(figsize=(fig_w, 5))
    width = 0.8 / max(1, len(backends))
    for i, be in enumerate(backends):
        xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(workloads))]
        ys = [by.get((wn, be)) or 0.0 for wn in workloads]
        bars = ax.bar(xs, ys, width, label=LABELS.get(be, be))
        for b, y in zip(bars, ys):
            if y:
                label = f"{y:.0f}" if y >= 10 else f"{y:.2g}"  # (CPU runs read thousandths)
                ax.annotate(label, (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s (median)")
    wrapped = "\n".join(textwrap.fill(line, width=int(fig_w * 11)) for line in title.split("\n"))
    ax.set_title(wrapped, fontsize=10)  # (long titles wrapped, their own lines kept)
    top = max([y for y in by.values() if y] or [1.0])
    ax.set_ylim(0, top * 1.2)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=max(1, len(backends)), loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    say(f"== wrote {path}")


def report_mode(
    args,
    device,
    title: str,
    legend: str,
    headers: list,
    rows: list[list[str]],
    notes: list[str],
    results: list[dict],
    interrupted: bool,
) -> int:
    """The end of the serving and layers modes: the markdown file if asked, the notes, the text table;
    returns the exit status (130 interrupted, 1 when a row failed its check or errored, else 0)."""
    if args.markdown:
        write_markdown(args.markdown, title, headers, rows, [legend, *notes])
        say(f"== wrote {args.markdown}")
    for line in notes:
        say(line)
    say()
    if device.type == "cpu":
        say(f"== {CPU_NOTE}")
    say(f"== {title}")
    say(f"   {legend}")
    say(format_text_table(headers, rows))
    failed = [r for r in results if r.get("ok") is False or r.get("error")]
    return 130 if interrupted else (1 if failed else 0)
