"""backend="auto" ordering (pure Python: runs on the CPU with stand-in batches)."""

from types import SimpleNamespace

import pytest
import torch

import pagedprefill
from pagedprefill.backends import auto_policy


def _batch(
    page_size=16,
    max_q=4096,
    max_kv=4096,
    dtype=torch.bfloat16,
    kv_dtype=None,
    paged=True,
    graph=0,
    d=128,
    dvo=None,
    causal=True,
):
    return SimpleNamespace(
        graph_mode=graph,
        paged=paged,
        page_size=page_size if paged else 0,
        max_q=max_q,
        max_kv=max_kv,
        causal=causal,
        head_dim_qk=d,
        head_dim_vo=d if dvo is None else dvo,
        q=torch.empty(0, dtype=dtype),
        k=torch.empty(0, dtype=kv_dtype or dtype),
    )


@pytest.fixture
def gluon(monkeypatch):
    """Stand-in for "the Hopper Gluon kernel serves this call" (it needs a real batch on an H200)."""
    serves = {"value": True}
    monkeypatch.setattr(auto_policy, "_gluon_serves", lambda batch: serves["value"])
    return serves


def test_prefills_of_512_tokens_and_more_prefer_triton_where_the_gluon_kernel_serves(gluon):
    """max_q >= 512 (causal or not, paged or ragged, chunked or not): every Dqk = Dvo workload
    measured 1.01-1.15x (page64_b16_q1k 1.01x / 1.04x)."""
    assert auto_policy.order(_batch())[0] == "triton"
    assert auto_policy.order(_batch(paged=False, max_q=4096, max_kv=4096))[0] == "triton"
    assert auto_policy.order(_batch(max_q=1024, max_kv=1024))[0] == "triton"  # llama8b_b16_q1k
    assert auto_policy.order(_batch(max_q=1024, max_kv=2048, page_size=64))[0] == "triton"
    assert auto_policy.order(_batch(max_q=2048, max_kv=2048, causal=False))[0] == "triton"
    assert auto_policy.order(_batch(max_q=512, max_kv=8192))[0] == "triton"  # chunked_b8_q512_p7680
    assert auto_policy.order(_batch(max_q=511, max_kv=8192))[0] == "cudnn"  # shorter: unmeasured
    assert auto_policy.order(_batch(max_q=16, max_kv=16, graph=1))[0] == "cudnn"
    gluon["value"] = False  # e.g. not an H200, head dim 96, knob gluon=0
    assert auto_policy.order(_batch())[0] == "cudnn"
    assert auto_policy.order(_batch(max_q=512, max_kv=8192))[0] == "cudnn"


def test_head_dim_64_prefers_triton_where_the_gluon_kernel_serves(gluon):
    assert auto_policy.order(_batch(max_q=128, max_kv=1024, d=64))[0] == "triton"
    gluon["value"] = False
    assert auto_policy.order(_batch(max_q=1024, max_kv=1024, d=64))[0] == "cudnn"


def test_causal_mla_prefills_of_512_tokens_and_more_prefer_triton_where_the_gluon_kernel_serves(gluon):
    assert auto_policy.order(_batch(d=192, dvo=128))[0] == "triton"  # 1.05-1.06x at max_q 4096
    assert auto_policy.order(_batch(d=192, dvo=128, max_q=511, max_kv=4096))[0] == "cudnn"  # unmeasured
    assert auto_policy.order(_batch(d=192, dvo=128, max_q=2048, causal=False))[0] == "cudnn"  # unmeasured
    assert auto_policy.order(_batch(d=192, dvo=128, page_size=1, causal=False))[0] == "triton"  # small pages
    gluon["value"] = False
    assert auto_policy.order(_batch(d=192, dvo=128))[0] == "cudnn"


def test_small_pages_and_fp8_prefer_triton(gluon):
    gluon["value"] = False
    assert auto_policy.order(_batch(page_size=1))[0] == "triton"
    assert auto_policy.order(_batch(page_size=8, graph=1))[0] == "triton"
    assert auto_policy.order(_batch(kv_dtype=torch.float8_e4m3fn))[0] == "triton"


def test_every_order_ends_with_the_reference(gluon):
    for b in (_batch(), _batch(page_size=1)):
        assert auto_policy.order(b)[-1] == "torch" and len(set(auto_policy.order(b))) == 3


def test_last_backend_reports_what_auto_picked_on_cpu():
    q = torch.randn(3, 2, 16)
    k = torch.randn(3, 1, 16)
    ws = torch.empty(4096, dtype=torch.uint8)
    pagedprefill.batch_prefill_with_kv_cache(
        q,
        k,
        k,
        0.25,
        ws,
        max_token_per_sequence=3,
        max_sequence_kv=3,
        actual_seq_lens_q=torch.tensor([3]),
        actual_seq_lens_kv=torch.tensor([3]),
        causal=True,
        return_lse=False,
    )
    assert pagedprefill.last_backend() == "torch"
