"""DeepSeek-V4 (`deepseek_v4`) causal LM in our own PyTorch.

Module and parameter names follow transformers' in-memory state dict (`model.layers.i.self_attn.
compressor.indexer.q_b_proj`, `model.layers.i.attn_hc.fn`, `model.hc_head.hc_fn`, ...), so the
loader maps the upstream and HF-saved spellings onto it (`models/v4_loader.py`).

The forward runs over a flattened `ForwardBatch` (any mix of prefill chunks, single decode tokens
and K-token verification runs) and reads / writes all attention state through a `V4Pass`
(`kv/v4/passes.py`) built from per-request `V4RequestState`s; the modules hold no state.

    ids [T] -> embed -> streams [T, N, D] (N = hc_mult copies)
    per layer:  streams = hc(attn(input_layernorm(collapse)))  then  hc(moe(post_attention_layernorm(collapse)))
    hidden = norm(hc_head(streams)) [T, D];  logits = lm_head(hidden)
"""

from __future__ import annotations

import torch
from torch import nn

from dhisparse.core.batch import ForwardBatch
from dhisparse.layers.rope import RotaryEmbedding
from dhisparse.layers.v4_attention import V4Attention, V4RopeTables
from dhisparse.layers.v4_hyper import HyperConnection, HyperHead, hc_expand
from dhisparse.layers.v4_moe import V4MoE
from dhisparse.layers.v4_ops import V4RMSNorm
from dhisparse.models.dsa import ModelOutput
from dhisparse.models.base import CausalLMHead
from dhisparse.core.v4_config import V4Config


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: V4Config, layer: int) -> None:
        super().__init__()
        args = (cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.self_attn = V4Attention(cfg, layer)
        self.mlp = V4MoE(cfg, layer)
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*args)
        self.ffn_hc = HyperConnection(*args)

    def forward(self, streams: torch.Tensor, ropes: V4RopeTables, batch: ForwardBatch, ctx) -> torch.Tensor:
        """streams [T, N, D] -> [T, N, D]."""
        w = self.attn_hc(streams)
        streams = hc_expand(w, streams, self.self_attn(self.input_layernorm(w.collapsed), ropes, batch, ctx))
        w = self.ffn_hc(streams)
        return hc_expand(w, streams, self.mlp(self.post_attention_layernorm(w.collapsed), batch.input_ids))


class V4Model(nn.Module):
    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
        self.build_ropes(cfg)

    def build_ropes(self, cfg: V4Config, device: torch.device | str | None = None) -> None:
        """(Re)create the rope modules (non-persistent buffers; call after a meta-device load)."""
        self.rope_main = RotaryEmbedding(cfg.rope_main, cfg.rope_head_dim)
        self.rope_compress = RotaryEmbedding(cfg.rope_compress, cfg.rope_head_dim)
        if device is not None:
            self.rope_main, self.rope_compress = self.rope_main.to(device), self.rope_compress.to(device)


class DeepseekV4ForCausalLM(CausalLMHead):
    """The V4 target model. `forward(batch, ctx)` -> ModelOutput; `logits(hidden)` -> fp32 logits."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = V4Model(cfg)
        self._init_head(cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, ctx, capture_layers: tuple[int, ...] = ()) -> ModelOutput:
        """batch: T new tokens of N requests; ctx: V4Pass over their states (advanced on return).

        Returns ModelOutput(hidden [T, hidden] after hc_head + norm, captured {layer: [T, hidden]},
        the mean over the hc_mult residual streams after layer `layer`: the target features that
        DFlash / DSpark drafters condition on; key num_layers: the last layer's streams themselves,
        flattened [T, hc_mult * hidden], before hc_head and the final norm, which the MTP block reads).
        """
        m = self.model
        h = m.embed_tokens(batch.input_ids)
        ropes = V4RopeTables(m.rope_main(batch.positions, h.dtype), m.rope_compress(batch.positions, h.dtype),
                             m.rope_compress)
        streams = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(m.layers):
            streams = layer(streams, ropes, batch, ctx)
            if i in capture_layers:  # drafter features: the mean of the hc_mult streams [T, D]
                captured[i] = streams.mean(dim=1)
        if len(m.layers) in capture_layers:  # the MTP block's input (spec/mtp_v4.py): streams before hc_head
            captured[len(m.layers)] = streams.flatten(1)
        ctx.finish()
        return ModelOutput(m.norm(m.hc_head(streams)), captured)
