"""The built-in `tiny` model: a 6-layer GLM-5 (`glm_moe_dsa`) with seeded random weights.

No files needed. Its vocabulary is the ByteTokenizer's (259 ids, padded to 320; the padding rows
of lm_head are zero so greedy output stays within the byte vocabulary), its layers mix
`full` and `shared` indexers (F F S S F S), layer 0 is dense and the rest are MoE (8 experts, top-2,
one shared expert). `index_topk` 16 keeps selection sparse for prompts past 16 tokens; 8 indexer
heads avoid ReLU score ties. The config dict is also a valid transformers config.
"""

from __future__ import annotations

import torch

from dhisparse.core.config import ModelConfig
from dhisparse.models.dsa import DsaForCausalLM
from dhisparse.models.loader import LoadedModel

TINY_CONFIG: dict = {
    "model_type": "glm_moe_dsa",
    "architectures": ["GlmMoeDsaForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 16,
    "indexer_types": ["full", "full", "shared", "shared", "full", "shared"],
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}

BYTE_VOCAB = 259  # ByteTokenizer ids; rows past it are vocabulary padding
BASE_STD = 0.02
# Larger scales on the projections that decide what a random model attends to and predicts,
# so greedy output wanders instead of repeating one token.
STD_BY_SUFFIX = {
    "embed_tokens.weight": 1.0,
    "lm_head.weight": 0.5,
    "q_a_proj.weight": 0.3,
    "q_b_proj.weight": 0.3,
    "kv_a_proj_with_mqa.weight": 0.3,
    "kv_b_proj.weight": 0.3,
    "o_proj.weight": 0.2,
    "indexer.wq_b.weight": 0.3,
    "indexer.wk.weight": 0.3,
    "indexer.weights_proj.weight": 0.3,
    "mlp.gate.weight": 0.3,
    "e_score_correction_bias": 0.05,
}


def tiny_config() -> ModelConfig:
    """The ModelConfig of the built-in tiny model."""
    return ModelConfig.from_hf(TINY_CONFIG)


def _std(name: str) -> float:
    for suffix, std in STD_BY_SUFFIX.items():
        if name.endswith(suffix):
            return std
    return BASE_STD


def _init_value(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """fp32 initial value: norms 1, LayerNorm bias 0, everything else N(0, std(name))."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("norm.bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=gen) * _std(name)


def build_tiny(seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Deterministic random `tiny` model: same seed -> identical weights (sampled in fp32, then cast).

    The router weight and correction bias stay fp32 like a loaded checkpoint's.
    """
    cfg = tiny_config()
    model = DsaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    with torch.no_grad():
        for name in sorted(n for n in model.state_dict()):
            t = tensors[name]
            value = _init_value(name, t.shape, gen)
            keep32 = name.endswith((".mlp.gate.weight", "e_score_correction_bias"))
            if name == "lm_head.weight":
                value[BYTE_VOCAB:] = 0.0  # padding ids score 0, below real tokens' maxima
            t.data = value.to(torch.float32 if keep32 else dtype)
    return LoadedModel(model.to(device).eval(), cfg, {})
