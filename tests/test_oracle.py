"""The oracle's own tests: its two formulations agree, and ``check`` fails on every kind of error.

``reference`` computes blocks of query rows at once (vectorised, masked); ``reference_rows`` one
row at a time over materialised K/V. Agreement of the two on random cases, and ``check`` raising on
corrupted results, is what lets every backend's tests trust them.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import check_sampled
from oracle import check, make_case, reference, reference_rows

from pagedprefill import cudnn_batch_prefill_with_kv_cache


def _random_case(seed: int, **over):
    r = random.Random(seed)
    lens_q, lens_kv = [], []
    for _ in range(r.randint(1, 4)):
        lq = r.choice([0, r.randint(1, 40)])
        lkv = r.choice([0, r.randint(1, 60), r.randint(0, max(0, lq - 1))])  # (q_len > kv_len too)
        lens_q.append(lq)
        lens_kv.append(lkv)
    if not any(lens_q):
        lens_q[0] = 5
    hq, hkv = r.choice([(4, 4), (4, 2), (6, 1), (8, 2)])
    dqk = r.choice([16, 64])
    params = dict(
        lens_q=lens_q,
        lens_kv=lens_kv,
        hq=hq,
        hkv=hkv,
        dqk=dqk,
        dvo=r.choice([dqk, dqk, 32]),
        page_size=r.choice([0, 1, 3, 16]),
        kv_layout=r.choice(["nhd", "hnd", "interleaved"]),
        dtype=r.choice([torch.float16, torch.bfloat16, torch.float32]),
        kv_dtype=r.choice([None, None, torch.float8_e4m3fn, torch.float8_e5m2]),
        causal=r.random() < 0.6,
        offsets=r.choice(["none", "elements", "tokens"]),
        gaps=r.random() < 0.5,
        lse_layout=r.choice(["padded", "packed"]),
        return_lse=True,
    )
    if params["kv_layout"] == "interleaved":  # (one K/V buffer: Dqk = Dvo)
        params["dvo"] = dqk
    if params["kv_dtype"] is not None:  # (fp8 K/V take a 16-bit q)
        params["dtype"] = r.choice([torch.float16, torch.bfloat16])
    params.update(over)
    return make_case(seed, **params)


def _corruptible_case(seed: int, **over):
    """A float32 case with gap rows in out, an empty sequence and causal rows without keys."""
    fixed = dict(lens_q=[7, 0, 12], lens_kv=[3, 4, 20], causal=True, gaps=True, offsets="tokens")
    return _random_case(seed, **fixed, dtype=torch.float32, kv_dtype=None, **over)


@pytest.mark.parametrize("seed", range(24))
def test_reference_agrees_with_reference_rows(seed):
    case = _random_case(seed)
    ref_out, ref_lse = reference(case)
    hq, max_q = case.kwargs["q"].shape[1], case.kwargs["max_token_per_sequence"]
    rows = [(b, i) for b, lq in enumerate(case.lens_q) for i in range(lq)]
    assert len(ref_out) == len(rows) == len(ref_lse)
    for (b, i), (o, lse) in reference_rows(case, rows).items():
        torch.testing.assert_close(ref_out[case.o_start[b] + i], o, atol=1e-12, rtol=0)
        off = (case.lse_start[b] if case.lse_start is not None else b * max_q * hq) + i * hq
        torch.testing.assert_close(ref_lse[off], lse, atol=1e-12, rtol=0)
        if case.kwargs["causal"] and i + case.lens_kv[b] - case.lens_q[b] < 0:  # no visible key
            assert (o == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("seed", range(4))
def test_check_fails_on_each_kind_of_error(seed):
    """A correct result passes; one wrong value, one unwritten (NaN) covered value, one write to an
    uncovered row, one wrong or unwritten lse entry, and a finite lse where -inf is due each fail."""
    case = _corruptible_case(100 + seed)
    out, lse = cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="torch")
    check(case, out, lse, atol=2e-3)
    covered = {case.o_start[b] + i for b, lq in enumerate(case.lens_q) for i in range(lq)}
    uncovered = [r for r in range(out.shape[0]) if r not in covered]
    assert uncovered, "the case should leave gap rows in out"
    r = random.Random(seed)
    row = r.choice(sorted(covered))
    _, ref_lse = reference(case)
    hq = out.shape[1]
    finite = [off + h for off, v in ref_lse.items() for h in range(hq) if torch.isfinite(v[h])]
    no_key = [off + h for off, v in ref_lse.items() for h in range(hq) if torch.isneginf(v[h])]
    assert finite and no_key, "sequence 0 (q_len 7 > kv_len 3, causal) has rows without keys"
    for corrupt, msg in (
        ("wrong", "max error"),
        ("unwritten", "non-finite"),
        ("stray", "uncovered out row"),
        ("lse", "lse at"),
        ("lse_nan", "lse at"),
        ("lse_inf", "-inf mismatch"),
    ):
        o, lz = out.clone(), lse.clone()
        if corrupt == "wrong":
            o[row, r.randrange(o.shape[1]), r.randrange(o.shape[2])] += 0.05
        elif corrupt == "unwritten":
            o[row, r.randrange(o.shape[1]), r.randrange(o.shape[2])] = float("nan")
        elif corrupt == "stray":
            o[r.choice(uncovered)] = 0.0
        elif corrupt == "lse":
            lz.view(-1)[r.choice(finite)] += 0.05
        elif corrupt == "lse_nan":
            lz.view(-1)[r.choice(finite)] = float("nan")
        else:
            lz.view(-1)[r.choice(no_key)] = 0.0
        with pytest.raises(AssertionError, match=msg):
            check(case, o, lz, atol=2e-3)


@pytest.mark.parametrize("seed", range(2))
def test_check_sampled_fails_on_each_kind_of_error(seed):
    """The sampled check of long cases (every row sampled here) fails as ``check`` does, on a +inf
    LSE where -inf is due too, and on a write to an uncovered LSE entry of a given buffer."""
    case = _corruptible_case(200 + seed, lse_layout="padded")
    out, lse = cudnn_batch_prefill_with_kv_cache(**case.kwargs, backend="torch")
    check_sampled(case, out, lse, atol=2e-3, per_seq=40)
    covered = sorted({case.o_start[b] + i for b, lq in enumerate(case.lens_q) for i in range(lq)})
    uncovered = [r for r in range(out.shape[0]) if r not in covered]
    hq, max_q = out.shape[1], case.kwargs["max_token_per_sequence"]
    no_key = [i * hq for i in range(case.lens_q[0] - case.lens_kv[0])]  # (sequence 0's first rows)
    unused = [max_q * hq + h for h in range(hq)]  # (sequence 1 has no query: its LSE rows stay as given)
    r = random.Random(seed)
    for corrupt, msg in (
        ("wrong", "max error"),
        ("unwritten", "max error nan"),
        ("stray", "uncovered out row"),
        ("lse_plus_inf", "-inf mismatch"),
        ("lse_stray", "uncovered lse entry"),
    ):
        o, lz = out.clone(), lse.clone()
        if corrupt == "wrong":
            o[r.choice(covered), r.randrange(hq), r.randrange(o.shape[2])] += 0.05
        elif corrupt == "unwritten":
            o[r.choice(covered), r.randrange(hq), r.randrange(o.shape[2])] = float("nan")
        elif corrupt == "stray":
            o[r.choice(uncovered)] = 0.0
        elif corrupt == "lse_plus_inf":
            lz.view(-1)[r.choice(no_key)] = float("inf")
        else:
            lz.view(-1)[r.choice(unused)] = 0.0
        with pytest.raises(AssertionError, match=msg):
            check_sampled(case, o, lz, atol=2e-3, per_seq=40)
