"""Static sm_90 SASS counts of the Hopper kernel, compiled on the CPU (no GPU needed):

    python scripts/sass_counts.py d128 d64:rowsum=0 kv8:consumers=2,consumer_regs=224

Each spec is a named shape (``SHAPES``) with optional Hopper knobs after a colon. The real launch of a
small batch of that shape is compiled for sm_90a (Triton's ptxas), disassembled (cuobjdump), and
printed: shared memory, spill stores, whether ptxas serialized the wgmmas (C7512), the opcode counts of
the consumers' key loop (the innermost loop holding wgmmas, once per consumer warpgroup's code: both its
masked and unmasked tile paths) and of the loop that issues the K/V tiles' TMA copies (all its paths;
every warp of its partition runs it). Counts are static instructions, not executed ones: compare two
trees or two knob sets with them (``PYTHONPATH=_ab/NAME/src``) before spending device time, then time
what they suggest.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import call_tensors, planned  # noqa: E402
from oracle import make_case  # noqa: E402

from pagedprefill import tuning  # noqa: E402
from pagedprefill.backends.triton import hopper as hp  # noqa: E402

# name: (Dqk, Dvo, page size, q dtype, kv dtype or None, return_lse)
SHAPES = {
    "d128": (128, 128, 16, torch.bfloat16, None, True),
    "d64": (64, 64, 16, torch.bfloat16, None, False),
    "d96": (96, 96, 16, torch.bfloat16, None, True),
    "d256": (256, 256, 16, torch.bfloat16, None, True),
    "mla192": (192, 128, 16, torch.bfloat16, None, True),
    "kv8": (128, 128, 16, torch.bfloat16, torch.float8_e4m3fn, True),
    "kv8d64": (64, 64, 16, torch.bfloat16, torch.float8_e4m3fn, True),
    "f8": (128, 128, 16, torch.float8_e4m3fn, None, True),
}
SHOWN = ("HGMMA", "QGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "SHFL", "BAR", "LDL", "STL")
TMA_SHOWN = ("UTMALDG", "BAR", "ELECT", "VOTEU", "LDGSTS", "LDL", "STL")
_INS = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);")


def _opcode(text: str) -> str:
    words = text.split()
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def innermost_loop(sass: str, holds: str) -> collections.Counter:
    """Opcodes of the innermost backward-branch body whose instructions include ``holds``."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in map(_INS.match, sass.splitlines()) if m]
    where = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (a, text) in enumerate(ins):
        if "BRA" not in text:
            continue
        tgt = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        if not tgt or int(tgt.group(1), 16) >= a or int(tgt.group(1), 16) not in where:
            continue
        body = ins[where[int(tgt.group(1), 16)] : i + 1]
        if any(holds in t for _, t in body) and (best is None or len(body) < len(best)):
            best = body
    return collections.Counter(_opcode(t) for _, t in best or [])


def key_loop(sass: str) -> collections.Counter:
    """Opcodes of the first consumer's key loop (the innermost loop that holds a wgmma)."""
    return innermost_loop(sass, "GMMA")


def tma_loop(sass: str) -> collections.Counter:
    """Opcodes of the innermost loop that issues K/V TMA copies (the load warps' tile loop: the
    issuing warp's with 16-bit K/V): all its paths, the cp.async gather's included where it is there."""
    return innermost_loop(sass, "UTMALDG.2D")


def compile_sm90(kernel, args: tuple, kwargs: dict):
    """One launch of a Gluon kernel (``kernel[grid](*args, **kwargs)``) compiled for sm_90a on this
    machine, GPU or not: Triton's compiled kernel (``.asm["ptx"]``, ``.metadata``)."""
    target = GPUTarget("cuda", 90, 128)
    backend = make_backend(target)
    bound, sp, opts = create_function_from_signature(kernel.signature, kernel.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, sp, opts)
    return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def compile_spec(spec: str, workdir: str) -> str:
    name, _, knob_text = spec.partition(":")
    dqk, dvo, page, dt, kv_dt, lse = SHAPES[name]
    knobs = {k: int(v) for k, v in (kv.split("=") for kv in knob_text.split(",") if kv)}
    case = make_case(
        0,
        lens_q=[300, 700],
        lens_kv=[900, 3000],
        hq=8,
        hkv=2,
        dqk=dqk,
        dvo=dvo,
        page_size=page,
        dtype=dt,
        kv_dtype=kv_dt,
        causal=True,
        return_lse=lse,
    )
    p, lp, ws = planned(case, "torch")
    with tuning.override("hopper", **knobs):
        plan = hp.HopperPlan(lp.batch)
    kernel, _grid, args, kwargs = plan.launches(call_tensors(case, p, lp, ws))[0]
    c = compile_sm90(kernel, args, kwargs)
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptx, cubin = os.path.join(workdir, "k.ptx"), os.path.join(workdir, "k.cubin")
    Path(ptx).write_text(c.asm["ptx"])
    log = subprocess.run(
        [bindir / "ptxas", "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin], capture_output=True, text=True, check=True
    ).stderr
    sass = subprocess.run([bindir / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    spill = max([int(x) for x in re.findall(r"(\d+) bytes spill stores", log)] or [0])
    serial = " | wgmmas SERIALIZED (ptxas C7512)" if "are serialized" in log else ""
    loop = key_loop(sass)
    shown = " ".join(f"{op}={loop[op]}" for op in SHOWN if loop[op])
    tma = tma_loop(sass)
    tma_shown = " ".join(f"{op}={tma[op]}" for op in TMA_SHOWN if tma[op])
    return (
        f"{spec:28s} shared {c.metadata.shared:6d} B, spill {spill:4d} B | key loop {sum(loop.values()):4d}: {shown}"
        + (f" | TMA loop {sum(tma.values()):4d}: {tma_shown}" if tma else "")
        + serial
    )


def main() -> int:
    specs = sys.argv[1:] or list(SHAPES)
    if any(s.partition(":")[0] not in SHAPES for s in specs):
        print(f"shapes: {', '.join(SHAPES)} (each optionally :knob=value,...)", file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as workdir:
        for spec in specs:
            print(compile_spec(spec, workdir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
