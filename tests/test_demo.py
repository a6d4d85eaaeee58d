"""The demo runs on the CPU and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedprefill import demo


def test_demo_in_process(capsys):
    assert demo.main(["--device", "cpu", "--reps", "1"]) == 0
    text = capsys.readouterr().out
    for key in (
        "device:",
        "backend:",
        "q:",
        "k_cache:",
        "out:",
        "lse:",
        "vs torch:",
        "time:",
        "result:      OK",
    ):
        assert key in text


def test_demo_module_entry_point(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU even on a GPU machine: keeps the test fast
    proc = subprocess.run(
        [sys.executable, "-m", "pagedprefill.demo", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result:      OK" in proc.stdout


@pytest.mark.gpu
def test_demo_gpu(capsys):
    assert demo.main(["--reps", "3"]) == 0, capsys.readouterr().out
