"""The DeepSeek-V3-style MTP ("next-n predict") module as a PyTorch module.

For one position t (H = hidden size, V = vocab, D = kv_lora_rank + qk_rope_head_dim):

    e_t  = embed(x_{t+1})                                     [T, H]  (zero at t = 0, see below)
    u_t  = eh_proj(cat(enorm(e_t), hnorm(g_t)))                [T, H]  eh_proj.weight [H, 2H]
    h'_t = DecoderLayer(u_t) over the module's own MLA rows     [T, H]  (MLA + MoE / MLP, residuals)
    logits_t = head(shared_head.norm(h'_t))                    [T, V]

g_t is the target's hidden state at t: with `hidden_input="normed"` (default) the target's
last-layer output after its final norm, which is what SGLang's NEXTN worker and vLLM's
DeepSeek MTP proposer hand the module (both take the model output that also feeds the LM head);
with "raw" the last-layer output before the final norm. Chaining (EAGLE-style) feeds the module's
own h' back as the next g, through `shared_head.norm` in "normed" mode (SGLang's convention: the
same kind of tensor as the target's) and raw in "raw" mode (vLLM feeds the raw h'). vLLM and a
GLM-5 NextN port zero the token embedding at position 0 (`mask_position0`); SGLang does not.

The decoder layer is `models.dsa.DecoderLayer` on a one-layer copy of the target's config (no
indexer: the drafter attends densely over its window, see `spec/mtp.py` for why that is exact DSA).
Parameter names are the checkpoint's names below the `model.layers.{L}.` prefix, except that the
decoder layer's own tensors sit under `decoder.` and experts are stacked (`spec/mtp_io.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dhisparse.core.config import ModelConfig
from dhisparse.layers.attention import PreAttention
from dhisparse.layers.norm import RMSNorm
from dhisparse.layers.rope import RopeTables, RotaryEmbedding
from dhisparse.models.dsa import DecoderLayer

HIDDEN_INPUTS = ("normed", "raw")
KEEP_FP32 = (".mlp.gate.weight", "e_score_correction_bias")  # the router stays fp32, as in the loader
STD_BY_SUFFIX = {"eh_proj.weight": 0.15, "q_a_proj.weight": 0.3, "q_b_proj.weight": 0.3, "kv_a_proj_with_mqa.weight": 0.3,
                 "kv_b_proj.weight": 0.3, "o_proj.weight": 0.2, "mlp.gate.weight": 0.3, "e_score_correction_bias": 0.05,
                 "embed_tokens.weight": 1.0, "shared_head.head.weight": 0.5}


@dataclass(frozen=True)
class MtpConfig:
    """layer: the checkpoint layer index L of the MTP block (num_hidden_layers for the first);
    moe: its FFN is MoE (else a dense SiLU-GLU MLP of intermediate_size); own_embed / own_head:
    the block ships `embed_tokens` / `shared_head.head` (else the target's are shared);
    hidden_input / mask_position0: see the module docstring."""

    layer: int
    moe: bool = True
    own_embed: bool = False
    own_head: bool = False
    hidden_input: str = "normed"
    mask_position0: bool = True

    def __post_init__(self) -> None:
        if self.hidden_input not in HIDDEN_INPUTS:
            raise ValueError(f"MtpConfig.hidden_input must be one of {HIDDEN_INPUTS}, got {self.hidden_input!r}")


def layer_config(tcfg: ModelConfig, moe: bool) -> ModelConfig:
    """A one-layer copy of the target's config for the MTP decoder layer (no indexer)."""
    return tcfg.with_updates(num_layers=1, indexer_full=(False,), mlp_moe=(moe,))


class MtpModule(nn.Module):
    def __init__(self, cfg: MtpConfig, tcfg: ModelConfig) -> None:
        super().__init__()
        H, eps = tcfg.hidden_size, tcfg.rms_norm_eps
        self.cfg, self.tcfg = cfg, tcfg
        self.enorm, self.hnorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.decoder = DecoderLayer(layer_config(tcfg, cfg.moe), 0)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, eps)
        self.shared_head.head = nn.Linear(H, tcfg.vocab_size, bias=False) if cfg.own_head else None
        self.embed_tokens = nn.Embedding(tcfg.vocab_size, H) if cfg.own_embed else None
        self.rotary_emb = RotaryEmbedding(tcfg.rope, tcfg.qk_rope_head_dim)

    @property
    def weight(self) -> torch.Tensor:
        """A parameter in the module's compute dtype / device."""
        return self.eh_proj.weight

    # ---- the forward, piece by piece -----------------------------------------------------------
    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embeds [T, H] of x_{t+1}, hidden [T, H] (g_t), positions [T] -> layer input u [T, H]."""
        if self.cfg.mask_position0:
            embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden.to(embeds.dtype))], dim=-1))

    def pre(self, u: torch.Tensor, positions: torch.Tensor) -> PreAttention:
        """u [T, H] at positions [T] -> queries and the rows to store (`latent` [T, D])."""
        rope = RopeTables.build(*self.rotary_emb(positions, u.dtype))
        return self.decoder.pre(u, rope.C, rope.S)

    def attend(self, u: torch.Tensor, pre: PreAttention, rows: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        """Attention over rows [R, 1, D] at loc [T, L] (-1 = skip), then the FFN -> h' [T, H]."""
        return self.decoder.attn_ffn(rows, None, u, pre.q_abs, pre.q_pe, loc)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """h' [T, H] -> the LM head's input shared_head.norm(h') [T, H]."""
        return self.shared_head.norm(h)

    def chain_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h' [T, H] -> the g fed to the next chained step."""
        return self.shared_head.norm(h) if self.cfg.hidden_input == "normed" else h

    def forward_sequence(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                         window: int) -> torch.Tensor:
        """Dense windowed causal pass over whole sequences (training, and the drafter's reference).
        embeds / hidden [T, H], positions [T] of concatenated sequences, each starting at position 0;
        row t attends its sequence's rows max(0, p_t - W + 1)..p_t -> h' [T, H]."""
        u = self.fuse(embeds, hidden, positions)
        pre = self.pre(u, positions)
        T = u.shape[0]
        row = torch.arange(T, device=u.device)
        cand = row[:, None] - (window - 1) + torch.arange(window, device=u.device)[None, :]  # [T, W]
        loc = torch.where(cand >= (row - positions)[:, None], cand, torch.full_like(cand, -1))
        return self.attend(u, pre, pre.latent[:, None, :], loc)

    # ---- random weights ------------------------------------------------------------------------
    def init_random(self, gen: torch.Generator) -> "MtpModule":
        """Seeded values in place (sampled in fp32 on CPU): norms 1, the rest N(0, std(name))."""
        with torch.no_grad():
            for name, t in sorted(self.state_dict(keep_vars=True).items()):
                if name.endswith("norm.weight"):
                    value = torch.ones(t.shape)
                else:
                    std = next((s for suffix, s in STD_BY_SUFFIX.items() if name.endswith(suffix)), 0.02)
                    value = torch.randn(t.shape, generator=gen) * std
                t.data = value.to(device=t.device, dtype=torch.float32 if name.endswith(KEEP_FP32) else t.dtype)
        return self

    def to_target(self, dtype: torch.dtype, device: torch.device | str) -> "MtpModule":
        """Move to the target's device and dtype, the router kept in fp32."""
        self.to(device)
        with torch.no_grad():
            for name, t in self.state_dict(keep_vars=True).items():
                if t.is_floating_point() and not name.endswith(KEEP_FP32):
                    t.data = t.data.to(dtype)
        return self

    @classmethod
    def random(cls, tcfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", **cfg_kw) -> "MtpModule":
        """A seeded random MTP block for a target without one (built-in random models)."""
        cfg = MtpConfig(layer=tcfg.num_layers, moe=tcfg.n_routed_experts > 0, **cfg_kw)
        module = cls(cfg, tcfg).init_random(torch.Generator().manual_seed(seed))
        return module.to_target(dtype, device).eval()


class MtpParts:
    """The DeepSeek-V3-style block against its target `lm` (DsaForCausalLM): what `MtpDrafter`
    needs. layer: the captured target layer (the last); window: W (default index_topk);
    row_width: the MLA latent D; feat_width: H."""

    def __init__(self, module: MtpModule, lm, window: int | None = None) -> None:
        tcfg = lm.config
        self.module = module
        self.embed = module.embed_tokens if module.embed_tokens is not None else lm.model.embed_tokens
        self.head = module.shared_head.head if module.shared_head.head is not None else lm.lm_head
        self.final_norm = lm.model.norm if module.cfg.hidden_input == "normed" else None
        self.layer = tcfg.num_layers - 1
        self.window = window or tcfg.index_topk
        self.row_width = tcfg.latent_dim
        self.feat_width = tcfg.hidden_size

    def features(self, g: torch.Tensor) -> torch.Tensor:
        """Captured g [rows, H] -> the hnorm input kept by the drafter [rows, H]."""
        g = g.to(self.module.weight.dtype)
        return self.final_norm(g) if self.final_norm is not None else g

    def rows(self, ids: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Committed positions: ids [T] (x_{p+1}), feats [T, H] (g_p), pos [T] -> latent rows [T, D]."""
        m = self.module
        return m.pre(m.fuse(self.embed(ids).to(m.weight.dtype), feats, pos), pos).latent

    def step(self, tok: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, window):
        """One chained step: tok [N], hidden [N, H], pos [N]; `window(latent [N, D])` -> (rows, loc)
        -> (logits [N, V] fp32, next hidden [N, H])."""
        m = self.module
        u = m.fuse(self.embed(tok).to(m.weight.dtype), hidden, pos)
        pre = m.pre(u, pos)
        h = m.attend(u, pre, *window(pre.latent))
        return self.head(m.head_input(h).to(self.head.weight.dtype)).float(), m.chain_hidden(h)
