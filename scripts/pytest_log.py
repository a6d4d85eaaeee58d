"""What a ``pytest -v`` log (with or without pytest-xdist) says about tests that never finished.

    python scripts/pytest_log.py LOG

Prints the counts of each outcome and every test that started but has no outcome, with how many
outcomes the log records after its start: under a time limit those are the tests that were running
when it struck; one that other tests kept finishing around for long (dozens of outcomes) is a hang
(a ``timeout`` that stops pytest leaves no summary line, so nothing else names them).
"""

from __future__ import annotations

import re
import sys
from collections import Counter

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_NODE = r"(tests/\S+?::\S+)"
_STARTED = re.compile(rf"^{_NODE}(?=\s|$)")
_AFTER = re.compile(rf"\b({'|'.join(OUTCOMES)})\s+{_NODE}")  # xdist: "[gw3] [ 5%] PASSED tests/..."
_BEFORE = re.compile(rf"{_NODE}\s+({'|'.join(OUTCOMES)})\b")  # one process: "tests/... PASSED [ 5%]"


def read(lines) -> tuple[Counter, list[tuple[str, int]]]:
    """(outcome counts, [(test started without an outcome, outcomes recorded after its start)], in
    the order they started)."""
    started: dict[str, int] = {}
    done: dict[str, str] = {}
    for line in lines:
        m = _STARTED.match(line)
        if m:
            started.setdefault(m.group(1), len(done))
        for outcome, node in _AFTER.findall(line):
            done[node] = outcome
        for node, outcome in _BEFORE.findall(line):
            done[node] = outcome
    return Counter(done.values()), [(n, len(done) - at) for n, at in started.items() if n not in done]


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(sys.argv[1], errors="replace") as f:
        counts, unfinished = read(f)
    print(", ".join(f"{n} {k.lower()}" for k, n in sorted(counts.items())) or "no outcomes")
    for node, after in unfinished:
        print(f"started, no outcome: {node} ({after} outcomes after its start)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
