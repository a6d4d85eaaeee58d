"""Host µs of each stage of a CACHED call (GPU machine), timed with perf_counter in loops of 300,
no profiler: what a repeated call with the same layout and lengths spends where.

Usage: python scripts/host_stages.py [workload] [backend ...]   (default llama8b_b16_q1k cudnn triton)
"""

from __future__ import annotations

import sys

import torch

from pagedprefill import api, cudnn_batch_prefill_with_kv_cache
from pagedprefill import workloads as wl
from pagedprefill.bench import host_time_ms

N = 300


def us(fn, n: int = N) -> float:
    for _ in range(10):
        fn()
    return host_time_ms(fn, n) * 1e3


def stages(name: str, case: dict, backend: str) -> None:
    kw = dict(case, backend=backend)
    cudnn_batch_prefill_with_kv_cache(**kw)
    sig_args = (
        case["q"], case["k_cache"], case["v_cache"], case["scale"], case["workspace_buffer"],
        case["max_token_per_sequence"], case["max_sequence_kv"], case.get("actual_seq_lens_q"),
        case.get("actual_seq_lens_kv"), case.get("block_tables"), case["causal"], case["return_lse"],
        (case.get("q_scale"), case.get("k_scale"), case.get("v_scale")),
        (case.get("batch_offsets_q"), case.get("batch_offsets_o"), case.get("batch_offsets_k"),
         case.get("batch_offsets_v"), case.get("batch_offsets_stats")),
        case.get("batch_offsets_units", "elements"), case.get("out"), case.get("lse"),
        case.get("is_cuda_graph_compatible", False), backend, case.get("o_data_type"),
    )  # fmt: skip
    key = api._call_signature(*sig_args)
    plan = api._PLANS[key]
    q, k, v, out, lse = case["q"], case["k_cache"], case["v_cache"], case.get("out"), case.get("lse")
    batch = object.__new__(api.PrefillBatch)
    batch.__dict__.update(plan.template.__dict__)
    batch.q, batch.k, batch.v, batch.out = q, k, v, out
    batch.lse = lse.view(-1) if lse is not None else None
    rows = {
        "public call": lambda: cudnn_batch_prefill_with_kv_cache(**kw),
        "  _call_signature": lambda: api._call_signature(*sig_args),
        "  _CallPlan.run": lambda: plan.run(q, k, v, out, lse),
        "    _write_metadata": lambda: api._write_metadata(batch, plan.staged),
        "    backend run": lambda: plan.module.run(batch),
    }
    if backend == "cudnn":
        from pagedprefill.backends import cudnn_backend as cb

        p = cb._plan_for(batch)
        views = cb._views(batch, p)
        rows.update(
            {
                "      _plan_for": lambda: cb._plan_for(batch),
                "      _views": lambda: cb._views(batch, p),
                "      _prepare (Triton launch)": lambda: cb._prepare(batch, p, views),
                "      _execute_cudnn": lambda: cb._execute_cudnn(p, batch, views),
                "      bare graph execute": cb.bare_graph(batch),
            }
        )
    print(f"== {name} / {backend}: host µs per call (cached path, {N} calls per row)")
    for label, fn in rows.items():
        print(f"  {label:32s} {us(fn):8.1f}")


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "llama8b_b16_q1k"
    case = wl.build_case(wl.get_workload(name), "cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for be in sys.argv[2:] or ["cudnn", "triton"]:
        stages(name, case, be)


if __name__ == "__main__":
    main()
