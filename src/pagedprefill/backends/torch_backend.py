"""Reference backend in plain PyTorch: CPU or GPU, any head dims and dtypes, float32 math.

It reads the normalised metadata back to the host (one sync), so it cannot be captured in a CUDA
graph. Memory stays bounded on long sequences: scores are computed for chunks of query rows, never
for the whole batch at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedprefill.api import PrefillBatch

NAME = "torch"
SCORE_BYTES = 256 * 2**20  # float32 bytes of one chunk's score matrix


def unavailable_reason(device: torch.device) -> str | None:
    return None


def unsupported_reason(batch: PrefillBatch) -> str | None:
    if batch.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return (
            "the torch reference backend reads lengths back to the host and cannot be captured "
            "in a CUDA graph; use backend='triton' or 'cudnn'"
        )
    return None


def workspace_bytes(batch: PrefillBatch) -> int:
    return 0


def _dequant(t: Tensor, scale: Tensor | None) -> Tensor:
    t = t.float()
    return t * scale if scale is not None else t


def _sequence_kv(batch: PrefillBatch, cache: Tensor, b: int, start: int, kv_len: int) -> Tensor:
    """(Hkv, kv_len, D) keys or values of sequence b."""
    if not batch.paged:
        return cache[start : start + kv_len].transpose(0, 1)
    n_pages = -(-kv_len // batch.page_size)
    pages = batch.block_tables[b, :n_pages].long().clamp(0, cache.shape[0] - 1)
    seq = cache.index_select(0, pages)  # (n_pages, Hkv, page_size, D)
    seq = seq.transpose(0, 1).reshape(cache.shape[1], n_pages * batch.page_size, cache.shape[-1])
    return seq[:, :kv_len]


def run(batch: PrefillBatch) -> None:
    lens_q, lens_kv, q_start, o_start, k_start, v_start, lse_start = batch.meta.cpu().tolist()
    hq, hkv, g = batch.num_qo_heads, batch.num_kv_heads, batch.group_size
    for b in range(batch.batch_size):
        lq, lkv = lens_q[b], lens_kv[b]
        if lq == 0:
            continue
        out_rows = batch.out[o_start[b] : o_start[b] + lq]
        lse_rows = None
        if batch.lse is not None:
            lse_rows = batch.lse[lse_start[b] : lse_start[b] + lq * hq].view(lq, hq)
        if lkv == 0:
            out_rows.zero_()
            if lse_rows is not None:
                lse_rows.fill_(float("-inf"))
            continue
        k = _dequant(_sequence_kv(batch, batch.k, b, k_start[b], lkv), batch.k_scale)
        v = _dequant(_sequence_kv(batch, batch.v, b, v_start[b], lkv), batch.v_scale)
        chunk = max(1, SCORE_BYTES // (4 * hq * lkv))
        for r0 in range(0, lq, chunk):
            r1 = min(lq, r0 + chunk)
            q = _dequant(batch.q[q_start[b] + r0 : q_start[b] + r1], batch.q_scale)  # (c, Hq, D)
            q = q.permute(1, 0, 2).reshape(hkv, g * (r1 - r0), -1)  # rows ordered (head, token)
            s = torch.bmm(q, k.transpose(1, 2)) * batch.scale  # (Hkv, G*c, lkv)
            s = s.view(hkv, g, r1 - r0, lkv)
            if batch.causal:
                rows = torch.arange(r0, r1, device=s.device).view(-1, 1)
                cols = torch.arange(lkv, device=s.device).view(1, -1)
                s = s.masked_fill(cols > rows + (lkv - lq), float("-inf"))
            lse = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf for rows with no visible key
            p = torch.exp(s - lse.clamp(min=torch.finfo(torch.float32).min))
            o = torch.matmul(p.view(hkv, g * (r1 - r0), lkv), v).view(hkv, g, r1 - r0, -1)
            out_rows[r0:r1] = o.reshape(hq, r1 - r0, -1).transpose(0, 1).to(batch.out.dtype)
            if lse_rows is not None:
                lse_rows[r0:r1] = lse.view(hq, r1 - r0).transpose(0, 1)
