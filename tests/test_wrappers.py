"""FlashInfer's wrapper API (``pagedprefill.BatchPrefillWith*KVCacheWrapper``): plan / run with CSR pages
(partial last pages), both KV layouts, tuple and 5-D caches, base-2 LSEs, against the oracle."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from helpers import DEVICE, atol_for, csr_pages
from oracle import check, make_case, reference

import pagedprefill
from pagedprefill import flashinfer

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


def _case(seed=1, page_size=4, dtype=F32, **kw):
    base = dict(
        lens_q=[7, 3, 12, 1],
        lens_kv=[21, 3, 12, 30],
        hq=6,
        hkv=2,
        dqk=32,
        page_size=page_size,
        dtype=dtype,
        return_lse=False,
        with_out=False,
        device=DEVICE,
    )
    return make_case(seed, **{**base, **kw})


def _csr(case, partial: bool = True):
    """The case's pages as int32 CSR tensors; ``partial``: the case must have partial last pages."""
    indptr, indices, last = csr_pages(case)
    ps = case.kwargs["k_cache"].shape[2]
    assert not partial or any(x not in (0, ps) for x in last), "the case should have partial last pages"
    i32 = dict(dtype=torch.int32)
    return torch.tensor(indptr, **i32), torch.tensor(indices, **i32).to(DEVICE), torch.tensor(last, **i32)


def _qo_indptr(case):
    return torch.tensor([0, *torch.tensor(case.lens_q).cumsum(0).tolist()], dtype=torch.int32)


def _ref_lse_rows(case) -> torch.Tensor:
    """(total_q, Hq) natural-log reference LSE, rows packed by sequence."""
    case.kwargs["return_lse"] = True
    _, lses = reference(case)
    case.kwargs["return_lse"] = False
    hq, max_q = case.kwargs["q"].shape[1], case.kwargs["max_token_per_sequence"]
    rows = [lses[b * max_q * hq + i * hq] for b, n in enumerate(case.lens_q) for i in range(n)]
    return torch.stack(rows)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("packed_cache", [False, True])
