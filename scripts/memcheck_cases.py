"""Small calls through every kernel path, each checked against the torch backend: run under
``compute-sanitizer --tool memcheck`` (scripts/gpu_session.sh memcheck) with the caching allocator
off, so that every tensor is its own allocation and any access outside one is reported.

Paths: the Hopper kernel (TMA and cp.async K/V, TMA copies from one issuing warp, fp8 K/V through
its staging slots (filled by one issuing warp at D 64 / 96), Q by TMA and by the consumers, static and
dynamic scheduling, a last round split into shares and their merge, window / soft-cap / sinks), the
portable kernel (paged,
ragged, split-KV, fp8, D 96 / 256, CSR pages), the device metadata kernel (device lengths and
offsets, untrusted values), the cuDNN preparation kernel and graph, and the merge kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import atol_for  # noqa: E402
from oracle import check, make_case  # noqa: E402

import pagedprefill  # noqa: E402
from pagedprefill import tuning  # noqa: E402

BF16, F16, E4M3 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


def compare(case, backend: str, knobs: dict | None, atol: float) -> None:
    """Run the case on ``backend`` and check it against the float64 oracle (which also checks that
    rows outside every sequence kept their poison). ``knobs``: Triton knobs, and the Hopper kernel's
    under the key ``"hopper_knobs"``."""
    knobs = dict(knobs or {})
    hopper = knobs.pop("hopper_knobs", {})
    for _ in range(2):  # (the second call: cuDNN's raw execution, Triton's bound launch)
        with tuning.override("triton", **knobs), tuning.override("hopper", **hopper):
            out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend=backend)
        torch.cuda.synchronize()
        check(case, out, lse, atol=atol, lse_atol=max(atol, 2e-2))


def main() -> int:
    cases = []
    base = dict(lens_q=[70, 0, 33, 5], lens_kv=[300, 4, 33, 0], hq=8, hkv=2, device="cuda")
    for name, extra, backend, knobs in [
        ("hopper paged16 tma", dict(dqk=128, page_size=16, dtype=BF16), "triton", None),
        ("hopper paged64 tma (a page a tile)", dict(dqk=128, page_size=64, dtype=BF16), "triton", None),
        (
            "hopper paged128 tma two consumers",
            dict(dqk=128, page_size=128, dtype=F16, lens_q=[60, 0, 33, 5]),
            "triton",
            None,
        ),
        ("hopper ragged dqk192", dict(dqk=192, dvo=128, page_size=0, dtype=BF16), "triton", None),
        (
            "hopper d64 paged16 two consumers",
            dict(dqk=64, page_size=16, dtype=BF16, lens_q=[30, 0, 17, 5]),
            "triton",
            None,
        ),
        (
            "hopper fp8kv paged16 two consumers",
            dict(dqk=128, page_size=16, dtype=BF16, kv_dtype=E4M3, lens_q=[30, 0, 17, 5]),
            "triton",
            None,
        ),
        (
            "hopper fp8kv d96 paged16 two consumers",
            dict(dqk=96, page_size=16, dtype=BF16, kv_dtype=E4M3, lens_q=[30, 0, 17, 5]),
            "triton",
            None,
        ),
        ("hopper page1 cp.async gqa3", dict(dqk=64, page_size=1, dtype=F16, hq=6, hkv=2), "triton", None),
        (
            "hopper d64 paged16 tma row sums",
            dict(dqk=64, page_size=16, dtype=BF16),
            "triton",
            dict(hopper_knobs=dict(rowsum=1)),
        ),
        ("hopper d96 paged16 tma 64+32", dict(dqk=96, page_size=16, dtype=BF16), "triton", None),
        (
            "hopper d256 ragged split stages, work counter",
            dict(dqk=256, page_size=0, dtype=BF16),
            "triton",
            dict(hopper_knobs=dict(dynamic=1)),
        ),
        ("hopper d96 page1 cp.async gqa3", dict(dqk=96, page_size=1, dtype=F16, hq=6, hkv=2), "triton", None),
        ("hopper d256 paged16 tma", dict(dqk=256, page_size=16, dtype=BF16), "triton", None),
        ("hopper d256 ragged", dict(dqk=256, page_size=0, dtype=F16), "triton", None),
        (
            "hopper shares of the last round",
            dict(dqk=128, page_size=16, dtype=BF16),
            "triton",
            dict(num_splits=1, hopper_knobs=dict(dynamic=0, shares=3)),
        ),
        (
            "hopper shares d256 ragged",
            dict(dqk=256, page_size=0, dtype=F16),
            "triton",
            dict(num_splits=1, hopper_knobs=dict(dynamic=0, shares=2)),
        ),
        (
            "hopper window softcap sinks",
            dict(dqk=128, page_size=16, dtype=BF16, window_left=40, logits_soft_cap=30.0, sinks=True),
            "triton",
            None,
        ),
        ("hopper fp8kv paged16 tma staging", dict(dqk=128, page_size=16, dtype=BF16, kv_dtype=E4M3), "triton", None),
        (
            "hopper fp8kv d96 page1 gqa3",
            dict(dqk=96, page_size=1, dtype=F16, hq=6, hkv=2, kv_dtype=E4M3),
            "triton",
            None,
        ),
        ("hopper fp8kv d256 ragged", dict(dqk=256, page_size=0, dtype=BF16, kv_dtype=E4M3), "triton", None),
        (
            "hopper fp8kv d64 paged16 issuing warp",
            dict(dqk=64, page_size=16, dtype=BF16, kv_dtype=E4M3),
            "triton",
            dict(hopper_knobs=dict(dynamic=1)),
        ),
        (
            "hopper fp8kv d96 ragged issuing warp gqa3",
            dict(dqk=96, page_size=0, dtype=F16, hq=6, hkv=2, kv_dtype=E4M3),
            "triton",
            dict(hopper_knobs=dict(dynamic=0)),
        ),
        (
            "hopper fp8 qkv paged16 tma",
            dict(dqk=128, page_size=16, dtype=E4M3, kv_dtype=E4M3),
            "triton",
            dict(num_splits=1),
        ),
        (
            "hopper fp8 qkv d64 page1 gqa3",
            dict(dqk=64, page_size=1, dtype=E4M3, hq=6, hkv=2),
            "triton",
            dict(num_splits=1),
        ),
        ("hopper fp8 qkv ragged", dict(dqk=128, page_size=0, dtype=E4M3, kv_dtype=E4M3), "triton", dict(num_splits=1)),
        ("fa2 d96 fp8kv", dict(dqk=96, page_size=16, dtype=BF16, kv_dtype=E4M3), "triton", dict(hopper=0)),
        ("fa2 d256 fp8", dict(dqk=256, page_size=0, dtype=E4M3, kv_dtype=E4M3), "triton", None),
        (
            "fa2 split window sinks",
            dict(dqk=128, page_size=16, dtype=BF16, window_left=64, sinks=True),
            "triton",
            dict(num_splits=3, hopper=0),
        ),
        (
            "device lengths + offsets",
            dict(
                dqk=128,
                page_size=16,
                dtype=BF16,
                lens_on_device=True,
                offsets="elements",
                gaps=True,
                lse_layout="packed",
            ),
            "triton",
            None,
        ),
        (
            "hopper device vectors ragged",
            dict(dqk=128, page_size=0, dtype=BF16, lens_on_device=True, offsets="tokens"),
            "triton",
            None,
        ),
        (
            "hopper device vectors + shares",
            dict(dqk=128, page_size=16, dtype=BF16, lens_on_device=True, offsets="elements"),
            "triton",
            dict(num_splits=1, hopper_knobs=dict(dynamic=0, shares=3)),
        ),
        ("cudnn paged", dict(dqk=128, page_size=16, dtype=BF16), "cudnn", None),
        ("cudnn ragged device lengths", dict(dqk=128, page_size=0, dtype=BF16, lens_on_device=True), "cudnn", None),
        ("cudnn empty operand", dict(dqk=128, page_size=0, dtype=BF16, lens_q=[7], lens_kv=[0]), "cudnn", None),
    ]:
        opts = {**base, **extra}
        atol = atol_for(opts["dtype"], opts.get("kv_dtype"))
        cases.append((name, make_case(3, **opts), backend, knobs, atol))
    failed = 0
    for name, case, backend, knobs, atol in cases:
        try:
            compare(case, backend, knobs, atol)
        except ValueError as e:  # a backend refusing a variant is fine here; memory errors are not
            print(f"{name:34s} refused: {str(e)[:90]}", flush=True)
            continue
        except AssertionError as e:
            failed += 1
            print(f"{name:34s} WRONG: {e}", flush=True)
            continue
        print(f"{name:34s} matches the float64 oracle (atol {atol:g})", flush=True)
    va, vb = (torch.randn(257, 8, 128, device="cuda", dtype=BF16) for _ in range(2))
    sa, sb = (torch.randn(257, 8, device="cuda") for _ in range(2))
    pagedprefill.merge_state(va, sa, vb, sb)
    pagedprefill.merge_states(torch.stack([va, vb], 1), torch.stack([sa, sb], 1))
    torch.cuda.synchronize()
    print(f"merge kernels ran; {failed} case(s) wrong", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
