"""Scaled benchmark models: the KV structure of the paper's models, with weights that fit one GPU.

`glm52-scaled` keeps GLM-5.2's KV shape exactly (78 layers; 21 `full` indexers feeding 57 `shared`
layers via index_topk_freq 4 / offset 3; MLA latent rows of kv_lora 512 + rope 64 = 576 values,
1152 B in bf16; index keys of 128; k = 2048) and `dsv32-scaled` DeepSeek-V3.2's (61 layers, every
layer `full`, same latent and index shapes). What does not touch the KV cache is shrunk: hidden
size 1024, 16 heads with 64-wide nope / value heads, q_lora 384, 16 routed experts (top 2) of
width 256 plus one shared expert, and a 32K vocabulary: about 1.4 B (GLM) / 1.1 B (DSV) parameters,
~2.8 / ~2.2 GB in bf16.

Weights are seeded random (no files). Initialization keeps 78 layers finite in bf16: every
matrix is N(0, 1/fan_in) (unit-variance outputs for unit-variance inputs), residual projections
(o_proj, down projections) are further scaled by 1/sqrt(2 * layers), norms are 1. Indexer
projections are ordinary random matrices, so top-k scores are spread out (no ties). Selection
locality: every embedding row also carries one shared random direction (EMBED_OFFSET = 3 x a
row's scale; larger offsets start to crowd the confident head's margin). It gives index scores a stable, query-independent part, so consecutive decode steps
select overlapping rows as a trained model's do. Measured by bench/locality.py (hisparse, one
request, B = 2k; `bench/results/locality_*.json`): 4 layers, fp32, 8K history: 15% of selected rows
host-fetched at offset 1.5 (56% with no offset). 78 layers, 2K history: 4.4% in fp32 at 1.5, but in
bf16 29.6% / 16.3% / 10.7% at offsets 1.5 / 3 / 6 (16-bit rounding blurs the stable part). The
paper's GLM-5.2 at low load: 14.2% at B = 2k. The 8K bf16 point is to be measured on the GPU. lm_head rows
past the ByteTokenizer's 259 ids are zero, so greedy output stays decodable.

`build_scaled(name, seed, dtype, device, num_layers=None)` builds straight on `device` (CUDA
models never pass through the CPU); `num_layers` truncates the layer plan for fast CPU tests.
"""

from __future__ import annotations

import math

import torch

from dhisparse.core.config import ModelConfig
from dhisparse.models.dsa import DsaForCausalLM
from dhisparse.models.loader import LoadedModel

BYTE_VOCAB = 259  # ByteTokenizer ids; lm_head rows past it are zero

SHARED_CONFIG: dict = {  # the config keys every scaled (and the faithful) model starts from
    "vocab_size": 32768,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 384,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "index_n_heads": 8,
    "index_head_dim": 128,
    "index_topk": 2048,
    "first_k_dense_replace": 3,
    "n_routed_experts": 16,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "bfloat16",
}

SCALED_CONFIGS: dict[str, dict] = {
    "glm52-scaled": {
        **SHARED_CONFIG,
        "model_type": "glm_moe_dsa",
        "architectures": ["GlmMoeDsaForCausalLM"],
        "num_hidden_layers": 78,
        "index_topk_freq": 4,
        "index_skip_topk_offset": 3,
        "rms_norm_eps": 1e-5,
    },
    "dsv32-scaled": {
        **SHARED_CONFIG,
        "model_type": "deepseek_v32",
        "architectures": ["DeepseekV32ForCausalLM"],
        "num_hidden_layers": 61,
        "rms_norm_eps": 1e-6,
    },
}

SCALED_CONFIGS["glm52-scaled-k512"] = {**SCALED_CONFIGS["glm52-scaled"], "index_topk": 512}

HEAD_GAIN = 16.0  # logit of the continuation ~ HEAD_GAIN * (share of h along its token's row)
EMBED_OFFSET = 3.0  # shared embedding direction, in units of an embedding row's scale: bench/locality.py
INDEX_GAIN = 8.0  # stable index-query direction (x the query's own spread): 14.1% host-fetched, H200 8K bf16

