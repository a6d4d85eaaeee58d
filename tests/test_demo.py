"""The demo (pagedprefill.demo): its independent float64 reference, its printout, its exit status."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import pagedprefill
from pagedprefill import demo
from pagedprefill import workloads as wl


def test_reference_matches_plain_attention_written_out():
    """The demo's reference against attention written out for each (sequence, head, query row)."""
    w = {
        **demo.CPU_WORKLOAD,
        "batch": 3,
        "qo_min": 2,
        "qo_max": 9,
        "prefix_max": 20,
        "heads_q": 4,
        "heads_kv": 2,
    }
    case = wl.build_case(w, "cpu", dtype=torch.float32, seed=2)
    out, lse = demo.reference_fp64(case)
    q_lens, kv_lens = wl.lengths(w)
    table, page = case["block_tables"], w["page_size"]
    row = 0
    for b, (lq, lkv) in enumerate(zip(q_lens, kv_lens)):
        for i in range(lq):
            for h in range(w["heads_q"]):
                kvh = h // (w["heads_q"] // w["heads_kv"])
                keys = [j for j in range(lkv) if j <= i + lkv - lq]
                kk = torch.stack([case["k_cache"][table[b, j // page], kvh, j % page] for j in keys]).double()
                vv = torch.stack([case["v_cache"][table[b, j // page], kvh, j % page] for j in keys]).double()
                s = kk @ case["q"][row + i, h].double() * case["scale"]
                p = torch.softmax(s, 0)
                torch.testing.assert_close(out[row + i, h], p @ vv, rtol=1e-10, atol=1e-12)
                torch.testing.assert_close(lse[row + i, h], torch.logsumexp(s, 0), rtol=1e-10, atol=1e-12)
        row += lq


def test_demo_cpu_in_process(capsys):
    assert demo.main(["--device", "cpu", "--reps", "1"]) == 0
    text = capsys.readouterr().out
    ran = "ran:         backend='auto' -> torch (pagedprefill.last_backend()), float32 q/k/v"
    assert f"{ran}, heads 8/2, head dim 64" in text
    for key in (
        "device:",
        "batch:",
        "q lengths:",
        "kv lengths:",
        "q:",
        "k_cache:",
        "out:",
        "vs float64:",
        "time:",
    ):
        assert key in text
    assert "bfloat16" not in text.split("note:")[0]  # never bf16 on the CPU
    assert "python -m pagedprefill.demo" in text  # how to run it on the GPU
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):  # (conftest sets it on CPUs)
        assert "ran:         backend='triton' (pagedprefill.last_backend()), float16 q/k/v" in text
        assert text.count("result:      OK") == 2
    else:
        assert text.count("result:      OK") == 1


def test_demo_exits_nonzero_above_tolerance(monkeypatch, capsys):
    real = pagedprefill.cudnn_batch_prefill_with_kv_cache

    def off_by_a_little(*a, **kw):
        out, lse = real(*a, **kw)
        return out * 1.01, lse

    monkeypatch.setattr(pagedprefill, "cudnn_batch_prefill_with_kv_cache", off_by_a_little)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch run alone
    assert demo.main(["--device", "cpu", "--reps", "1"]) == 1
    assert "result:      ERROR ABOVE TOLERANCE" in capsys.readouterr().out


def test_demo_backend_unavailable_exits_2(capsys):
    assert demo.main(["--device", "cpu", "--backend", "cudnn", "--reps", "1"]) == 2
    assert "cannot run here" in capsys.readouterr().out


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
    assert "result:      OK" in proc.stdout and "TRITON_INTERPRET=1" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_demo_gpu(capsys):
    assert demo.main(["--reps", "3"]) == 0
    text = capsys.readouterr().out
    assert "heads 32/8, head dim 128" in text and "bfloat16" in text and "result:      OK" in text
