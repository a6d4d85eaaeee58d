"""``pagedprefill.workspace`` and the device metadata kernel: the table from device lengths matches its
torch definition for any (untrusted) values, and a workspace serves one call at a time."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from helpers import HAS_CUDA
from oracle import check, make_case

import pagedprefill
from pagedprefill import workspace
from pagedprefill.backends import torch_ref
from pagedprefill.kernels import metadata
from pagedprefill.workspace import meta_bytes


def _adversarial(rng: random.Random, n: int, scale: int, dtype: torch.dtype) -> torch.Tensor:
    """Device-held values are untrusted: negatives, zeros, in-range, huge, non-multiples; sometimes a
    strided view."""
    pool = [-(2**40), -7, -1, 0, 0, 1, 3, scale, scale * 2 + 1, 2**31 + 5, 2**40]
    vals = [rng.choice(pool) if rng.random() < 0.4 else rng.randint(0, 2 * scale) for _ in range(n)]
    if dtype == torch.int32:
        vals = [max(min(x, 2**31 - 1), -(2**31)) for x in vals]
    t = torch.tensor(vals, dtype=dtype)
    if rng.random() < 0.3:
        t = torch.stack([t, torch.full_like(t, -99)], 1)[:, 0]
    return t


@pytest.mark.needs_triton
@pytest.mark.skipif(HAS_CUDA, reason="runs the kernel in the CPU interpreter")
@pytest.mark.parametrize("seed", range(30))
def test_device_metadata_kernel_matches_its_torch_definition(seed):
    rng = random.Random(seed)
    bsz = rng.choice([1, 3, 7, 1100])  # 1100: more than one 1024-wide chunk (carried prefix sums)
    pages = rng.choice([0, 1, 2])
    dt = rng.choice([torch.int32, torch.int64])
    offsets = {}
    for name in ("q", "o", "k", "v", "stats"):
        if rng.random() < 0.5 and not (pages and name in ("k", "v")):
            offsets[name] = _adversarial(rng, bsz + 1, 40 * 64, dt)
    bounds = metadata.Bounds(
        max_q=8,
        max_kv=14,
        rows_q=rng.randint(0, 60),
        rows_o=rng.randint(0, 60),
        rows_k=rng.randint(0, 90),
        rows_v=rng.randint(0, 90),
        lse_numel=rng.randint(0, 400),
        lse_mode=rng.choice([0, 1, 2]),
        pages=pages,
        table_width=rng.randint(0, 5),
        table_stride=rng.randint(5, 9),
        num_indices=rng.randint(0, 50),
        page_size=rng.choice([1, 4]),
        num_heads=4,
        units=dict(q=rng.choice([1, 64]), o=64, k=32, v=32, stats=4),
    )
    if bounds.lse_mode == 2:  # (packed LSE rows are placed by stats offsets)
        offsets.setdefault("stats", _adversarial(rng, bsz + 1, 40 * 64, dt))
    else:
        offsets.pop("stats", None)
    lens_q, lens_kv = _adversarial(rng, bsz, 6, dt), _adversarial(rng, bsz, 12, dt)
    indptr = _adversarial(rng, bsz + 1, 20, dt) if pages == 2 else None
    last = _adversarial(rng, bsz, 4, dt) if pages == 2 else None
    want = torch.full((8, bsz), -5, dtype=torch.int32)
    metadata.device_table_torch(bounds, lens_q, lens_kv, offsets, indptr, last, want)
    got = torch.full((8, bsz), -5, dtype=torch.int32)
    metadata.device_table_triton(bounds, lens_q, lens_kv, offsets, indptr, last, got)
    assert torch.equal(got, want), (got, want)
    assert (want >= 0).all()


def test_meta_bytes_are_aligned():
    for b in (0, 1, 7, 100, 1000):
        assert meta_bytes(b) % 256 == 0 and meta_bytes(b) >= 8 * max(b, 1) * 4


def test_a_workspace_in_use_by_another_thread_is_refused(monkeypatch):
    """Two threads sharing one workspace at the same time would overwrite each other's metadata and
    scratch: the second call is refused with a clear error (and writes nothing); with a workspace of
    its own it runs; after the first call returns, the shared workspace is free again."""
    gate, entered = threading.Event(), threading.Event()
    real = torch_ref.TorchPlan.run

    def slow_run(self, t):
        if threading.current_thread().name == "first":
            entered.set()
            gate.wait(10)
        return real(self, t)

    monkeypatch.setattr(torch_ref.TorchPlan, "run", slow_run)
    a = make_case(1, lens_q=[3, 4], lens_kv=[5, 9], page_size=2, lens_on_device=False)
    b = make_case(2, lens_q=[2, 6], lens_kv=[7, 6], page_size=2)
    shared = a.kwargs["workspace_buffer"]
    results = {}
    t = threading.Thread(
        target=lambda: results.update(a=pagedprefill.cudnn_batch_prefill_with_kv_cache(**a.kwargs, backend="torch")),
        name="first",
    )
    t.start()
    assert entered.wait(10)
    before = b.kwargs["out"].clone()
    with pytest.raises(ValueError, match="^workspace_buffer: expected a workspace no other thread is using"):
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**dict(b.kwargs, workspace_buffer=shared), backend="torch")
    assert torch.equal(before, b.kwargs["out"]) or torch.isnan(b.kwargs["out"]).all()
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**b.kwargs, backend="torch")  # its own workspace
    check(b, out, lse, atol=2e-5)
    gate.set()
    t.join(10)
    check(a, *results["a"], atol=2e-5)
    b.kwargs["out"].fill_(float("nan"))
    b.kwargs["lse"].fill_(float("nan"))
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(
        **dict(b.kwargs, workspace_buffer=shared), backend="torch"
    )
    check(b, out, lse, atol=2e-5)


def test_empty_workspaces_are_never_held():
    """Every empty tensor has address 0: threads with their own empty workspaces (a backend that needs
    none) do not refuse each other."""
    mine = torch.empty(0, dtype=torch.uint8)
    assert workspace.acquire(mine)  # (as a nested hold: nothing to release)
    errors = []
    t = threading.Thread(target=lambda: errors.append(workspace.acquire(torch.empty(0, dtype=torch.uint8))))
    t.start()
    t.join()
    assert errors == [True]


def test_hold_is_reentrant_in_one_thread_and_refused_to_another():
    ws = torch.empty(16, dtype=torch.uint8)
    assert not workspace.acquire(ws)  # the outer hold
    assert workspace.acquire(ws)  # a nested call on the same thread: not released by it
    errors = []

    def other():
        try:
            workspace.acquire(ws)
        except ValueError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and errors[0].startswith("workspace_buffer: expected a workspace no other thread is using")
    workspace.release(ws)
    t = threading.Thread(target=lambda: (workspace.acquire(ws), workspace.release(ws)))
    t.start()
    t.join()
    assert not workspace.acquire(ws)
    workspace.release(ws)
