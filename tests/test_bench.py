"""The benchmark (pagedprefill.bench) and the workload rules (pagedprefill.workloads), on the CPU.

GPU smoke tests at the end (``@pytest.mark.gpu``) run every GPU code path on tiny cases.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedprefill import workloads as wl
from pagedprefill.bench import cases, cli, layers, references, serving, sweep, tables
from pagedprefill.bench.checks import compare
from pagedprefill.bench.common import OUT_REL_TOL, Interrupted, Progress

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / "workloads.json"
REQUIRED = {
    "workload",
    "backend",
    "kind",
    "data",
    "ms",
    "tflops",
    "gflop",
    "gpu",
    "date",
    "torch",
    "ok",
    "max_err",
}
FAST = ["--device", "cpu", "--reps", "1"]


def _rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _table_lines(text: str) -> list[str]:
    return text.strip().splitlines()


# ---------------------------------------------------------------------------------------------
# workloads.py
# ---------------------------------------------------------------------------------------------


def test_workloads_json_is_the_shared_file():
    here = Path(wl.__file__).with_name("workloads.json")
    names = [w["name"] for w in wl.load_workloads()]
    assert len(names) == 17 and len(set(names)) == 17
    if not SHARED.exists():
        pytest.skip(f"{SHARED} not present on this machine")
    assert here.read_bytes() == SHARED.read_bytes()


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


def test_lengths_fixed_workloads():
    assert wl.lengths(wl.get_workload("llama8b_b16_q1k")) == ([1024] * 16, [1024] * 16)
    assert wl.lengths(wl.get_workload("chunked_b8_q512_p7680")) == ([512] * 8, [8192] * 8)
    assert wl.lengths(wl.get_workload("short_b256_q64_p512")) == ([64] * 256, [576] * 256)


def test_flops_small_hand_computed_case():
    # README: per sequence and query head 2 * (Dqk + Dvo) * visible pairs; causal row i sees
    # min(kv, kv - q + i + 1) keys, never below 0.
    # q=3, kv=5 causal: rows see 3, 4, 5 keys = 12 pairs; q=4, kv=2 causal: rows see 0, 0, 1, 2 = 3 pairs.
    hq, dqk, dvo = 2, 4, 8
    assert wl.flops(([3], [5]), True, hq, dqk, dvo) == 2 * (4 + 8) * 2 * 12 == 576
    assert wl.flops(([4], [2]), True, hq, dqk, dvo) == 2 * 12 * 2 * 3
    assert wl.flops(([3, 4], [5, 2]), False, hq, dqk, dvo) == 2 * 12 * 2 * (15 + 8)


def _brute_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    return sum(1 for i in range(q_len) for j in range(kv_len) if not causal or j <= i + kv_len - q_len)


@pytest.mark.parametrize("causal", [True, False])
def test_flops_against_brute_force(causal):
    q_lens = [1, 5, 7, 0, 9, 3, 12]
    kv_lens = [1, 9, 3, 4, 0, 3, 30]  # includes q > kv (rows with no key) and kv = 0
    hq, dqk, dvo = 3, 16, 8
    want = sum(2 * (dqk + dvo) * hq * _brute_pairs(q, k, causal) for q, k in zip(q_lens, kv_lens))
    assert wl.flops((q_lens, kv_lens), causal, hq, dqk, dvo) == want


def test_flops_match_readme_gflop_column():
    anchors = {  # the README's GFLOP column
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
        "d64_b16_q2k": 275.0,
        "d96_mha_b4_q4k": 412.4,
        "d256_b8_q2k": 137.5,
        "gqa7_b4_q4k": 481.2,
        "short_b256_q64_p512": 146.2,
        "fp8kv_b8_q2k": 275.0,
        "fp8_b2_q8k": 1099.6,
    }
    assert {w["name"]: round(wl.flops(w) / 1e9, 1) for w in wl.load_workloads()} == anchors


@pytest.mark.parametrize("name", ["fp8kv_b8_q2k", "fp8_b2_q8k", "cpu_fp8kv_b2_q64", "cpu_fp8_b2_q64"])
def test_fp8_builders_store_value_over_half_with_half_scales(name):
    w = wl.get_workload(name)
    kind = w["dtype"]
    lens = ([5, 19], [21, 19])  # small lengths: the workload's heads, dims and page size
    wide = wl.build_case(w, "cpu", seed=4, lens=lens, fp8=False)
    got = wl.build_case(w, "cpu", seed=4, lens=lens)
    e4m3 = torch.float8_e4m3fn
    for name_ in ("k_cache", "v_cache"):
        assert got[name_].dtype == e4m3 and got[name_].stride() == wide[name_].stride()  # NHD pages stay NHD
        want = (wide[name_].float() / 0.5).to(e4m3)
        assert torch.equal(got[name_].view(torch.uint8), want.view(torch.uint8))
        real = got[name_].float() * 0.5  # real = stored x scale: within e4m3's rounding of the value
        assert torch.allclose(real, wide[name_].float(), rtol=2**-4, atol=2**-10)
    for s in ("k_scale", "v_scale"):
        assert got[s].dtype == torch.float32 and got[s].shape == (1,) and float(got[s]) == 0.5
    if kind == "fp8":
        assert got["q"].dtype == e4m3 and float(got["q_scale"]) == 0.5 and got["q_scale"].shape == (1,)
        assert torch.equal(got["q"].view(torch.uint8), (wide["q"].float() / 0.5).to(e4m3).view(torch.uint8))
        assert got["out"].dtype == torch.bfloat16
    else:
        assert "q_scale" not in got and torch.equal(got["q"], wide["q"]) and got["q"].dtype == torch.bfloat16
    assert torch.equal(got["block_tables"], wide["block_tables"])  # the same batch (lengths, pages)
    assert wl.quantize_case(wide, kind)["block_tables"] is wide["block_tables"]
    dense = wl.dense_reference_inputs(got)
    assert dense["k"].dtype == e4m3 and dense["k_scale"] == 0.5


def test_named_case_suffixes():
    e4m3 = torch.float8_e4m3fn
    plain = wl.named_case("cpu_b2_q64_p64", "cpu", seed=5)
    assert plain["k_cache"].dtype == torch.bfloat16 and "lse" not in plain and plain["return_lse"] is False
    kv8 = wl.named_case("cpu_b2_q64_p64:fp8kv", "cpu", seed=5)
    assert kv8["k_cache"].dtype == e4m3 and kv8["q"].dtype == torch.bfloat16 and torch.equal(kv8["q"], plain["q"])
    wide = wl.named_case("cpu_fp8_b2_q64:bf16", "cpu")
    assert wide["q"].dtype == wide["k_cache"].dtype == torch.bfloat16 and "q_scale" not in wide
    with pytest.raises(ValueError, match="suffix 'fp4'"):
        wl.named_case("cpu_b2_q64_p64:fp4", "cpu")
    with pytest.raises(ValueError, match="one of fp8kv"):
        wl.named_case("cpu_fp8_b2_q64:fp8:bf16", "cpu")
    # longest: the same (q, kv) pairs, most visible query-key pairs first; devlens: on q's device
    w = wl.get_workload("cpu_varlen_b4_noncausal")
    q_lens, kv_lens = wl.lengths(w)
    got = wl.named_case("cpu_varlen_b4_noncausal:longest:devlens", "cpu")
    pairs = list(zip(got["actual_seq_lens_q"].tolist(), got["actual_seq_lens_kv"].tolist()))
    assert sorted(pairs) == sorted(zip(q_lens, kv_lens)) and got["actual_seq_lens_q"].device == got["q"].device
    work = [wl.visible_pairs(q, k, bool(w["causal"])) for q, k in pairs]
    drawn = [wl.visible_pairs(q, k, bool(w["causal"])) for q, k in zip(q_lens, kv_lens)]
    assert work == sorted(work, reverse=True) and drawn != work  # (the drawn order was another)


def test_build_case_layout_and_dense_inputs():
    w = wl.get_workload("cpu_varlen_b4_noncausal")
    case = wl.build_case(w, "cpu", seed=3)
    q_lens, kv_lens = wl.lengths(w)
    k = case["k_cache"]
    assert k.dim() == 4 and k.shape[1] == w["heads_kv"] and k.shape[2] == w["page_size"]
    assert k.permute(0, 2, 1, 3).is_contiguous()  # NHD storage viewed as (pages, Hkv, page, D)
    assert case["block_tables"].dtype == torch.int32
    assert case["q"].dtype == torch.bfloat16 and case["q"].shape[0] == sum(q_lens)
    assert case["scale"] == pytest.approx(1 / math.sqrt(w["head_dim_qk"]))
    page = w["page_size"]
    used = [int(p) for b, n in enumerate(kv_lens) for p in case["block_tables"][b, : -(-n // page)].tolist()]
    assert sorted(used) == list(range(k.shape[0])) and used != sorted(used)  # every page once, shuffled
    dense = wl.dense_reference_inputs(case)
    row = 0
    for b, n in enumerate(kv_lens):  # token t of sequence b, one key at a time through the block table
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
# the table mode
# ---------------------------------------------------------------------------------------------


def test_cpu_bench_end_to_end(tmp_path, capsys):
    out, md = tmp_path / "r.json", tmp_path / "t.md"
    t0 = time.perf_counter()
    rc = cli.main(
        [
            *FAST,
            "--backends",
            "torch,cudnn,fa3-varlen,fa2-varlen",
            "--out-json",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    elapsed = time.perf_counter() - t0
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    assert elapsed < 20
    rows = _rows(out)
    assert len(rows) == 4 * len(wl.CPU_WORKLOADS)  # one per (workload, backend)
    for r in rows:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        if r["backend"] != "torch":  # cannot run on the CPU: skipped, with the reason
            assert r["ms"] is None and r["skipped"]
            continue
        assert r["ms"] > 0 and r["tflops"] > 0 and r["gflop"] > 0 and r["gpu"] == "cpu"
        assert r["ok"] is True and r["rel_err"] <= OUT_REL_TOL and r["data"] == r["kind"]
    assert {r["kind"] for r in rows} == {"bf16", "fp8_kv", "fp8"}
    assert "not comparable to GPU numbers" in cap.out
    assert "skipped: cpu_b2_q64_p64 / cudnn" in cap.out
    assert "skipped: cpu_b2_q64_p64 / fa2-varlen: FlashAttention-2 needs a CUDA GPU" in cap.out
    last = _table_lines(cap.out)
    assert last[-1].startswith("cpu_fp8_b2_q64 [fp8]")  # the table comes last
    header = next(line for line in last if line.startswith("workload"))
    assert "TF/s" in header
    assert md.read_text().count("| cpu_") == len(wl.CPU_WORKLOADS)
    assert "[24/24] cpu_fp8_b2_q64 fa2-varlen ..." in cap.err  # progress on stderr


def test_workloads_file_runs_the_users_shapes(tmp_path, monkeypatch, capsys):
    """A JSON list of workloads (workloads.json's keys) is run, checked against the reference, in
    place of the defaults; --workloads may pick among them."""
    monkeypatch.setattr(wl, "_ADDED", [])
    mine = [
        {"name": "my_varlen", "batch": 3, "qo_min": 5, "qo_max": 40, "prefix_max": 30, "seed": 4,
         "heads_q": 6, "heads_kv": 2, "head_dim_qk": 32, "head_dim_vo": 32, "page_size": 4, "causal": True},
        {"name": "my_ragged", "batch": 2, "qo_len": 17, "prefix": 9, "heads_q": 5, "heads_kv": 1,
         "head_dim_qk": 48, "head_dim_vo": 48, "page_size": 0, "causal": False},
    ]  # fmt: skip
    del mine[1]["head_dim_vo"]  # (optional: head_dim_qk's)
    path, out = tmp_path / "mine.json", tmp_path / "r.json"
    path.write_text(json.dumps(mine))
    rc = cli.main([*FAST, "--workloads-file", str(path), "--backends", "torch", "--out-json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    rows = _rows(out)
    assert [r["workload"] for r in rows] == ["my_varlen", "my_ragged"]
    assert all(r["ok"] is True and r["ms"] > 0 for r in rows)
    assert rows[0]["gflop"] == pytest.approx(wl.flops(mine[0]) / 1e9, abs=5e-4)  # (rows keep 3 decimals)
    rc = cli.main([*FAST, "--workloads-file", str(path), "--workloads", "my_ragged", "--out-json", str(out)])
    assert rc == 0 and [r["workload"] for r in _rows(out)] == ["my_ragged"]
    assert cli.main(["--list", "--workloads-file", str(path)]) == 0
    assert f"workloads of {path}:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "entries, message",
    [
        ([{"name": "x"}], "workload 'x': 'batch' expected an int >= 1, got None"),
        ("not a list", "expected a list of workloads"),
        ([{**wl.CPU_WORKLOADS[0], "name": "a", "causal": 1}], "workload 'a': 'causal' expected true or false"),
        ([{**wl.CPU_WORKLOADS[0], "name": "a", "heads_kv": 3}], "'heads_kv' expected a divisor of heads_q = 4"),
        ([{**wl.CPU_WORKLOADS[0], "name": "a"}, {**wl.CPU_WORKLOADS[0], "name": "a"}], "repeated: a"),
        ([wl.CPU_WORKLOADS[0]], "the name of one of the project's workloads"),
        ([{**wl.CPU_WORKLOADS[0], "name": "a", "dtype": "int8"}], "dtype must be one of"),
        ([{**wl.CPU_WORKLOADS[0], "name": "a", "qo_len": None}], "'qo_len' expected an int >= 0, got None"),
        ([{**wl.CPU_WORKLOADS[0], "name": "a", "sede": 3}], "unknown key(s) ['sede']"),
        ([{**wl.CPU_WORKLOADS[0], "name": "a"}, wl.CPU_WORKLOADS[1]], "the name of one of the project's"),
    ],
)
def test_workloads_file_errors_name_the_entry_and_key(entries, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wl, "_ADDED", [])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(entries))
    assert cli.main([*FAST, "--workloads-file", str(path)]) == 2
    assert message in capsys.readouterr().err
    assert cli.main([*FAST, "--layers", "1", "--workloads-file", str(path)]) == 2
    assert "table mode only" in capsys.readouterr().err
    assert wl._ADDED == []


@pytest.mark.needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter path")
def test_cpu_triton_under_the_interpreter_uses_fp16(tmp_path, capsys):
    from pagedprefill.kernels import launch

    if not launch.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 was not set before pagedprefill was imported")
    out = tmp_path / "r.json"
    rc = cli.main([*FAST, "--workloads", "cpu_b2_q64_p64", "--backends", "triton", "--out-json", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    (row,) = _rows(out)
    assert row["dtype"] == "fp16" and row["data"] == "fp16" and row["ok"] is True and row["served_by"] == "triton"
    assert "CPU figures" in cap.out


def test_no_file_written_without_an_output_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main([*FAST, "--workloads", "cpu_page1_b2_q64_p64"]) == 0
    assert cli.main([*FAST, "--layers", "1", "--workloads", "cpu_b4_q16"]) == 0
    assert cli.main([*FAST, "--serving", "2", "--serving-warmup", "1", "--serving-checks", "0"]) == 0
    assert list(tmp_path.rglob("*")) == []
    assert "JSON rows" not in capsys.readouterr().out


def test_out_json_replaced_unless_append(tmp_path, capsys):
    out = tmp_path / "sub" / "r.json"
    args = [*FAST, "--workloads", "cpu_page1_b2_q64_p64", "--no-check", "--out-json", str(out)]
    assert cli.main(args) == 0 and cli.main(args) == 0
    assert len(_rows(out)) == 1
    assert cli.main([*args, "--append"]) == 0
    assert len(_rows(out)) == 2


def test_progress_lines_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # "import tqdm" raises ImportError
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # where tqdm would draw a bar
    rc = cli.main(
        [
            *FAST,
            "--no-check",
            "--workloads",
            "cpu_b2_q64_p64,cpu_ragged_b2_q64_p64",
            "--backends",
            "torch,auto",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err.splitlines()
    steps = [line for line in err if line.startswith("[")]
    assert steps == [
        "[1/4] cpu_b2_q64_p64 torch ...",
        "[2/4] cpu_b2_q64_p64 auto ...",
        "[3/4] cpu_ragged_b2_q64_p64 torch ...",
        "[4/4] cpu_ragged_b2_q64_p64 auto ...",
    ]
    p = Progress(1, "x")
    assert p.bar is None


def test_plot_without_matplotlib_fails_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    ran = []
    monkeypatch.setattr(sweep, "run_table", lambda *a, **k: ran.append(1) or 0)
    monkeypatch.setattr(cases, "prefill", lambda **kw: ran.append(1))
    rc = cli.main([*FAST, "--plot", str(tmp_path / "p.png"), "--out-json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and not ran
    assert "matplotlib" in err and "pip install matplotlib" in err
    assert list(tmp_path.iterdir()) == []  # not even the JSON file was started


def test_plot_written_when_matplotlib_is_there(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    assert cli.main([*FAST, "--no-check", "--workloads", "cpu_b2_q64_p64", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_fa3_missing_is_a_skip_with_the_reason(tmp_path, monkeypatch, capsys):
    for mod in references.FA3_MODULES:
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.setattr(references, "_FA3", {})
    fn, why = references.fa3_status()
    assert fn is None
    assert "fa3_fwd_interface" in why and "flash_attn_interface" in why and "pip install fa3-fwd==0.0.3" in why
    out = tmp_path / "r.json"
    rc = cli.main([*FAST, "--workloads", "cpu_b2_q64_p64", "--backends", "torch,fa3-varlen", "--out-json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0  # the benchmark still runs
    fa3 = next(r for r in _rows(out) if r["backend"] == "fa3-varlen")
    assert fa3["ms"] is None and "FlashAttention-3 is not importable" in fa3["skipped"]
    assert "fa3-varlen will be skipped: FlashAttention-3 is not importable" in text
    assert "skipped: cpu_b2_q64_p64 / fa3-varlen: FlashAttention-3 is not importable" in text


def test_references_choose_their_data():
    assert references.data_for("fa3-varlen", "fp8", "bf16") == "fp8"  # FA3's fp8 path on the fp8 data
    assert references.data_for("fa3-varlen", "fp8_kv", "bf16") == "bf16"  # no bf16-q / fp8-KV kernel
    assert references.data_for("fa2-varlen", "fp8", "bf16") == "bf16"
    assert references.data_for("fa2-varlen", "bf16", "bf16") == "bf16"


def test_summary_table_ratios_to_cudnn_and_fa3_and_geomean():
    base = {"gflop": 10.0, "ok": True, "kind": "bf16", "data": "bf16"}
    results = [
        {**base, "workload": "a", "backend": "cudnn", "ms": 2.0, "tflops": 5.0, "host_us": 20.0},
        {**base, "workload": "a", "backend": "triton", "ms": 1.0, "tflops": 10.0, "host_us": 30.0},
        {**base, "workload": "a", "backend": "fa3-varlen", "ms": 0.5, "tflops": 20.0, "host_us": 90.0},
        {
            **base,
            "workload": "b",
            "kind": "fp8",
            "data": "bf16",
            "backend": "cudnn",
            "ms": 2.0,
            "tflops": 10.0,
        },
        {
            **base,
            "workload": "b",
            "kind": "fp8",
            "data": "fp8",
            "backend": "triton",
            "ms": 4.0,
            "tflops": 5.0,
        },
        {
            **base,
            "workload": "b",
            "kind": "fp8",
            "data": "fp8",
            "backend": "fa3-varlen",
            "ms": 1.0,
            "tflops": 20.0,
        },
        {**base, "workload": "c", "backend": "cudnn", "ms": 1.0, "tflops": 10.0},
        {**base, "workload": "c", "backend": "triton", "ms": 9.0, "tflops": 1.0, "ok": False},
        {**base, "workload": "c", "backend": "fa3-varlen", "ms": None, "skipped": "FA3 missing"},
    ]
    headers, rows = tables.summary_table(results, ["cudnn", "triton", "fa3-varlen"])
    assert headers == [
        ("", "workload"),
        ("", "GFLOP"),
        ("cudnn", "TF/s"),
        ("cudnn", "×FA3"),
        ("cudnn", "host µs"),
        ("triton", "TF/s"),
        ("triton", "×cuDNN"),
        ("triton", "×FA3"),
        ("triton", "host µs"),
        ("fa3-varlen", "TF/s"),
        ("fa3-varlen", "×cuDNN"),
        ("fa3-varlen", "host µs"),
    ]
    a, b, c, g = rows
    assert a[0] == "a" and a[3] == "0.25" and a[6] == "2.00" and a[7] == "0.50" and a[10] == "4.00"
    assert b[0] == "b [fp8]" and b[2] == "10.0 (bf16)" and b[5] == "5.0" and b[6] == "0.50" and b[7] == "0.25"
    assert c[5] == "1.0 FAILED" and c[9] == "skip" and c[7] == "–"
    assert g[0] == "geomean"
    assert g[3] == f"{math.sqrt(0.25 * 0.5):.2f}"  # cudnn x FA3 over a and b
    assert g[6] == "1.00"  # triton x cuDNN: a (2.0) and b (0.5); c failed its check: left out
    assert g[7] == f"{math.sqrt(0.5 * 0.25):.2f}" and g[10] == f"{math.sqrt(4.0 * 2.0):.2f}"
    text = tables.format_text_table(headers, rows)
    lines = text.splitlines()
    assert lines[0].split() == ["cudnn", "triton", "fa3-varlen"]  # backends above their columns
    assert len({len(line) for line in lines[1:]}) == 1  # aligned


def test_compare_flags_nan_and_errors():
    ref = torch.randn(10, 2, 4)
    lse = torch.randn(10, 2)
    assert compare(ref.clone(), ref, lse.clone(), lse)["ok"]
    bad = ref.clone()
    bad[3] = float("nan")
    assert not compare(bad, ref)["ok"]
    assert not compare(ref * 1.5, ref)["ok"]
    assert compare(ref * 1.05, ref, rel_tol=0.08)["ok"]
    lse_bad = lse.clone()
    lse_bad[0, 0] += 1.0
    assert not compare(ref.clone(), ref, lse_bad, lse)["ok"]
    inf = torch.full((2, 2), float("-inf"))
    assert compare(ref.clone(), ref, inf, inf.clone())["lse_err"] == 0.0


def test_first_call_grows_workspace(monkeypatch):
    case = wl.build_case(wl.get_workload("cpu_b2_q64_p64"), "cpu", workspace_bytes=16)
    real = cases.prefill
    calls = []

    def fake(**kw):
        calls.append(kw["workspace_buffer"].numel())
        if kw["workspace_buffer"].numel() < 3 * 2**20:
            raise ValueError("workspace_buffer: expected at least 3000000 bytes for this call (...), got 16 bytes")
        return real(**kw)

    monkeypatch.setattr(cases, "prefill", fake)
    cases.first_call(case, "torch", say=lambda m: None)
    assert calls == [16, 3 * 2**20] and case["workspace_buffer"].numel() == 3 * 2**20


def test_a_check_failure_is_loud(tmp_path, monkeypatch, capsys):
    real = cases.prefill

    def wrong(**kw):
        out, lse = real(**kw)
        if kw.get("backend") == "auto":
            out.mul_(1.5)
        return out, lse

    monkeypatch.setattr(cases, "prefill", wrong)
    rc = cli.main([*FAST, "--workloads", "cpu_b2_q64_p64", "--backends", "torch,auto"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "CHECK FAILED: cpu_b2_q64_p64 / auto" in text and "FAILED the correctness check" in text
    assert "FAILED" in _table_lines(text)[-1]  # the workload's row (no geomean row without cuDNN / FA3)


def test_error_in_backend_is_reported_not_fatal(tmp_path, monkeypatch, capsys):
    real = cases.prefill

    def fake(**kw):
        if kw.get("backend") == "auto":
            raise RuntimeError("kernel exploded")
        return real(**kw)

    monkeypatch.setattr(cases, "prefill", fake)
    out = tmp_path / "r.json"
    rc = cli.main([*FAST, "--workloads", "cpu_b2_q64_p64", "--backends", "auto,torch", "--out-json", str(out)])
    cap = capsys.readouterr()
    assert rc == 1
    assert "kernel exploded" in cap.out
    rows = _rows(out)
    assert [r["backend"] for r in rows] == ["auto", "torch"]
    assert rows[0]["error"].startswith("RuntimeError") and rows[1]["ok"] is True


def test_interrupt_prints_partial_table(monkeypatch, capsys):
    real = sweep.run_backend
    n = {"calls": 0}

    def fake(*a, **k):
        n["calls"] += 1
        if n["calls"] == 2:
            raise Interrupted()
        return real(*a, **k)

    monkeypatch.setattr(sweep, "run_backend", fake)
    rc = cli.main([*FAST, "--workloads", "cpu_b2_q64_p64,cpu_page1_b2_q64_p64"])
    text = capsys.readouterr().out
    assert rc == 130
    assert "interrupted" in text
    assert _table_lines(text)[-1].startswith("cpu_b2_q64_p64")


def test_sigterm_prints_partial_table(monkeypatch, capsys):
    real = sweep.run_backend
    n = {"calls": 0}

    def fake(*a, **k):
        n["calls"] += 1
        if n["calls"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler main installed turns it into Interrupted
        return real(*a, **k)

    monkeypatch.setattr(sweep, "run_backend", fake)
    before = signal.getsignal(signal.SIGTERM)
    rc = cli.main([*FAST, "--no-check", "--workloads", "cpu_b2_q64_p64,cpu_page1_b2_q64_p64"])
    assert rc == 130
    assert _table_lines(capsys.readouterr().out)[-1].startswith("cpu_b2_q64_p64")
    assert signal.getsignal(signal.SIGTERM) is before  # restored


def test_bad_arguments_exit_2(capsys):
    assert cli.main(["--device", "cpu", "--backends", "nope"]) == 2
    assert cli.main(["--device", "cpu", "--workloads", "nope"]) == 2
    assert cli.main(["--device", "cpu", "--serving", "2", "--layers", "2"]) == 2
    assert cli.main(["--device", "cpu", "--serving", "2", "--serving-backends", "fa2-varlen"]) == 2
    assert cli.main(["--device", "cpu", "--layers", "2", "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "unknown backend" in err and "unknown workload" in err and "--plot" in err
    assert cli.main(["--device", "cpu", "--serving", "0"]) == 2  # (not the table mode)
    assert cli.main(["--device", "cpu", "--layers", "0"]) == 2
    assert "N >= 1" in capsys.readouterr().err


def test_unwritable_output_paths_fail_before_running(tmp_path, capsys):
    assert cli.main([*FAST, "--out-json", str(tmp_path)]) == 2
    (tmp_path / "file").write_text("")
    assert cli.main([*FAST, "--markdown", str(tmp_path / "file" / "t.md")]) == 2
    err = capsys.readouterr().err
    assert "--out-json" in err and "a directory" in err and "--markdown" in err


def test_nothing_measured_is_an_error(monkeypatch, capsys):
    """Every cell skipped (here: triton on the CPU without the interpreter) exits 1, saying so."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from pagedprefill.kernels import launch

    monkeypatch.setattr(launch, "INTERPRETED", False)
    rc = cli.main([*FAST, "--workloads", "cpu_b2_q64_p64", "--backends", "triton"])
    assert rc == 1 and "nothing was measured" in capsys.readouterr().out


def test_list(capsys):
    assert cli.main(["--list"]) == 0
    text = capsys.readouterr().out
    assert "fp8_b2_q8k" in text and "1099.6 GFLOP" in text and "ragged_b32_devoffsets" in text


def test_entry_points_are_the_new_main():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads(Path(__file__).resolve().parents[1].joinpath("pyproject.toml").read_text())["project"][
        "scripts"
    ]
    assert scripts["pagedprefill-bench"] == "pagedprefill.bench.cli:main"
    assert scripts["pagedprefill-demo"] == "pagedprefill.demo:main"
    import pagedprefill.bench

    assert pagedprefill.bench.main is cli.main


def test_python_dash_m_entry_point(tmp_path):
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["--device", "cpu", "--workloads", "cpu_ragged_b2_q64_p64", "--reps", "1", "--out-json", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "pagedprefill.bench", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _rows(out)[0]["workload"] == "cpu_ragged_b2_q64_p64"
    assert "[1/1] cpu_ragged_b2_q64_p64 torch ..." in proc.stderr and "[1/1]" not in proc.stdout


# ---------------------------------------------------------------------------------------------
# the layers mode
# ---------------------------------------------------------------------------------------------


def test_layers_mode_cpu(tmp_path, capsys):
    out = tmp_path / "l.json"
    rc = cli.main(
        [*FAST, "--layers", "2", "--workloads", "cpu_b4_q16,cpu_ragged_b3_devoffsets", "--out-json", str(out)]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    rows = _rows(out)
    assert [(r["case"], r["api"]) for r in rows] == [
        ("cpu_b4_q16", "plan.run"),
        ("cpu_b4_q16", "one-shot"),
        ("cpu_ragged_b3_devoffsets", "plan.run"),
        ("cpu_ragged_b3_devoffsets", "one-shot"),
    ]
    for r in rows:
        assert r["backend"] == "torch" and r["layers"] == 2 and r["ok"] is True and r["served_by"] == "torch"
        assert r["host_us"] > 0 and r["wall_us"] > 0 and r["device_us"] is None  # no device time on the CPU
        assert 0 < r["host_probe_us"] < r["host_us"]
    lines = _table_lines(cap.out)
    header = next(line for line in lines if line.startswith("case"))
    for col in ("host µs/call", "host probe µs", "wall µs/layer", "device µs/layer", "wall/device", "TF/s", "check"):
        assert col in header
    assert lines[-1].startswith("cpu_ragged_b3_devoffsets") and lines[-1].endswith("ok")
    assert "[4/4] cpu_ragged_b3_devoffsets torch one-shot ..." in cap.err


def test_layers_table_ratios_and_geomean():
    def row(case, be, api, wall):
        return {
            "case": case,
            "backend": be,
            "api": api,
            "host_us": 10.0,
            "wall_us": wall,
            "device_us": wall / 2,
            "wall_over_device": 2.0,
            "tflops": 1.0,
            "ok": True,
            "rel_err": 0.0,
            "preload_ok": True,
        }

    walls = {"a": (100.0, 50.0, 80.0), "b": (100.0, 200.0, 100.0)}  # cudnn, triton, FA3
    results = []
    for case, (c, t, f) in walls.items():
        results += [row(case, "cudnn", "plan.run", c), row(case, "triton", "plan.run", t)]
        results.append(row(case, "fa3-varlen", "reference", f))
    headers, rows = layers.table(results)
    assert headers[-3:] == ["×cuDNN", "×FA3", "check"]
    assert rows[1][-3:] == ["2.00", "1.60", "ok"] and rows[4][-3:] == ["0.50", "0.50", "ok"]
    geo = {tuple(r[1:3]): r[-3:-1] for r in rows if r[0] == "geomean"}
    assert geo[("triton", "plan.run")] == ["1.00", f"{math.sqrt(1.6 * 0.5):.2f}"]
    assert geo[("cudnn", "plan.run")] == ["1.00", f"{math.sqrt(0.8 * 1.0):.2f}"]


def test_layer_batch_has_distinct_layers_over_one_cache():
    lb = layers.LayerBatch(layers.known_cases()["cpu_ragged_b3_devoffsets"], 3, torch.device("cpu"), torch.float32, 0)
    assert len({t.data_ptr() for t in lb.q}) == 3 and len({t.data_ptr() for t in lb.out}) == 3
    assert not torch.equal(lb.q[0], lb.q[1])
    kw0, kw2 = lb.layer_kwargs(0), lb.layer_kwargs(2)
    assert kw0["k_cache"] is kw2["k_cache"] and kw0["batch_offsets_q"] is kw2["batch_offsets_q"]
    assert kw0["return_lse"] is False and "lse" not in kw0
    pairs = [("triton", "plan.run"), ("triton", "one-shot"), ("fa3-varlen", "reference")]
    assert layers.variants(["triton", "fa3-varlen"]) == pairs


# ---------------------------------------------------------------------------------------------
# the serving mode
# ---------------------------------------------------------------------------------------------


def test_serving_lengths_respect_limits():
    cfg = serving.ServingConfig()
    steps = serving.serving_lengths(cfg, 200, seed=0)
    assert steps == serving.serving_lengths(cfg, 200, seed=0)  # seeded
    for q_lens, kv_lens in steps:
        assert 1 <= len(q_lens) <= cfg.batch_max and sum(q_lens) <= cfg.token_budget
        assert all(1 <= q <= cfg.q_max for q in q_lens)
        assert all(0 <= k - q <= cfg.prefix_max for q, k in zip(q_lens, kv_lens))
    assert len({len(q) for q, _ in steps}) > 10  # batch sizes vary


def test_serving_mode_cpu(tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = cli.main(
        [
            "--device",
            "cpu",
            "--serving",
            "6",
            "--serving-warmup",
            "2",
            "--serving-checks",
            "2",
            "--out-json",
            str(out),
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    (row,) = _rows(out)
    assert row["mode"] == "serving" and row["backend"] == "torch"
    assert row["calls"] == 6 and row["warmup_calls"] == 2
    assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"] and row["host_p50_ms"] > 0
    assert row["ok"] is True and row["checked_calls"] == 2
    header = next(line for line in _table_lines(cap.out) if line.startswith("backend"))
    assert "mem warm MiB" in header and "growth MiB" in header
    assert _table_lines(cap.out)[-1].startswith("torch")
    assert "[1/1] serving torch ..." in cap.err


def test_serving_backends_flag_and_fixed_max(tmp_path, capsys):
    out = tmp_path / "s.json"
    args = ["--device", "cpu", "--serving", "3", "--serving-warmup", "1", "--serving-fixed-max"]
    assert cli.main([*args, "--serving-backends", "torch,auto", "--out-json", str(out)]) == 0
    rows = _rows(out)
    assert [r["backend"] for r in rows] == ["torch", "auto"] and all(r["ok"] for r in rows)


def test_serving_counts_failing_calls(tmp_path, monkeypatch, capsys):
    real = cases.prefill
    n = {"calls": 0}

    def flaky(**kw):
        n["calls"] += 1
        if n["calls"] % 3 == 0:
            raise RuntimeError("transient failure")
        return real(**kw)

    monkeypatch.setattr(cases, "prefill", flaky)
    out = tmp_path / "s.json"
    rc = cli.main(["--device", "cpu", "--serving", "6", "--serving-warmup", "1", "--out-json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    (row,) = _rows(out)
    assert row["failed_calls"] >= 1 and row["ok"] is False and "transient failure" in row["first_error"]
    assert "calls raised" in _table_lines(text)[-1]


# ---------------------------------------------------------------------------------------------
# GPU smoke tests (skipped without CUDA): every GPU code path on tiny cases, in seconds
# ---------------------------------------------------------------------------------------------

TINY = "cpu_b2_q64_p64,cpu_ragged_b2_q64_p64,cpu_varlen_b4_noncausal,cpu_fp8kv_b2_q64,cpu_fp8_b2_q64"


@pytest.mark.gpu
def test_gpu_bench_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--workloads", TINY, "--backends", "cudnn,triton,auto,fa3-varlen,fa2-varlen,torch", "--reps", "3"]
    rc = cli.main([*args, "--out-json", str(out), "--markdown", str(tmp_path / "t.md")])
    text = capsys.readouterr().out
    rows = _rows(out)
    assert rc == 0, text
    assert {r["backend"] for r in rows if r["ms"]} >= {"torch", "triton", "fa2-varlen"}
    for r in rows:
        assert REQUIRED <= set(r)
        if r.get("skipped"):
            continue
        assert r["ms"] > 0 and r["ok"] is True and r["host_us"] > 0, r
        assert r["gpu"] != "cpu" and r["timer"].startswith("cuda-events")
    fp8 = {r["backend"]: r["data"] for r in rows if r["workload"] == "cpu_fp8_b2_q64" and r["ms"]}
    assert fp8["triton"] == "fp8" and fp8["fa2-varlen"] == "bf16"
    if "fa3-varlen" in fp8:
        assert fp8["fa3-varlen"] == "fp8"


@pytest.mark.gpu
def test_gpu_interleaved_timer_tells_calls_apart():
    """``time_interleaved`` on two sleep kernels of 1:3 length reads them in that ratio (each median
    its own call's), and a call that raises on the host is named by its index."""
    from pagedprefill.bench import timing

    cycles = int(timing.SleepCalibration.get() or 1e6) // 5  # (about 0.2 ms)
    cfg = timing.TimingConfig(reps=20, warmup_ms=1.0)
    (short_ms, long_ms), n, timer = timing.time_interleaved(
        [lambda: torch.cuda._sleep(cycles), lambda: torch.cuda._sleep(3 * cycles)], cfg
    )
    assert n == 20 and timer.startswith("cuda-events") and "interleaved" in timer
    assert 2.5 < long_ms / short_ms < 3.5, (short_ms, long_ms)

    def boom():
        raise ValueError("host side")

    with pytest.raises(timing.CallFailed) as e:
        timing.time_interleaved([lambda: torch.cuda._sleep(cycles), boom], cfg)
    assert e.value.index == 1 and isinstance(e.value.error, ValueError)


@pytest.mark.gpu
def test_gpu_bench_cuda_graph_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = [
        "--workloads",
        "cpu_b2_q64_p64",
        "--backends",
        "cudnn,triton,fa3-varlen,fa2-varlen",
        "--cuda-graph",
    ]
    rc = cli.main([*args, "--reps", "3", "--out-json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = _rows(out)
    for r in rows:
        assert r["cuda_graph"] is True and r["lengths_on"] == "device", r
        assert r.get("skipped") or (r["ok"] is True and r["timer"].startswith("cuda-graph replay")), r
    ran = {r["backend"] for r in rows if not r.get("skipped")}
    assert {"cudnn", "triton"} <= ran, ran  # (the references may be missing; our backends may not)


@pytest.mark.gpu
def test_gpu_layers_smoke(tmp_path, capsys):
    out = tmp_path / "l.json"
    rc = cli.main(
        [
            "--layers",
            "4",
            "--workloads",
            "b128_q128,ragged_b32_devoffsets",
            "--reps",
            "2",
            "--out-json",
            str(out),
        ]
    )
    assert rc == 0, capsys.readouterr().out
    for r in _rows(out):
        if r.get("skipped"):
            continue
        assert r["ok"] is True and r["device_us"] > 0 and r["wall_us"] > 0 and r["wall_over_device"] > 0.5, r


@pytest.mark.gpu
def test_gpu_serving_smoke(tmp_path, capsys):
    out = tmp_path / "s.json"
    args = ["--serving", "6", "--serving-warmup", "2", "--serving-checks", "1", "--out-json", str(out)]
    gc.collect()  # earlier tests' cyclic garbage would otherwise be freed inside the loop (a negative growth)
    rc = cli.main(args)
    text = capsys.readouterr().out
    assert rc == 0, text
    for r in _rows(out):
        if r.get("skipped"):
            continue
        assert r["p50_ms"] > 0 and r["gpu_p50_ms"] > 0 and r["ok"] is True, r
        assert r["mem_end_mib"] > 0 and r["mem_growth_mib"] < 64, r


def _three_rows() -> tuple[list[dict], list]:
    """Rows x, y, z of one workload and their pending calls (each returns its name): x has an fp8
    run's 16-bit call too, z fails when timed."""
    rows = [dict(workload="w", backend=n, timer="eager") for n in ("x", "y", "z")]
    pending = [
        (rows[0], [("ms", lambda: "a"), ("wide_ms", lambda: "a16")]),
        (rows[1], [("ms", lambda: "b")]),
        (rows[2], [("ms", lambda: "bad")]),
    ]
    return rows, pending


def test_backends_are_timed_in_turn(monkeypatch):
    """Each workload's backends are timed round by round, in turn (so that a drift of the GPU's clocks
    reaches every backend alike), and each row reads the median of its rounds; a call that fails while
    timed marks its own row only."""
    order: list[str] = []
    drift = iter(range(100))

    def fake_time_gpu(fn, cfg, say):
        order.append(fn())
        if fn() == "bad":
            raise RuntimeError("boom")
        return 1.0 + {"a": 0.0, "b": 10.0, "a16": 20.0}[fn()] + next(drift), 7, "fake-timer"

    monkeypatch.setattr(sweep.timing, "time_gpu", fake_time_gpu)
    monkeypatch.setattr(sweep, "cuda_healthy", lambda: True)
    rows, pending = _three_rows()
    args = cli.build_parser().parse_args(["--rounds", "3", "--timer", "events"])
    sweep.time_in_turn(pending, args, Progress(0, "t"))
    assert order == ["a", "a16", "b", "bad"] + ["a", "a16", "b"] * 2
    # (the drift adds 0, 1, 2, ... in call order: a reads 1, 4, 7; a16 22, 25, 28; b 13, 16, 19)
    assert rows[0]["ms"] == 4.0 and rows[0]["wide_ms"] == 25.0 and rows[1]["ms"] == 16.0
    assert rows[0]["round_ms"] == [1.0, 4.0, 7.0] and rows[1]["round_ms"] == [13.0, 16.0, 19.0]
    note = sweep.round_spread_note(rows)  # (a: 7 / 1, b: 19 / 13; the failed row has none)
    assert note.startswith("round spread") and "median 4.231x over 2 rows" in note, note
    assert "largest 7.000x (w / x: 1.000-7.000 ms)" in note, note
    assert sweep.round_spread_note([dict(workload="w", backend="x", round_ms=[2.0])]) is None
    assert rows[0]["reps"] == 21 and rows[0]["timer"] == "fake-timer, 3 rounds in turn"
    assert rows[2]["ms"] is None and "boom" in rows[2]["error"] and "error" not in rows[1]


def test_default_timer_runs_the_calls_run_by_run(monkeypatch):
    """With the default timer each round times all live calls of a workload together, run by run
    (``time_interleaved``); a call that raises on the host fails its own row and the round is timed
    again without it; an error surfacing at a synchronisation fails every row of that round; a
    single call left is timed alone."""
    seen: list[list[str]] = []
    drift = iter(range(100))

    def fake_interleaved(fns, cfg):
        names = [fn() for fn in fns]
        seen.append(names)
        if "bad" in names:
            raise sweep.timing.CallFailed(names.index("bad"), RuntimeError("boom"))
        d = next(drift)
        return [{"a": 1.0, "a16": 2.0, "b": 3.0}[x] + d for x in names], 9, "fake-interleaved"

    alone: list[str] = []
    monkeypatch.setattr(sweep.timing, "time_interleaved", fake_interleaved)
    monkeypatch.setattr(sweep.timing, "time_gpu", lambda fn, cfg, say: (alone.append(fn()) or 5.0, 4, "fake-alone"))
    monkeypatch.setattr(sweep, "cuda_healthy", lambda: True)
    rows, pending = _three_rows()
    args = cli.build_parser().parse_args(["--rounds", "3"])
    sweep.time_in_turn(pending, args, Progress(0, "t"))
    assert seen == [["a", "a16", "b", "bad"]] + [["a", "a16", "b"]] * 3 and not alone
    assert rows[0]["round_ms"] == [1.0, 2.0, 3.0] and rows[0]["ms"] == 2.0 and rows[0]["wide_ms"] == 3.0
    assert rows[1]["round_ms"] == [3.0, 4.0, 5.0] and rows[1]["reps"] == 27
    assert rows[1]["timer"] == "fake-interleaved, 3 rounds in turn"
    assert "boom" in rows[2]["error"] and rows[2]["ms"] is None and "error" not in rows[0]

    def sync_error(fns, cfg):
        raise RuntimeError("unspecified launch failure")

    monkeypatch.setattr(sweep.timing, "time_interleaved", sync_error)
    rows = [dict(workload="w", backend=n, timer="eager") for n in ("x", "y", "z")]
    pending = [(rows[0], [("ms", lambda: "a")]), (rows[1], [("ms", lambda: "b")])]
    sweep.time_in_turn(pending, args, Progress(0, "t"))
    assert all("launch failure" in r["error"] and r["ms"] is None for r in rows[:2])
    sweep.time_in_turn([(rows[2], [("ms", lambda: "c")])], args, Progress(0, "t"))  # (one call: timed alone)
    assert alone == ["c"] * 3 and rows[2]["ms"] == 5.0 and rows[2]["timer"] == "fake-alone, 3 rounds in turn"


def test_timing_in_turn_keeps_what_was_measured_when_the_context_breaks(monkeypatch):
    """A call that breaks the CUDA context while timed stops the rounds (the error propagates) but
    the rounds already measured stay in every row; the failing row carries the error."""
    calls = {"n": 0}

    def fake_time_gpu(fn, cfg, say):
        calls["n"] += 1
        if fn() == "b" and calls["n"] > 2:
            raise RuntimeError("illegal address")
        return {"a": 2.0, "b": 3.0}[fn()], None, "fake-timer"

    monkeypatch.setattr(sweep.timing, "time_gpu", fake_time_gpu)
    monkeypatch.setattr(sweep, "cuda_healthy", lambda: False)
    rows = [dict(workload="w", backend=n, timer="cuda-graph replay") for n in ("x", "y")]
    args = cli.build_parser().parse_args(["--rounds", "3", "--timer", "events"])
    with pytest.raises(RuntimeError, match="illegal address"):
        sweep.time_in_turn([(rows[0], [("ms", lambda: "a")]), (rows[1], [("ms", lambda: "b")])], args, Progress(0, "t"))
    assert rows[0]["ms"] == 2.0 and rows[0]["reps"] is None
    assert rows[0]["timer"] == "cuda-graph replay, fake-timer, 3 rounds in turn"
    assert rows[1]["ms"] is None and "illegal address" in rows[1]["error"]
