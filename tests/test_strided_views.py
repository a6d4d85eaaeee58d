"""q as a slice of a fused QKV projection and out as a view with padded rows: every backend must
read and write through the real strides (and leave the padding alone)."""

import os

import pytest
import torch
from oracle import check, make_case, poison

import pagedprefill

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
BACKENDS = ["torch", "triton"] + (["cudnn"] if HAS_CUDA else [])


def _dtype_and_atol(backend: str) -> tuple[torch.dtype, float]:
    """The data dtype for ``backend`` here (bf16 on a GPU; fp16 in Triton's interpreter, which gets bf16
    dots wrong; else float32) and its tolerance against the oracle."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float16 if backend == "triton" else torch.float32
    return dtype, {torch.bfloat16: 2e-2, torch.float16: 5e-3}.get(dtype, 1e-4)


def _available(backend: str) -> bool:
    if backend == "triton" and not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [0, 16])
def test_fused_qkv_slice_and_padded_out(backend, page_size):
    if not _available(backend):
        pytest.skip("triton needs a GPU or TRITON_INTERPRET=1")
    dtype, atol = _dtype_and_atol(backend)
    hq, hkv, d = 4, 2, 64
    case = make_case(
        70 + page_size,
        lens_q=[9, 4, 13],
        lens_kv=[20, 4, 29],
        hq=hq,
        hkv=hkv,
        dqk=d,
        page_size=page_size,
        dtype=dtype,
        device=DEVICE,
    )
    q = case.kwargs["q"]
    fused = torch.randn(q.shape[0], hq + 2 * hkv, d, dtype=torch.float32).to(dtype).to(DEVICE)
    fused[:, :hq] = q
    q_view = fused[:, :hq]  # row stride (Hq + 2 Hkv) * D
    out_buf = poison(torch.empty(q.shape[0], hq, d + 32, dtype=dtype, device=DEVICE))
    out_view = out_buf[..., :d]  # head stride D + 32
    kw = dict(case.kwargs, q=q_view, out=out_view)
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend=backend)
    assert out.data_ptr() == out_view.data_ptr()
    check(case, out, lse, atol=atol, lse_atol=atol)
    assert torch.isnan(out_buf[..., d:].float()).all(), "the padding after each head was written"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("api", ["one-shot", "plan.run", "split-kv"])
def test_strided_sinks(backend, api):
    """sinks as every other entry of a larger tensor (stride 2), the entries between them huge: the
    kernels must see the sinks' values, not the memory after the first one."""
    if not _available(backend):
        pytest.skip("triton needs a GPU or TRITON_INTERPRET=1")
    if api == "split-kv" and backend != "triton":
        pytest.skip("split-KV is the Triton backend's")
    dtype, atol = _dtype_and_atol(backend)
    hq = 6
    case = make_case(
        91,
        lens_q=[5, 1, 12],
        lens_kv=[40, 7, 12],
        hq=hq,
        hkv=2,
        page_size=4,
        dtype=dtype,
        causal=True,
        sinks=True,
        device=DEVICE,
    )
    kw = case.kwargs
    wide = torch.full((2 * hq,), 1e4, dtype=torch.float32, device=DEVICE)
    wide[::2] = kw["sinks"]
    strided = wide[::2]
    assert strided.stride() == (2,) and torch.equal(strided, kw["sinks"])
    poison(kw["out"])
    poison(kw["lse"])
    if api == "plan.run":
        from helpers import plan_of

        p = plan_of(case, backend)
        for _ in range(2):  # (the second run: the layout kept from the first)
            out, lse = p.run(kw["q"], kw["k_cache"], kw["v_cache"], kw["out"], kw["lse"], sinks=strided)
            check(case, out, lse, atol=atol, lse_atol=atol)
        return
    from pagedprefill import tuning

    knobs = dict(num_splits=3) if api == "split-kv" else {}
    with tuning.override("triton", **knobs):
        out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**dict(kw, sinks=strided), backend=backend)
    check(case, out, lse, atol=atol, lse_atol=atol)
