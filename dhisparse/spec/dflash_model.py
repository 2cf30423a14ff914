"""The DFlash / DFlash2 block drafter network (our own implementation of the published design; the
`dflash` package's DFlashDraftModel / DFlash2DraftModel are its test-time reference).

One pass drafts a whole block for N requests at once:

    block input  [anchor, mask, ..., mask] (B tokens) embedded with the TARGET's table, times
                 input_embedding_scale -> x [N, B, H]
    context      target features of committed positions: cat over target_layer_ids -> fc ->
                 hidden_norm -> c [n, H]; every draft layer projects c with its own k/v
                 (k_norm, RoPE at the context positions) -> context K/V, stored by the caller
    each layer   h = x + attn(norm(x)); x = h + mlp(norm(h)); queries come only from the block;
                 keys/values = [context K/V ; block K/V] (KV injection prepends the context);
                 which keys a query sees is the layer's mask (`attention_mask`: sliding window,
                 causal or not - DFlash's blocks are non-causal)
    DFlash2      each layer's attention input and MLP input pass a grouped dynamic causal
                 convolution along the block (`GroupedDynamicConv.prepare`), and their outputs
                 the second half of it (`finish`), with per-token kernels predicted from the input
    output       final norm -> the TARGET's LM head on block rows 1..B-1, times output_multiplier,
                 soft-capped (`logits`); DFlash2 then walks its candidate lattice (`CandidateSelector`),
                 DSpark its sequential head (`SequentialHead`, spec/dspark_head.py)

Parameter names (state-dict keys, no prefix): fc.weight [H, F*H], hidden_norm.weight, norm.weight,
layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight,
layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias with attention_bias),
layers.{i}.self_attn.{q,k}_norm.weight (qk_norm), layers.{i}.mlp.{gate,up,down}_proj.weight;
DFlash2: layers.{i}.{attention,mlp}_conv.base_kernel [2, ks, H],
layers.{i}.{attention,mlp}_conv.kernel_projection.weight [2*ks*H/g, H],
candidate_selector.{predecessor,successor}_codebook.weight [V, r], candidate_selector.hidden_projection.weight [r, H].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dhisparse.layers.moe import MLP
from dhisparse.layers.norm import RMSNorm
from dhisparse.layers.rope import rope_half_split
from dhisparse.spec.dflash_config import DFlashConfig
from dhisparse.spec.dflash_select import CandidateSelector, GroupedDynamicConv
from dhisparse.spec.dspark_head import SequentialHead


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, window: int | None,
                   causal: bool) -> torch.Tensor:
    """Which keys each block query sees. q_pos [N, B], k_pos [N, L+B], k_valid [N, L+B] -> [N, B, L+B]:
    valid keys with (causal) k <= q, (window) q - k < window and, when not causal, k - q < window."""
    d = q_pos[:, :, None] - k_pos[:, None, :]
    visible = k_valid[:, None, :].expand(-1, q_pos.shape[1], -1).clone()
    if causal:
        visible &= d >= 0
    if window is not None:
        visible &= d < window
        if not causal:
            visible &= -d < window
    return visible


class DraftAttention(nn.Module):
    """GQA attention whose keys/values are [injected context ; block]."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H]; cos/sin [T, d/2] -> roped k, v [T, kv_heads, head_dim]."""
        k = self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        return rope_half_split(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """x [N, B, H]; cos/sin [N*B, d/2] (block positions); ctx_k/ctx_v [N, L, kv_heads, d];
        visible [N, B, L+B] (attention_mask) -> [N, B, H]."""
        n, b, _ = x.shape
        flat = x.reshape(n * b, -1)
        q = rope_half_split(self.q_norm(self.q_proj(flat).view(-1, self.heads, self.head_dim)), cos, sin)
        k_blk, v_blk = self.kv(flat, cos, sin)
        shape = (n, b, self.kv_heads, self.head_dim)
        out = grouped_attention(q.view(n, b, self.heads, self.head_dim), ctx_k, ctx_v, k_blk.view(shape),
                                v_blk.view(shape), visible)
        return self.o_proj(out.to(x.dtype).reshape(n, b, -1))


def _keys32(ctx: torch.Tensor, blk: torch.Tensor) -> torch.Tensor:
    """[ctx ; blk] along positions, per K/V head, in fp32: ctx [N, L, kvh, d], blk [N, B, kvh, d]
    -> [N, kvh, L+B, d] contiguous (the transpose and the upcast are one copy)."""
    return torch.cat([ctx, blk], dim=1).transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)


