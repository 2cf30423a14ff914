"""Multi-head latent attention (MLA) in absorbed form over gathered sparse rows.

Cache rows are [c_kv (kv_lora) | k_pe (rope)]. With W_UK/W_UV split out of kv_b_proj,
    q_abs = q_nope . W_UK                      [T, H, kv_lora]
    logit = (q_abs . c_kv + q_pe . k_pe) * scale
    o     = softmax(logit) . c_kv . W_UV       [T, H, v]
which equals transformers' expanded MLA with the top-k mask, but reads only the selected rows.

Tensor parallelism (layers/tp.py) splits the heads: rank r of N runs heads [r*H/N, (r+1)*H/N)
(its q_b_proj / kv_b_proj rows, i.e. their W_UK / W_UV, and its o_proj columns; `cfg.num_heads`
is then H/N) and o_proj's partial output is summed over the ranks. The latent row
[c_kv | k_pe] is shared by every head, so each rank computes, stores and reads the FULL row:
the KV is replicated, not split. Per rank the KV bytes per token are one GPU's (GLM-5 FP8: a
656-B latent row + a 132-B index key per layer), so a TP-N group holds N copies of every row and
serves the sessions one GPU's pool would (plus the pages the freed weights make room for),
while DP attention (each rank its own requests) holds each row once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dhisparse.kernels.dispatch import sparse_mla
from dhisparse.kernels.fp8_dispatch import shared_activations
from dhisparse.core.batch import ForwardBatch, KVContext
from dhisparse.layers.indexer import Indexer, IndexerProjection
from dhisparse.layers.norm import RMSNorm
from dhisparse.layers.rope import RopeTables, rope_fused, softmax_mscale
from dhisparse.core.config import ModelConfig
from dhisparse.core.kvformat import RowFormat


class Located(NamedTuple):
    """A layer's selection [T, k] (positions, -1 padding), the row space(s) it reads, the
    locations loc [T, k] of the selected rows in them (-1: none) and the rows' format (None:
    plain rows of the model dtype; core/kvformat.py)."""

    selection: torch.Tensor
    rows: object
    loc: torch.Tensor
    fmt: RowFormat | None = None


class PreAttention(NamedTuple):
    """The KV-free part of a layer's attention. q_abs [T, H, C] queries absorbed into latent
    space; q_pe [T, H, rope] roped; latent [T, C + rope] the row to store; index: the indexer's
    projections (None on GLM `shared` layers)."""

    q_abs: torch.Tensor
    q_pe: torch.Tensor
    latent: torch.Tensor
    index: IndexerProjection | None


class MLAttention(nn.Module):
    """MLA + lightning indexer (HF module names). Shared (GLM) layers have no indexer."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        H = cfg.num_heads
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.indexer = Indexer(cfg) if cfg.indexer_full[layer] else None
        self.scale = cfg.qk_head_dim**-0.5 * softmax_mscale(cfg.rope)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, C], W_UV [H, v, C]) split out of kv_b_proj."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        batch: ForwardBatch,
        kv: KVContext,
        prev_selection: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (out [T, hidden], selection [T, index_topk])."""
        return self.core(self.pre(x, rope.C, rope.S), batch, kv, prev_selection)

    def pre(self, x: torch.Tensor, C: torch.Tensor, S: torch.Tensor) -> PreAttention:
        """Everything before the KV cache, a pure per-token function (graph-capturable):
        x [T, hidden], C / S [T, rope] (RopeTables) -> PreAttention."""
        c, T, rope = self.cfg, x.shape[0], RopeTables(None, None, C, S)
        with shared_activations(x):  # FP8 w8a8: q_a and kv_a quantize x once
            q_lat = self.q_a_layernorm(self.q_a_proj(x))
            ckv = self.kv_a_proj_with_mqa(x)
        q = self.q_b_proj(q_lat).view(T, c.num_heads, c.qk_head_dim)
        q_pe = rope_fused(q[..., c.qk_nope_head_dim :], rope, interleaved=True)
        q_abs = torch.einsum("thn,hnc->thc", q[..., : c.qk_nope_head_dim], self.absorbed_weights()[0])
        latent = torch.cat([self.kv_a_layernorm(ckv[:, : c.kv_lora_rank]), rope_fused(ckv[:, c.kv_lora_rank :], rope, interleaved=True)], -1)
        proj = self.indexer.project(x, q_lat, rope) if self.indexer is not None else None
        return PreAttention(q_abs, q_pe, latent, proj)

    def core(self, pre: PreAttention, batch: ForwardBatch, kv: KVContext,
             prev_selection: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the rows, select, locate, attend, project out: (out [T, hidden], selection)."""
        o_lat, selection = self.attend(pre, batch, kv, prev_selection)
        return self.post(o_lat), selection

    def attend(self, pre: PreAttention, batch: ForwardBatch, kv: KVContext,
               prev_selection: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV part: store the rows, select, locate, sparse attention ->
        (o_lat [T, heads, kv_lora_rank], selection [T, index_topk])."""
        found = self.locate(pre, batch, kv, prev_selection)
        return self.sparse(pre.q_abs, pre.q_pe, found.rows, found.loc, found.fmt), found.selection

    def locate(self, pre: PreAttention, batch: ForwardBatch, kv: KVContext,
               prev_selection: torch.Tensor | None) -> "Located":
        """Store this layer's rows, select (own indexer or the producer's selection), locate."""
        c, proj = self.cfg, pre.index
        kv.store(self.layer, pre.latent, proj.k if proj is not None else None)
        if proj is not None:
            selection = self.indexer.select(proj, batch, kv, self.layer, c.index_topk)
        elif prev_selection is None:
            raise ValueError(f"layer {self.layer} is 'shared' but received no selection from a full layer")
        else:
            selection = prev_selection
        rows, loc = kv.locate(self.layer, selection)
        formats = kv.row_formats()
        return Located(selection, rows, loc, formats.latent if formats is not None else None)

    def sparse(self, q_abs: torch.Tensor, q_pe: torch.Tensor, rows, loc: torch.Tensor,
               fmt: RowFormat | None = None) -> torch.Tensor:
        """Sparse MLA over the located rows (stored in `fmt`): q_abs [T, H, C], q_pe [T, H, rope],
        loc [T, k] -> o_lat [T, H, C]."""
        return sparse_mla(q_abs, q_pe, rows, loc, self.scale, fmt)

    def post(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Value up-projection and out-projection, a pure per-token function (graph-capturable):
        o_lat [T, heads, kv_lora_rank] -> [T, hidden]."""
        o = torch.einsum("thc,hvc->thv", o_lat, self.absorbed_weights()[1]).reshape(o_lat.shape[0], -1)
        return self.o_proj(o)