RESIDUAL_SUFFIXES = ("o_proj.weight", "down_proj.weight", "experts.down_proj")
FP32_SUFFIXES = (".mlp.gate.weight", "e_score_correction_bias")


def scaled_hf_config(name: str, num_layers: int | None = None) -> dict:
    """The config.json-style dict of a scaled model; `num_layers` truncates it (tests)."""
    if name not in SCALED_CONFIGS:
        raise KeyError(f"unknown scaled model {name!r}; known: {', '.join(SCALED_CONFIGS)}")
    d = dict(SCALED_CONFIGS[name])
    if num_layers is not None:
        d["num_hidden_layers"] = num_layers
    return d


def scaled_config(name: str, num_layers: int | None = None) -> ModelConfig:
    """ModelConfig of a scaled model (no weights are built)."""
    return ModelConfig.from_hf(scaled_hf_config(name, num_layers))


def param_count(cfg: ModelConfig) -> int:
    """Parameters of a scaled model, counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = DsaForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


def _std(name: str, shape: torch.Size, layers: int) -> float:
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name.endswith("e_score_correction_bias"):
        return 0.05
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith(RESIDUAL_SUFFIXES):
        std /= math.sqrt(2 * layers)
    return std


@torch.no_grad()
def init_weights(model: torch.nn.Module, cfg: ModelConfig, seed: int, dtype: torch.dtype,
                 embed_offset: float = EMBED_OFFSET, index_gain: float = INDEX_GAIN) -> None:
    """Seeded in-place init on the model's own device (see the module docstring); casts to dtype
    except the router weight and its correction bias, which stay fp32 like a checkpoint's.
    embed_offset: every embedding row gets `embed_offset * u` added, u ~ N(0, I) one fixed vector
    (a shared residual direction, which gives index scores a query-independent part: locality).
    index_gain: see `_stable_index_queries`."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    shared = offset_direction(cfg.hidden_size, seed, device)
    init_module(model, "", cfg.num_layers, dtype, device, gen)
    if embed_offset:
        emb = model.model.embed_tokens.weight
        emb.data += (embed_offset * shared).to(emb.dtype)
    _confident_head(model, cfg, seed, embed_offset * shared)
    if index_gain and embed_offset:
        _stable_index_queries(model, cfg, seed, shared, index_gain)


def offset_direction(hidden: int, seed: int, device: str | torch.device) -> torch.Tensor:
    """[hidden] fp32: u, the shared direction of the locality offset of the model built with `seed` on
    `device` (drawn on that device: a CUDA build's direction is not the CPU build's); the GLM builders'
    (this module's and models/faithful.py's)."""
    return torch.empty(hidden, device=device).normal_(generator=torch.Generator(device=device).manual_seed(seed + 1))


def init_module(module: torch.nn.Module, prefix: str, layers: int, dtype: torch.dtype, device: torch.device | str,
                gen: torch.Generator) -> None:
    """Every state-dict tensor of `module` (named `prefix` + its own name) set to `init_tensor`'s
    value, in sorted name order (one draw order from `gen` for a given set of names)."""
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    for name in sorted(module.state_dict()):
        t = tensors[name]
        t.data = init_tensor(prefix + name, t.shape, layers, dtype, device, gen)


def init_tensor(name: str, shape: torch.Size, layers: int, dtype: torch.dtype, device: torch.device | str,
                gen: torch.Generator) -> torch.Tensor:
    """The seeded initial value of one named tensor (module docstring): norms 1 (biases 0), every
    other tensor N(0, `_std`) drawn from `gen`; the router and its bias stay fp32 (FP32_SUFFIXES),
    the rest is `dtype`; lm_head rows past the byte ids are zero."""
    target = torch.float32 if name.endswith(FP32_SUFFIXES) else dtype
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device, dtype=target)
    if name.endswith("norm.bias"):
        return torch.zeros(shape, device=device, dtype=target)
    value = torch.empty(shape, device=device, dtype=target)
    value.normal_(0.0, _std(name, shape, layers), generator=gen)
    if name == "lm_head.weight":
        value[BYTE_VOCAB:] = 0.0
    return value


