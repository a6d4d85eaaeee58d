"""Shared test helpers: calling a backend on an oracle case, sampled checks for long cases, the
random case grid, and direct access to a case's plan (for backend-level tests).

Without CUDA the Triton kernels run in Triton's CPU interpreter (``conftest.py`` sets
``TRITON_INTERPRET=1`` before pagedprefill is imported). The interpreter cannot do bf16 dots, so CPU
tests use fp16 / fp32; bf16 runs in the GPU tests (``@pytest.mark.gpu``).
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import torch
from oracle import check, make_case, reference_rows

import pagedprefill
from pagedprefill import api, tuning, workspace
from pagedprefill.batch import CallTensors

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def atol_for(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> float:
    if dtype == torch.float32 and kv_dtype in (None, torch.float32):
        return 1e-4
    if dtype == torch.bfloat16 or dtype in FP8 or kv_dtype in FP8:
        return 2.5e-2
    return 5e-3


def call(case, backend: str = "triton", knobs: dict | None = None, hopper: dict | None = None, **override):
    """The public function on ``case`` (``override`` replaces keyword arguments), with Triton knobs
    (``knobs``) or Hopper-kernel knobs (``hopper``) forced."""
    kw = {**case.kwargs, **override}
    with tuning.override("triton", **(knobs or {})), tuning.override("hopper", **(hopper or {})):
        return pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw, backend=backend)


def run_and_check(case, atol, lse_atol=None, backend="triton", **knobs):
    out, lse = call(case, backend, knobs)
    check(case, out, lse, atol=atol, lse_atol=lse_atol if lse_atol is not None else max(atol, 1e-3))
    return out, lse


def planned(case, backend: str = "triton", **override):
    """``(plan, layer plan, workspace)`` of a case, as the one-shot call makes them (nothing run)."""
    kw = {**case.kwargs, **override}
    names = ("q_scale", "k_scale", "v_scale")
    offs = tuple(kw.get(f"batch_offsets_{n}") for n in ("q", "o", "k", "v", "stats"))
    return api._plan_call(
        kw["q"],
        kw["k_cache"],
        kw["v_cache"],
        kw["scale"],
        kw["workspace_buffer"],
        kw["max_token_per_sequence"],
        kw["max_sequence_kv"],
        kw["actual_seq_lens_q"],
        kw["actual_seq_lens_kv"],
        kw.get("block_tables"),
        kw["causal"],
        kw["return_lse"],
        tuple(kw.get(n) for n in names),
        offs,
        kw.get("batch_offsets_units", "elements"),
        kw.get("out"),
        kw.get("lse"),
        kw.get("is_cuda_graph_compatible", False),
        backend,
        kw.get("o_data_type"),
        kw.get("window_left", -1),
        kw.get("logits_soft_cap", 0.0),
        kw.get("sinks"),
    )


def call_tensors(case, p, lp, ws) -> CallTensors:
    """The run's tensors of a planned host-metadata case (for direct backend calls)."""
    kw = case.kwargs
    batch = lp.batch
    meta, scratch = workspace.carve(ws, batch.batch_size, batch.device_metadata)
    pages = workspace.device_pages(p.seq, kw.get("block_tables"), batch.device)
    out = kw.get("out")
    if out is None:
        out = torch.zeros(lp.out_shape, dtype=batch.out_dtype, device=batch.device)
    lse = kw.get("lse")
    if lse is None and lp.return_lse:
        lse = torch.full(lp.lse_shape, float("-inf"), device=batch.device)
    return CallTensors(
        kw["q"],
        kw["k_cache"],
        kw["v_cache"],
        out,
        lse.view(-1) if lse is not None else None,
        p.meta if meta is None else meta,
        pages,
        kw.get("q_scale"),
        kw.get("k_scale"),
        kw.get("v_scale"),
        kw.get("sinks"),
        scratch,
    )


def batch_of(case, backend: str = "torch", **override):
    """The PrefillBatch of a case (it does not depend on the backend)."""
    return planned(case, backend, **override)[1].batch


