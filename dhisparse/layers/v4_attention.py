"""DeepSeek-V4 attention: shared K=V MQA over (sliding window rows ++ selected compressed rows).

    q_lat = q_a_norm(q_a_proj(x));  q = rms(q_b_proj(q_lat)) per head, RoPE on trailing dims   [T, H, D]
    kv    = RoPE(kv_norm(kv_proj(x)))                                    one head, K and V    [T, D]
    keys of token t = window rows (positions t-W+1 .. t)                 every layer
                   ++ compressed rows: all complete ones (HCA) | the indexer's top-k (CSA)
    p = softmax([q.k * D^-0.5 ..., sink_h]) without the sink column;  o = p . rows          [T, H, D]
    o = RoPE^-1(o) at the query position (V carried the keys' rotation)
    out = o_b_proj(concat_g o_a_proj_g(o viewed as G groups of H*D/G))                      [T, hidden]

Attention gathers rows through (rows, loc) row spaces (`LocatedRows`) and never builds a dense mask;
loc -1 entries are dropped. Sliding layers use the "main" rope, CSA / HCA layers the "compress" one.

Cross-layer sources (`core/v4_sources.py`): a "full" CSA layer emits its source's rows and index
keys and selects with its own indexer; a "reindex" layer has only an indexer query
(`self_attn.reindexer.{q_b_proj, scorer.weights_proj}`) and selects over its source's index keys;
a "reuse" layer takes the pass's latest located selection on its source (`ctx.reuse`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dhisparse.core.rows import gather_rows
from dhisparse.kv.v4.passes import LocatedRows
from dhisparse.layers.rope import RotaryEmbedding
from dhisparse.layers.v4_compressor import Compressor, Reindexer, V4Indexer
from dhisparse.layers.v4_ops import V4RMSNorm, rope_trailing, unweighted_rms_norm
from dhisparse.core.v4_config import CSA, SLIDING, V4Config
from dhisparse.kernels.fp8_dispatch import shared_activations
from dhisparse.core.v4_sources import FULL, REINDEX


class V4RopeTables(NamedTuple):
    """cos/sin [T, r/2] at the pass's positions for both ropes, and the compress rope itself
    (compressed rows are rotated at their window start w*m)."""

    main: tuple[torch.Tensor, torch.Tensor]
    compress: tuple[torch.Tensor, torch.Tensor]
    compress_rope: RotaryEmbedding


def v4_sparse_attention(
    q: torch.Tensor, spaces: list[LocatedRows], sinks: torch.Tensor, scale: float, chunk_elems: int = 1 << 24
) -> torch.Tensor:
    """q [T, H, D]; spaces: row spaces whose loc [T, k_i] are concatenated per token (-1 = drop;
    rows may be a tuple of paged spaces addressed with `arena.SPACE` tags, e.g. + staging; rows
    stored in an FP8 format (`LocatedRows.fmt`) are decoded after the gather);
    sinks [H] per-head sink logits -> o [T, H, D] (fp32 math, q's dtype)."""
    T, H, D = q.shape
    out = q.new_zeros(T, H, D)
    spaces = [sp for sp in spaces if sp.loc.shape[1] > 0 and (isinstance(sp.rows, tuple) or sp.rows[..., 0].numel() > 0)]
    K = sum(sp.loc.shape[1] for sp in spaces)
    step = max(1, chunk_elems // max(1, K * D))
    sink = sinks.float().view(1, H, 1)
    for a in range(0, T, step):
        b = min(T, a + step)
        rows = torch.cat([_gathered(sp, a, b) for sp in spaces], dim=1).float()
        valid = torch.cat([sp.loc[a:b] >= 0 for sp in spaces], dim=1)  # [S, K]
        logit = torch.einsum("shd,skd->shk", q[a:b].float(), rows) * scale
        logit = logit.masked_fill(~valid[:, None, :], float("-inf"))
        logit = torch.cat([logit, sink.expand(b - a, H, 1)], dim=-1)
        p = torch.softmax(logit, dim=-1)[..., :-1]
        out[a:b] = torch.einsum("shk,skd->shd", p, rows).to(out.dtype)
    return out


def _gathered(sp: LocatedRows, a: int, b: int) -> torch.Tensor:
    """Rows of tokens a..b-1 at sp.loc [S, k_i, D], decoded when stored in an FP8 format."""
    g = gather_rows(sp.rows, sp.loc[a:b].clamp(min=0))
    return sp.fmt.decode(g) if sp.fmt is not None else g


def all_complete_rows(positions: torch.Tensor, m: int) -> torch.Tensor:
    """HCA selection: positions [T] -> [T, max_t (t+1)//m] row ids w < (t+1)//m, -1 beyond."""
    limit = (positions + 1) // m
    width = int(limit.max()) if positions.numel() else 0
    ids = torch.arange(width, device=positions.device)[None, :].expand(positions.shape[0], -1)
    return torch.where(ids < limit[:, None], ids, torch.full_like(ids, -1))


class GroupedLinear(nn.Module):
    """o_a_proj: weight [G * R, in_per_group]; x [T, G, in_per_group] -> [T, G, R] (block diagonal)."""

    def __init__(self, in_per_group: int, rank: int, groups: int) -> None:
        super().__init__()
        self.groups, self.rank = groups, rank
        self.weight = nn.Parameter(torch.zeros(groups * rank, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, self.rank, -1)
        return torch.einsum("tgi,gri->tgr", x, w)


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        H, D, hid = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        self.kind, self.m, self.scale = cfg.layer_types[layer], cfg.compress_rate(layer), D**-0.5
        self.q_a_proj = nn.Linear(hid, cfg.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(hid, D, bias=False)
        self.kv_norm = V4RMSNorm(D, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(H * D // cfg.o_groups, cfg.o_lora_rank, cfg.o_groups)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, hid, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.source, self.selection = cfg.source_of(layer), cfg.selection_type(layer)
        self.compressor = self.reindexer = None
        idx_args = (hid, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, self.m, cfg.index_topk)
        if self.kind != SLIDING and self.selection == FULL:
            self.compressor = Compressor(hid, D, self.m, self.kind == CSA, cfg.rms_norm_eps)
            if self.kind == CSA:
                self.compressor.indexer = V4Indexer(*idx_args, cfg.rms_norm_eps)
        elif self.selection == REINDEX:
            self.reindexer = Reindexer(*idx_args)

    def forward(self, x: torch.Tensor, ropes: V4RopeTables, batch, ctx) -> torch.Tensor:
        """x [T, hidden] (normed block input) of a ForwardBatch, ctx a V4Pass -> [T, hidden]."""
        c, T = self.cfg, x.shape[0]
        cos, sin = ropes.main if self.kind == SLIDING else ropes.compress
        with shared_activations(x):  # FP8 w8a8: q_a and kv quantize x once
            q_lat = self.q_a_norm(self.q_a_proj(x))
            kv = rope_trailing(self.kv_norm(self.kv_proj(x)), cos, sin)
        q = unweighted_rms_norm(self.q_b_proj(q_lat).view(T, c.num_heads, c.head_dim), c.rms_norm_eps)
        q = rope_trailing(q, cos, sin)
        spaces = [ctx.window(self.layer, kv)]
        if self.kind != SLIDING:
            spaces.append(self._compressed(x, q_lat, ropes, batch, ctx))
        o = v4_sparse_attention(q, spaces, self.sinks, self.scale)
        o = rope_trailing(o, cos, sin, inverse=True)
        o = self.o_a_proj(o.reshape(T, c.o_groups, -1)).reshape(T, -1)
        return self.o_b_proj(o)

    def _compressed(self, x, q_lat, ropes: V4RopeTables, batch, ctx) -> LocatedRows:
        """Emit this pass's compressed rows (producers), select per token, locate the selection
        on the source (a "reuse" layer takes the source's latest located selection instead)."""
        if self.selection not in (FULL, REINDEX):
            return ctx.reuse(self.source)
        comp, idx = self.compressor, self.reindexer
        if comp is not None:
            comp.emit(ctx, self.layer, "kv", x, ropes.compress_rope)
            if self.kind != CSA:
                return ctx.locate(self.layer, "kv", all_complete_rows(batch.positions, self.m))
            idx = comp.indexer
            idx.emit(ctx, self.layer, "index", x, ropes.compress_rope)
        cos, sin = ropes.compress
        parts = []
        for r in range(batch.num_reqs):
            a, b = batch.query_start[r], batch.query_start[r + 1]
            keys = ctx.index_keys(self.source, r)
            parts.append(idx.select(x[a:b], q_lat[a:b], batch.positions[a:b], keys, cos[a:b], sin[a:b]))
        selection = torch.cat(parts) if parts else torch.empty(0, idx.topk, dtype=torch.int64, device=x.device)
        return ctx.locate(self.source, "kv", selection)