def grouped_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, k_blk: torch.Tensor,
                      v_blk: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """GQA over [context ; block], each K/V head read once for its group of query heads.

    q [N, B, Hq, d]; ctx_k / ctx_v [N, L, kvh, d]; k_blk / v_blk [N, B, kvh, d]; visible [N, B, L+B]
    -> [N, B, Hq, d]: fp32 for fp32 inputs (`upcast_grouped`: the reference parity and training
    path), q's dtype for 16-bit ones (`fused_grouped`). Query head h uses K/V head h // (Hq / kvh),
    as repeat_interleave would pair them; a query that sees no key gets 0.

        scores [N, kvh, B*rep, L+B]   rows (block query i, head r of the group), i-major
               = q_g @ k^T / sqrt(d), -inf where not visible, softmax over keys

    The per-head form (K/V repeated to every query head, then upcast) moved Hq/kvh times the K/V
    bytes: with the paper's GLM-5 drafter shape (48 query heads over 4 K/V heads of 128, a 2,048-row
    window) ~2 GB of transient fp32 K/V a layer at C20. Here K/V are upcast once per K/V head
    (`per_head_attention` is the reference; tests/test_dflash_attention.py checks the two agree and
    that a wrong pairing fails).
    """
    form = fused_grouped if q.dtype in (torch.float16, torch.bfloat16) else upcast_grouped
    return form(q, ctx_k, ctx_v, k_blk, v_blk, visible)


