"""DeepSeek-V4.1-style models with seeded random weights: the scaled benchmark model and tiny test
models of the cross-layer source extension (`core/v4_sources.py`).

`v41-scaled` keeps the KV structure the paper measures on DeepSeek-V4.1-Flash: k = 512 selected
compressed rows (CSA, m = 4) of head_dim 512 (1 KiB in bf16), index keys of 128, a sliding
window of 128, HCA rows (m = 128) on every other layer, and **four shared CSA sources read by
eight selecting layers**: per source one "full" layer (compressor + indexer), one "reindex" layer
(its own indexer query over the source's keys) and two "reuse" layers (no selection), so a
decode step makes 8 resolver calls. What does not touch the KV cache is shrunk (hidden 1024, 16
heads, q_lora 384, 16 routed experts of 256, 32K vocabulary). Layer plan (34 layers):

    0 SWA, 1 SWA, then per source s = 0..3 (base b = 2 + 8s):
    b CSA full | b+1 HCA | b+2 CSA reuse(b) | b+3 HCA | b+4 CSA reindex(b) | b+5 HCA | b+6 CSA reuse(b) | b+7 HCA

`v41_plan(groups)` builds that plan for any number of sources (tests use 1-2), and
`build_v4_random(cfg, seed, dtype, device)` initializes any V4Config: matrices N(0, 1/fan_in)
(residual projections / sqrt(2L)), norms ~1, sinks / position biases / hyper-connection biases
random (so those paths matter), distinct hash-routing experts per token; lm_head rows past the
byte tokenizer's 259 ids are zero when the vocabulary is larger.
"""

from __future__ import annotations

import math

import torch

from dhisparse.core.v4_config import CSA, HCA, SLIDING, V4Config
from dhisparse.core.v4_sources import FULL, REINDEX, REUSE
from dhisparse.models.dsv4 import DeepseekV4ForCausalLM
from dhisparse.models.loader import LoadedModel
from dhisparse.models.v4_loader import _FP32

BYTE_VOCAB = 259


def v41_plan(groups: int, swa_head: int = 2) -> dict:
    """layer_types / kv_source_layer_ids / selection_types of `groups` shared sources."""
    types, src, sel = [SLIDING] * swa_head, list(range(swa_head)), [FULL] * swa_head
    for _ in range(groups):
        b = len(types)
        for j, kind in enumerate((FULL, REUSE, REINDEX, REUSE)):
            types += [CSA, HCA]
            src += [b, b + 2 * j + 1]  # every CSA layer of the group reads source b
            sel += [kind, FULL]
    return {"num_hidden_layers": len(types), "layer_types": types, "kv_source_layer_ids": src,
            "selection_types": sel, "mlp_layer_types": ["hash_moe"] * min(3, len(types)) + ["moe"] * max(0, len(types) - 3)}


V41_SCALED: dict = {
    "model_type": "deepseek_v4", "vocab_size": 32768, "hidden_size": 1024, "num_attention_heads": 16,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 384, "o_groups": 4,
    "o_lora_rank": 256, "sliding_window": 128, "compress_rates": {CSA: 4, HCA: 128}, "index_n_heads": 8,
    "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 16, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "n_shared_experts": 1, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "max_position_embeddings": 262144, "num_nextn_predict_layers": 0, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "dtype": "bfloat16", **v41_plan(4),
}


def v41_scaled_config(groups: int = 4) -> V4Config:
    """The scaled V4.1 config; `groups` < 4 truncates it to fewer shared sources (CPU runs)."""
    return V4Config.from_hf({**V41_SCALED, **v41_plan(groups)})


def init_rule(name: str, shape: torch.Size, layers: int) -> tuple[float, float]:
    """(mean, std) of parameter `name`'s seeded normal values (module docstring): norms ~1, sinks /
    position biases / hyper-connection biases and scales random, embeddings N(0, 1), matrices
    N(0, 1/fan_in), residual projections further / sqrt(2L)."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith((".sinks", "position_bias")):
        return 0.0, 1.0
    if name.endswith((".base", "hc_base")):
        return 0.0, 0.3
    if name.endswith((".scale", "hc_scale")):
        return 1.0, 0.3
    if name.endswith("embed_tokens.weight"):
        return 0.0, 1.0
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith(("o_b_proj.weight", "down_proj.weight", "experts.down_proj")):
        std /= math.sqrt(2 * layers)
    return 0.0, std


@torch.no_grad()
def build_v4_random(cfg: V4Config, seed: int = 0, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu"):
    """A DeepseekV4ForCausalLM of `cfg` with seeded random weights (see the module docstring)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg)
    rnd = lambda shape, mean, std: (torch.randn(shape, generator=gen) * std + mean)  # noqa: E731
    for name, p in model.named_parameters():
        p.copy_(rnd(p.shape, *init_rule(name, p.shape, cfg.num_layers)).to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
            b.copy_(torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(b.shape[0])]))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(rnd(b.shape, 0.0, 0.05))
    if cfg.vocab_size > BYTE_VOCAB and not cfg.tie_word_embeddings:
        model.lm_head.weight[BYTE_VOCAB:] = 0
    for name, p in model.named_parameters():  # fp32 where the checkpoint loader keeps fp32
        if not _FP32.search(name):
            p.data = p.data.to(dtype)
    model.model.build_ropes(cfg, device)
    return model.eval()


def build_v41_scaled(seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                     groups: int = 4):
    """LoadedModel of `v41-scaled` (random weights); `groups` < 4 keeps fewer shared sources."""
    cfg = v41_scaled_config(groups)
    return LoadedModel(build_v4_random(cfg, seed, dtype, device), cfg, {})
