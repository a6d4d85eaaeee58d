"""scripts/sass_counts.py: the key loop found in SASS, and the row sums' wgmma visible in it (compiled
for sm_90 on the CPU)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_counts.py"


def _module():
    spec = importlib.util.spec_from_file_location("sass_counts", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_key_loop_is_the_innermost_loop_with_a_wgmma():
    lines = [
        "/*0000*/ MOV R1, c[0x0][0x28] ;",
        "/*0010*/ HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ ;",  # (an outer loop's, not the innermost's)
        "/*0020*/ FADD R2, R2, R3 ;",
        "/*0030*/ HGMMA.64x64x16.F32 R24, gdesc[UR8], R24 ;",
        "/*0040*/ MUFU.EX2 R5, R5 ;",
        "/*0050*/ @P0 BRA 0x30 ;",  # (the inner loop: 0x30 .. 0x50)
        "/*0060*/ FMUL R2, R2, R3 ;",
        "/*0070*/ BRA 0x10 ;",  # (the outer loop)
        "/*0080*/ @!P1 BRA 0x60 ;",  # (a loop without a wgmma)
    ]
    got = _module().key_loop("\n".join(lines))
    assert got == {"HGMMA": 1, "MUFU": 1, "BRA": 1}


def test_row_sums_by_wgmma_trade_fadds_for_four_wgmmas(tmp_path):
    """D 64 (no LSE) with and without the row sums' wgmma: 4 more HGMMA in the key loop (one per 16 keys
    of a 64-key tile), ~60 fewer FADD, and fewer instructions in all. (A process of its own: the
    interpreter, which the CPU tests run under, replaces the kernels at import.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    cmd = [sys.executable, str(SCRIPT), "d64:rowsum=0", "d64:rowsum=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    off, on = (line.split("key loop")[1] for line in res.stdout.splitlines())

    def count(part, op):
        return int(part.split(f" {op}=")[1].split()[0]) if f" {op}=" in part else 0

    assert count(on, "HGMMA") == count(off, "HGMMA") + 4, res.stdout
    assert count(off, "FADD") - count(on, "FADD") >= 50, res.stdout
    assert int(on.split(":")[0]) < int(off.split(":")[0]), res.stdout