def check_sampled(case, out, lse, *, atol, lse_atol=None, per_seq=6, seed=0):
    """Long cases: the oracle on sampled rows (first, last and random rows of every sequence), plus
    every covered row finite and every uncovered row of a given (NaN-poisoned) out/lse untouched."""
    r = random.Random(seed)
    rows = []
    for b, lq in enumerate(case.lens_q):
        if lq:
            picks = {0, lq - 1} | {r.randrange(lq) for _ in range(per_seq)}
            rows += [(b, i) for i in sorted(picks)]
    ref = reference_rows(case, rows)
    out_c = out.detach().cpu().to(torch.float64)
    hq = out.shape[1]
    max_q = case.kwargs["max_token_per_sequence"]
    flat = lse.detach().cpu().reshape(-1).to(torch.float64) if lse is not None else None
    latol = lse_atol if lse_atol is not None else max(atol, 1e-3)

    def lse_off(b, i):
        return (case.lse_start[b] if case.lse_start is not None else b * max_q * hq) + i * hq

    for (b, i), (o_ref, l_ref) in ref.items():
        err = (out_c[case.o_start[b] + i] - o_ref).abs().max().item()
        assert err <= atol, f"out of sequence {b} row {i}: max error {err:.3g} > {atol}"
        if flat is not None:
            got = flat[lse_off(b, i) : lse_off(b, i) + hq]
            inf = torch.isneginf(l_ref)
            assert torch.equal(torch.isneginf(got), inf), f"lse of sequence {b} row {i}: -inf mismatch"
            assert ((got[~inf] - l_ref[~inf]).abs() <= latol).all(), f"lse of sequence {b} row {i}"
    covered = torch.zeros(out.shape[0], dtype=torch.bool)
    touched = torch.zeros(flat.numel() if flat is not None else 0, dtype=torch.bool)
    for b, lq in enumerate(case.lens_q):
        covered[case.o_start[b] : case.o_start[b] + lq] = True
        if flat is not None and lq:
            touched[lse_off(b, 0) : lse_off(b, 0) + lq * hq] = True
    assert torch.isfinite(out_c[covered]).all(), "a covered out row is not finite (unwritten?)"
    if case.kwargs.get("out") is not None:
        assert torch.isnan(out_c[~covered]).all(), "an uncovered out row was written"
    else:  # (an out the call allocated: 0 where no sequence writes)
        assert (out_c[~covered] == 0).all(), "an uncovered row of the allocated out is not 0"
    if flat is not None:
        assert not torch.isnan(flat[touched]).any(), "a covered lse entry was not written"
        if case.kwargs.get("lse") is not None:
            assert torch.isnan(flat[~touched]).all(), "an uncovered lse entry was written"
        else:  # (an allocated LSE: -inf where no sequence writes)
            assert torch.isneginf(flat[~touched]).all(), "an uncovered entry of the allocated lse is not -inf"


# GQA shapes of the random grids: MHA, MQA, and groups of 2-8 including the odd ones (3, 5, 6, 7)
HEADS = [(4, 4), (4, 2), (4, 1), (6, 2), (8, 2), (9, 3), (10, 2), (12, 2), (7, 1), (16, 2), (24, 8)]


