#!/usr/bin/env python3
"""One-shot GPU smoke test of the cuDNN backend: which frontend calls work on this machine.

Run from the repo root on a CUDA machine:  python scripts/cudnn_smoke.py [--quick]

Prints the versions, then one line per check:
    PASS|FAIL|ERROR <name>: out_err=... lse_err=... stray=<uncovered entries written> build=<s> engine=...
Each check is isolated (try/except, compact traceback), so one failure never hides the rest.
Ends with the list of graphs built (spec, engine, workspace, build seconds) and a summary line.
Exit code: 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
import traceback

import torch

RESULTS: list[tuple[str, str]] = []


def say(msg: str) -> None:
    print(msg, flush=True)


def compact_tb(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}({f.name})" for f in reversed(frames))
    msg = " ".join(str(exc).split())
    if len(msg) > 700:
        msg = msg[:700] + " ..."
    return f"{type(exc).__name__}: {msg} [at {where}]"


def check(name: str):
    def deco(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                status, detail = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - report and go on
                status, detail = "ERROR", compact_tb(exc)
            dt = time.perf_counter() - t0
            say(f"{status:5s} {name}: {detail} ({dt:.2f}s)")
            RESULTS.append((name, status))

        return wrapper

    return deco


# --------------------------------------------------------------------------------------------
# Cases and a float32 reference (self-contained: no test helpers needed)
# --------------------------------------------------------------------------------------------


class Case:
    pass


def make(
    lens_q,
    lens_kv,
    *,
    hq=8,
    hkv=2,
    dqk=128,
    dvo=None,
    ps=16,
    layout="nhd",
    dtype=torch.bfloat16,
    causal=True,
    lse="padded",
    scale=None,
    max_q=None,
    max_kv=None,
    seed=0,
    extra_cols=2,
    offsets=False,
    rows=None,
    npages=None,
    table_cols=None,
    fill=-5,
):
    """A prefill call on the GPU with poisoned (NaN) out/lse so stray writes are visible.

    ``rows`` / ``npages`` / ``table_cols`` fix the shapes of q/out, the caches and the block table
    (CUDA-graph replays need one set of shapes for many length sets); ``fill``: the block-table
    entries past each sequence's last page."""
    g = torch.Generator().manual_seed(seed)
    dvo = dqk if dvo is None else dvo
    dev = "cuda"
    c = Case()
    c.lens_q, c.lens_kv, c.causal, c.ps = list(lens_q), list(lens_kv), causal, ps
    bsz = len(lens_q)
    c.max_q = max(lens_q + [1]) if max_q is None else max_q
    c.max_kv = max(lens_kv + [1]) if max_kv is None else max_kv
    c.scale = 1 / math.sqrt(dqk) if scale is None else scale
    gap = 2 if offsets else 0
    c.q_start = [sum(lens_q[:b]) + gap * (b + 1) for b in range(bsz)]
    rows = sum(lens_q) + gap * (bsz + 1) if rows is None else rows

    def rnd(*shape, dt=dtype):
        x = torch.randn(*shape, generator=g)
        if dt in (torch.float8_e4m3fn, torch.float8_e5m2):
            x = x.clamp(-8, 8)
        return x.to(dt).to(dev)

    c.q = rnd(rows, hq, dqk)
    kw = dict(
        q=c.q,
        scale=c.scale,
        max_token_per_sequence=c.max_q,
        max_sequence_kv=c.max_kv,
        causal=causal,
        return_lse=lse is not None,
        actual_seq_lens_q=torch.tensor(lens_q, dtype=torch.int32),
        actual_seq_lens_kv=torch.tensor(lens_kv, dtype=torch.int32),
        workspace_buffer=torch.empty(64 << 20, dtype=torch.uint8, device=dev),
    )
    if ps:
        need = [-(-n // ps) for n in lens_kv]
        npages = sum(need) + 3 if npages is None else npages
        if layout == "nhd":
            c.k = rnd(npages, ps, hkv, dqk).permute(0, 2, 1, 3)
            c.v = rnd(npages, ps, hkv, dvo).permute(0, 2, 1, 3)
        elif layout == "hnd":
            c.k, c.v = rnd(npages, hkv, ps, dqk), rnd(npages, hkv, ps, dvo)
        else:  # interleaved: K and V are two views of one buffer
            kv = rnd(npages, 2, ps, hkv, dqk)
            c.k, c.v = kv[:, 0].permute(0, 2, 1, 3), kv[:, 1].permute(0, 2, 1, 3)
        perm = torch.randperm(npages, generator=g).tolist()
        cols = max(need + [0]) + extra_cols if table_cols is None else table_cols
        table = torch.full((bsz, cols), fill, dtype=torch.int32)
        c.spare = perm[sum(need) :]  # pages no sequence uses
        it = iter(perm)
        for b, n in enumerate(need):
            for j in range(n):
                table[b, j] = next(it)
        c.table = table
        kw["block_tables"] = table.to(dev)
    else:
        c.k_start = [sum(lens_kv[:b]) for b in range(bsz)]
        c.k, c.v = rnd(sum(lens_kv), hkv, dqk), rnd(sum(lens_kv), hkv, dvo)
    kw.update(k_cache=c.k, v_cache=c.v)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for n in ("q_scale", "k_scale", "v_scale"):
            kw[n] = torch.tensor([0.5], device=dev)
    if offsets:
        kw["batch_offsets_units"] = "tokens"
        kw["batch_offsets_q"] = torch.tensor(c.q_start + [rows], dtype=torch.int32)
    out_dtype = torch.bfloat16 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
    c.out = torch.full((rows, hq, dvo), float("nan"), dtype=out_dtype, device=dev)
    kw["out"] = c.out
    c.lse_start = None
    if lse == "padded":
        c.lse = torch.full((bsz, c.max_q, hq), float("nan"), device=dev)
        kw["lse"] = c.lse
    elif lse == "packed":
        c.lse_start = [(sum(lens_q[:b]) + b) * hq for b in range(bsz)]  # one unused row between sequences
        c.lse = torch.full((sum(lens_q) + bsz + 1, hq), float("nan"), device=dev)
        kw["lse"] = c.lse
        unit = 1 if offsets else hq  # offsets=True switches batch_offsets_units to "tokens"
        stats_off = [s // hq * unit for s in c.lse_start] + [c.lse.numel() // hq * unit]
        kw["batch_offsets_stats"] = torch.tensor(stats_off, dtype=torch.int32)
    else:
        c.lse = None
    c.kwargs = kw
    return c


def reference(c):
    """float32 reference: {out row: (Hq, Dvo)}, {flat lse offset: (Hq,)}."""
    q = c.q.float()
    k = c.k.float() * float(c.kwargs.get("k_scale", torch.ones(1)).item())
    v = c.v.float() * float(c.kwargs.get("v_scale", torch.ones(1)).item())
    q = q * float(c.kwargs.get("q_scale", torch.ones(1)).item())
    hq, hkv = q.shape[1], k.shape[1]
    outs, lses = {}, {}
    for b, (lq, lkv) in enumerate(zip(c.lens_q, c.lens_kv)):
        if lq == 0:
            continue
        if c.ps:
            j = torch.arange(lkv)
            pages = c.table[b].long()[j // c.ps].to(q.device)
            slots = (j % c.ps).to(q.device)
            kb, vb = k[pages, :, slots], v[pages, :, slots]
        else:
            s0 = c.k_start[b]
            kb, vb = k[s0 : s0 + lkv], v[s0 : s0 + lkv]
        kb = kb.repeat_interleave(hq // hkv, dim=1)
        vb = vb.repeat_interleave(hq // hkv, dim=1)
        qb = q[c.q_start[b] : c.q_start[b] + lq]
        s = torch.einsum("ihd,jhd->hij", qb, kb) * c.scale
        if c.causal:
            i = torch.arange(lq, device=q.device)[:, None]
            s = s.masked_fill(torch.arange(lkv, device=q.device)[None, :] > i + lkv - lq, float("-inf"))
        lse = torch.logsumexp(s, dim=-1) if lkv else torch.full((hq, lq), float("-inf"), device=q.device)
        p = torch.exp(s - lse[..., None].clamp(min=-1e30)) if lkv else s.new_zeros(hq, lq, 0)
        o = torch.einsum("hij,jhd->ihd", p, vb) if lkv else q.new_zeros(lq, hq, v.shape[-1])
        for i in range(lq):
            outs[c.q_start[b] + i] = o[i]
            off = (c.lse_start[b] if c.lse_start is not None else b * c.max_q * hq) + i * hq
            lses[off] = lse[:, i]
    return outs, lses


def compare(c, out, lse, atol=3e-2, lse_atol=2e-2):
    """(ok, 'out_err=.. lse_err=.. stray=..')"""
    ref_o, ref_l = reference(c)
    torch.cuda.synchronize()
    of = out.float()
    covered = torch.zeros(of.shape[0], dtype=torch.bool, device=of.device)
    err, nonfinite = 0.0, 0
    for r, exp in ref_o.items():
        covered[r] = True
        got = of[r]
        nonfinite += int((~torch.isfinite(got)).sum())
        err = max(err, float((got - exp).abs().nan_to_num(1e9).max()))
    stray = int((~torch.isnan(of[~covered])).sum())
    lerr, linf_bad = 0.0, 0
    if lse is not None:
        flat = lse.reshape(-1)
        touched = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        hq = out.shape[1]
        for off, exp in ref_l.items():
            touched[off : off + hq] = True
            got = flat[off : off + hq]
            inf = torch.isinf(exp)
            linf_bad += int((torch.isinf(got) != inf).sum()) + int(torch.isnan(got).sum())
            if (~inf).any():
                lerr = max(lerr, float((got[~inf] - exp[~inf]).abs().nan_to_num(1e9).max()))
        stray += int((~torch.isnan(flat[~touched])).sum())
    ok = err <= atol and lerr <= lse_atol and stray == 0 and nonfinite == 0 and linf_bad == 0
    detail = f"out_err={err:.2e} lse_err={lerr:.2e} stray={stray} nonfinite={nonfinite} "
    detail += f"lse_inf_mismatch={linf_bad}"
    return ok, detail


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def new_plan_info(before):
    from pagedprefill.backends import cudnn_backend as cb

    plans = cb.cached_plans()[before:]
    if not plans:
        return "build=cached"
    return " ".join(
        f"build={p.build_seconds:.2f}s engine={p.engine} ws={p.layout.workspace_size}" for p in plans
    )


def run_case(c, **extra):
    import pagedprefill
    from pagedprefill.backends import cudnn_backend as cb

    before = len(cb.cached_plans())
    out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**c.kwargs, backend="cudnn", **extra)
    ok, detail = compare(c, out, lse)
    return ("PASS" if ok else "FAIL"), f"{detail} {new_plan_info(before)}"


def main() -> int:
    quick = "--quick" in sys.argv
    say(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}")
    if not torch.cuda.is_available():
        say("ERROR no CUDA device")
        return 1
    say(f"gpu {torch.cuda.get_device_name()}  cc {torch.cuda.get_device_capability()}")
    say(f"torch.backends.cudnn.version() = {torch.backends.cudnn.version()}")
    try:
        import cudnn

        ver = f"{cudnn.backend_version()} ({cudnn.backend_version_string()})"
        say(f"cudnn-frontend {cudnn.__version__}  backend {ver}")
        say(f"sdpa_capabilities: {sorted(cudnn.sdpa_capabilities())}")
    except Exception as exc:  # noqa: BLE001
        say(f"ERROR import cudnn: {compact_tb(exc)}")
        return 1
    from pagedprefill.backends import cudnn_backend as cb

    say(f"unavailable_reason(cuda) = {cb.unavailable_reason(torch.device('cuda'))}")
    say(f"engine policy ({cb.ENGINE_POLICY_ENV}) = {os.environ.get(cb.ENGINE_POLICY_ENV, 'auto')}")
    fp = torch.float16
    lq, lkv = [37, 1, 64, 9], [300, 40, 64, 200]

    @check("paged bf16 causal GQA 8/2 D128 ps16 NHD padded-lse")
    def _():
        return run_case(make(lq, lkv, layout="nhd"))

    _()

    @check("paged bf16 causal D128 ps16 HND")
    def _():
        return run_case(make(lq, lkv, layout="hnd"))

    _()

    @check("paged bf16 causal D128 ps16 interleaved K/V views")
    def _():
        return run_case(make(lq, lkv, layout="interleaved"))

    _()

    @check("paged bf16 packed lse (batch_offsets_stats) + q offsets with gaps")
    def _():
        return run_case(make(lq, lkv, lse="packed", offsets=True))

    _()

    @check("ragged K/V bf16 causal D192/128 padded lse")
    def _():
        return run_case(make(lq, lkv, ps=0, dqk=192, dvo=128))

    _()

    @check("paged bf16 D192/128 ps16")
    def _():
        return run_case(make(lq, lkv, dqk=192, dvo=128))

    _()

    @check("paged fp16 non-causal D64 ps64 MHA no lse")
    def _():
        return run_case(make(lq, lkv, hq=4, hkv=4, dqk=64, ps=64, dtype=fp, causal=False, lse=None))

    _()

    @check("paged bf16 page_size 1")
    def _():
        return run_case(make([5, 3], [20, 9], ps=1))

    _()

    @check("paged bf16 D256")
    def _():
        return run_case(make([5, 3], [40, 9], dqk=256))

    _()

    @check("kv_len 0 and causal q_len > kv_len (empty rows -> out 0, lse -inf), host lengths")
    def _():
        return run_case(make([6, 9, 4], [0, 4, 30], max_q=12))

    _()

    @check("same, lengths on device (CUDA-graph fix-up path)")
    def _():
        c = make([6, 9, 4], [0, 4, 30], max_q=12)
        c.kwargs["actual_seq_lens_q"] = c.kwargs["actual_seq_lens_q"].cuda()
        c.kwargs["actual_seq_lens_kv"] = c.kwargs["actual_seq_lens_kv"].cuda()
        return run_case(c, is_cuda_graph_compatible=True)

    _()

    @check("PROBE native cuDNN on rows without visible keys (no skip, no fix-up)")
    def _():
        import pagedprefill

        c = make([6, 9, 4], [0, 4, 30], max_q=12, seed=5)
        cb._DEBUG_NATIVE_EMPTY_ROWS = True
        try:
            out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**c.kwargs, backend="cudnn")
            torch.cuda.synchronize()
        finally:
            cb._DEBUG_NATIVE_EMPTY_ROWS = False
        o = out.float()
        kv0 = o[0:6]  # sequence 0: kv_len 0
        br = o[6:11]  # sequence 1: rows 0..4 see no key (q_len 9 > kv_len 4)
        desc = []
        for label, rows, lrow in (("kv_len0", kv0, lse[0, :6]), ("causal_overhang", br, lse[1, :5])):
            desc.append(
                f"{label}: out nan={int(torch.isnan(rows).sum())} "
                f"zero={int((rows == 0).sum())}/{rows.numel()} "
                f"absmax={float(rows.nan_to_num(0).abs().max()):.3g}; lse {lrow.flatten()[:3].tolist()}"
            )
        ok, detail = compare(c, out, lse)
        return "INFO", " | ".join(desc) + f" | vs spec: {'matches' if ok else 'differs'} ({detail})"

    _()

    @check("INFO cuDNN limitation: NaN in slots past kv_len of a last page (seq 0 poisoned only)")
    def _():
        import pagedprefill

        c = make([5, 9, 3], [21, 35, 7], layout="hnd", seed=3)
        n = c.lens_kv[0]
        last = int(c.table[0, (n - 1) // 16])
        c.k[last, :, n % 16 :] = float("nan")
        c.v[last, :, n % 16 :] = float("nan")
        out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**c.kwargs, backend="cudnn")
        torch.cuda.synchronize()
        per_seq = []
        for b, lq_ in enumerate(c.lens_q):
            rows = out[c.q_start[b] : c.q_start[b] + lq_].float()
            per_seq.append(int((~torch.isfinite(rows)).sum()))
        others_ok = all(x == 0 for x in per_seq[1:])
        return "INFO", f"non-finite out entries per sequence {per_seq}; confined to sequence 0: {others_ok}"

    _()

    @check("large finite garbage (+-3e4) past kv_len in last pages does not change the result")
    def _():
        c = make([5, 9, 3], [21, 35, 7], layout="hnd", seed=3)
        g = torch.Generator(device="cuda").manual_seed(0)
        for b, n in enumerate(c.lens_kv):
            if n % 16:
                last = int(c.table[b, (n - 1) // 16])
                for t in (c.k, c.v):
                    tail = t[last, :, n % 16 :]
                    sign = torch.randint(0, 2, tail.shape, generator=g, device="cuda") * 2 - 1
                    tail.copy_((sign * 3e4).to(t.dtype))
        return run_case(c)

    _()

    @check("NaN pages named in block_tables past ceil(kv_len/page_size) are never read")
    def _():
        c = make([5, 9, 3], [21, 35, 7], layout="nhd", seed=4, extra_cols=5)
        for p in c.spare:
            c.k[p] = float("nan")
            c.v[p] = float("nan")
        for b, n in enumerate(c.lens_kv):
            c.table[b, -(-n // 16) :] = c.spare[b % len(c.spare)]
        c.kwargs["block_tables"].copy_(c.table)
        return run_case(c)

    _()

    @check("anchor: same shapes, another scale")
    def _():
        s1, d1 = run_case(make(lq, lkv, scale=0.05, seed=7))
        s2, d2 = run_case(make(lq, lkv, scale=0.5, seed=7))
        return ("PASS" if s1 == s2 == "PASS" else "FAIL"), f"[{d1}] [{d2}]"

    _()

    @check("anchor: block table much wider than max_kv/page_size")
    def _():
        return run_case(make(lq, lkv, extra_cols=50))

    _()

    @check("engine policy 'backend' (cuDNN library engines only)")
    def _():
        os.environ[cb.ENGINE_POLICY_ENV] = "backend"
        try:
            return run_case(make(lq, lkv, ps=0, seed=11))
        finally:
            os.environ.pop(cb.ENGINE_POLICY_ENV, None)

    _()

    @check("fp8 e4m3 q/k/v (expect a refusal before Blackwell)")
    def _():
        import pagedprefill

        c = make([5, 3], [20, 9], dtype=torch.float8_e4m3fn)
        try:
            out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**c.kwargs, backend="cudnn")
        except Exception as exc:  # noqa: BLE001
            untouched = bool(torch.isnan(c.out.float()).all())
            msg = " ".join(str(exc).split())[:500]
            return "INFO", f"refused ({type(exc).__name__}), out untouched={untouched}: {msg}"
        ok, detail = compare(c, out, lse, atol=8e-2, lse_atol=5e-2)
        return ("PASS" if ok else "FAIL"), "ran: " + detail

    _()

    @check("CUDA graph capture + 7 replays: new lengths (kv 0, q 0, q > kv, maxima), tables, data")
    def _():
        import pagedprefill

        scenarios = [
            ([5, 3, 8, 16], [20, 7, 33, 64]),
            ([16, 1, 0, 9], [64, 0, 5, 9]),  # kv_len 0 with q rows, q_len 0, q_len > kv_len
            ([12, 16, 4, 2], [3, 64, 0, 40]),  # causal overhang, kv_len 0
            ([16, 16, 16, 16], [64, 64, 64, 64]),  # the captured maxima
            ([1, 7, 1, 13], [1, 17, 0, 2]),
        ]
        shape = dict(max_q=16, max_kv=64, rows=64, npages=19, table_cols=6)
        cases = [make(lq_, lkv_, seed=40 + i, **shape) for i, (lq_, lkv_) in enumerate(scenarios)]
        live = make(*scenarios[0], seed=39, **shape)  # the tensors the graph is captured on
        names = ("actual_seq_lens_q", "actual_seq_lens_kv")
        for n in names:
            live.kwargs[n] = live.kwargs[n].cuda()

        def load(c):  # copy scenario c's lengths, table and data into the live tensors
            for n in names:
                live.kwargs[n].copy_(c.kwargs[n])
            live.kwargs["block_tables"].copy_(c.kwargs["block_tables"])
            for t in ("q", "k", "v"):
                getattr(live, t).copy_(getattr(c, t))
            live.out.fill_(float("nan"))
            live.lse.fill_(float("nan"))

        kw = dict(live.kwargs, backend="cudnn", is_cuda_graph_compatible=True)
        load(cases[0])
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)
        torch.cuda.current_stream().wait_stream(side)
        n0 = cb.graph_builds()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, lse = pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)
        details, ok = [], cb.graph_builds() == n0
        for i in [1, 2, 3, 4, 0, 1, 2]:
            load(cases[i])
            g.replay()
            good, d = compare(cases[i], out, lse)  # the reference reads scenario i's own tensors
            ok &= good
            details.append(f"#{i} {d}")
        details.append(f"builds_during_capture={cb.graph_builds() - n0}")
        return ("PASS" if ok else "FAIL"), " | ".join(details)

    _()

    @check("bucketing: serving loop on ONE cache (batch 1..64, q 16..2048, prefix 0..8192, ps 16)")
    def _():
        import pagedprefill

        rng = random.Random(0)
        hq, hkv, d, ps, max_b = 4, 2, 64, 16, 64
        num_pages = max_b * -(-(2048 + 8192) // ps)
        cache = torch.randn(2, num_pages, ps, hkv, d, device="cuda").to(torch.bfloat16).permute(0, 1, 3, 2, 4)
        q_buf = torch.randn(max_b * 2048, hq, d, device="cuda").to(torch.bfloat16)
        out_buf = torch.empty_like(q_buf)
        lse_buf = torch.empty(max_b * 2048 * hq, device="cuda")
        ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

        def call():
            bsz = rng.randint(1, max_b)
            lq_ = [rng.randint(16, 2048) for _ in range(bsz)]
            lkv_ = [x + rng.randint(0, 8192) for x in lq_]
            need = [-(-n // ps) for n in lkv_]
            perm = torch.randperm(num_pages)[: sum(need)].to(torch.int32)
            table = torch.zeros(bsz, max(need), dtype=torch.int32)
            at = 0
            for b, n in enumerate(need):
                table[b, :n] = perm[at : at + n]
                at += n
            rows, mq = sum(lq_), max(lq_)
            pagedprefill.cudnn_batch_prefill_with_kv_cache(
                q=q_buf[:rows],
                k_cache=cache[0],
                v_cache=cache[1],
                scale=d**-0.5,
                workspace_buffer=ws,
                max_token_per_sequence=mq,
                max_sequence_kv=max(lkv_),
                actual_seq_lens_q=torch.tensor(lq_, dtype=torch.int32),
                actual_seq_lens_kv=torch.tensor(lkv_, dtype=torch.int32),
                block_tables=table.cuda(),
                causal=True,
                return_lse=True,
                out=out_buf[:rows],
                lse=lse_buf[: bsz * mq * hq].view(bsz, mq, hq),
                backend="cudnn",
            )

        warm, calls = (60, 200) if quick else (300, 1000)
        n0, t0 = cb.graph_builds(), time.perf_counter()
        for _i in range(warm):
            call()
        n1, t1 = cb.graph_builds(), time.perf_counter()
        for _i in range(calls):
            call()
        torch.cuda.synchronize()
        built = cb.graph_builds() - n1
        detail = (
            f"warm-up {warm} calls: {n1 - n0} graphs ({t1 - t0:.1f}s); then {calls} calls: {built} graphs "
            f"({time.perf_counter() - t1:.1f}s); target <= 20"
        )
        return ("PASS" if built <= 20 else "FAIL"), detail

    _()

    @check("timing: prefill B=8 q=1024 kv=4096 Hq=32 Hkv=8 D128 ps16 bf16 causal")
    def _():
        import pagedprefill

        c = make([1024] * 8, [4096] * 8, hq=32, hkv=8, dqk=128, ps=16, lse="padded", seed=31)
        kw = dict(c.kwargs, backend="cudnn")
        t0 = time.perf_counter()
        pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        for _i in range(3):
            pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 10
        e0.record()
        for _i in range(n):
            pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)
        e1.record()
        torch.cuda.synchronize()
        ms = e0.elapsed_time(e1) / n
        # causal bottom-right: each query row sees (kv - q + i + 1) keys
        flops = 8 * 32 * sum(4096 - 1024 + i + 1 for i in range(1024)) * 128 * 4
        rate = flops / ms / 1e9
        return "INFO", f"first call {first:.2f}s (incl. build), {ms:.3f} ms/call, {rate:.1f} TFLOP/s"

    _()

    @check("host overhead: B16 q=kv=1024 Hq32 Hkv8 D128 ps16 causal lse (llama8b_b16_q1k) vs the graph alone")
    def _():
        import statistics

        import pagedprefill
        from pagedprefill import api

        c = make([1024] * 16, [1024] * 16, hq=32, hkv=8, dqk=128, ps=16, lse="padded", seed=51, extra_cols=0)
        kw = dict(c.kwargs, backend="cudnn")

        def public():
            pagedprefill.cudnn_batch_prefill_with_kv_cache(**kw)

        public()
        k = c.kwargs
        batch = api._normalise(**k)
        api._fill_metadata(batch, cb)

        def backend_only():  # what the backend does per call, resolution included
            batch.extras.pop("cudnn_plan", None)
            batch.extras.pop("cudnn_key", None)
            cb.unsupported_reason(batch)
            cb.workspace_bytes(batch)
            cb.run(batch)

        backend_only()
        plan = batch.extras["cudnn_plan"]
        views = cb._views(batch, plan)
        ops = cb._operands(plan, batch, views)
        handle = cb._handle(torch.cuda.current_device())
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
        if plan.binding == "tensors":
            pack, ws = {t: ops[n] for n, t in plan.tensors.items()}, views.workspace
        else:
            pack, ws = {t: ops[n].data_ptr() for n, t in plan.tensors.items()}, views.workspace.data_ptr()

        def direct():  # the built graph alone, operands bound once
            plan.graph.execute(pack, ws, handle=handle)

        flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
        res = {}
        for name, fn in (("public", public), ("backend", backend_only), ("graph", direct)):
            for _i in range(5):
                fn()
            torch.cuda.synchronize()
            n = 40  # few enough that the launch queue never fills (the host is not throttled)
            t0 = time.perf_counter()
            for _i in range(n):
                fn()
            host_us = (time.perf_counter() - t0) / n * 1e6
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _i in range(n):
                fn()
            e1.record()
            torch.cuda.synchronize()
            b2b = e0.elapsed_time(e1) / n
            times = []
            for _i in range(30):  # the benchmark's way: L2 flushed, events around one call
                flush.zero_()
                s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s0.record()
                fn()
                s1.record()
                torch.cuda.synchronize()
                times.append(s0.elapsed_time(s1))
            res[name] = (host_us, b2b, statistics.median(times))
        g = res["graph"]
        parts = []
        for name, (h, b, f) in res.items():
            parts.append(
                f"{name}: host {h:.0f} us/call, back-to-back {b:.3f} ms ({b / g[1]:.3f}x), "
                f"flushed {f:.3f} ms ({f / g[2]:.3f}x)"
            )
        ok = res["backend"][1] <= 1.03 * g[1]
        parts.append(f"binding={plan.binding}; backend within 3% back-to-back: {ok}")
        if plan.binding_error:
            parts.append(f"binding_error={plan.binding_error[:300]}")
        return "INFO", " | ".join(parts)

    _()

    say("--- graphs built:")
    for p in cb.cached_plans():
        info = f"engine={p.engine} ws={p.layout.workspace_size} build={p.build_seconds:.2f}s"
        info += f" binding={p.binding}"
        say(f"  {p.spec.describe()} | {info}")
    say(f"graph_builds()={cb.graph_builds()} failures cached: {len(cb._FAILED)}")
    for reason in list(cb._FAILED.values())[:5]:
        say(f"  refused: {reason[:400]}")
    bad = [n for n, s in RESULTS if s in ("FAIL", "ERROR")]
    say(f"SUMMARY {len(RESULTS) - len(bad)}/{len(RESULTS)} ok; failing: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
