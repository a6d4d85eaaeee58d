"""Where a per-layer call spends its host time: cProfile over plan.run and the one-shot call, with
the GPU busy (calls queued behind a sleep kernel), plus the cost of the primitives they use.

    python scripts/host_profile.py [--out DIR] [--cases b128_q128,ragged_b32_devoffsets] [--backends triton]

``--out`` keeps two ``.prof`` files per case and backend: the device machine returns 8 files at most,
so keep cases x backends (and the log beside them) within that.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from pagedprefill.bench import cases, layers, timing


def per_call_us(fn, n: int = 500) -> float:
    for _ in range(20):
        fn()
    return timing.host_time_ms(fn, n) * 1e3


def primitives() -> None:
    dev = torch.device("cuda")
    x = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    q = torch.randn(4096, 32, 128, device=dev, dtype=torch.bfloat16)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    lay = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    items = {
        "torch.empty(64 KiB)": lambda: torch.empty(65536, dtype=torch.uint8, device=dev),
        "slice ws[:4].view(int32)": lambda: x[:4].view(torch.int32),
        "slice.view.zero_()": lambda: x[:4].view(torch.int32).zero_(),
        "t.data_ptr()": lambda: q.data_ptr(),
        "t.shape, t.stride()": lambda: (q.shape, q.stride()),
        "NVMMASharedLayout()": lambda: gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3),
        "TensorDescriptor(q)": lambda: TensorDescriptor(q, list(q.shape), list(q.stride()), [16, 4, 64], lay),
        "current_stream": lambda: torch.cuda.current_stream(),
    }
    for name, fn in items.items():
        print(f"  {name:32s} {per_call_us(fn):7.2f} µs")


def profile(name: str, fn, n_layers: int, reps: int, out: str | None) -> None:
    fn()
    torch.cuda.synchronize()
    t_host = []
    for _ in range(5):
        timing.preload(40)
        t0 = time.perf_counter()
        fn()
        t_host.append((time.perf_counter() - t0) / n_layers * 1e6)
        torch.cuda.synchronize()
    print(f"== {name}: host {min(t_host):.1f} µs/call (min of 5 bursts of {n_layers})")
    pr = cProfile.Profile()
    for _ in range(reps):
        timing.preload(40)
        pr.enable()
        fn()
        pr.disable()
        torch.cuda.synchronize()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s).sort_stats("tottime")
    st.print_stats(28)
    txt = s.getvalue()
    print("\n".join(line for line in txt.splitlines()[6:40] if line.strip()))
    if out:
        st.dump_stats(f"{out}/{name.replace(' ', '_').replace('/', '_')}.prof")


def burst_us(fn, n: int = 32) -> float:
    """Host µs per call of ``fn``: min over 5 bursts of ``n`` calls queued behind a busy GPU."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        timing.preload(40)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


def breakdown(name: str, p, lb) -> None:
    """plan.run's host time cut into its layers: the whole call, the plan's Python without the
    backend, the backend's run, the bound launch, and Triton's C launch function alone."""
    k, v, q, out = lb.base["k_cache"], lb.base["v_cache"], lb.q[0], lb.out[0]
    p.run(q, k, v, out=out)
    lp = next(reversed(p.layers.values()))
    be = lp.backend
    seen = {}
    real = be.run
    be.run = lambda t: (seen.setdefault("t", t), real(t))[1]
    p.run(q, k, v, out=out)
    be.run = real
    t = seen["t"]
    rows = {"plan.run": lambda: p.run(q, k, v, out=out), "backend.run(t)": lambda: be.run(t)}
    if hasattr(be, "execute") and hasattr(be, "views"):  # cuDNN: the preparation launch and the graph apart
        views = be.views(t.scratch)
        rows["cudnn graph execute"] = lambda: be.execute(t, views)
        be_exec = be.execute
        be.execute = lambda *a: None
        rows["cudnn run, no graph"] = lambda: be.run(t)
        print(f"  {name} {'cudnn run, no graph':24s} {burst_us(lambda: be.run(t)):7.2f} µs")
        be.execute = be_exec
        del rows["cudnn run, no graph"]
    if getattr(lp, "bounds", None) is not None and p.vectors is not None and not lp.reads_vectors:  # the table alone
        from pagedprefill import workspace

        meta, slot = t.meta, lp.table_launch
        rows["device table launch"] = lambda: workspace.write_device_table(lp.bounds, p.vectors, meta, slot=slot)
    bound = getattr(be, "_bound", None)
    if bound:
        tensors = be._tensors(t)
        rows["bound launch"] = lambda: bound(tensors)
        raw = bound.raw
        got = {}
        bound.raw = lambda *a: (got.setdefault("a", a), raw(*a))[1]
        bound(tensors)
        bound.raw = raw
        args = got["a"]
        print(f"   (raw launch: {len(args)} arguments)")
        rows["C launch alone"] = lambda: raw(*args)
    for label, fn in rows.items():
        print(f"  {name} {label:24s} {burst_us(fn):7.2f} µs")
    be.run = lambda t: None
    print(f"  {name} {'plan.run, no backend':24s} {burst_us(lambda: p.run(q, k, v, out=out)):7.2f} µs")
    be.run = real


