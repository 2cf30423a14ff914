"""GLM-5.x (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`) causal LMs in our own PyTorch.

Module and parameter names follow transformers' state dict (`model.layers.i.self_attn.q_a_proj`,
`model.layers.i.mlp.experts.gate_up_proj`, ...), so a checkpoint maps onto the module with the
loader's small renaming (per-expert tensors are stacked). The forward works over a flattened
`ForwardBatch` and reads / writes KV only through a `KVContext`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from dhisparse.core.batch import ForwardBatch, KVContext
from dhisparse.layers.attention import MLAttention
from dhisparse.layers.moe import MLP, MoE
from dhisparse.layers.norm import RMSNorm
from dhisparse.layers.rope import RopeTables, RotaryEmbedding
from dhisparse.models.base import CausalLMHead
from dhisparse.core.config import ModelConfig
from dhisparse.models.graphs import spaces_key


@dataclass
class ModelOutput:
    """hidden [T, hidden] after the final norm; captured {layer: [T, hidden]} outputs of the
    decoder layers asked for (the DFlash drafter conditions on them)."""

    hidden: torch.Tensor
    captured: dict[int, torch.Tensor] = field(default_factory=dict)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, layer)
        self.mlp = MoE(cfg) if cfg.mlp_moe[layer] else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        """The FFN block with its residual: a pure function of h [T, H] (graph-capturable)."""
        return h + self.mlp(self.post_attention_layernorm(h))

    def post_ffn(self, h: torch.Tensor, o_lat: torch.Tensor) -> torch.Tensor:
        """Attention out-projection + residual, then the FFN block: a pure function of the layer
        input h [T, H] and the attention output o_lat [T, heads, kv_lora_rank] (graph-capturable)."""
        return self.ffn(h + self.self_attn.post(o_lat))

    def attn_ffn(self, rows, fmt, h: torch.Tensor, q_abs: torch.Tensor, q_pe: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        """Sparse attention over `rows` (stored in RowFormat `fmt`, None = plain) at loc [T, k],
        then `post_ffn`: a function of its tensor inputs for fixed row spaces (graph-capturable
        per engine)."""
        return self.post_ffn(h, self.self_attn.sparse(q_abs, q_pe, rows, loc, fmt))

    def pre(self, h: torch.Tensor, C: torch.Tensor, S: torch.Tensor):
        """Input norm + the KV-free part of attention: a pure function of h, C, S (graph-capturable)."""
        return self.self_attn.pre(self.input_layernorm(h), C, S)

    def forward(self, h, rope, batch, kv, prev_selection, graphs=None):
        """graphs: models.graphs.PiecewiseGraphs replaying the pure pieces, or None (eager)."""
        layer = self.self_attn.layer
        if graphs is not None and "pre" in graphs.pieces:
            pre = graphs.pre(layer, self.pre, h, rope.C, rope.S)
        else:
            pre = self.pre(h, rope.C, rope.S)
        if graphs is not None and "attn" in graphs.pieces:
            found = self.self_attn.locate(pre, batch, kv, prev_selection)
            out = graphs.attn(layer, found.rows, partial(self.attn_ffn, found.rows, found.fmt), h, pre.q_abs, pre.q_pe, found.loc)
            return out, found.selection
        o_lat, selection = self.self_attn.attend(pre, batch, kv, prev_selection)
        if graphs is not None and "ffn" in graphs.pieces:
            return graphs.ffn(layer, self.post_ffn, h, o_lat), selection
        return self.post_ffn(h, o_lat), selection


class DsaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)


class DsaForCausalLM(CausalLMHead):
    """The target model. `forward(batch, kv)` -> ModelOutput; `logits(hidden)` -> fp32 logits."""

    supports_cuda_graphs = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DsaModel(cfg)
        self.graphs = None  # models.graphs.PiecewiseGraphs: CUDA-graph replays of each layer's pure pieces
        self._init_head(cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings)

    @torch.inference_mode()
    def capture_graphs(self, max_tokens: int, spaces=None, fmt=None) -> int:
        """Capture every layer's graph pieces for each bucket up to `max_tokens` tokens a pass (the
        decode / verification batches) now, so no step pays a capture; larger passes (prefill
        chunks) run eagerly. Pure pieces see zero inputs; the 'attn' piece sees no located rows
        (loc -1). spaces(layer) -> the row-space variants that layer reads (the engine's arena
        rows, and with staging the (rows, stage) pair); 'attn' graphs of other row spaces are
        dropped, and without `spaces` none are captured here; fmt: the RowFormat of those rows
        (None: plain). Returns the number captured."""
        g = self.graphs
        if g is None:
            return 0
        before, m, c = len(g.replays), self.model, self.config
        dev, dtype = m.embed_tokens.weight.device, m.embed_tokens.weight.dtype
        if spaces is not None and "attn" in g.pieces:
            before -= g.keep_spaces({spaces_key(r) for i in range(len(m.layers)) for r in spaces(i)})
        for T in g.allow(max_tokens):
            h = torch.zeros(T, c.hidden_size, device=dev, dtype=dtype)
            rope = RopeTables.build(*m.rotary_emb(torch.zeros(T, dtype=torch.int64, device=dev), dtype))
            o_lat = torch.zeros(T, c.num_heads, c.kv_lora_rank, device=dev, dtype=dtype)
            q_pe = torch.zeros(T, c.num_heads, c.qk_rope_head_dim, device=dev, dtype=dtype)
            loc = torch.full((T, c.index_topk), -1, dtype=torch.int64, device=dev)
            for i, layer in enumerate(m.layers):
                if "pre" in g.pieces:
                    g.pre(i, layer.pre, h, rope.C, rope.S)
                if "ffn" in g.pieces:
                    g.ffn(i, layer.post_ffn, h, o_lat)
                if "attn" in g.pieces and spaces is not None:
                    for rows in spaces(i):
                        g.attn(i, rows, partial(layer.attn_ffn, rows, fmt), h, o_lat, q_pe, loc)
        return len(g.replays) - before

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVContext, capture_layers: tuple[int, ...] = (),
                piecewise: bool = True) -> ModelOutput:
        """piecewise=False: no piecewise graph replays (inside a whole-step graph capture)."""
        m = self.model
        graphs = self.graphs if piecewise else None
        h = m.embed_tokens(batch.input_ids)
        rope = RopeTables.build(*m.rotary_emb(batch.positions, h.dtype))  # once per pass
        selection = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.layers):
            h, selection = layer(h, rope, batch, kv, selection, graphs)
            if i in capture_layers:
                captured[i] = h
        kv.finish()
        return ModelOutput(m.norm(h), captured)
