"""DeepSeek-V4 KV compressor and CSA lightning indexer (transformers module names).

Every token t yields a candidate c_t = kv_proj(x_t) and a gate z_t = gate_proj(x_t) (raw, no
bias); a complete window w of m tokens pools them channel-wise:

    HCA (no overlap, width d):   slots = window w                          m slots
    CSA (overlap, width 2d):     slots = [Ca of window w-1 | Cb of window w]  2m slots
                                 Ca = channels [:d], Cb = channels [d:]; window -1 has weight 0

          w-1          w
    ... [ Ca Ca Ca Ca | Cb Cb Cb Cb ]  -> row w      (CSA, m = 4)

    g = z + position_bias[slot]  (fp32);  row_w = kv_norm(sum_slots softmax_slots(g) * c)
    then compress-RoPE on its trailing rope dims at position w*m (the window start).

The CSA indexer owns a second overlapping compressor at index_head_dim (its keys), plus q_b_proj
and scorer.weights_proj:

    score[t, w] = sum_h weights_proj(x_t)[h] * iH^-0.5 * relu(q_t,h . K_w) * iD^-0.5
    selection   = top min(index_topk, N) rows over w < (t+1)//m; picks past that limit -> -1
"""

from __future__ import annotations

import torch
from torch import nn

from dhisparse.kernels.indexer_torch import tie_topk
from dhisparse.kv.v4.passes import PendingWindows
from dhisparse.layers.rope import RotaryEmbedding
from dhisparse.layers.v4_ops import V4RMSNorm, rope_trailing


class Compressor(nn.Module):
    """kv_proj / gate_proj [width, hidden], position_bias [m, width] fp32, kv_norm [d];
    width = 2d when `overlap` (CSA) else d (HCA)."""

    def __init__(self, hidden: int, d: int, m: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.d, self.m, self.overlap = d, m, overlap
        width = 2 * d if overlap else d
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(m, width, dtype=torch.float32))
        self.kv_norm = V4RMSNorm(d, eps)

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> raw inputs [T, 2 * width] = [kv | gate]."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def pool(self, p: PendingWindows, rope: RotaryEmbedding) -> torch.Tensor:
        """Rows [p.count, d] of windows p.first .. p.first + p.count - 1 (post-RoPE)."""
        m, d, n = self.m, self.d, p.count
        width = p.raw.shape[-1] // 2
        kv = p.raw[:, :width].reshape(-1, m, width)
        gate = p.raw[:, width:].reshape(-1, m, width) + self.position_bias  # fp32
        if self.overlap:
            cur_kv, cur_g = kv[int(p.prev):, :, d:], gate[int(p.prev):, :, d:]
            prev_kv, prev_g = kv[:n, :, :d], gate[:n, :, :d]
            if not p.prev:  # window 0 has no predecessor: zero rows with weight 0
                pad_kv = prev_kv.new_zeros(1, m, d)
                pad_g = prev_g.new_full((1, m, d), float("-inf"))
                prev_kv, prev_g = torch.cat([pad_kv, prev_kv[: n - 1]]), torch.cat([pad_g, prev_g[: n - 1]])
            kv, gate = torch.cat([prev_kv, cur_kv], dim=1), torch.cat([prev_g, cur_g], dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        rows = self.kv_norm((kv * weights).sum(dim=1))
        positions = (p.first + torch.arange(n, device=rows.device)) * m
        cos, sin = rope(positions, rows.dtype)
        return rope_trailing(rows, cos, sin)

    def emit(self, ctx, layer: int, kind: str, x: torch.Tensor, rope: RotaryEmbedding) -> None:
        """Feed this pass's tokens to the `kind` stream of every request; store completed rows."""
        for p in ctx.feed(layer, kind, self.raw(x)):
            ctx.append_rows(layer, kind, p.req, self.pool(p, rope))


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


def _select(self, x, q_lat, positions, keys, cos, sin, chunk: int = 256) -> torch.Tensor:
    """Shared by `V4Indexer` and `Reindexer` (see `V4Indexer.select`)."""
    S, N = x.shape[0], keys.shape[0]
    out = torch.full((S, self.topk), -1, dtype=torch.int64, device=x.device)
    kk = min(self.topk, N)
    if kk == 0 or S == 0:
        return out
    q = self.q_b_proj(q_lat).view(S, self.n_heads, self.d)
    q = rope_trailing(q, cos, sin)
    w = self.scorer.weights_proj(x).float() * self.n_heads**-0.5  # [S, iH]
    kt = keys.float().T
    rows = torch.arange(N, device=x.device)
    for a in range(0, S, chunk):
        b = min(S, a + chunk)
        s = torch.relu(torch.matmul(q[a:b].float(), kt)) * self.d**-0.5  # [s, iH, N]
        score = (s * w[a:b, :, None]).sum(dim=1)  # [s, N]
        limit = (positions[a:b] + 1) // self.m  # rows w < limit are complete for the token
        score = score.masked_fill(rows[None, :] >= limit[:, None], float("-inf"))
        idx = tie_topk(score, kk)[1]
        out[a:b, :kk] = torch.where(idx >= limit[:, None], torch.full_like(idx, -1), idx)
    return out


class V4Indexer(Compressor):
    """CSA lightning indexer: an overlapping compressor at index_head_dim, q_b_proj, scorer."""

    def __init__(self, hidden: int, q_lora: int, n_heads: int, head_dim: int, m: int, topk: int, eps: float):
        super().__init__(hidden, head_dim, m, True, eps)
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_lora, n_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden, n_heads)

    def select(
        self, x: torch.Tensor, q_lat: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, chunk: int = 256,
    ) -> torch.Tensor:
        """Tokens of ONE request: x [S, hidden], q_lat [S, q_lora], positions [S], keys [N, iD]
        (all its index rows), cos/sin [S, r/2] compress rope -> selection [S, index_topk] (-1 pad)."""
        return _select(self, x, q_lat, positions, keys, cos, sin, chunk)


class Reindexer(nn.Module):
    """The indexer query of a "reindex" layer (no compressor: it scores a shared source's keys):
    q_b_proj [iH * iD, q_lora] and scorer.weights_proj [iH, hidden]; `select` as `V4Indexer.select`."""

    def __init__(self, hidden: int, q_lora: int, n_heads: int, head_dim: int, m: int, topk: int) -> None:
        super().__init__()
        self.n_heads, self.d, self.m, self.topk = n_heads, head_dim, m, topk
        self.q_b_proj = nn.Linear(q_lora, n_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden, n_heads)

    select = V4Indexer.select