def one_shot_breakdown(name: str, lb, backend: str) -> None:
    """The one-shot call's host time cut into its parts: the whole call, its cache key, the cache
    lookup, the per-call device vectors, and the cached plan's execute alone (the parts it shares
    with plan.run), each timed again on the arguments one real call passed it."""
    from pagedprefill import api, plan_cache, prefill_plan

    kw = {**lb.layer_kwargs(0), "backend": backend}
    call = lambda: api.cudnn_batch_prefill_with_kv_cache(**kw)  # noqa: E731
    call()
    seen: dict = {}
    parts = [(plan_cache, "signature"), (plan_cache, "get"), (api, "_call_vectors")]
    parts += [(prefill_plan.PrefillPlan, "execute"), (api, "_plan_call")]
    real = {(owner, fn): getattr(owner, fn) for owner, fn in parts}
    for (owner, fn), f in real.items():

        def spy(*a, _f=f, _n=fn, **k):
            seen.setdefault(_n, (a, k))
            return _f(*a, **k)

        setattr(owner, fn, spy)
    try:
        call()
    finally:
        for (owner, fn), f in real.items():
            setattr(owner, fn, f)
    hit = "_plan_call" not in seen
    print(f"  {name} one-shot cache {'hit' if hit else 'MISS (every call takes the full path)'}")
    rows = {"one-shot call": call}
    for (_owner, fn), f in real.items():
        if fn in seen and fn != "_plan_call":
            a, k = seen[fn]
            rows[fn] = lambda f=f, a=a, k=k: f(*a, **k)
    for label, fn in rows.items():
        print(f"  {name} {label:24s} {burst_us(fn):7.2f} µs")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="b128_q128,ragged_b32_devoffsets")
    ap.add_argument("--backends", default="triton,cudnn")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    print(f"== host probe: {timing.host_probe_us():.3f} µs an iteration (pagedprefill.bench.timing.host_probe_us)")
    print("== primitives (µs per call, back to back, no sync)")
    primitives()
    known = layers.known_cases()
    n = 32
    for cname in a.cases.split(","):
        lb = layers.LayerBatch(known[cname], n, torch.device("cuda"), torch.bfloat16, 0)
        for be in a.backends.split(","):
            p = lb.plan(be)
            k, v = lb.base["k_cache"], lb.base["v_cache"]

            def plan_step(p=p, k=k, v=v, qs=lb.q, outs=lb.out):
                for i in range(n):
                    p.run(qs[i], k, v, out=outs[i])

            kws = [lb.layer_kwargs(i) for i in range(n)]

            def one_shot(kws=kws, be=be):
                for kw in kws:
                    cases.prefill(**kw, backend=be)

            if be in ("triton", "cudnn"):
                breakdown(f"{cname} {be}", p, lb)
                one_shot_breakdown(f"{cname} {be}", lb, be)
            profile(f"{cname} {be} plan.run", plan_step, n, a.reps, a.out)
            profile(f"{cname} {be} one-shot", one_shot, n, a.reps, a.out)


if __name__ == "__main__":
    main()
