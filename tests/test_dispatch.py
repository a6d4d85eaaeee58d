"""``pagedprefill.dispatch``: the registry, backend="auto"'s order and last_backend (CPU)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers import batch_of
from oracle import make_case

import pagedprefill
from pagedprefill import dispatch
from pagedprefill.backends import triton as tb
from pagedprefill.backends.triton import hopper as hp


def _cuda_batch(busy=True, host_lens=None, **kw):
    """A real batch description, moved (on paper) to a CUDA device: the policy reads only the
    description. ``busy``: its host lengths read as two 8k prompts (enough key tiles per program
    that the few-tiles rule does not apply); ``host_lens``: ``(lens_q, lens_kv)`` they read as
    instead (the policy's inputs without the tensors' memory)."""
    base = dict(lens_q=[5, 7], lens_kv=[9, 20], hq=8, hkv=2, dqk=128, page_size=16, dtype=torch.float16)
    b = dataclasses.replace(batch_of(make_case(1, **{**base, **kw})), device=torch.device("cuda", 0))
    if busy or host_lens is not None:
        lq, lkv = host_lens if host_lens is not None else ((8192, 8192), (8192, 8192))
        b = dataclasses.replace(b, host=dataclasses.replace(b.host, lens_q=tuple(lq), lens_kv=tuple(lkv)))
    return b


@pytest.fixture
def hopper(monkeypatch):
    """Stand-in for "the Hopper kernel serves this call" (that needs a real batch on an H200), on an
    H200's 132 programs."""
    serves = {"value": True}
    monkeypatch.setattr(tb, "uses_hopper_kernel", lambda batch, ws=None: serves["value"])
    monkeypatch.setattr(hp, "_num_sms", lambda device: 132)
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


def test_a_handful_of_short_prompts_goes_to_cudnn_at_d128(hopper):
    """At D 128 with 16-bit K/V, host lengths that leave each of the Hopper kernel's programs under
    FEW_TILES key tiles (measured 1.05-1.16x faster on cuDNN) go to cuDNN first, unless the call is
    under CUDNN_MIN_FLOPS (its kernel shorter than cuDNN's host time); more work, other head dims,
    device lengths and what cuDNN cannot serve stay on Triton."""
    lens = [1014, 792, 149, 352, 235, 547, 480, 390, 765, 790, 956, 621, 533, 614, 786, 733]  # (x_varlen_b16_q1k)
    small = dict(busy=False, host_lens=(lens, lens), hq=32, hkv=8)
    assert hp.tiles_per_program(_cuda_batch(**small), 132) < hp.FEW_TILES
    assert dispatch._host_flops(_cuda_batch(**small)) == pytest.approx(56.3e9, rel=2e-3)  # (its GFLOP)
    assert dispatch.auto_order(_cuda_batch(**small)) == ["cudnn", "triton", "torch"]
    assert dispatch.auto_order(_cuda_batch(**small, page_size=0))[0] == "cudnn"
    tiny = dict(small, host_lens=([634, 578, 344, 488],) * 2)  # (9 GFLOP: ~50 µs of kernel)
    assert hp.tiles_per_program(_cuda_batch(**tiny), 132) < hp.FEW_TILES
    assert dispatch._host_flops(_cuda_batch(**tiny)) < dispatch.CUDNN_MIN_FLOPS
    assert dispatch.auto_order(_cuda_batch(**tiny))[0] == "triton"
    big = dict(small, host_lens=([1024] * 16,) * 2)  # (llama8b_b16_q1k: 191 tiles, Triton 1.16x)
    assert hp.tiles_per_program(_cuda_batch(**big), 132) >= hp.FEW_TILES
    assert dispatch.auto_order(_cuda_batch(**big))[0] == "triton"
    unmeasured = (dict(page_size=64), dict(window_left=4), dict(sinks=True), dict(logits_soft_cap=30.0))
    for kw in (dict(dqk=64), dict(dqk=96), dict(kv_dtype=torch.float8_e4m3fn), dict(page_size=8), *unmeasured):
        assert dispatch.auto_order(_cuda_batch(**small, **kw))[0] == "triton", kw
    on_device = dataclasses.replace(_cuda_batch(**small), host=None)
    assert dispatch.auto_order(on_device)[0] == "triton"  # (device lengths: no sync to count them)


def test_few_tiles_closed_form_against_the_kernels_items():
    """tiles_per_program's closed form against the item-by-item count of the Hopper kernel's key
    ranges (192-row items, 64-key tiles; prefixes, none, and fewer keys than queries); the count may
    stop past its limit, never below it."""
    rng = random.Random(7)
    for _ in range(60):
        g, n = rng.choice([1, 3, 4, 7]), rng.randint(1, 12)
        lq = [rng.randint(0, 900) for _ in range(n)]
        lkv = [max(q + rng.choice([0, rng.randint(0, 2000), -rng.randint(0, q)]), 0) for q in lq]
        causal = rng.random() < 0.8
        b = _cuda_batch(busy=False, lens_q=lq, lens_kv=lkv, hq=2 * g, hkv=2, causal=causal)
        exact = 0
        for q, kv in zip(lq, lkv):
            for r in range(0, q * g, 192):
                hi = max(min(kv, min((r + 191) // g, q - 1) + kv - q + 1), 0) if causal else kv
                exact += -(-hi // 64)
        got = hp.tiles_per_program(b, 1) / 2
        items = sum(-(-q * g // 192) for q in lq)  # (the closed form takes half a tile of rounding each)
        assert abs(got - exact) <= 0.05 * exact + items / 2 + n, (lq, lkv, g, got, exact)
        if exact > 10:
            assert hp.tiles_per_program(b, 1, limit=10) > 10


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
    with pytest.raises(NotImplementedError, match="FlashInfer's backend='cubin'"):  # (its own selector's value)
        dispatch.check_backend("cubin")
    case = make_case(3, lens_q=[2], lens_kv=[5], page_size=2)
    with pytest.raises(NotImplementedError, match="cubin"):
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**{**case.kwargs, "backend": "cubin"})


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


def test_clear_caches_reaches_loaded_backends_only(monkeypatch):
    """``pagedprefill.clear_caches`` calls each imported backend module's ``clear_caches`` through the
    registry, and imports none that is not loaded."""
    import sys
    import types

    cleared = []
    fake = types.ModuleType("fake_cudnn")
    fake.clear_caches = lambda: cleared.append("cudnn")
    monkeypatch.setitem(sys.modules, dispatch._MODULES["cudnn"], fake)
    monkeypatch.delitem(sys.modules, dispatch._MODULES["torch"], raising=False)
    pagedprefill.clear_caches()
    assert cleared == ["cudnn"]
    assert dispatch._MODULES["torch"] not in sys.modules
