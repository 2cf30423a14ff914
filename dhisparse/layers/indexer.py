"""Lightning indexer (DeepSeek Sparse Attention): scores every history row, keeps the top k.

    score[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s] * iD^-0.5),   w = weights_proj(x) * iH^-0.5

over the positions s <= pos(t) of token t's request; the selection is the ordered top-k of those
scores (descending), with -1 where fewer than k positions are visible (eq. 1 of the paper).
The plain-PyTorch per-request scorer here is the ground truth for the batched paths in
`dhisparse.kernels.indexer`; `indexer_topk` picks one for a pass.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from torch import nn

from dhisparse.core.batch import ForwardBatch
from dhisparse.core.topk import stable_topk
from dhisparse.kernels.dispatch import indexer_topk_batched
from dhisparse.layers.rope import RopeTables, rope_fused
from dhisparse.core.config import ModelConfig


class IndexerProjection(NamedTuple):
    """q [T, iH, iD] roped index queries; k [T, iD] roped index keys; w [T, iH] fp32 head weights."""

    q: torch.Tensor
    k: torch.Tensor
    w: torch.Tensor


class Indexer(nn.Module):
    """Projections of the lightning indexer (HF names: wq_b, wk, k_norm, weights_proj)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.interleave = cfg.indexer_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def project(self, x: torch.Tensor, q_lat: torch.Tensor, rope: RopeTables) -> IndexerProjection:
        """x [T, H], q_lat [T, q_lora], rope: the pass's tables (cos/sin [T, rope/2]) -> IndexerProjection."""
        q = self.wq_b(q_lat).view(-1, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        r = self.rope_dim
        q = torch.cat([rope_fused(q[..., :r], rope, self.interleave), q[..., r:]], dim=-1)
        k = torch.cat([rope_fused(k[:, :r], rope, self.interleave), k[:, r:]], dim=-1)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        return IndexerProjection(q, k, w)


def indexer_topk_reference(
    proj: IndexerProjection,
    positions: torch.Tensor,
    query_start: list[int],
    keys_of: Callable[[int], torch.Tensor],
    topk: int,
    chunk: int = 256,
) -> torch.Tensor:
    """Ordered top-k selection per token.

    proj: projections of the T tokens; positions [T]; query_start: N+1 offsets;
    keys_of(r) -> [L_r, iD] index keys of request r (history and this pass).
    Returns selection [T, topk] int64: positions in descending score order, -1 padding.
    """
    T = proj.q.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int64, device=proj.q.device)
    scale = proj.q.shape[-1] ** -0.5
    for r in range(len(query_start) - 1):
        a, b = query_start[r], query_start[r + 1]
        if a == b:
            continue
        keys = keys_of(r).float()  # [L, iD]
        L = keys.shape[0]
        for c0 in range(a, b, chunk):
            c1 = min(b, c0 + chunk)
            s = torch.relu(torch.matmul(proj.q[c0:c1].float(), keys.T) * scale)  # [S, iH, L]
            score = torch.matmul(proj.w[c0:c1].unsqueeze(-2), s).squeeze(-2)  # [S, L]
            future = torch.arange(L, device=keys.device)[None, :] > positions[c0:c1, None]
            score = score.masked_fill(future, float("-inf"))
            kk = min(topk, L)
            val, idx = stable_topk(score, kk)
            out[c0:c1, :kk] = torch.where(torch.isinf(val), torch.full_like(idx, -1), idx)
    return out


def indexer_topk(proj: IndexerProjection, batch: ForwardBatch, kv, layer: int, topk: int) -> torch.Tensor:
    """Selection [T, topk] int64 of every token of `batch` (same as `indexer_topk_reference`).

    Contexts that offer an `index_table(layer)` (not None) are scored in one batched pass
    (`kernels/dispatch.py`: the Triton kernel on CUDA, the batched PyTorch path otherwise; a
    verification round of 2 <= K <= 16 tokens a request is scored K queries per key read). Other
    contexts fall back to the per-request reference over `index_keys`.
    """
    table = kv.index_table(layer)
    if table is None:
        return indexer_topk_reference(proj, batch.positions, batch.query_start, lambda r: kv.index_keys(layer, r), topk)
    return indexer_topk_batched(proj.q, proj.w, batch.positions, batch.req_idx, table, topk, batch.tokens_per_request)