def test_paged_wrapper_matches_the_oracle(backend, kv_layout, packed_cache):
    dtype = F16 if backend == "triton" else F32
    layout = {"NHD": "interleaved" if packed_cache else "nhd", "HND": "hnd"}[kv_layout]
    case = _case(dtype=dtype, kv_layout=layout)
    kw = case.kwargs
    k, v = kw["k_cache"], kw["v_cache"]  # (pages, Hkv, ps, D) views
    if kv_layout == "NHD":
        cache = (k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
        if packed_cache:  # the (pages, 2, ps, Hkv, D) buffer that K and V are views of
            base = k.permute(0, 2, 1, 3)
            between = (v.data_ptr() - k.data_ptr()) // k.element_size()
            cache = torch.as_strided(
                base,
                (base.shape[0], 2, *base.shape[1:]),
                (base.stride(0), between, *base.stride()[1:]),
                base.storage_offset(),
            )
            assert torch.equal(cache[:, 1], v.permute(0, 2, 1, 3))
    else:
        cache = torch.stack([k, v], 1) if packed_cache else (k, v)
    indptr, indices, last = _csr(case)
    ws = torch.empty(1 << 24, dtype=torch.uint8, device=DEVICE)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout, backend=backend)
    w.plan(
        _qo_indptr(case),
        indptr,
        indices,
        last,
        6,
        2,
        32,
        4,
        causal=kw["causal"],
        sm_scale=kw["scale"],
        q_data_type=dtype,
    )
    for _ in range(2):
        out, lse = w.run(kw["q"], cache, return_lse=True)
        check(case, out, None, atol=atol_for(dtype))
        ref = _ref_lse_rows(case)
        torch.testing.assert_close(lse.double().cpu() * math.log(2), ref, atol=2e-3, rtol=0)
    assert w.run(kw["q"], cache).shape == out.shape  # (return_lse=False: the output alone)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_ragged_wrapper_matches_the_oracle(kv_layout):
    case = _case(page_size=0)
    kw = case.kwargs
    k, v = kw["k_cache"], kw["v_cache"]
    if kv_layout == "HND":
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    kv_indptr = torch.tensor([0, *torch.tensor(case.lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    w = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"], kv_layout)
    w.plan(_qo_indptr(case), kv_indptr, 6, 2, 32, causal=kw["causal"], q_data_type="float32")
    out, lse = w.run(kw["q"], k, v, return_lse=True)
    check(case, out, None, atol=2e-5)
    torch.testing.assert_close(lse.double() * math.log(2), _ref_lse_rows(case), atol=1e-4, rtol=0)


def test_wrapper_and_one_shot_agree_and_merge_in_base_2():
    """The ragged wrapper (base-2 LSE) and the one-shot call (natural-log LSE) give one result on one
    batch, against the oracle; the wrapper's runs over two uneven parts of each sequence's keys merge
    into the whole with flashinfer.merge_state (base 2) and with pagedprefill.merge_state (natural log)."""
    case = _case(page_size=0, causal=False)
    kw = case.kwargs
    q, k, v = kw["q"], kw["k_cache"], kw["v_cache"]
    ln2 = math.log(2)
    starts = [0, *torch.tensor(case.lens_kv).cumsum(0).tolist()]
    cuts = [s + n // 3 + 1 for s, n in zip(starts, case.lens_kv)]  # (each part non-empty: every kv_len >= 3)

    def run(rows: list[range]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor([i for r in rows for i in r], dtype=torch.long, device=k.device)
        indptr = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()], dtype=torch.int32)
        w = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"])
        w.plan(_qo_indptr(case), indptr, 6, 2, 32, sm_scale=kw["scale"], q_data_type=F32)
        return w.run(q, k[idx], v[idx], return_lse=True)

    o, lse2 = run([range(a, b) for a, b in zip(starts, starts[1:])])
    check(case, o, None, atol=2e-5)
    torch.testing.assert_close(lse2.double().cpu() * ln2, _ref_lse_rows(case), atol=1e-4, rtol=0)
    one_o, one_lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**{**kw, "return_lse": True})
    hq = q.shape[1]
    one_rows = torch.cat([one_lse[b, :n] for b, n in enumerate(case.lens_q)]).view(-1, hq)
    torch.testing.assert_close(one_o, o, atol=1e-5, rtol=0)
    torch.testing.assert_close(one_rows, lse2 * ln2, atol=1e-5, rtol=0)
    oa, sa = run([range(a, c) for a, c in zip(starts, cuts)])
    ob, sb = run([range(c, b) for c, b in zip(cuts, starts[1:])])
    assert (sa - lse2).abs().max() > 0.1  # (a part's LSE is not the whole's)
    m, s = flashinfer.merge_state(oa, sa, ob, sb)
    torch.testing.assert_close(m, o, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, lse2, atol=1e-5, rtol=0)
    m, s = pagedprefill.merge_state(oa, sa * ln2, ob, sb * ln2)
    torch.testing.assert_close(m, o, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, lse2 * ln2, atol=1e-5, rtol=0)


def test_default_sm_scale_is_one_over_sqrt_head_dim_qk():
    """Without sm_scale both wrappers scale logits by 1/sqrt(head_dim_qk), whatever head_dim_vo is."""
    paged = _case(seed=3, dqk=48, dvo=16, causal=True)
    kw = paged.kwargs
    assert kw["scale"] == 1.0 / math.sqrt(48)
    indptr, indices, last = _csr(paged)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND")
    w.plan(_qo_indptr(paged), indptr, indices, last, 6, 2, 48, 4, causal=True, head_dim_vo=16, q_data_type=F32)
    check(paged, w.run(kw["q"], (kw["k_cache"], kw["v_cache"])), None, atol=2e-5)
    ragged = _case(seed=4, page_size=0, dqk=48, dvo=16, causal=True)
    kw = ragged.kwargs
    kv_indptr = torch.tensor([0, *torch.tensor(ragged.lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    r = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"])
    r.plan(_qo_indptr(ragged), kv_indptr, 6, 2, 48, 16, causal=True, q_data_type=F32)
    check(ragged, r.run(kw["q"], kw["k_cache"], kw["v_cache"]), None, atol=2e-5)


def test_window_override_at_run():
    case = _case(page_size=0, window_left=3)
    kw = case.kwargs
    kv_indptr = torch.tensor([0, *torch.tensor(case.lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    w = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"])
    w.plan(_qo_indptr(case), kv_indptr, 6, 2, 32, causal=kw["causal"], q_data_type=F32)  # no window planned
    out = w.run(kw["q"], kw["k_cache"], kw["v_cache"], window_left=3)
    check(case, out, None, atol=2e-5)


def _paged_wrapper(case, kv_layout="HND", **plan_kw):
    kw = case.kwargs
    indptr, indices, last = _csr(case, partial=kw["k_cache"].shape[2] > 1)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], kv_layout)
    ps = kw["k_cache"].shape[2]
    w.plan(_qo_indptr(case), indptr, indices, last, 6, 2, 32, ps, q_data_type=F32, causal=kw["causal"], **plan_kw)
    return w


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_paged_wrapper_takes_squeezed_page_size_1_caches(kv_layout):
    """FlashInfer's page-size-1 forms: a tuple of 3-D (pages, Hkv, D) tensors, or one 4-D
    (pages, 2, Hkv, D) tensor, with the page dimension implied."""
    case = _case(page_size=1, causal=True)
    kw = case.kwargs
    k, v = kw["k_cache"][:, :, 0], kw["v_cache"][:, :, 0]  # (pages, Hkv, D): one token a page
    w = _paged_wrapper(case, kv_layout)
    for cache in ((k, v), torch.stack([k, v], 1)):
        check(case, w.run(kw["q"], cache), None, atol=2e-5)


def test_paged_wrapper_lse_buffer_shape_and_uncovered_rows():
    """A caller's lse must be (q rows, Hq) float32; rows no sequence covers keep their contents
    (the base-2 conversion scales the covered rows alone)."""
    case = _case(causal=True)
    kw = case.kwargs
    cache = (kw["k_cache"], kw["v_cache"])
    w = _paged_wrapper(case)
    rows = sum(case.lens_q)
    q = torch.cat([kw["q"][:rows], torch.randn(5, 6, 32, dtype=F32, device=DEVICE)])  # 5 rows past the batch
    for bad in (torch.empty(rows + 5, 5), torch.empty((rows + 5) * 6), torch.empty(rows, 6)):
        with pytest.raises(ValueError, match=r"^lse: expected a float32 tensor of shape \(q rows, num_qo_heads\)"):
            w.run(q, cache, lse=bad, return_lse=True)
    lse = torch.full((rows + 5, 6), 7.0, device=DEVICE)
    out, got = w.run(q, cache, lse=lse, return_lse=True)
    assert got is lse
    assert (lse[rows:] == 7.0).all(), "uncovered LSE rows were written"
    torch.testing.assert_close(lse[:rows].double().cpu() * math.log(2), _ref_lse_rows(case), atol=2e-5, rtol=0)
    check(case, out[:rows], None, atol=2e-5)
    with pytest.raises(ValueError, match="^lse: expected None when return_lse=False"):  # (never ignored)
        w.run(q, cache, lse=lse)


@pytest.mark.parametrize("non_blocking", [True, False])
def test_cuda_graph_buffers_are_filled_as_plan_s_non_blocking_says(non_blocking, monkeypatch):
    """use_cuda_graph: plan copies the batch into the wrapper's buffers with FlashInfer's
    ``non_blocking`` (False: a caller may change its pinned host arrays right after plan)."""
    case = _case(causal=True)
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND", use_cuda_graph=True)
    seen = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor,
        "copy_",
        lambda self, src, non_blocking=False: seen.append(non_blocking) or real(self, src, non_blocking),
    )
    w.plan(
        _qo_indptr(case), indptr, indices, last, 6, 2, 32, 4, q_data_type=F32, causal=True, non_blocking=non_blocking
    )
    monkeypatch.undo()
    assert seen and set(seen) == {non_blocking}
    check(case, w.run(kw["q"], (kw["k_cache"], kw["v_cache"])), None, atol=2e-5)


def test_cuda_graph_buffers_given_are_the_ones_plan_fills_and_run_reads():
    """use_cuda_graph with the caller's four buffers (longer than the batch): plan writes the batch into
    them, and a run reads the page ids from them (two page ids swapped in the buffer, with the two
    pages' contents swapped in the cache, give the same result)."""
    case = _case(causal=True)
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    qo = _qo_indptr(case)
    given = {"qo_indptr": qo, "paged_kv_indptr": indptr, "paged_kv_indices": indices, "paged_kv_last_page_len": last}
    bufs = {f"{n}_buf": torch.full((t.numel() + 5,), -7, dtype=torch.int32, device=DEVICE) for n, t in given.items()}
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND", use_cuda_graph=True, **bufs)
    w.plan(qo, indptr, indices, last, 6, 2, 32, 4, q_data_type=F32, causal=True, sm_scale=kw["scale"])
    for n, t in given.items():
        assert torch.equal(bufs[f"{n}_buf"][: t.numel()].cpu(), t.cpu()), n
    cache = (kw["k_cache"], kw["v_cache"])
    check(case, w.run(kw["q"], cache), None, atol=2e-5)
    ids = bufs["paged_kv_indices_buf"]
    a, b = int(indices[0]), int(indices[-1])
    swapped = torch.where(ids == a, b, torch.where(ids == b, a, ids))
    ids.copy_(swapped)
    for c in cache:
        c[[a, b]] = c[[b, a]].clone()
    check(case, w.run(kw["q"], cache), None, atol=2e-5)


def test_paged_wrapper_lse_rows_read_on_the_device_with_cuda_graphs():
    """use_cuda_graph: the covered rows come from the indptr buffer a later plan refills (the same
    masked conversion a replay would run)."""
    case = _case(causal=True)
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND", use_cuda_graph=True)
    w.plan(_qo_indptr(case), indptr, indices, last, 6, 2, 32, 4, q_data_type=F32, causal=True)
    rows = sum(case.lens_q)
    q = torch.cat([kw["q"][:rows], torch.randn(3, 6, 32, dtype=F32, device=DEVICE)])
    lse = torch.full((rows + 3, 6), float("nan"), device=DEVICE)
    w.run(q, (kw["k_cache"], kw["v_cache"]), lse=lse, return_lse=True)
    assert torch.isnan(lse[rows:]).all()
    torch.testing.assert_close(lse[:rows].double().cpu() * math.log(2), _ref_lse_rows(case), atol=2e-5, rtol=0)


def test_deprecated_flashinfer_methods():
    """begin_forward, run_return_lse, forward / forward_return_lse (their causal, window, soft-cap
    and scale replace the plan's, for later runs too, as in FlashInfer, until the next plan),
    end_forward, is_cuda_graph_enabled, reset_workspace_buffer (plan again before the next run);
    rope_scale / rope_theta without RoPE taken (FlashInfer reads them only for ROPE_LLAMA);
    workspace_size refused by name."""
    causal = _case(causal=True)
    kw = causal.kwargs
    indptr, indices, last = _csr(causal)
    cache = (kw["k_cache"], kw["v_cache"])
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND")
    assert w.is_cuda_graph_enabled is False
    w.begin_forward(_qo_indptr(causal), indptr, indices, last, 6, 2, 32, 4, q_data_type=F32)  # not causal
    check(causal, w.forward(kw["q"], cache, causal=True, sm_scale=kw["scale"]), None, atol=2e-5)
    out, lse = w.forward_return_lse(kw["q"], cache, causal=True, sm_scale=kw["scale"])
    torch.testing.assert_close(lse.double().cpu() * math.log(2), _ref_lse_rows(causal), atol=2e-5, rtol=0)
    capped = _case(causal=True, logits_soft_cap=5.0, window_left=4)
    check(capped, w.forward(kw["q"], cache, True, window_left=4, logits_soft_cap=5.0), None, atol=2e-5)
    check(capped, w.run(kw["q"], cache), None, atol=2e-5)  # (a later run keeps the forward's settings)
    # (FlashInfer's record, which engines check before a run, says what the runs use: forward's settings)
    assert (w._causal, w._window_left, w._logits_soft_cap) == (True, 4, 5.0)
    assert w._sm_scale == pytest.approx(1 / math.sqrt(32))
    full = _case(causal=False)
    check(full, w.forward(kw["q"], cache, sm_scale=kw["scale"], rope_scale=1.0, rope_theta=1e4), None, atol=2e-5)
    o2, l2 = w.run_return_lse(kw["q"], cache)  # (the last forward's: not causal, no window)
    check(full, o2, None, atol=2e-5)
    torch.testing.assert_close(l2.double().cpu() * math.log(2), _ref_lse_rows(full), atol=2e-5, rtol=0)
    o3 = w.run_return_lse(kw["q"], cache, return_lse=False)  # (FlashInfer's partialmethod: the call's own wins)
    assert isinstance(o3, torch.Tensor)
    check(full, o3, None, atol=2e-5)
    with pytest.raises(NotImplementedError, match="pos_encoding_mode"):
        w.forward(kw["q"], cache, pos_encoding_mode="ROPE_LLAMA", rope_theta=1e4)
    with pytest.raises(NotImplementedError, match="workspace_size"):
        w.workspace_size(_qo_indptr(causal), indptr, indices, last, 6, 2, 32, 4)
    w.end_forward()
    w.reset_workspace_buffer(torch.empty_like(kw["workspace_buffer"]), torch.empty(8, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="plan"):
        w.run(kw["q"], cache)
    w.plan(_qo_indptr(causal), indptr, indices, last, 6, 2, 32, 4, q_data_type=F32, causal=True)
    check(causal, w.run(kw["q"], cache), None, atol=2e-5)
    w.forward(kw["q"], cache, causal=False, sm_scale=0.5)
    assert (w._causal, w._sm_scale) == (False, 0.5)
    w.plan(_qo_indptr(causal), indptr, indices, last, 6, 2, 32, 4, q_data_type=F32, causal=True)
    check(causal, w.run(kw["q"], cache), None, atol=2e-5)  # (a new plan's settings again)
    assert (w._causal, w._window_left, w._logits_soft_cap) == (True, -1, 0.0)


def test_errors_name_the_wrappers_own_arguments():
    """An argument the wrapper passes on under the library's name is named in errors as the caller
    wrote it (FlashInfer's paged_kv_* and o_indptr), at plan and at run time."""
    case = _case(causal=True)
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    ps = kw["k_cache"].shape[2]
    cache = (kw["k_cache"], kw["v_cache"])
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND")

    def plan(ip=indptr, ids=indices, lp=last):
        w.plan(_qo_indptr(case), ip, ids, lp, 6, 2, 32, ps, q_data_type=F32, causal=True)

    bad_last = last.clone()
    bad_last[0] = ps + 1
    with pytest.raises(ValueError, match="^paged_kv_last_page_len: expected values in"):
        plan(lp=bad_last)
    bad_ptr = indptr.clone()
    bad_ptr[-1] += 1
    with pytest.raises(ValueError, match="^paged_kv_indptr: expected"):
        plan(ip=bad_ptr)
    bad_ids = indices.clone()
    bad_ids[0] = kw["k_cache"].shape[0] + 5
    plan(ids=bad_ids)  # (ids on the device are checked against the cache at the run, on the host here)
    with pytest.raises(ValueError, match="^paged_kv_indices: expected page ids in"):
        w.run(kw["q"], cache)
    plan()
    check(case, w.run(kw["q"], cache), None, atol=2e-5)  # (the failed plans left nothing behind)
    r = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"], "NHD")
    i32 = dict(dtype=torch.int32)
    with pytest.raises(ValueError, match="^o_indptr: expected offsets whose sequences' output rows do not overlap"):
        r.plan(
            torch.tensor([0, 3, 6], **i32),
            torch.tensor([0, 4, 9], **i32),
            2,
            2,
            32,
            q_data_type=F32,
            o_indptr=torch.tensor([0, 2, 5], **i32),
        )


def test_paged_plan_checks_seq_lens_against_the_pages():
    """FlashInfer plans its KV lengths from seq_lens where given: beside CSR pages they must be the
    pages' lengths (never ignored); fixed_split_size -1 or 0 is FlashInfer's "off"; rope_scale /
    rope_theta without RoPE are no-ops there and taken here."""
    case = _case(causal=True)
    kw = case.kwargs
    w = _paged_wrapper(case, seq_lens=torch.tensor(case.lens_kv, dtype=torch.int32), fixed_split_size=-1)
    check(case, w.run(kw["q"], (kw["k_cache"], kw["v_cache"])), None, atol=2e-5)
    w = _paged_wrapper(case, fixed_split_size=0, rope_scale=1.0, rope_theta=1e4)
    check(case, w.run(kw["q"], (kw["k_cache"], kw["v_cache"])), None, atol=2e-5)
    with pytest.raises(NotImplementedError, match="fixed_split_size"):
        _paged_wrapper(case, fixed_split_size=64)
    wrong = torch.tensor(case.lens_kv, dtype=torch.int32) + 1
    with pytest.raises(ValueError, match="^seq_lens: expected the KV lengths of the CSR pages"):
        _paged_wrapper(case, seq_lens=wrong)


def test_ragged_run_takes_an_o_scale_of_one():
    case = _case(page_size=0)
    kw = case.kwargs
    kv_indptr = torch.tensor([0, *torch.tensor(case.lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    w = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"])
    w.plan(_qo_indptr(case), kv_indptr, 6, 2, 32, causal=kw["causal"], q_data_type=F32)
    check(case, w.run(kw["q"], kw["k_cache"], kw["v_cache"], o_scale=1.0), None, atol=2e-5)
    check(case, w.forward(kw["q"], kw["k_cache"], kw["v_cache"], causal=kw["causal"]), None, atol=2e-5)
    with pytest.raises(NotImplementedError, match="o_scale"):
        w.run(kw["q"], kw["k_cache"], kw["v_cache"], o_scale=2.0)


@pytest.mark.parametrize("seed", range(700, 716))
def test_wrappers_random_grid(seed):
    """Random batches through both wrappers against the oracle: page sizes 1-16 with partial last
    pages in shuffled CSR pages, both KV layouts, GQA 1-7, head dims 32-128 (Dqk != Dvo too), causal
    or not, windows, soft-caps, empty sequences, LSE in base 2, a caller's out and lse buffers."""
    r = random.Random(seed)
    b = r.randint(1, 5)
    lens_q = [r.choice([0, 1, 3, 7, 16, 33]) for _ in range(b)]
    lens_kv = [q + r.choice([0, 0, 5, 19, 40]) for q in lens_q]
    hkv = r.choice([1, 2])
    hq = hkv * r.choice([1, 2, 3, 5, 7])
    dqk = r.choice([32, 64, 128])
    dvo = r.choice([dqk, 32]) if dqk > 32 else dqk
    paged = seed % 4 != 3
    page = r.choice([1, 3, 4, 16]) if paged else 0
    layout = r.choice(["nhd", "hnd"])
    variants = {}
    if seed % 3 == 0:
        variants["window_left"] = r.choice([0, 5, 30])
    if seed % 5 == 1:
        variants["logits_soft_cap"] = 20.0
    case = make_case(
        seed,
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=hq,
        hkv=hkv,
        dqk=dqk,
        dvo=dvo,
        page_size=page,
        kv_layout=layout,
        causal=seed % 2 == 0,
        return_lse=False,
        with_out=False,
        device=DEVICE,
        **variants,
    )
    kw = case.kwargs
    k, v = kw["k_cache"], kw["v_cache"]
    kv_layout = "NHD" if layout == "nhd" else "HND"
    rows = sum(lens_q)
    common = dict(causal=kw["causal"], sm_scale=kw["scale"], q_data_type=F32, **variants)
    if paged:
        indptr, indices, last = _csr(case, partial=False)
        w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], kv_layout)
        w.plan(_qo_indptr(case), indptr, indices, last, hq, hkv, dqk, page, head_dim_vo=dvo, **common)
        cache = (k, v) if kv_layout == "HND" else (k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
        run = lambda **o: w.run(kw["q"][:rows], cache, **o)  # noqa: E731
    else:
        kv_indptr = torch.tensor([0, *torch.tensor(lens_kv).cumsum(0).tolist()], dtype=torch.int32)
        w = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"], kv_layout)
        w.plan(_qo_indptr(case), kv_indptr, hq, hkv, dqk, head_dim_vo=dvo, **common)
        if kv_layout == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        run = lambda **o: w.run(kw["q"][:rows], k, v, **o)  # noqa: E731
    out = torch.full((rows, hq, dvo), float("nan"), device=DEVICE)
    lse = torch.full((rows, hq), float("nan"), device=DEVICE)
    got, got_lse = run(out=out, lse=lse, return_lse=True)
    assert got is out and got_lse is lse
    check(case, out, None, atol=2e-5)
    if rows:
        torch.testing.assert_close(lse.double().cpu() * math.log(2), _ref_lse_rows(case), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "where, kwargs",
    [
        ("plan", dict(pos_encoding_mode="ROPE_LLAMA")),
        ("plan", dict(custom_mask=torch.ones(3))),
        ("plan", dict(use_fp16_qk_reduction=True)),
        ("plan", dict(fixed_split_size=64)),
        ("init", dict(jit_args=[1])),
        ("init", dict(custom_mask_buf=torch.ones(3))),
        ("init", dict(backend="trtllm-gen")),
        ("run", dict(kv_cache_sf=torch.ones(3))),
    ],
)
def test_unsupported_flashinfer_arguments_are_named(where, kwargs):
    case = _case()
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    name = next(iter(kwargs))
    with pytest.raises(NotImplementedError, match=name):
        w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(
            kw["workspace_buffer"], **(kwargs if where == "init" else {})
        )
        w.plan(
            _qo_indptr(case), indptr, indices, last, 6, 2, 32, 4, q_data_type=F32, **(kwargs if where == "plan" else {})
        )
        k = kw["k_cache"].permute(0, 2, 1, 3)
        w.run(kw["q"], (k, kw["v_cache"].permute(0, 2, 1, 3)), **(kwargs if where == "run" else {}))


@pytest.mark.parametrize(
    "where, kwargs",
    [
        ("plan", dict(packed_custom_mask=torch.ones(3, dtype=torch.uint8))),
        ("plan", dict(prefix_len_ptr=torch.ones(4, dtype=torch.int32))),
        ("plan", dict(token_pos_in_items_ptr=torch.ones(4, dtype=torch.int32))),
        ("plan", dict(max_item_len_ptr=torch.ones(4, dtype=torch.int32))),
        ("plan", dict(seq_lens=torch.ones(4, dtype=torch.int32))),
        ("plan", dict(seq_lens_q=torch.ones(4, dtype=torch.int32))),
        ("plan", dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0)),
        ("run", dict(kv_cache_sf=torch.ones(3))),
        ("run", dict(o_scale=0.5)),
    ],
)
def test_unsupported_ragged_arguments_are_named(where, kwargs):
    """The ragged wrapper refuses what it does not implement, each by name, with a tensor shown by its
    shape and dtype (never its values)."""
    case = _case(page_size=0)
    kw = case.kwargs
    kv_indptr = torch.tensor([0, *torch.tensor(case.lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    w = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"])
    name = next(iter(kwargs))
    with pytest.raises(NotImplementedError, match=f"FlashInfer's {name}=") as err:
        w.plan(_qo_indptr(case), kv_indptr, 6, 2, 32, q_data_type=F32, **(kwargs if where == "plan" else {}))
        w.run(kw["q"], kw["k_cache"], kw["v_cache"], **(kwargs if where == "run" else {}))
    if isinstance(kwargs[name], torch.Tensor):
        assert f"tensor of shape {tuple(kwargs[name].shape)}" in str(err.value) and "tensor([" not in str(err.value)


def test_positional_run_arguments_point_to_the_scale_keywords():
    """FlashInfer's fp8 route passes per-head q / k / v scales positionally after the cache: refused
    by name, pointing to this library's keywords, in both wrappers; the keywords serve."""
    case = _case()
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    cache = (kw["k_cache"].permute(0, 2, 1, 3), kw["v_cache"].permute(0, 2, 1, 3))
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "NHD")
    w.plan(_qo_indptr(case), indptr, indices, last, 6, 2, 32, 4, causal=kw["causal"], sm_scale=kw["scale"],
           q_data_type=F32)  # fmt: skip
    scales = [torch.ones(6), torch.ones(2), torch.ones(2)]
    with pytest.raises(
        NotImplementedError, match="extra positional run arguments.*got 3.*q_scale=, k_scale=, v_scale="
    ):
        w.run(kw["q"], cache, *scales)
    r = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"])
    kv = torch.tensor([0, *torch.tensor(case.lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    r.plan(_qo_indptr(case), kv, 6, 2, 32, q_data_type=F32)
    ragged = _case(page_size=0)
    with pytest.raises(NotImplementedError, match="got 1: tuple of 1: tensor of shape \\(6,\\)"):
        r.run(ragged.kwargs["q"], ragged.kwargs["k_cache"], ragged.kwargs["v_cache"], scales[0])
    check(case, w.run(kw["q"], cache, q_scale=1.0, k_scale=1.0, v_scale=1.0), None, atol=2e-5)


def test_an_8_bit_output_dtype_is_refused_at_plan():
    """o_data_type=float8 (FlashInfer takes it; no backend here writes an 8-bit O): refused by plan, in
    both wrappers, before any run."""
    case = _case()
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "NHD")
    e4m3 = torch.float8_e4m3fn
    with pytest.raises(NotImplementedError, match="^o_data_type: an 8-bit output"):
        w.plan(_qo_indptr(case), indptr, indices, last, 6, 2, 32, 4, q_data_type=e4m3, o_data_type=e4m3)
    r = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"])
    kv = torch.tensor([0, *torch.tensor(case.lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="^o_data_type: an 8-bit output"):
        r.plan(_qo_indptr(case), kv, 6, 2, 32, q_data_type=BF16, o_data_type="float8_e4m3fn")
    with pytest.raises(ValueError, match="^o_data_type: expected torch.float16"):
        r.plan(_qo_indptr(case), kv, 6, 2, 32, q_data_type=BF16, o_data_type=torch.int8)


def test_run_checks_the_planned_dtypes_and_layout():
    case = _case()
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "NHD")
    with pytest.raises(RuntimeError, match="plan"):
        w.run(kw["q"], (kw["k_cache"], kw["v_cache"]))
    w.plan(_qo_indptr(case), indptr, indices, last, 6, 2, 32, 4, q_data_type=F16)
    with pytest.raises(ValueError, match="^q: expected dtype torch.float16"):
        w.run(kw["q"], (kw["k_cache"].permute(0, 2, 1, 3), kw["v_cache"].permute(0, 2, 1, 3)))
    with pytest.raises(ValueError, match="^kv_layout"):
        pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "NDH")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton", "cudnn"])
def test_gpu_paged_wrapper_every_backend(backend):
    case = make_case(
        4,
        lens_q=[300, 5, 77],
        lens_kv=[900, 500, 77],
        hq=32,
        hkv=8,
        dqk=128,
        page_size=16,
        dtype=BF16,
        return_lse=False,
        with_out=False,
        device="cuda",
    )
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "NHD", backend=backend)
    cache = (kw["k_cache"].permute(0, 2, 1, 3), kw["v_cache"].permute(0, 2, 1, 3))
    plan = functools.partial(w.plan, _qo_indptr(case), indptr, indices, last, 32, 8, 128, 16, causal=True,
                             q_data_type=BF16)  # fmt: skip
    plan()
    if backend == "cudnn":  # cuDNN reads (B, width) tables, not CSR pages: refused by name ...
        with pytest.raises(ValueError, match="CSR"):
            w.run(kw["q"], cache)
        # ... and served in FlashInfer's cudnn form: KV lengths and the block table beside the CSR pages
        plan(seq_lens=torch.tensor(case.lens_kv, dtype=torch.int32, device="cuda"), block_tables=kw["block_tables"])
    out = torch.full_like(kw["q"], float("nan"))
    assert w.run(kw["q"], cache, out=out) is out
    check(case, out, None, atol=atol_for(BF16))
    if backend != "auto":
        assert pagedprefill.last_backend() == backend


@pytest.mark.gpu
def test_gpu_cuda_graph_wrapper_replays_after_replan():
    """use_cuda_graph: capture one run, re-plan with new lengths and pages (same batch size, within the
    first plan's bounds), replay: the right answer each time."""
    ws = torch.empty(1 << 26, dtype=torch.uint8, device="cuda")
    cases = [
        make_case(
            10 + i,
            lens_q=lq,
            lens_kv=lkv,
            hq=8,
            hkv=2,
            dqk=128,
            page_size=16,
            dtype=BF16,
            return_lse=False,
            with_out=False,
            device="cuda",
        )
        for i, (lq, lkv) in enumerate([([40, 3], [300, 90]), ([12, 40], [100, 256]), ([0, 7], [5, 40])])
    ]
    total_pages = max(c.kwargs["k_cache"].shape[0] for c in cases)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(
        ws,
        "HND",
        use_cuda_graph=True,
        paged_kv_indices_buf=torch.empty(total_pages, dtype=torch.int32, device="cuda"),
    )
    rows = max(c.kwargs["q"].shape[0] for c in cases)
    q = torch.empty(rows, 8, 128, dtype=BF16, device="cuda")
    k = torch.empty(total_pages, 2, 16, 128, dtype=BF16, device="cuda")
    v = torch.empty_like(k)
    out = torch.empty(rows, 8, 128, dtype=BF16, device="cuda")
    lse = torch.empty(rows, 8, dtype=torch.float32, device="cuda")

    def load(c):
        indptr, indices, last = _csr(c)
        w.plan(
            _qo_indptr(c),
            indptr,
            indices,
            last,
            8,
            2,
            128,
            16,
            causal=True,
            q_data_type=BF16,
            max_token_per_sequence=40,
            max_sequence_kv=300,
        )
        kw = c.kwargs
        q[: kw["q"].shape[0]].copy_(kw["q"])
        k[: kw["k_cache"].shape[0]].copy_(kw["k_cache"])
        v[: kw["v_cache"].shape[0]].copy_(kw["v_cache"])
        out.fill_(float("nan"))
        lse.fill_(float("nan"))

    load(cases[0])
    w.run(q, (k, v), out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, (k, v), out=out, lse=lse, return_lse=True)
    for c in cases[1:] + cases[:1]:
        load(c)
        graph.replay()
        torch.cuda.synchronize()
        rows = sum(c.lens_q)
        check(c, out[:rows].clone(), None, atol=atol_for(BF16))
        # (the base-2 scaling reads the rows it covers from the refilled indptr: the rest stay NaN)
        torch.testing.assert_close(lse[:rows].double().cpu() * math.log(2), _ref_lse_rows(c), atol=2e-2, rtol=0)
        assert torch.isnan(lse[rows:]).all()


def test_paged_plan_checks_csr_pages_beside_a_block_table():
    """FlashInfer's cudnn form (seq_lens + block_tables) beside the CSR arguments: the runs read the
    table, so the CSR pages must describe the same batch (lengths and page ids, on the host), never be
    ignored."""
    case = _case(causal=True)
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    indices, table = indices.cpu(), kw["block_tables"].cpu()
    lens = torch.tensor(case.lens_kv, dtype=torch.int32)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND")

    def plan(indptr=indptr, indices=indices, last=last, lens=lens):
        w.plan(_qo_indptr(case), indptr, indices, last, 6, 2, 32, 4, q_data_type=F32, causal=True,
               seq_lens=lens, block_tables=table)  # fmt: skip

    plan()
    check(case, w.run(kw["q"], (kw["k_cache"], kw["v_cache"])), None, atol=2e-5)
    other = indices.clone()
    other[1] = int(other[1]) + 1
    with pytest.raises(ValueError, match="^paged_kv_indices: expected sequence 0's page ids as in block_tables"):
        plan(indices=other)
    with pytest.raises(ValueError, match="^paged_kv_indices: expected a tensor"):
        plan(indices="garbage")
    with pytest.raises(ValueError, match="^seq_lens: expected the KV lengths of the CSR pages"):
        plan(lens=lens + 1)
    with pytest.raises(ValueError, match="^paged_kv_indptr"):
        plan(indptr=indptr[:-1])


def test_a_failed_plan_keeps_the_planned_dtypes():
    """A plan that raises leaves the wrapper as it was: its last plan still runs with that plan's q
    dtype (the failed one asked for another)."""
    case = _case(dtype=F16)
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND")
    plan = functools.partial(w.plan, _qo_indptr(case), indptr, indices, last, causal=kw["causal"],
                             sm_scale=kw["scale"])  # fmt: skip
    plan(6, 2, 32, 4, q_data_type=F16)
    with pytest.raises(ValueError, match="^num_qo_heads"):
        plan(5, 2, 32, 4, q_data_type=BF16, non_blocking=False)
    assert w._non_blocking is True
    check(case, w.run(kw["q"], (kw["k_cache"], kw["v_cache"])), None, atol=atol_for(F16))


def test_cudnn_form_checks_seq_lens_and_the_table_rows():
    """seq_lens + block_tables beside CSR pages: a seq_lens that is no length tensor, or a table whose
    rows are not the batch's, is named (never an IndexError or AttributeError)."""
    case = _case(causal=True)
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    table, lens = kw["block_tables"].cpu(), torch.tensor(case.lens_kv, dtype=torch.int32)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND")

    def plan(lens=lens, table=table):
        w.plan(_qo_indptr(case), indptr, indices.cpu(), last, 6, 2, 32, 4, q_data_type=F32, causal=True,
               seq_lens=lens, block_tables=table)  # fmt: skip

    with pytest.raises(ValueError, match="^seq_lens: expected an int32/int64 torch.Tensor"):
        plan(lens=list(case.lens_kv))
    with pytest.raises(ValueError, match="^seq_lens: expected 4 entries"):
        plan(lens=lens[:3])
    with pytest.raises(ValueError, match="^block_tables: expected a .B, width. tensor of page ids with B = 4 rows"):
        plan(table=table[:2])
    with pytest.raises(ValueError, match="^block_tables: expected a .B, width. tensor"):
        plan(table=table.reshape(-1))
    plan()
    check(case, w.run(kw["q"], (kw["k_cache"], kw["v_cache"])), None, atol=2e-5)


def test_plan_names_a_decreasing_indptr():
    case = _case()
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    bad = _qo_indptr(case)
    bad[2] = bad[1] - 1
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND")
    with pytest.raises(ValueError, match="^qo_indptr: expected non-decreasing entries"):
        w.plan(bad, indptr, indices, last, 6, 2, 32, 4, q_data_type=F32)
    r = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"])
    kv_bad = torch.tensor([0, 5, 3, 9, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="^kv_indptr: expected non-decreasing entries"):
        r.plan(_qo_indptr(case), kv_bad, 6, 2, 32, q_data_type=F32)


def test_run_checks_out_and_names_the_cache_as_flashinfer_does():
    """out: q's rows x Hq x Dvo in the planned output dtype (FlashInfer's check); an error about the
    cache names paged_kv_cache, the argument the caller passed."""
    case = _case()
    kw = case.kwargs
    w = _paged_wrapper(case)
    cache = (kw["k_cache"], kw["v_cache"])
    rows = kw["q"].shape[0]
    with pytest.raises(ValueError, match=r"^out: expected a tensor of shape \(q rows, num_qo_heads, head_dim_vo\)"):
        w.run(kw["q"], cache, out=torch.empty(rows + 3, 6, 32))
    with pytest.raises(ValueError, match="^out: expected dtype torch.float32"):
        w.run(kw["q"], cache, out=torch.empty(rows, 6, 32, dtype=F16))
    out = torch.full((rows, 6, 32), float("nan"))
    assert w.run(kw["q"], cache, out=out) is out
    check(case, out, None, atol=2e-5)
    with pytest.raises(ValueError, match=r"^paged_kv_cache \(k\): expected 2 heads") as e:
        w.run(kw["q"], (kw["k_cache"][:, :1], kw["v_cache"][:, :1]))
    assert "k_cache" not in str(e.value).replace("paged_kv_cache", "")
    with pytest.raises(ValueError, match=r"^paged_kv_cache: expected a \(k_cache, v_cache\) tuple") as e:
        w.run(kw["q"], (kw["k_cache"], kw["v_cache"], kw["v_cache"]))
    assert "tuple of 3: tensor of shape" in str(e.value) and "tensor([" not in str(e.value)  # (shapes, not values)


def test_paged_run_of_an_fp8_cache_without_scales_takes_scales_of_one():
    """FlashInfer: a k_scale / v_scale not given is 1.0."""
    case = _case(dtype=F16, kv_dtype=torch.float8_e4m3fn)
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND", backend="torch")
    fp8 = torch.float8_e4m3fn
    w.plan(_qo_indptr(case), indptr, indices, last, 6, 2, 32, 4, q_data_type=F16, kv_data_type=fp8, causal=kw["causal"])
    cache = (kw["k_cache"], kw["v_cache"])
    ones = w.run(kw["q"], cache, k_scale=1.0, v_scale=1.0)
    torch.testing.assert_close(w.run(kw["q"], cache), ones, rtol=0, atol=0)
    assert not torch.equal(ones, w.run(kw["q"], cache, k_scale=kw["k_scale"], v_scale=kw["v_scale"]))
    check(case, w.run(kw["q"], cache, k_scale=kw["k_scale"], v_scale=kw["v_scale"]), None, atol=2.5e-2)


@pytest.mark.parametrize("head_dim_qk", [0, -4, None])
def test_plan_names_a_bad_head_dim_qk(head_dim_qk):
    """The default scale 1 / sqrt(head_dim_qk) is taken only after head_dim_qk is checked by name."""
    case = _case()
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    paged = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "NHD")
    with pytest.raises(ValueError, match="^head_dim_qk: expected"):
        paged.plan(_qo_indptr(case), indptr, indices, last, 6, 2, head_dim_qk, 4, q_data_type=F32)
    ragged = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"], "NHD")
    with pytest.raises(ValueError, match="^head_dim_qk: expected"):
        ragged.plan(_qo_indptr(case), indptr, 6, 2, head_dim_qk, q_data_type=F32)


def test_csr_lengths_are_named_against_qo_indptr():
    """A CSR vector whose length does not fit qo_indptr's batch names itself and says it is measured
    against qo_indptr (either of the two may be the wrong one)."""
    case = _case()
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "NHD")
    qo = _qo_indptr(case)
    long_qo = torch.cat([qo, qo[-1:] + 1])
    with pytest.raises(ValueError, match=r"^paged_kv_indptr: expected 6 entries \(as many entries as qo_indptr"):
        w.plan(long_qo, indptr, indices, last, 6, 2, 32, 4, q_data_type=F32)
    with pytest.raises(ValueError, match=r"^paged_kv_last_page_len: expected 4 entries \(qo_indptr's entries less 1"):
        w.plan(qo, indptr, indices, last[:-1], 6, 2, 32, 4, q_data_type=F32)
    r = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"], "NHD")
    with pytest.raises(ValueError, match=r"^kv_indptr: expected 6 entries \(as many entries as qo_indptr"):
        r.plan(long_qo, indptr, 6, 2, 32, q_data_type=F32)


def test_ragged_o_indptr_writes_an_out_of_its_own_rows():
    """o_indptr places out's rows elsewhere than q's: a caller's out of those rows is taken (checked by
    the plan against o_indptr, not against q's rows), rows before the first sequence's stay unwritten,
    and an out too short for o_indptr is refused before any write."""
    case = _case(page_size=0)
    kw = case.kwargs
    qo = _qo_indptr(case)
    kv_indptr = torch.tensor([0, *torch.tensor(case.lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    w = pagedprefill.BatchPrefillWithRaggedKVCacheWrapper(kw["workspace_buffer"], "NHD")
    w.plan(qo, kv_indptr, 6, 2, 32, causal=kw["causal"], q_data_type=F32, o_indptr=qo + 3)
    q, k, v = kw["q"], kw["k_cache"], kw["v_cache"]
    n = int(qo[-1]) + 3
    short = torch.full((n - 1, 6, 32), float("nan"), device=q.device)
    with pytest.raises(ValueError, match="^out: expected an out with at least"):
        w.run(q, k, v, out=short)
    assert short.isnan().all()
    with pytest.raises(ValueError, match=r"^out: expected a tensor of shape \(rows up to o_indptr\[-1\]"):
        w.run(q, k, v, out=torch.empty(n, 6, 16, device=q.device))
    out = torch.full((n, 6, 32), float("nan"), device=q.device)
    assert w.run(q, k, v, out=out) is out
    assert out[:3].isnan().all()
    ref, _ = reference(case)
    assert len(ref) == int(qo[-1])
    for row, want in ref.items():
        torch.testing.assert_close(out[row + 3].double().cpu(), want, atol=2e-5, rtol=0)


def _failed_replan(dev: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """use_cuda_graph: plan A, run; a plan B of new lengths and pages that raises (window_left=-5,
    refused after the batch's vectors were read); run again. Returns both runs' outputs and the
    wrapper's buffers before and after B."""
    torch.manual_seed(0)
    ps, hq, hkv, d = 16, 8, 8, 64
    k = torch.randn(8, hkv, ps, d, device=dev, dtype=dtype)
    v = torch.randn(8, hkv, ps, d, device=dev, dtype=dtype)
    q = torch.randn(6, hq, d, device=dev, dtype=dtype)

    def i32(*x):
        return torch.tensor(x, dtype=torch.int32)

    ws = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(ws, "HND", use_cuda_graph=True)
    w.plan(
        i32(0, 3, 6), i32(0, 1, 2), i32(5, 2), i32(16, 16), hq, hkv, d, ps, q_data_type=dtype,
        max_token_per_sequence=8, max_sequence_kv=32,
    )  # fmt: skip
    before = w.run(q, (k, v)).clone()
    bufs = [b.clone() for b in w._buffers.values() if isinstance(b, torch.Tensor)]
    with pytest.raises(ValueError, match="window_left"):
        w.plan(i32(0, 1, 6), i32(0, 1, 2), i32(0, 7), i32(3, 9), hq, hkv, d, ps, q_data_type=dtype, window_left=-5)
    after_bufs = [b.clone() for b in w._buffers.values() if isinstance(b, torch.Tensor)]
    return before, w.run(q, (k, v)), bufs, after_bufs


def test_cuda_graph_wrapper_failed_plan_leaves_its_buffers():
    """use_cuda_graph: a plan that raises writes nothing into the buffers the last plan (and a graph
    captured from it) reads at every run, so that plan's runs are unchanged."""
    before, after, bufs, after_bufs = _failed_replan(DEVICE, F32 if DEVICE == "cpu" else F16)
    assert len(bufs) == len(after_bufs) >= 4
    for a, b in zip(bufs, after_bufs):
        assert torch.equal(a, b)
    assert torch.equal(before, after)


@pytest.mark.gpu
def test_gpu_cuda_graph_wrapper_failed_plan_leaves_its_buffers():
    """The same on the GPU, where the plan reads the buffers on the device at every run."""
    before, after, bufs, after_bufs = _failed_replan("cuda", F16)
    for a, b in zip(bufs, after_bufs):
        assert torch.equal(a, b)
    assert torch.equal(before, after)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_flashinfer_kernel_names_pdl_and_plan_record(backend):
    """FlashInfer's backend names fa2 / fa3 run on 'auto', ``enable_pdl=True`` is taken as a hint, and
    the plan's record that engines assert on (``_causal``, ``_window_left``, ``_logits_soft_cap``,
    ``_sm_scale``, FlashInfer's default scale 1 / sqrt(head_dim_qk)) is there after ``plan``."""
    case = _case(causal=True)
    kw = case.kwargs
    indptr, indices, last = _csr(case)
    w = pagedprefill.BatchPrefillWithPagedKVCacheWrapper(kw["workspace_buffer"], "HND", backend=backend)
    w.plan(_qo_indptr(case), indptr, indices, last, 6, 2, 32, 4, q_data_type=F32, causal=True)
    assert (w._causal, w._window_left, w._logits_soft_cap) == (True, -1, 0.0)
    assert w._sm_scale == pytest.approx(1 / math.sqrt(32))
    check(case, w.run(kw["q"], (kw["k_cache"], kw["v_cache"]), enable_pdl=True), None, atol=2e-5)
    w.plan(_qo_indptr(case), indptr, indices, last, 6, 2, 32, 4, q_data_type=F32, sm_scale=0.25, window_left=7,
           logits_soft_cap=30.0)  # fmt: skip
    assert (w._causal, w._window_left, w._logits_soft_cap, w._sm_scale) == (False, 7, 30.0, 0.25)
