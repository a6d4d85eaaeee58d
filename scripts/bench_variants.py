"""The attention variants on a GPU, each against the plain kernel on the same shape, and FlashAttention-3
where its build has the variant; and merge_state against the copy bandwidth. Prints a markdown table.

    python scripts/bench_variants.py [--out table.md]

Times: CUDA events around one call, L2 flushed before it, median of runs after warm-up. FLOPs count
visible (query, key) pairs only: 2 (Dqk + Dvo) per pair per query head.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch

import pagedprefill

FLUSH = None


def timed(fn, reps: int = 30) -> float:
    """Median ms of ``fn`` (CUDA events; a 256 MiB write before each run flushes the L2)."""
    global FLUSH
    if FLUSH is None:
        FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        FLUSH.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def pairs(q: int, kv: int, window: int) -> int:
    """Visible (i, j) pairs of one causal sequence with an optional sliding window."""
    total = 0
    for i in range(q):
        p = i + kv - q
        hi = min(kv, p + 1)
        lo = max(0, p - window) if window >= 0 else 0
        total += max(0, hi - lo)
    return total


def make(batch, q_len, hq, hkv, d, page=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv_len = q_len
    per = -(-kv_len // page)
    pages = batch * per
    q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(pages, device="cpu").to(torch.int32)
    table = perm.view(batch, per).cuda()
    lens = torch.full((batch,), q_len, dtype=torch.int32)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    call = dict(
        q=q,
        k_cache=k.permute(0, 2, 1, 3),
        v_cache=v.permute(0, 2, 1, 3),
        scale=1 / math.sqrt(d),
        workspace_buffer=ws,
        max_token_per_sequence=q_len,
        max_sequence_kv=kv_len,
        actual_seq_lens_q=lens,
        actual_seq_lens_kv=lens,
        block_tables=table,
        causal=True,
        return_lse=False,
        out=torch.empty(batch * q_len, hq, d, device="cuda", dtype=torch.bfloat16),
    )
    dense = (
        q,
        k[perm.long().cuda()].reshape(batch, per * page, hkv, d)[:, :kv_len].reshape(-1, hkv, d),
        v[perm.long().cuda()].reshape(batch, per * page, hkv, d)[:, :kv_len].reshape(-1, hkv, d),
    )
    return call, dense


def fa3():
    try:
        from fa3_fwd_interface import flash_attn_varlen_func
    except Exception as e:  # not installed here
        return None, f"{type(e).__name__}: {e}"
    return flash_attn_varlen_func, None


def run_fa3(fn, dense, batch, q_len, softcap=0.0, window=-1):
    q, k, v = dense
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
    return lambda: fn(q, k, v, cu, cu, q_len, q_len, causal=True, softcap=softcap, window_size=(window, 0))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    fa3_fn, fa3_why = fa3()
    rows = []

    def ours(call, backend="triton", **variant):
        return lambda: pagedprefill.cudnn_batch_prefill_with_kv_cache(**call, backend=backend, **variant)

    def add(name, shape, label, fn, flops, note=""):
        try:
            ms = timed(fn)
            rows.append((name, shape, label, f"{flops / ms / 1e9:.0f}", f"{ms:.3f}", note))
        except Exception as e:  # a system without the variant: say so
            rows.append((name, shape, label, "–", "–", f"{type(e).__name__}: {str(e)[:80]}"))
        print(rows[-1], flush=True)

    # 1. sliding window 4096 over a 32k prefill (Llama-8B heads)
    b, n, hq, hkv, d = 1, 32768, 32, 8, 128
    call, dense = make(b, n, hq, hkv, d)
    full = 2 * 2 * d * hq * pairs(n, n, -1) * b
    win = 2 * 2 * d * hq * pairs(n, n, 4096) * b
    add("window 4096", "1 x 32k, 32/8, D128", "triton, full causal", ours(call), full)
    add("window 4096", "1 x 32k, 32/8, D128", "triton, window 4096", ours(call, window_left=4096), win)
    add("window 4096", "1 x 32k, 32/8, D128", "cudnn, window 4096", ours(call, "cudnn", window_left=4096), win)
    if fa3_fn is not None:
        add("window 4096", "1 x 32k, 32/8, D128", "fa3-varlen, full causal", run_fa3(fa3_fn, dense, b, n), full)
        add(
            "window 4096",
            "1 x 32k, 32/8, D128",
            "fa3-varlen, window 4096",
            run_fa3(fa3_fn, dense, b, n, window=4096),
            win,
        )
    del call, dense
    # 2. soft-cap 50, Gemma-shaped (16/8 heads, D 256)
    b, n, hq, hkv, d = 4, 4096, 16, 8, 256
    call, dense = make(b, n, hq, hkv, d)
    f = 2 * 2 * d * hq * pairs(n, n, -1) * b
    add("soft-cap 50", "4 x 4k, 16/8, D256", "triton, plain", ours(call), f)
    add("soft-cap 50", "4 x 4k, 16/8, D256", "triton, soft-cap 50", ours(call, logits_soft_cap=50.0), f)
    add("soft-cap 50", "4 x 4k, 16/8, D256", "cudnn, plain", ours(call, "cudnn"), f)
    if fa3_fn is not None:
        add("soft-cap 50", "4 x 4k, 16/8, D256", "fa3-varlen, plain", run_fa3(fa3_fn, dense, b, n), f)
        add("soft-cap 50", "4 x 4k, 16/8, D256", "fa3-varlen, soft-cap 50", run_fa3(fa3_fn, dense, b, n, 50.0), f)
    # the same on D 128 (the Hopper kernel)
    b, n, hq, hkv, d = 4, 4096, 32, 8, 128
    call, dense = make(b, n, hq, hkv, d)
    f = 2 * 2 * d * hq * pairs(n, n, -1) * b
    add("soft-cap 50", "4 x 4k, 32/8, D128", "triton, plain", ours(call), f)
    add("soft-cap 50", "4 x 4k, 32/8, D128", "triton, soft-cap 50", ours(call, logits_soft_cap=50.0), f)
    if fa3_fn is not None:
        add("soft-cap 50", "4 x 4k, 32/8, D128", "fa3-varlen, plain", run_fa3(fa3_fn, dense, b, n), f)
        add("soft-cap 50", "4 x 4k, 32/8, D128", "fa3-varlen, soft-cap 50", run_fa3(fa3_fn, dense, b, n, 50.0), f)
    # 3. sinks + window 128, gpt-oss-shaped (64/8 heads, D 64)
    b, n, hq, hkv, d = 4, 4096, 64, 8, 64
    call, dense = make(b, n, hq, hkv, d)
    sinks = torch.randn(hq, device="cuda")
    f = 2 * 2 * d * hq * pairs(n, n, -1) * b
    fw = 2 * 2 * d * hq * pairs(n, n, 128) * b
    add("sinks + window 128", "4 x 4k, 64/8, D64", "triton, plain causal", ours(call), f)
    add("sinks + window 128", "4 x 4k, 64/8, D64", "triton, window 128", ours(call, window_left=128), fw)
    add(
        "sinks + window 128",
        "4 x 4k, 64/8, D64",
        "triton, sinks + window 128",
        ours(call, window_left=128, sinks=sinks),
        fw,
    )
    add("sinks + window 128", "4 x 4k, 64/8, D64", "triton, sinks (no window)", ours(call, sinks=sinks), f)
    if fa3_fn is not None:
        add("sinks + window 128", "4 x 4k, 64/8, D64", "fa3-varlen, plain causal", run_fa3(fa3_fn, dense, b, n), f)
        add(
            "sinks + window 128",
            "4 x 4k, 64/8, D64",
            "fa3-varlen, window 128",
            run_fa3(fa3_fn, dense, b, n, window=128),
            fw,
        )
    del call, dense
    # 4. merge_state against the copy bandwidth
    t, h, d = 65536, 32, 128
    va, vb = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sa, sb = (torch.randn(t, h, device="cuda") for _ in range(2))
    moved = 3 * va.numel() * 2 + 3 * sa.numel() * 4
    ms = timed(lambda: pagedprefill.merge_state(va, sa, vb, sb))
    dst = torch.empty_like(va)
    cms = timed(lambda: dst.copy_(va))
    copy_bw = 2 * va.numel() * 2 / cms / 1e6  # GB/s (ms -> s: x1e3, B -> GB: /1e9)
    merge_bw = moved / ms / 1e6
    rows.append(
        (
            "merge_state",
            "64k x 32 x 128 bf16",
            "triton",
            f"{merge_bw:.0f} GB/s",
            f"{ms:.3f}",
            f"{merge_bw / copy_bw:.0%} of the copy bandwidth ({copy_bw:.0f} GB/s, same run)",
        )
    )
    print(rows[-1], flush=True)
    lines = ["| variant | shape | system | TFLOP/s | ms | note |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    if fa3_fn is None:
        lines.append(f"\nFA3 not importable: {fa3_why}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