def random_params(seed: int, dtypes: tuple, long: bool = False, variants: bool = True, dims=(64,)) -> dict:
    """Random case parameters: lengths with empty sequences and rows without keys, every layout, GQA
    group, offset form, LSE layout, and (``variants``) sliding windows, soft-capping and sinks."""
    r = random.Random(seed)
    bsz = r.randint(1, 3)
    max_len_q, max_len_kv = (1500, 3500) if long else (24, 48)
    lens_q, lens_kv = [], []
    for _ in range(bsz):
        kind = r.random()
        lq = r.randint(1, max_len_q)
        lkv = r.randint(lq, lq + max_len_kv // 2)
        if kind < 0.12:
            lq = 0
        elif kind < 0.24:
            lkv = 0
        elif kind < 0.40:
            lkv = r.randint(1, max(1, lq - 1))  # q_len > kv_len: causal rows without keys
        lens_q.append(lq)
        lens_kv.append(lkv)
    hq, hkv = r.choice(HEADS)
    d = r.choice(dims)
    params = dict(
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=hq,
        hkv=hkv,
        dqk=d,
        dvo=128 if d == 192 else d,
        page_size=r.choice([0, 1, 3, 16]),
        kv_layout=r.choice(["nhd", "hnd", "interleaved"]),
        dtype=r.choice(dtypes),
        causal=r.random() < 0.6,
        offsets=r.choice(["none", "elements", "tokens"]),
        gaps=r.random() < 0.5,
        lse_layout=r.choice(["padded", "packed"]),
        return_lse=r.random() < 0.8,
        extra_table_cols=r.randint(0, 2),
        with_out=r.random() < 0.8,
        device=DEVICE,
    )
    if params["kv_layout"] == "interleaved" and params["dvo"] != params["dqk"]:
        params["kv_layout"] = "nhd"
    if r.random() < 0.3:  # max_* larger than the longest sequence
        params["max_q"] = max(lens_q + [1]) + r.randint(1, 5)
        params["max_kv"] = max(lens_kv + [1]) + r.randint(1, 9)
    if variants:
        if r.random() < 0.25:
            params["window_left"] = r.choice([0, 1, 5, 17, 40])
        if r.random() < 0.2:
            params["logits_soft_cap"] = r.choice([1.5, 30.0])
        if r.random() < 0.2:
            params["sinks"] = True
    return params


def make_random_case(seed: int, dtypes: tuple, **kw):
    return make_case(seed, **random_params(seed, dtypes, **kw))


def plan_of(case, backend="torch", csr=False, **over):
    """A plan made from an oracle case's batch (its lengths, table, offsets, heads, dims)."""
    kw = case.kwargs
    q, k, v = kw["q"], kw["k_cache"], kw["v_cache"]
    paged = kw.get("block_tables") is not None
    args = dict(
        num_qo_heads=q.shape[1],
        num_kv_heads=k.shape[1],
        head_dim_qk=q.shape[2],
        head_dim_vo=v.shape[-1],
        page_size=k.shape[2] if paged else 0,
        actual_seq_lens_q=kw["actual_seq_lens_q"],
        max_token_per_sequence=kw["max_token_per_sequence"],
        max_sequence_kv=kw["max_sequence_kv"],
        causal=kw["causal"],
        scale=kw["scale"],
        return_lse=kw["return_lse"],
        backend=backend,
        window_left=kw.get("window_left", -1),
        logits_soft_cap=kw.get("logits_soft_cap", 0.0),
    )
    for n in ("q", "o", "k", "v", "stats"):
        if kw.get(f"batch_offsets_{n}") is not None:
            args[f"batch_offsets_{n}"] = kw[f"batch_offsets_{n}"]
    if "batch_offsets_units" in kw:
        args["batch_offsets_units"] = kw["batch_offsets_units"]
    if csr:
        args.update(to_csr(case))
    else:
        args["actual_seq_lens_kv"] = kw["actual_seq_lens_kv"]
        if paged:
            args["block_tables"] = kw["block_tables"]
    args.update(over)
    return pagedprefill.plan(kw["workspace_buffer"], **args)


def to_csr(case) -> dict:
    """FlashInfer's CSR pages of a case's dense block table, as ``plan()`` arguments on the table's
    device (three junk page ids past the last sequence's, never read)."""
    indptr, indices, last = csr_pages(case)
    i32 = dict(dtype=torch.int32, device=case.kwargs["block_tables"].device)
    return dict(
        kv_indptr=torch.tensor(indptr, **i32),
        kv_indices=torch.tensor(indices + [9] * 3, **i32),
        kv_last_page_len=torch.tensor(last, **i32),
    )


def csr_pages(case) -> tuple[list[int], list[int], list[int]]:
    """``(kv_indptr, kv_indices, kv_last_page_len)`` of a paged case's dense block table."""
    ps = case.kwargs["k_cache"].shape[2]
    table = case.info["block_tables"]
    indptr, indices, last = [0], [], []
    for b, n in enumerate(case.lens_kv):
        pages = -(-n // ps)
        indices += table[b, :pages].tolist()
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * ps if pages else 0)
    return indptr, indices, last
