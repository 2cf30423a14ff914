"""The DeepSeek-V4 MTP ("next-n predict") block as a PyTorch module, built from our V4 layers.

Structure (D = hidden, N = hc_mult, V = vocab, Dh = head_dim; one position t):

    e_t  = embed(x_{t+1})                        [T, D]     zero at t = 0 (`mask_position0`, as vLLM)
    g_t  = the target's residual streams after its last layer, BEFORE hc_head and the final
           norm, flattened                       [T, N * D] (`DeepseekV4ForCausalLM` capture key L)
    s_t  = h_proj(hnorm(g_t viewed [N, D]))  +  e_proj(enorm(e_t))   broadcast over the N streams
                                                 [T, N, D]  e_proj / h_proj: [D, D] each, no bias
    s'_t = V4DecoderLayer L (hyper-connections around sliding-window attention and the MoE) [T, N, D]
    logits_t = head(norm(hc_head(s'_t)))         [T, V]     the block's own hc_head / norm; the
                                                            target's head unless it ships `head`

hnorm and h_proj act on each stream; e_proj's output is added to all N of them. Chaining feeds
s'_t (flattened, again before any head) back as the next step's g. The decoder layer is
`models.dsv4.V4DecoderLayer` built for layer index L = num_hidden_layers on the target's config
extended by that layer (`layer_config`): sliding-window attention (V4 configs list the MTP layer
in `compress_ratios` with ratio 0), the "main" RoPE of sliding layers (rope_theta, unscaled), and
a scored MoE (layer L is past num_hash_layers; a block that ships `ffn.gate.tid2eid` is hashed on
x_{t+1}, as DeepSeek's Block passes its input ids). The layer's attention row of position t is
kv_t = RoPE(kv_norm(kv_proj(attn_norm(collapse_attn_hc(s_t)))))  [Dh] (`kv_rows`).

Sources read (paraphrased, nothing copied): DeepSeek's V4 inference `model.py` `MTPBlock(Block)`
as reproduced in public ports (e.g. chiro2001/deepseek-v4.1-flash-ascend910B, torchtitan's
deepseek_v4 `MTPBlock`), vLLM's `deepseek_v4_mtp.py` (`DeepSeekV4MultiTokenPredictorLayer`: the
target hands the flat pre-hc_head residual, position 0 masked, hc_head deferred to the logits,
`mtp.{i}.*` names) and llama.cpp's V4 NextN graph (the MTP input is the last layer's HC output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from dhisparse.core.v4_config import SLIDING, V4Config
from dhisparse.core.v4_sources import FULL
from dhisparse.kv.v4.passes import LocatedRows
from dhisparse.layers.rope import RotaryEmbedding
from dhisparse.layers.v4_attention import V4RopeTables
from dhisparse.layers.v4_hyper import HyperHead
from dhisparse.layers.v4_ops import V4RMSNorm, rope_trailing
from dhisparse.models.dsv4 import V4DecoderLayer
from dhisparse.models.v4_loader import _FP32 as KEEP_FP32  # the target's fp32 rule (hyper-connections, norms, ...)


@dataclass(frozen=True)
class MtpV4Config:
    """layer: L = num_hidden_layers; hashed: hash-routed MoE (the block ships tid2eid);
    own_embed / own_head: the block ships `embed` / `head` (else the target's are shared)."""

    layer: int
    hashed: bool = False
    own_embed: bool = False
    own_head: bool = False
    mask_position0: bool = True


def layer_config(tcfg: V4Config, hashed: bool = False) -> V4Config:
    """The target's config plus layer L = num_layers: sliding-window attention, its own source."""
    L = tcfg.num_layers
    ext: dict = dict(num_layers=L + 1, layer_types=tcfg.layer_types + (SLIDING,), mlp_hash=tcfg.mlp_hash + (hashed,))
    if tcfg.kv_source_layer_ids:
        ext["kv_source_layer_ids"] = tcfg.kv_source_layer_ids + (L,)
    if tcfg.selection_types:
        ext["selection_types"] = tcfg.selection_types + (FULL,)
    return tcfg.with_updates(**ext)


class _Tokens(NamedTuple):
    """What the decoder layer reads from a batch for a sliding layer: the ids (hash routing)."""

    input_ids: torch.Tensor


class SequenceWindow:
    """A `V4Pass` stand-in over whole sequences: row t sees rows max(start, t - W + 1)..t of its
    own sequence (positions [T], each sequence starting at 0). Records the rows it was given."""

    def __init__(self, positions: torch.Tensor, window: int) -> None:
        self.positions, self.width, self.kv = positions, window, None

    def window_rows(self, kv: torch.Tensor) -> LocatedRows:
        T, W = kv.shape[0], self.width
        row = torch.arange(T, device=kv.device)
        cand = row[:, None] - (W - 1) + torch.arange(W, device=kv.device)[None, :]  # [T, W]
        loc = torch.where(cand >= (row - self.positions)[:, None], cand, torch.full_like(cand, -1))
        return LocatedRows(kv[:, None, :], loc)

    def window(self, layer: int, kv: torch.Tensor) -> LocatedRows:  # noqa: ARG002 (the V4Pass signature)
        self.kv = kv
        return self.window_rows(kv)


class MtpV4Module(nn.Module):
    def __init__(self, cfg: MtpV4Config, tcfg: V4Config) -> None:
        super().__init__()
        D, eps = tcfg.hidden_size, tcfg.rms_norm_eps
        self.cfg, self.tcfg = cfg, tcfg
        self.enorm, self.hnorm, self.norm = V4RMSNorm(D, eps), V4RMSNorm(D, eps), V4RMSNorm(D, eps)
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.block = V4DecoderLayer(layer_config(tcfg, cfg.hashed), cfg.layer)
        self.hc_head = HyperHead(D, tcfg.hc_mult, tcfg.hc_eps, eps)
        self.head = nn.Linear(D, tcfg.vocab_size, bias=False) if cfg.own_head else None
        self.embed = nn.Embedding(tcfg.vocab_size, D) if cfg.own_embed else None
        self.rope = RotaryEmbedding(tcfg.rope_main, tcfg.rope_head_dim)  # sliding layers use the main rope

    @property
    def weight(self) -> torch.Tensor:
        """A parameter in the module's compute dtype / device."""
        return self.e_proj.weight

    # ---- the forward, piece by piece -----------------------------------------------------------
    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embeds [T, D] of x_{t+1}, hidden [T, N * D] (g_t), positions [T] -> streams s [T, N, D]."""
        dt = self.weight.dtype
        embeds = embeds.to(dt)
        if self.cfg.mask_position0:
            embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        h = self.hnorm(hidden.to(dt).view(hidden.shape[0], self.tcfg.hc_mult, self.tcfg.hidden_size))
        return self.h_proj(h) + self.e_proj(self.enorm(embeds)).unsqueeze(1)

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> V4RopeTables:
        main = self.rope(positions, dtype)
        return V4RopeTables(main, main, self.rope)  # a sliding layer reads only `main`

    def kv_rows(self, streams: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """streams [T, N, D] -> the attention rows the layer writes for them [T, Dh] (what
        `V4Attention` hands `ctx.window`; tests/test_spec_mtp_v4.py checks they agree)."""
        blk, attn = self.block, self.block.self_attn
        x = blk.input_layernorm(blk.attn_hc(streams).collapsed)
        cos, sin = self.rope(positions, x.dtype)
        return rope_trailing(attn.kv_norm(attn.kv_proj(x)), cos, sin)

    def run_block(self, streams: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor, ctx) -> torch.Tensor:
        """streams [T, N, D] at positions [T], token ids [T] (x_{t+1}); ctx answers
        `window(layer, kv [T, Dh]) -> LocatedRows` -> s' [T, N, D]."""
        return self.block(streams, self.ropes(positions, streams.dtype), _Tokens(ids), ctx)

    def head_input(self, streams: torch.Tensor) -> torch.Tensor:
        """s' [T, N, D] -> the LM head's input norm(hc_head(s')) [T, D]."""
        return self.norm(self.hc_head(streams))

    def forward_sequence(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                         ids: torch.Tensor, window: int) -> torch.Tensor:
        """Dense windowed causal pass over concatenated sequences (the drafter's reference).
        embeds [T, D], hidden [T, N * D], positions / ids [T] -> s' [T, N, D]."""
        streams = self.fuse(embeds, hidden, positions)
        return self.run_block(streams, positions, ids, SequenceWindow(positions, window))

    # ---- random weights ------------------------------------------------------------------------
    @torch.no_grad()
    def init_random(self, gen: torch.Generator) -> "MtpV4Module":
        """Seeded values in place (fp32 on CPU), like `build_v4_random`: norms ~1, sinks N(0, 1),
        hyper-connection bases N(0, .3) / scales N(1, .3), matrices N(0, 1 / fan_in)."""
        E, k = self.tcfg.n_routed_experts, self.tcfg.num_experts_per_tok
        for name, t in sorted(self.state_dict(keep_vars=True).items()):
            shape = t.shape
            if name.endswith("tid2eid"):
                v = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(shape[0])])
            elif name.endswith("norm.weight"):
                v = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif name.endswith(".sinks"):
                v = torch.randn(shape, generator=gen)
            elif name.endswith((".base", "hc_base")):
                v = 0.3 * torch.randn(shape, generator=gen)
            elif name.endswith((".scale", "hc_scale")):
                v = 1.0 + 0.3 * torch.randn(shape, generator=gen)
            elif name.endswith("e_score_correction_bias"):
                v = 0.05 * torch.randn(shape, generator=gen)
            else:
                v = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
            t.data = v.to(device=t.device, dtype=t.dtype if not t.is_floating_point() else torch.float32)
        return self

    def to_target(self, dtype: torch.dtype, device: torch.device | str) -> "MtpV4Module":
        """Move to the target's device and dtype; fp32 where the V4 loader keeps fp32."""
        self.rope = RotaryEmbedding(self.tcfg.rope_main, self.tcfg.rope_head_dim)  # (re)built: meta-safe
        self.to(device)
        with torch.no_grad():
            for name, t in self.state_dict(keep_vars=True).items():
                if t.is_floating_point():
                    t.data = t.data.to(torch.float32 if KEEP_FP32.search(name) else dtype)
                else:
                    t.data = t.data.long()
        return self

    @classmethod
    def random(cls, tcfg: V4Config, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", **cfg_kw) -> "MtpV4Module":
        """A seeded random V4 MTP block (built-in random V4 models ship none)."""
        cfg = MtpV4Config(layer=tcfg.num_layers, **cfg_kw)
        return cls(cfg, tcfg).init_random(torch.Generator().manual_seed(seed)).to_target(dtype, device).eval()
