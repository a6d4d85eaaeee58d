"""``pagedprefill.dispatch``: the registry, backend="auto"'s order and last_backend (CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import batch_of
from oracle import make_case

import pagedprefill
from pagedprefill import dispatch
from pagedprefill.backends import triton as tb


def _cuda_batch(**kw):
    """A real batch description, moved (on paper) to a CUDA device: the policy reads only the description."""
    base = dict(lens_q=[5, 7], lens_kv=[9, 20], hq=8, hkv=2, dqk=128, page_size=16, dtype=torch.float16)
    return dataclasses.replace(batch_of(make_case(1, **{**base, **kw})), device=torch.device("cuda", 0))


@pytest.fixture
def hopper(monkeypatch):
    """Stand-in for "the Hopper kernel serves this call" (that needs a real batch on an H200)."""
    serves = {"value": True}
    monkeypatch.setattr(tb, "uses_hopper_kernel", lambda batch, ws=None: serves["value"])
    return serves


def test_the_hopper_kernel_goes_first_wherever_it_serves(hopper):
    for kw in (
        {},
        dict(page_size=0),
        dict(causal=False),
        dict(dqk=64),
        dict(dqk=96),
        dict(dqk=192, dvo=128),
        dict(page_size=64),
    ):
        assert dispatch.auto_order(_cuda_batch(**kw)) == ["triton", "cudnn", "torch"], kw
    # D 256: Triton where its tiles come by TMA (two 64-key stages, K released apart from V: 1.04x
    # cuDNN); pages the TMA cannot box (48 tokens) take five 32-key stages, 0.97x: cuDNN first, but
    # soft-capping (cuDNN has none) still goes to Triton
    assert dispatch.auto_order(_cuda_batch(dqk=256))[0] == "triton"
    assert dispatch.auto_order(_cuda_batch(dqk=256, page_size=0))[0] == "triton"
    assert dispatch.auto_order(_cuda_batch(dqk=256, page_size=48))[0] == "cudnn"
    assert dispatch.auto_order(_cuda_batch(dqk=256, page_size=48, logits_soft_cap=30.0))[0] == "triton"
    hopper["value"] = False  # e.g. not an H200, head dim 80, split-KV chosen
    for kw in ({}, dict(dqk=96), dict(dqk=256), dict(page_size=0)):
        assert dispatch.auto_order(_cuda_batch(**kw))[0] == "cudnn", kw


def test_what_cudnn_cannot_do_well_or_at_all_goes_to_triton(hopper):
    hopper["value"] = False
    for kw in (
        dict(page_size=1),
        dict(page_size=8),
        dict(kv_dtype=torch.float8_e4m3fn),
        dict(dtype=torch.float8_e5m2, kv_dtype=torch.float8_e5m2),
        dict(logits_soft_cap=30.0),
    ):
        assert dispatch.auto_order(_cuda_batch(**kw))[0] == "triton", kw


def test_every_order_ends_with_the_reference(hopper):
    for b in (_cuda_batch(), _cuda_batch(page_size=1)):
        order = dispatch.auto_order(b)
        assert order[-1] == "torch" and len(set(order)) == 3
    assert dispatch.auto_order(batch_of(make_case(1, lens_q=[2], lens_kv=[3]))) == ["torch"]  # CPU


def test_unknown_backend_names_the_choices():
    for bad in ("cuda", "TORCH", "", 3):
        with pytest.raises(ValueError, match=r"^backend: expected one of \('auto', 'cudnn', 'triton', 'torch'\)"):
            dispatch.check_backend(bad)
    assert dispatch.check_backend(None) == "auto"


def test_auto_reports_why_nothing_serves(monkeypatch):
    case = make_case(2, lens_q=[3], lens_kv=[5], page_size=2, dtype=torch.bfloat16)  # (bf16: no interpreter)
    batch = batch_of(case)
    monkeypatch.setattr(dispatch, "auto_order", lambda batch, ws=None: ["cudnn", "triton"])
    with pytest.raises(ValueError, match="no backend can serve this call.*cudnn: needs a CUDA GPU; triton: "):
        dispatch.choose(batch, "auto")


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
