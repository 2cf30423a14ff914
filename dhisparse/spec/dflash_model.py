"""The DFlash-style block drafter network (our own implementation of the published design).

One pass drafts a whole block for N requests at once:

    block input  [anchor, mask, ..., mask] (B tokens) embedded with the TARGET's table -> x [N, B, H]
    context      target features of committed positions: cat over target_layer_ids -> fc ->
                 hidden_norm -> c [n, H]; every draft layer projects c with its own k/v
                 (k_norm, RoPE at the context positions) -> context K/V, stored by the caller
    each layer   h = x + attn(norm(x)); x = h + mlp(norm(h)); queries come only from the block;
                 keys/values = [context K/V of the visible window ; block K/V] (KV injection
                 prepends the context); attention is non-causal inside the block
    output       final norm -> the TARGET's LM head on block rows 1..B-1 (drafts x_1..x_{B-1})

Parameter names (state-dict keys, no prefix): fc.weight [H, F*H], hidden_norm.weight, norm.weight,
layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight,
layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight (qk_norm),
layers.{i}.mlp.{gate,up,down}_proj.weight.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dhisparse.layers.moe import MLP
from dhisparse.layers.norm import RMSNorm
from dhisparse.layers.rope import rope_half_split
from dhisparse.spec.dflash_config import DFlashConfig


class DraftAttention(nn.Module):
    """GQA attention whose keys/values are [injected context ; block]."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H]; cos/sin [T, d/2] -> roped k, v [T, kv_heads, head_dim]."""
        k = self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        return rope_half_split(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """x [N, B, H]; cos/sin [N*B, d/2] (block positions); ctx_k/ctx_v [N, L, kv_heads, d];
        ctx_valid [N, L] bool (False = padding) -> [N, B, H]."""
        n, b, _ = x.shape
        flat = x.reshape(n * b, -1)
        q = rope_half_split(self.q_norm(self.q_proj(flat).view(-1, self.heads, self.head_dim)), cos, sin)
        k_blk, v_blk = self.kv(flat, cos, sin)
        k = torch.cat([ctx_k, k_blk.view(n, b, self.kv_heads, self.head_dim)], dim=1)  # [N, L+B, kvh, d]
        v = torch.cat([ctx_v, v_blk.view(n, b, self.kv_heads, self.head_dim)], dim=1)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=2).transpose(1, 2)  # [N, heads, L+B, d]
        v = v.repeat_interleave(rep, dim=2).transpose(1, 2)
        q = q.view(n, b, self.heads, self.head_dim).transpose(1, 2)  # [N, heads, B, d]
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
        valid = torch.cat([ctx_valid, torch.ones(n, b, dtype=torch.bool, device=x.device)], dim=1)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v.float()  # [N, heads, B, d]
        return self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(n, b, -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_valid):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, ctx_valid)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """Owns only its layers, fc, norms and RoPE; embeddings and LM head are the target's."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # plain attribute, not a buffer: casting the model to bf16 must not round the frequencies
        self._inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [numel, head_dim/2] (half-split rotation, default RoPE)."""
        pos = positions.reshape(-1).to(torch.float64)
        freqs = pos[:, None] * self._inv_freq.to(positions.device)[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    @torch.inference_mode()
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [n, F*H] (target layers concatenated in target_layer_ids order); positions [n]
        -> per draft layer (k, v) [n, kv_heads, head_dim]."""
        w = self.fc.weight
        ctx = self.hidden_norm(self.fc(features.to(device=w.device, dtype=w.dtype)))
        cos, sin = self.rope(positions.to(w.device), ctx.dtype)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    @torch.inference_mode()
    def block_hidden(self, x: torch.Tensor, positions: torch.Tensor,
                     ctx: list[tuple[torch.Tensor, torch.Tensor]], ctx_valid: torch.Tensor) -> torch.Tensor:
        """x [N, B, H] embedded block; positions [N, B]; ctx per layer (k, v) [N, L, kvh, d];
        ctx_valid [N, L] -> final-normed hidden [N, B, H]."""
        cos, sin = self.rope(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx):
            x = layer(x, cos, sin, k, v, ctx_valid)
        return self.norm(x)

    @torch.no_grad()
    def init_random(self, generator: torch.Generator) -> None:
        """Seeded weights: norms 1, linear weights N(0, 1/fan_in) (keeps activations O(1))."""
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))

