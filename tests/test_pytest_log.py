"""scripts/pytest_log.py: the tests a time-limited ``pytest -v`` log left running."""

from __future__ import annotations

import random

from helpers import load_script


def _module():
    return load_script("pytest_log")


def test_xdist_log_names_the_test_that_never_finished():
    """Starts and outcomes interleaved as pytest-xdist prints them, a start line run into the next
    step's output, one test hung: it alone is named, the outcomes counted."""
    r = random.Random(5)
    nodes = [f"tests/test_k.py::test_gpu_case[{r.randint(0, 999)}-{i}]" for i in range(12)]
    hung = nodes[r.randrange(len(nodes))]
    lines, pending = [], []
    for i, node in enumerate(nodes):
        lines.append(f"{node} ")
        pending.append(node)
        if r.random() < 0.6 or i == len(nodes) - 1:
            for n in pending:
                if n != hung:
                    outcome = "FAILED" if n == nodes[3] and n != hung else "PASSED"
                    lines.append(f"[gw{r.randrange(8)}] [ {i * 8}%] {outcome} {n} ")
            pending = []
    lines[-1] += "=== bench 17:07:44"
    counts, unfinished = _module().read(lines)
    assert [n for n, _ in unfinished] == [hung]
    after = lines[lines.index(f"{hung} ") :]
    assert unfinished[0][1] == sum(1 for line in after if " PASSED " in line or " FAILED " in line)
    assert counts["PASSED"] + counts["FAILED"] == len(nodes) - 1
    assert counts["FAILED"] == (0 if hung == nodes[3] else 1)


def test_one_process_log_and_a_finished_run():
    """``pytest -v`` without xdist puts the outcome after the node id on the start line."""
    lines = [
        "tests/test_a.py::test_x PASSED                 [ 33%]",
        "tests/test_a.py::test_y[1-2] SKIPPED (no GPU)  [ 66%]",
        "tests/test_a.py::test_z FAILED                 [100%]",
        "FAILED tests/test_a.py::test_z - AssertionError",
    ]
    counts, unfinished = _module().read(lines)
    assert unfinished == []
    assert counts == {"PASSED": 1, "SKIPPED": 1, "FAILED": 1}
