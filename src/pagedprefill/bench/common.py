"""What every benchmark mode shares: tolerances, the "cannot run here" exception, progress lines on
stderr, the machine's versions, and small CUDA helpers.

Output convention: what a user reads as the result (headers, the tables, skip and failure lines)
goes to stdout; progress (one line per step, details of each measurement) goes to stderr, so that
``pagedprefill-bench > table.txt`` keeps only the results.
"""

from __future__ import annotations

import datetime
import platform
import sys

import torch

OUT_REL_TOL = 2e-2  # ‖out − ref‖₂ / ‖ref‖₂ for 16-bit data
# fp8 attention (FA3's fp8 path) rounds the probabilities to e4m3 before the PV product: 3 mantissa
# bits, about 3.6% RMS per element, which passes straight into the output's relative error.
OUT_REL_TOL_FP8 = 8e-2
LSE_ABS_TOL = 5e-2  # max |lse − ref| (natural log)
CPU_NOTE = "CPU figures (no GPU): not comparable to GPU numbers"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LIBRARY_BACKENDS = ("cudnn", "triton", "torch", "auto")


class Skip(Exception):
    """A backend cannot run this case here (unavailable, unsupported): not an error.

    ``kind``: "unavailable" (not on this machine), "unsupported" (not this call: a head dim, fp8 on
    this GPU), or "error" (the first call failed in a way that still means "cannot run")."""

    def __init__(self, reason: str, kind: str = "unavailable"):
        super().__init__(reason)
        self.kind = kind


class Interrupted(BaseException):
    """SIGTERM received: stop measuring, report what was measured."""


def say(msg: str = "") -> None:
    """A result line (stdout)."""
    print(msg, flush=True)


def note(msg: str) -> None:
    """A progress / detail line (stderr)."""
    print(msg, file=sys.stderr, flush=True)


def short(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 400 characters)."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first}"[:400]


class Progress:
    """One plain line on stderr per step (``[3/34] llama8b_b4_q4k triton ...``), always; on a terminal
    with tqdm installed, also a bar below the lines."""

    def __init__(self, total: int, desc: str):
        self.total, self.n, self.bar = total, 0, None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except Exception:  # tqdm missing or broken: the plain lines suffice
                self.bar = None

    def step(self, *what: str) -> None:
        """Announce step n+1 of ``total``: ``what`` are its names (workload, backend, ...)."""
        self.n += 1
        self.write(f"[{self.n}/{self.total}] {' '.join(what)} ...")
        if self.bar is not None:
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            note(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_healthy() -> bool:
    """False once the CUDA context is broken (e.g. after an illegal memory access)."""
    try:
        torch.cuda.synchronize()
        x = torch.ones(4, device="cuda")
        return float(x.sum().item()) == 4.0
    except Exception:
        return False


def resolve_device(name: str) -> torch.device:
    """``"auto"``: the current CUDA device when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but no CUDA GPU is available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def environment(device: torch.device) -> dict:
    """Versions and machine facts recorded with every result row (``fa3``: filled in by the CLI when
    FA3 is among the backends, since finding it loads its CUDA extension)."""
    env: dict = {
        "device": device.type,
        "gpu": "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": None,
        "cudnn": None,
        "cudnn_backend": None,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "fa3": None,
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


def fmt(x: float | None, digits: int) -> str:
    """``digits`` decimals, or 3 significant digits for small values (CPU figures); "–" for None."""
    if x is None:
        return "–"
    return f"{x:.{digits}f}" if abs(x) >= 10 ** (1 - digits) or x == 0 else f"{x:.3g}"