def _stable_index_queries(model: torch.nn.Module, cfg: ModelConfig, seed: int, shared: torch.Tensor,
                          gain: float) -> None:
    """`stable_index_query` on every layer with an indexer, one generator in layer order."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 3)
    for layer in model.model.layers:
        stable_index_query(layer, shared, gain, gen)


def stable_index_query(layer: torch.nn.Module, shared: torch.Tensor, gain: float, gen: torch.Generator) -> None:
    """Every indexer's wq_b += gain / sqrt(q_lora) * d c^T: c the unit direction of the shared
    embedding offset in that layer's normalized query latent (c . q_lat is large and positive for
    every token), d ~ N(0, 1) per head dim, zero on the RoPE'd dims. Each index query then carries
    ~gain x its own spread along one fixed, position-independent direction d, so the score of a key
    has a part that no query changes (d . k_s): consecutive steps select overlapping rows, as a
    trained model's do. Unlike a larger embedding offset this leaves the residual stream (and the
    head's margin) alone, and unlike the offset alone it survives the RoPE'd half of the index dims
    (whose contribution turns with every new position)."""
    ix = getattr(layer.self_attn, "indexer", None)
    if ix is None:
        return
    bump_index_query(ix.wq_b.weight, layer.self_attn.q_a_proj.weight, shared, ix.n_heads, ix.head_dim,
                     slice(0, ix.rope_dim), gain, gen)


def bump_index_query(w: torch.Tensor, q_a: torch.Tensor, shared: torch.Tensor, heads: int, head_dim: int,
                     rope: slice, gain: float, gen: torch.Generator) -> None:
    """w [heads * head_dim, q_lora] += gain / sqrt(q_lora) * d c^T in place: c the unit direction of
    `shared` through q_a [q_lora, hidden], d ~ N(0, 1) [heads, head_dim] (from `gen`, on the CPU),
    zero on the `rope` dims of every head (`stable_index_query`)."""
    c = q_a.float() @ shared.float()
    c = c / c.norm()
    d = torch.randn(heads, head_dim, generator=gen)
    d[:, rope] = 0.0
    bump = (gain / c.numel() ** 0.5) * d.reshape(-1, 1).to(w.device) * c[None, :]
    w.data = (w.float() + bump).to(w.dtype)


def _confident_head(model: torch.nn.Module, cfg: ModelConfig, seed: int, offset: torch.Tensor) -> None:
    """lm_head[pi(t)] = HEAD_GAIN / hidden * (embedding row of byte token t minus the shared offset):
    greedy decoding continues t with pi(t) (pi a seeded permutation of the byte ids) by a wide
    margin, because the residual stream keeps the current token's embedding. Random heads give
    near-tied logits whose argmax flips with the batch's GEMM rounding on a GPU, so an output
    recorded in one batch (the oracle drafter's reference) diverges in another; this head does not.
    Rows outside the byte ids stay zero."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return
    emb = model.model.embed_tokens.weight
    n = min(BYTE_VOCAB, cfg.vocab_size) - 3
    gen = torch.Generator(device="cpu").manual_seed(seed + 2)
    perm = (torch.randperm(n, generator=gen) + 3).to(emb.device)
    token = emb[3 : 3 + n].float() - offset.float()
    w = torch.zeros(head.weight.shape, device=emb.device, dtype=torch.float32)
    gain = HEAD_GAIN * float(1.0 + offset.float().pow(2).mean()) ** 0.5 / cfg.hidden_size  # h's share along a token row
    w[perm] = token * gain
    head.weight.data = w.to(head.weight.dtype)


def build_scaled(name: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", num_layers: int | None = None,
                 embed_offset: float = EMBED_OFFSET, index_gain: float = INDEX_GAIN) -> LoadedModel:
    """Deterministic random scaled model built directly on `device` (same seed + device ->
    identical weights). embed_offset, index_gain: see `init_weights` (bench/locality.py
    calibrates them)."""
    cfg = scaled_config(name, num_layers)
    with torch.device(device):
        model = DsaForCausalLM(cfg)
    init_weights(model, cfg, seed, dtype, embed_offset, index_gain)
    return LoadedModel(model.eval(), cfg, {})
