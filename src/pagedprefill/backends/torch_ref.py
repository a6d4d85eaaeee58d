"""Reference backend in plain PyTorch: CPU or GPU, every head dim, dtype and variant, float32 math.

Without host metadata it reads the device metadata back (one sync), so it cannot be captured in a
CUDA graph. Memory stays bounded on long sequences: scores are computed for chunks of query rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagedprefill.batch import CallTensors, PrefillBatch

NAME = "torch"
SCORE_BYTES = 256 * 2**20  # float32 bytes of one chunk's score matrix


def unavailable_reason(device: torch.device) -> str | None:
    return None


def unsupported_reason(batch: PrefillBatch) -> str | None:
    if batch.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return (
            "the torch reference backend reads lengths back to the host and cannot be captured in a CUDA "
            "graph; use backend='triton' or 'cudnn'"
        )
    return None


def plan(batch: PrefillBatch, workspace_bytes: int | None) -> TorchPlan:
    return TorchPlan(batch)


def _dequant(t: Tensor, scale: Tensor | None) -> Tensor:
    t = t.float()
    return t * scale if scale is not None else t


class TorchPlan:
    name = NAME
    workspace_bytes = 0

    def __init__(self, batch: PrefillBatch):
        self.batch = batch

    def _sequence_kv(self, t: CallTensors, cache: Tensor, b: int, bt_start: int, start: int, kv_len: int) -> Tensor:
        """(Hkv, kv_len, D) keys or values of sequence b."""
        batch = self.batch
        if not batch.paged:
            return cache[start : start + kv_len].transpose(0, 1)
        n_pages = -(-kv_len // batch.page_size)
        ids = t.pages[b, :n_pages] if batch.pages == "table" else t.pages[bt_start : bt_start + n_pages]
        pages = ids.long().clamp(0, cache.shape[0] - 1)
        seq = cache.index_select(0, pages)  # (n_pages, Hkv, page_size, D)
        seq = seq.transpose(0, 1).reshape(cache.shape[1], n_pages * batch.page_size, cache.shape[-1])
        return seq[:, :kv_len]

    def run(self, t: CallTensors) -> None:
        batch = self.batch
        h = batch.host
        rows = h.rows() if h is not None else t.meta.cpu().tolist()
        lens_q, lens_kv, q_start, o_start, k_start, v_start, lse_start, bt_start = rows
        hq, hkv, g = batch.num_qo_heads, batch.num_kv_heads, batch.group_size
        w, cap = batch.window_left, batch.logits_soft_cap
        sinks = t.sinks.float().view(hkv, g, 1, 1) if t.sinks is not None else None
        for b in range(batch.batch_size):
            lq, lkv = lens_q[b], lens_kv[b]
            if lq == 0:
                continue
            out_rows = t.out[o_start[b] : o_start[b] + lq]
            lse_rows = None
            if t.lse is not None:
                lse_rows = t.lse[lse_start[b] : lse_start[b] + lq * hq].view(lq, hq)
            if lkv == 0:
                out_rows.zero_()
                if lse_rows is not None:
                    if sinks is None:
                        lse_rows.fill_(float("-inf"))
                    else:
                        lse_rows.copy_(t.sinks.float().view(1, hq).expand(lq, hq))
                continue
            k = _dequant(self._sequence_kv(t, t.k, b, bt_start[b], k_start[b], lkv), t.k_scale)
            v = _dequant(self._sequence_kv(t, t.v, b, bt_start[b], v_start[b], lkv), t.v_scale)
            chunk = max(1, SCORE_BYTES // (4 * hq * lkv))
            for r0 in range(0, lq, chunk):
                r1 = min(lq, r0 + chunk)
                q = _dequant(t.q[q_start[b] + r0 : q_start[b] + r1], t.q_scale)  # (c, Hq, D)
                q = q.permute(1, 0, 2).reshape(hkv, g * (r1 - r0), -1)  # rows ordered (head, token)
                s = torch.bmm(q, k.transpose(1, 2)) * batch.scale  # (Hkv, G*c, lkv)
                s = s.view(hkv, g, r1 - r0, lkv)
                if cap > 0:
                    s = cap * torch.tanh(s / cap)
                pos = torch.arange(r0, r1, device=s.device).view(-1, 1) + (lkv - lq)  # absolute positions
                cols = torch.arange(lkv, device=s.device).view(1, -1)
                hidden = torch.zeros((r1 - r0, lkv), dtype=torch.bool, device=s.device)
                if batch.causal:
                    hidden |= cols > pos
                if w >= 0:
                    hidden |= cols < pos - w
                s = s.masked_fill(hidden, float("-inf"))
                # P = exp(s - m) / l with the row max m, not exp(s - lse): at logits of ~1e4 and above
                # lse = m + log(l) loses log(l) to float32 rounding
                m = s.amax(dim=-1, keepdim=True)
                sk = None if sinks is None else sinks.expand(hkv, g, r1 - r0, 1)
                if sk is not None:
                    m = torch.maximum(m, sk)
                m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # (rows with no visible key)
                e = torch.exp(s - m)
                den = e.sum(dim=-1, keepdim=True)
                if sk is not None:
                    den = den + torch.exp(sk - m)
                lse = m + torch.log(den)  # -inf for rows with no visible key (and no sink)
                p = e / den.clamp(min=torch.finfo(torch.float32).tiny)
                o = torch.matmul(p.view(hkv, g * (r1 - r0), lkv), v).view(hkv, g, r1 - r0, -1)
                out_rows[r0:r1] = o.reshape(hq, r1 - r0, -1).transpose(0, 1).to(t.out.dtype)
                if lse_rows is not None:
                    lse_rows[r0:r1] = lse.view(hq, r1 - r0).transpose(0, 1)
