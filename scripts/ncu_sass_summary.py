"""Summary of ``ncu --page source --csv --print-source sass`` output: per kernel, the executed
instruction mix, the warp-stall reasons sampled, and the shared-memory instructions whose wavefronts
exceed the ideal (bank conflicts).

    python scripts/ncu_sass_summary.py sass.csv
"""

from __future__ import annotations

import csv
import sys
from collections import Counter


def kernels(path: str) -> list:
    out, hdr = [], None
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if r and r[0] == "Kernel Name":
                out.append((r[1], []))
            elif r and r[0] == "Address":
                hdr = {h: i for i, h in enumerate(r)}
            elif out and r and hdr:
                out[-1][1].append((hdr, r))
    return out


def num(hdr, r, col) -> int:
    v = r[hdr[col]] if col in hdr else ""
    return int(v) if v.strip().isdigit() else 0


def main() -> int:
    for name, rows in kernels(sys.argv[1]):
        mix, stalls, conflicts = Counter(), Counter(), []
        for hdr, r in rows:
            words = r[1].split()
            op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]) if words else "?"
            mix[op.split(".")[0]] += num(hdr, r, "Instructions Executed")
            for c in hdr:
                if c.startswith("stall_") and "Not Issued" not in c:
                    stalls[c[6:]] += num(hdr, r, c)
            ex = num(hdr, r, "L1 Wavefronts Shared Excessive")
            if ex:
                conflicts.append((ex, r[1].strip(), num(hdr, r, "L1 Wavefronts Shared Ideal")))
        print(f"== {name}: {len(rows)} SASS instructions, {sum(mix.values())} warp instructions executed")
        print("  mix:", ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in mix.most_common(16)))
        print("  stall samples:", ", ".join(f"{k} {v}" for k, v in stalls.most_common(10)))
        print(f"  shared accesses over the ideal: {len(conflicts)}, excess wavefronts {sum(c[0] for c in conflicts)}")
        for ex, ins, ideal in sorted(conflicts, reverse=True)[:6]:
            print(f"    {ins[:56]:56s} excess {ex} ideal {ideal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