def upcast_grouped(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, k_blk: torch.Tensor,
                   v_blk: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`grouped_attention` in fp32 whatever the input dtype (K/V upcast once per K/V head, fp32
    GEMMs, softmax): the fp32 path, and for 16-bit inputs the form before session 46 (the named
    baseline of bench/dflash_attention_bench.py). -> [N, B, Hq, d] fp32."""
    n, b, hq, d = q.shape
    kvh = ctx_k.shape[2]
    k, v = _keys32(ctx_k, k_blk), _keys32(ctx_v, v_blk)
    scores = (_grouped_rows(q, kvh).float() @ k.transpose(-1, -2)).div_(math.sqrt(d))  # [N, kvh, B*rep, L+B]
    scores.view(n, kvh, b, hq // kvh, -1).masked_fill_(~visible[:, None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # out of place: training differentiates softmax
    return _per_query(probs @ v, b)


def fused_grouped(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, k_blk: torch.Tensor,
                  v_blk: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`grouped_attention` for 16-bit inputs: the same [N, kvh, B*rep, L+B] problem through one fused
    `scaled_dot_product_attention` in the input dtype (fp32 accumulation and softmax inside the
    kernel; the probabilities meet V in 16 bits, as the dflash reference's eager bf16 attention rounds
    them too), instead of upcasting K/V, fp32 GEMMs without tensor cores, a separate softmax and a
    NaN pass: at the paper's GLM-5 drafter shape those were about 3.5 ms of a 12.6-ms round at C20
    (H100, bench/results/step_profile_round_faithful_e12_100k_k2048_c20_w8a8_indexer_s46_h100.json).
    Drafts only: the target's tokens never depend on it. A query row that sees no key comes back
    NaN or 0 by backend; it is 0 here."""
    n, b, hq, _ = q.shape
    kvh = ctx_k.shape[2]
    rep = hq // kvh
    k = torch.cat([ctx_k, k_blk], dim=1).transpose(1, 2)  # [N, kvh, L+B, d]
    v = torch.cat([ctx_v, v_blk], dim=1).transpose(1, 2)
    mask = visible[:, None, :, None, :].expand(n, 1, b, rep, visible.shape[-1]).reshape(n, 1, b * rep, -1)
    out = F.scaled_dot_product_attention(_grouped_rows(q, kvh), k, v, attn_mask=mask)
    return _per_query(out.nan_to_num(0.0), b)  # out of place: SDPA's backward keeps its output


def _grouped_rows(q: torch.Tensor, kvh: int) -> torch.Tensor:
    """q [N, B, Hq, d] -> [N, kvh, B*rep, d] (rep = Hq / kvh): K/V head g's query heads g*rep ..
    g*rep+rep-1, rows i-major (block query i, head r of the group), the layout both grouped forms
    and their masks share."""
    n, b, hq, d = q.shape
    return q.view(n, b, kvh, hq // kvh, d).permute(0, 2, 1, 3, 4).reshape(n, kvh, b * (hq // kvh), d)


def _per_query(out: torch.Tensor, b: int) -> torch.Tensor:
    """`_grouped_rows`' inverse: [N, kvh, B*rep, d] -> [N, B, kvh*rep, d]."""
    n, kvh, rows, d = out.shape
    return out.view(n, kvh, b, rows // b, d).permute(0, 2, 1, 3, 4).reshape(n, b, kvh * (rows // b), d)


def per_head_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, k_blk: torch.Tensor,
                       v_blk: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`grouped_attention`'s plain reference, same signature and result: K/V repeated to every
    query head (repeat_interleave), upcast, masked softmax. Tests and bench/drafter_round.py only:
    it moves Hq / kvh times the K/V bytes."""
    rep = q.shape[2] // ctx_k.shape[2]
    k = torch.cat([ctx_k, k_blk], 1).repeat_interleave(rep, dim=2).transpose(1, 2).float()
    v = torch.cat([ctx_v, v_blk], 1).repeat_interleave(rep, dim=2).transpose(1, 2).float()
    scores = (q.transpose(1, 2).float() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return (torch.softmax(scores, -1).nan_to_num(0.0) @ v).transpose(1, 2)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, index: int) -> None:
        super().__init__()
        self.window, self.causal = cfg.layer_window(index), cfg.layer_causal(index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        if cfg.is_dflash2:
            self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, x, cos, sin, ctx_k, ctx_v, q_pos, k_pos, k_valid):
        visible = attention_mask(q_pos, k_pos, k_valid, self.window, self.causal)
        h = self._around(self.attention_conv, self.input_layernorm(x),
                         lambda t: self.self_attn(t, cos, sin, ctx_k, ctx_v, visible))
        h = x + h
        return h + self._around(self.mlp_conv, self.post_attention_layernorm(h), self.mlp)

    @staticmethod
    def _around(conv, x, inner):
        if conv is None:
            return inner(x)
        x, kernels = conv.prepare(x)
        return conv.finish(inner(x), kernels)


class DFlashModel(nn.Module):
    """Owns its layers, fc, norms, RoPE (and DFlash2's selector); embeddings and LM head are the target's."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_dflash2:
            self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank,
                                                        cfg.selector_top_k)
        if cfg.is_dspark:
            self.sequential_head = SequentialHead(cfg.vocab_size, cfg.hidden_size, cfg.dspark_markov_rank,
                                                  cfg.dspark_markov_gated)
        # plain attribute, not a buffer: casting the model to bf16 must not round the frequencies
        self._inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [numel, head_dim/2] (half-split rotation, default RoPE)."""
        pos = positions.reshape(-1).to(torch.float64)
        if self._inv_freq.device != positions.device:  # moved once: no host copy inside a graph capture
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = pos[:, None] * self._inv_freq[None, :]
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
    def block_hidden(self, x: torch.Tensor, positions: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
                     ctx_valid: torch.Tensor, ctx_positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, B, H] embedded block (scaled); positions [N, B]; ctx per layer (k, v) [N, L, kvh, d];
        ctx_valid [N, L]; ctx_positions [N, L] (None: the L positions right before the block)
        -> final-normed hidden [N, B, H]."""
        n, b, _ = x.shape
        length = ctx_valid.shape[1]
        if ctx_positions is None:
            ctx_positions = positions[:, :1] - length + torch.arange(length, device=x.device)[None, :]
        k_pos = torch.cat([ctx_positions.to(positions.device), positions], dim=1)
        k_valid = torch.cat([ctx_valid.to(x.device), torch.ones(n, b, dtype=torch.bool, device=x.device)], dim=1)
        cos, sin = self.rope(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx):
            x = layer(x, cos, sin, k, v, positions, k_pos, k_valid)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """hidden [..., H] -> fp32 logits [..., V]: the target's head, times output_multiplier, soft-capped."""
        out = lm_head(hidden.to(lm_head.weight.dtype)).float() * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    @torch.no_grad()
    def init_random(self, generator: torch.Generator) -> None:
        """Seeded weights: norms 1, linear weights N(0, 1/fan_in) (keeps activations O(1))."""
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias") or name.endswith("base_kernel"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
