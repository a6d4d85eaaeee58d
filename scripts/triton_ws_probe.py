"""Does Triton's automatic warp specialisation engage on Hopper for an attention loop? Compile-only
(no GPU needed): a minimal FA-style kernel for sm_90, with pointer loads or TMA tensor descriptors,
with and without ``tl.range(..., warp_specialize=True)``, at 4 and 8 warps. Prints, per variant,
whether the compiled TTGIR holds ``ttg.warp_specialize`` partitions, or the compiler's error.

Usage: python scripts/triton_ws_probe.py        (docs/triton_kernel.md records what Triton 3.6 does)
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _probe(
    Q, K, V, Out, T, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr, DESC: tl.constexpr
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    d = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + d[None, :])
    m = tl.full([BM], float("-inf"), tl.float32)
    l_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if DESC:
        kd = tl.make_tensor_descriptor(K, shape=[T, D], strides=[D, 1], block_shape=[BN, D])
        vd = tl.make_tensor_descriptor(V, shape=[T, D], strides=[D, 1], block_shape=[BN, D])
    for n in tl.range(0, T, BN, warp_specialize=WS):
        if DESC:
            k = kd.load([n, 0])
            v = vd.load([n, 0])
        else:
            keys = n + tl.arange(0, BN)
            k = tl.load(K + keys[:, None] * D + d[None, :])
            v = tl.load(V + keys[:, None] * D + d[None, :])
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
        m = m_new
    tl.store(Out + rows[:, None] * D + d[None, :], (acc / l_sum[:, None]).to(tl.float16))


def main() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    target = GPUTarget("cuda", 90, 32)
    sig = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "Out": "*fp16", "T": "i32"}
    sig.update({name: "constexpr" for name in ("D", "BM", "BN", "WS", "DESC")})
    print(f"triton {triton.__version__}, target sm_90, tile 128 x 64, D 128, 2 stages")
    for warps in (8, 4):
        for ws in (False, True):
            for desc in (False, True):
                consts = {"D": 128, "BM": 128, "BN": 64, "WS": ws, "DESC": desc}
                label = f"warps {warps}  warp_specialize {ws!s:5}  loads {'TMA' if desc else 'pointer':7}"
                try:
                    options = {"num_warps": warps, "num_stages": 2}
                    c = triton.compile(ASTSource(_probe, sig, consts), target=target, options=options)
                except Exception as e:  # the finding is the error itself
                    print(f"{label}  compile error: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                    continue
                parts = c.asm["ttgir"].count("ttg.warp_specialize")
                print(f"{label}  warp_specialize ops in TTGIR: {parts}")


if __name__ == "__main__":
    main()
