"""The benchmark CLI and the workload rules, on the CPU (fast)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from pagedprefill import bench
from pagedprefill import workloads as wl

REQUIRED = {
    "workload",
    "backend",
    "ms",
    "tflops",
    "gflop",
    "gpu",
    "date",
    "torch",
    "triton",
    "cudnn",
    "ok",
    "max_err",
}


def _rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------
# workloads.py
# ---------------------------------------------------------------------------------------------


def test_lengths_varlen_b32_matches_readme_rule():
    w = wl.get_workload("varlen_b32")
    assert (w["seed"], w["batch"], w["qo_min"], w["qo_max"], w["prefix_max"]) == (7, 32, 16, 2048, 4096)
    # The README's rule, written out independently: q lengths first, then prefixes, one generator.
    g = torch.Generator()
    g.manual_seed(7)
    q = torch.randint(16, 2048 + 1, (32,), generator=g)
    p = torch.randint(0, 4096 + 1, (32,), generator=g)
    q_lens, kv_lens = wl.lengths(w)
    assert q_lens == q.tolist()
    assert kv_lens == (q + p).tolist()
    assert all(16 <= x <= 2048 for x in q_lens)
    assert all(0 <= k - x <= 4096 for x, k in zip(q_lens, kv_lens))


def test_lengths_fixed_workloads():
    assert wl.lengths(wl.get_workload("llama8b_b16_q1k")) == ([1024] * 16, [1024] * 16)
    assert wl.lengths(wl.get_workload("chunked_b8_q512_p7680")) == ([512] * 8, [8192] * 8)
    assert wl.lengths(wl.get_workload("page64_b16_q1k")) == ([1024] * 16, [2048] * 16)


def _brute_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    n = 0
    for i in range(q_len):
        for j in range(kv_len):
            if not causal or j <= i + kv_len - q_len:
                n += 1
    return n


@pytest.mark.parametrize("causal", [True, False])
def test_flops_against_brute_force(causal):
    q_lens = [1, 5, 7, 0, 9, 3, 12]
    kv_lens = [1, 9, 3, 4, 0, 3, 30]  # includes q > kv (rows with no key) and kv = 0
    hq, dqk, dvo = 3, 16, 8
    want = sum(2 * (dqk + dvo) * hq * _brute_pairs(q, k, causal) for q, k in zip(q_lens, kv_lens))
    assert wl.flops((q_lens, kv_lens), causal, hq, dqk, dvo) == want


def test_flops_workload_dict_matches_readme_gflop():
    # GFLOP column of the README's anchor table.
    anchors = {
        "llama8b_b16_q1k": 137.6,
        "llama8b_b4_q4k": 549.9,
        "llama8b_b1_q16k": 2199.2,
        "chunked_b8_q512_p7680": 532.6,
        "varlen_b32": 1423.6,
        "llama70b_b8_q2k": 550.0,
        "noncausal_b8_q2k": 549.8,
        "page1_b16_q1k": 137.6,
        "page64_b16_q1k": 412.5,
        "mla192_b4_q4k": 2749.5,
    }
    got = {w["name"]: round(wl.flops(w) / 1e9, 1) for w in wl.load_workloads()}
    assert got == anchors


def test_build_case_layout_and_dense_inputs():
    w = dict(wl.get_workload("cpu_varlen_b4_noncausal"))
    case = wl.build_case(w, "cpu", seed=3)
    q_lens, kv_lens = wl.lengths(w)
    k = case["k_cache"]
    assert k.dim() == 4 and k.shape[1] == w["heads_kv"] and k.shape[2] == w["page_size"]
    assert k.permute(0, 2, 1, 3).is_contiguous()  # NHD storage viewed as (pages, Hkv, page, D)
    assert case["block_tables"].dtype == torch.int32
    assert case["q"].dtype == torch.bfloat16 and case["q"].shape[0] == sum(q_lens)
    assert case["scale"] == pytest.approx(1 / math.sqrt(w["head_dim_qk"]))
    used = [
        int(p)
        for b, n in enumerate(kv_lens)
        for p in case["block_tables"][b, : -(-n // w["page_size"])].tolist()
    ]
    assert sorted(used) == list(range(k.shape[0]))  # every page used once
    assert used != sorted(used)  # shuffled
    dense = wl.dense_reference_inputs(case)
    # token t of sequence b, gathered one key at a time through the block table
    page = w["page_size"]
    row = 0
    for b, n in enumerate(kv_lens):
        for t in range(n):
            pg = int(case["block_tables"][b, t // page])
            assert torch.equal(dense["k"][row], k[pg, :, t % page])
            assert torch.equal(dense["v"][row], case["v_cache"][pg, :, t % page])
            row += 1
    assert dense["cu_seqlens_k"].tolist()[-1] == sum(kv_lens)


def test_build_case_ragged_offsets():
    w = wl.get_workload("cpu_ragged_b2_q64_p64")
    case = wl.build_case(w, "cpu")
    assert "block_tables" not in case
    per_tok = w["heads_kv"] * w["head_dim_qk"]
    assert case["batch_offsets_k"].tolist() == [0, 128 * per_tok, 256 * per_tok]


# ---------------------------------------------------------------------------------------------
# bench.py
# ---------------------------------------------------------------------------------------------


def test_cpu_bench_end_to_end(tmp_path, capsys):
    out = tmp_path / "r.json"
    md = tmp_path / "t.md"
    t0 = time.perf_counter()
    rc = bench.main(
        [
            "--device",
            "cpu",
            "--backends",
            "torch,cudnn,fa2-varlen",
            "--reps",
            "2",
            "--out-json",
            str(out),
            "--markdown",
            str(md),
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    elapsed = time.perf_counter() - t0
    text = capsys.readouterr().out
    assert rc == 0, text
    assert elapsed < 30
    rows = _rows(out)
    assert len(rows) == 3 * len(wl.CPU_WORKLOADS)  # one per (workload, backend)
    for r in rows:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        if r["backend"] != "torch":  # cudnn and FA2 cannot run on the CPU: skipped, with the reason
            assert r["ms"] is None and r["skipped"]
            continue
        assert r["ms"] > 0 and r["tflops"] > 0 and r["gflop"] > 0
        assert r["ok"] is True and 0 <= r["max_err"] < 0.1 and r["rel_err"] <= bench.OUT_REL_TOL
        assert r["gpu"] == "cpu"
    assert "not comparable to GPU numbers" in text
    assert "skipped: cpu_b2_q64_p64 / cudnn" in text
    last = text.strip().splitlines()
    assert last[-1].startswith("cpu_varlen_b4_noncausal")  # the table comes last
    assert md.read_text().count("| cpu_") == len(wl.CPU_WORKLOADS)


def test_default_out_json_is_cpu_json(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the second run appends
        assert bench.main(["--device", "cpu", "--workloads", "cpu_page1_b2_q64_p64", "--reps", "2"]) == 0
    rows = _rows(tmp_path / "bench" / "results" / "cpu.json")
    assert [r["workload"] for r in rows] == ["cpu_page1_b2_q64_p64"] * 2


def test_summary_table_ratios_and_geomean():
    results = [
        {"workload": "a", "backend": "cudnn", "gflop": 10.0, "ms": 2.0, "tflops": 5.0, "ok": True},
        {"workload": "a", "backend": "triton", "gflop": 10.0, "ms": 1.0, "tflops": 10.0, "ok": True},
        {"workload": "b", "backend": "cudnn", "gflop": 20.0, "ms": 2.0, "tflops": 10.0, "ok": True},
        {"workload": "b", "backend": "triton", "gflop": 20.0, "ms": 8.0, "tflops": 2.5, "ok": False},
    ]
    headers, rows = bench.summary_table(results, ["cudnn", "triton"])
    assert headers == [
        "workload",
        "GFLOP",
        "cudnn ms",
        "cudnn TF/s",
        "triton ms",
        "triton TF/s",
        "triton ×cuDNN",
    ]
    assert rows[0][-1] == "2.00" and rows[1][-1] == "0.25"
    assert "(BAD)" in rows[1][5]
    assert rows[2][0] == "geomean" and rows[2][-1] == "0.71"  # sqrt(2 * 0.25)
    text = bench.format_text_table(headers, rows)
    assert len({len(line) for line in text.splitlines()}) == 1  # aligned


def test_compare_flags_nan_and_errors():
    ref = torch.randn(10, 2, 4)
    lse = torch.randn(10, 2)
    assert bench.compare(ref.clone(), ref, lse.clone(), lse)["ok"]
    bad = ref.clone()
    bad[3] = float("nan")
    assert not bench.compare(bad, ref)["ok"]
    assert not bench.compare(ref * 1.5, ref)["ok"]
    lse_bad = lse.clone()
    lse_bad[0, 0] += 1.0
    assert not bench.compare(ref.clone(), ref, lse_bad, lse)["ok"]
    inf = torch.full((2, 2), float("-inf"))
    assert bench.compare(ref.clone(), ref, inf, inf.clone())["lse_err"] == 0.0


def test_first_call_grows_workspace(monkeypatch):
    case = wl.build_case(wl.get_workload("cpu_b2_q64_p64"), "cpu", workspace_bytes=16)
    real = bench.cudnn_batch_prefill_with_kv_cache
    calls = []

    def fake(**kw):
        calls.append(kw["workspace_buffer"].numel())
        if kw["workspace_buffer"].numel() < 3 * 2**20:
            raise ValueError(
                "workspace_buffer: expected at least 3000000 bytes for this call (...), got 16 bytes"
            )
        return real(**kw)

    monkeypatch.setattr(bench, "cudnn_batch_prefill_with_kv_cache", fake)
    bench.first_call(case, "torch", say=lambda m: None)
    assert calls == [16, 3 * 2**20] and case["workspace_buffer"].numel() == 3 * 2**20


def test_error_in_backend_is_reported_not_fatal(tmp_path, monkeypatch, capsys):
    real = bench.cudnn_batch_prefill_with_kv_cache

    def fake(**kw):
        if kw.get("backend") == "auto":
            raise RuntimeError("kernel exploded")
        return real(**kw)

    monkeypatch.setattr(bench, "cudnn_batch_prefill_with_kv_cache", fake)
    out = tmp_path / "r.json"
    rc = bench.main(
        [
            "--device",
            "cpu",
            "--workloads",
            "cpu_b2_q64_p64",
            "--backends",
            "auto,torch",
            "--out-json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 1
    assert "kernel exploded" in text
    rows = _rows(out)
    assert [r["backend"] for r in rows] == ["auto", "torch"]
    assert next(r for r in rows if r["backend"] == "auto")["error"].startswith("RuntimeError")


def test_interrupt_prints_partial_table(tmp_path, monkeypatch, capsys):
    real = bench.run_backend
    n = {"calls": 0}

    def fake(*a, **k):
        n["calls"] += 1
        if n["calls"] == 2:
            raise bench.Interrupted()
        return real(*a, **k)

    monkeypatch.setattr(bench, "run_backend", fake)
    rc = bench.main(["--device", "cpu", "--out-json", str(tmp_path / "r.json"), "--reps", "2"])
    text = capsys.readouterr().out
    assert rc == 130
    assert "interrupted" in text
    assert text.strip().splitlines()[-1].startswith("cpu_b2_q64_p64")


def test_serving_lengths_respect_limits():
    cfg = bench.ServingConfig()
    steps = bench.serving_lengths(cfg, 200, seed=0)
    assert steps == bench.serving_lengths(cfg, 200, seed=0)  # seeded
    for q_lens, kv_lens in steps:
        assert 1 <= len(q_lens) <= cfg.batch_max
        assert sum(q_lens) <= cfg.token_budget
        assert all(1 <= q <= cfg.q_max for q in q_lens)
        assert all(0 <= k - q <= cfg.prefix_max for q, k in zip(q_lens, kv_lens))
    assert len({len(q) for q, _ in steps}) > 10  # batch sizes vary
    assert any(k > q for q, k in zip(*steps[0])) or any(k > q for s in steps for q, k in zip(*s))


def test_serving_mode_cpu(tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = bench.main(
        [
            "--device",
            "cpu",
            "--serving",
            "8",
            "--serving-warmup",
            "2",
            "--serving-checks",
            "2",
            "--out-json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    (row,) = _rows(out)
    assert row["mode"] == "serving" and row["backend"] == "torch"
    assert row["calls"] == 8 and row["warmup_calls"] == 2
    assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"] and row["host_p50_ms"] > 0
    assert row["ok"] is True and row["checked_calls"] == 2
    assert text.strip().splitlines()[-1].startswith("torch")


def test_serving_fixed_max_cpu(tmp_path, capsys):
    out = tmp_path / "s.json"
    args = ["--device", "cpu", "--serving", "4", "--serving-warmup", "1", "--serving-fixed-max"]
    assert bench.main([*args, "--out-json", str(out)]) == 0
    assert _rows(out)[0]["ok"] is True


def test_python_dash_m_entry_point(tmp_path):
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedprefill.bench",
            "--device",
            "cpu",
            "--workloads",
            "cpu_ragged_b2_q64_p64",
            "--reps",
            "2",
            "--out-json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _rows(out)[0]["workload"] == "cpu_ragged_b2_q64_p64"


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", "--backends", "nope"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", "--workloads", "nope"])
    assert e.value.code == 2


def test_gpu_slug():
    assert bench.gpu_slug("NVIDIA H200") == "h200"
    assert bench.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


def test_serving_counts_failing_calls(tmp_path, monkeypatch, capsys):
    real = bench.cudnn_batch_prefill_with_kv_cache
    n = {"calls": 0}

    def flaky(**kw):
        n["calls"] += 1
        if n["calls"] % 3 == 0:
            raise RuntimeError("transient failure")
        return real(**kw)

    monkeypatch.setattr(bench, "cudnn_batch_prefill_with_kv_cache", flaky)
    out = tmp_path / "s.json"
    rc = bench.main(["--device", "cpu", "--serving", "6", "--serving-warmup", "1", "--out-json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    (row,) = _rows(out)
    assert row["failed_calls"] >= 1 and row["ok"] is False
    assert "transient failure" in row["first_error"]
    assert "calls raised" in text.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# GPU smoke tests (skipped without CUDA): every GPU code path on tiny workloads, in seconds
# ---------------------------------------------------------------------------------------------

TINY = "cpu_b2_q64_p64,cpu_ragged_b2_q64_p64,cpu_varlen_b4_noncausal"


@pytest.mark.gpu
def test_gpu_bench_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--workloads", TINY, "--backends", "cudnn,triton,fa2-varlen,torch", "--reps", "3"]
    rc = bench.main([*args, "--out-json", str(out), "--markdown", str(tmp_path / "t.md")])
    text = capsys.readouterr().out
    rows = _rows(out)
    assert rc == 0, text
    assert {r["backend"] for r in rows if r["ms"]} >= {"torch", "fa2-varlen"}
    for r in rows:
        assert REQUIRED <= set(r)
        if r.get("skipped"):
            continue
        assert r["ms"] > 0 and r["ok"] is True, r
        assert r["gpu"] != "cpu" and r["timer"].startswith("cuda-events")


@pytest.mark.gpu
def test_gpu_bench_cuda_graph_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--workloads", "cpu_b2_q64_p64", "--backends", "cudnn,triton,fa2-varlen", "--cuda-graph"]
    rc = bench.main([*args, "--reps", "3", "--out-json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for r in _rows(out):
        assert r["cuda_graph"] is True and r["lengths_on"] == "device", r
        assert r.get("skipped") or r["ok"] is True, r


@pytest.mark.gpu
def test_gpu_serving_smoke(tmp_path, capsys):
    out = tmp_path / "s.json"
    args = ["--serving", "6", "--serving-warmup", "2", "--serving-checks", "1", "--out-json", str(out)]
    rc = bench.main(args)
    text = capsys.readouterr().out
    assert rc == 0, text
    for r in _rows(out):
        if r.get("skipped"):
            continue
        assert r["p50_ms"] > 0 and r["gpu_p50_ms"] > 0 and r["peak_mem_gib"] > 0 and r["ok"] is True, r
