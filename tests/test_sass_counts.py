"""scripts/sass_counts.py: the key loop and the TMA issuing loop found in SASS, the row sums' wgmma
and the one issuing warp visible in them (compiled for sm_90 on the CPU)."""

import os
import subprocess
import sys
from pathlib import Path

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_counts.py"


def _module():
    return load_script("sass_counts")


def _compile_specs(tmp_path, *specs: str) -> subprocess.CompletedProcess:
    """The script run on ``specs`` in a process of its own (the interpreter, which the CPU tests run
    under, replaces the kernels at import)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    res = subprocess.run([sys.executable, str(SCRIPT), *specs], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def count(part: str, op: str) -> int:
    """An opcode's count in a printed ``OP=N`` list (0 where it is not printed)."""
    return int(part.split(f" {op}=")[1].split()[0]) if f" {op}=" in part else 0


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
    of a 64-key tile), ~60 fewer FADD, and fewer instructions in all."""
    res = _compile_specs(tmp_path, "d64:rowsum=0", "d64:rowsum=1")
    off, on = (line.split("key loop")[1].split("|")[0] for line in res.stdout.splitlines())
    assert count(on, "HGMMA") == count(off, "HGMMA") + 4, res.stdout
    assert count(off, "FADD") - count(on, "FADD") >= 50, res.stdout
    assert int(on.split(":")[0]) < int(off.split(":")[0]), res.stdout


def test_tma_loop_is_the_innermost_loop_issuing_tile_copies():
    lines = [
        "/*0000*/ UTMALDG.3D [UR8], [UR16] ;",  # (Q's copy, outside the tile loop)
        "/*0010*/ BAR.SYNC.DEFER_BLOCKING 0x4, 0x80 ;",
        "/*0020*/ @UP0 UTMALDG.2D [UR36], [UR8] ;",
        "/*0030*/ ELECT P2, URZ, PT ;",
        "/*0040*/ @P0 BRA 0x10 ;",  # (the tile loop: 0x10 .. 0x40)
        "/*0050*/ BRA 0x0 ;",  # (the item loop)
    ]
    got = _module().tma_loop("\n".join(lines))
    assert got == {"BAR": 1, "UTMALDG": 1, "ELECT": 1, "BRA": 1}


def test_one_issuing_warp_copies_without_partition_barriers(tmp_path):
    """D 64, 16-bit K/V by TMA: the loop that issues the tiles' TMA copies runs on one warp, with no
    partition-wide barrier (Triton puts one before every copy where several warps issue in step) and
    no cp.async gather (the gather warps'), in under half the instructions of four load warps issuing
    in step (~400, 17 barriers). On 128-key tiles (a knob) the load warps stay in step and gather the
    tile across kv_len themselves: a loop with no gather there would leave that tile's stage unfilled
    and the consumers waiting for good."""
    res = _compile_specs(tmp_path, "d64", "d128:consumers=2,BLOCK_N=128,consumer_regs=224")
    alone, step = (line.split("TMA loop")[1].split(":", 1) for line in res.stdout.splitlines())
    assert count(alone[1], "BAR") == 0 and count(alone[1], "LDGSTS") == 0, res.stdout
    assert count(alone[1], "UTMALDG") >= 2, res.stdout
    assert int(alone[0]) < 200, res.stdout
    assert count(step[1], "LDGSTS") > 0 and count(step[1], "BAR") > 0, res.stdout


def test_widened_8_bit_tiles_at_d64_come_from_one_issuing_warp(tmp_path):
    """D 64, e4m3 K/V for bf16 q: one warp issues the staging slots' TMA boxes, with no partition
    barrier and no cp.async gather in its loop (the widening warps gather the tile across kv_len); at
    D 128 the four load warps still stage, gather and widen in step."""
    res = _compile_specs(tmp_path, "kv8d64", "kv8")
    alone, step = (line.split("TMA loop")[1].split(":", 1) for line in res.stdout.splitlines())
    assert count(alone[1], "BAR") == 0 and count(alone[1], "LDGSTS") == 0, res.stdout
    assert count(alone[1], "UTMALDG") >= 2, res.stdout
    assert count(step[1], "LDGSTS") > 0 and count(step[1], "BAR") > 0, res.stdout


def test_consumer_key_loops_hold_no_partition_barrier(tmp_path):
    """The consumers' key loop keeps no ``BAR.SYNC``: each thread releases its ring stages by its own
    arrive, and the one Triton puts before the marked wait on a full stage is dropped (sync.py), in the
    8-warp consumer partition (D 64, 8-bit K/V at D 128, or forced) and in 4-warp ones (D 128, D 96)."""
    res = _compile_specs(tmp_path, "d64", "d128", "d96", "kv8", "d128:merged=1")
    for line in res.stdout.splitlines():
        loop = line.split("key loop")[1].split("|")[0]
        assert count(loop, "BAR") == 0 and count(loop, "HGMMA") > 0, res.stdout
