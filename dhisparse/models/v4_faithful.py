"""`v41-faithful`: DeepSeek-V4.1-Flash's attention, KV and expert width, an MoE sized for one H200,
FP8 weights.

`v41-scaled` (models/v4_scaled.py) keeps the paper's DeepSeek-V4.1 KV structure but computes far
less per token (hidden 1,024, 16 heads). This model computes what DeepSeek-V4-Flash computes per
token, except for how many experts there are to choose from:

- V4-Flash's geometry (`V4Config`'s defaults, docs/reference: transformers' `DeepseekV4Config` and
  the V4-Flash config): hidden 4,096, 43 layers (2 sliding, then CSA m = 4 and HCA m = 128 in
  turn: 21 CSA, 20 HCA), 64 query heads over one shared K = V head of 512 (RoPE on the trailing
  64), q_lora 1,024, grouped output (8 groups, rank 1,024), a sliding window of 128, CSA indexers
  of 64 heads x 128 with top-k 512, hyper-connections (4 streams, 20 Sinkhorn steps), 3 hash-routed
  MoE layers then routed ones, every token through 6 routed experts of width 2,048 plus one shared
  expert (clamped SwiGLU, limit 10; sqrt-softplus scores), vocabulary 129,280.
- **The paper's V4.1 sources** (`v41_flash_plan`): the 21 CSA layers share four KV sources (5, 5, 5
  and 6 consecutive CSA layers). In each source the first layer compresses and indexes (Full), the
  third re-indexes the source's keys with its own query (Reindex), and the rest reuse its selection
  (Reuse). So a step makes 8 selecting calls (the paper: 2.6x fewer selecting layers than GLM-5's
  21), each reading one source row. HCA and sliding layers keep their own rows. The paper does not
  give V4.1's exact plan; this one is ours.
- **48 routed experts a layer instead of 256** (top-6 of 48), sized to fit one H200 (below).
- **Block-scaled FP8 weights** (float8_e4m3fn, one fp32 scale per 128 x 128 block), as V4-Flash's
  checkpoint stores its non-expert linears: q_a, q_b, kv, o_b, the compressors' kv / gate and the
  indexers' q_b projections, the shared experts (launched as expert GEMMs) and the routed experts
  (`Fp8V4Experts`; V4-Flash ships FP4 experts, and we have no FP4 GEMM). The grouped o_a projection
  (no grouped FP8 GEMM here), the index scorers' weights, routers, hyper-connections, norms,
  embeddings and head stay bf16 / fp32.
- Seeded random weights by `build_v4_random`'s rules (matrices N(0, 1/fan_in), residual
  projections / sqrt(2L), random sinks, position biases and hyper-connection biases, distinct hash
  experts per token); lm_head scores every id of the vocabulary, as drawn (from session 40, as
  glm5-faithful's: a head over the 256 byte ids cycled through a few of them over a long context;
  `head_vocab="byte"` zeroes rows past the byte tokenizer's 259 ids, the build before). No confident head, and
  the locality offset's direction is projected out of the head's rows (`faithful.offset_free_head`:
  before session 36 the 43-layer build's greedy output was one token repeated, for every prompt),
  and out of the KV projections' and the experts' inputs (`faithful.offset_blind` with
  `V4_OFFSET_BLIND`: the layers would turn the offset into parts common to every position, as
  glm5-faithful's did until session 37).
- glm5-faithful's **selection locality**, with its constants (not re-tuned): every embedding row
  carries EMBED_OFFSET x one shared direction and each index query INDEX_GAIN x a fixed part
  along it (`stable_v4_index_query`). On a small geometry on CPU (8 layers, k 64, 4K tokens,
  hisparse, B = 2k per source) it takes the host-fetched share from 84% to 12%; at B = k it stays
  ~94%, because a source's Full and Reindex layers select up to 2k distinct rows a step and
  thrash a k-row hot cache (bench/results/locality_v41_faithful_small_cpu_s30.json).

Memory (one H200, ~139 GiB usable):

    FP8 q_a + q_b + kv + o_b            43 x 80.6 M                  3.5 GB
    bf16 o_a (grouped)                  43 x 33.6 M                  2.9 GB
    FP8 shared experts                  43 x 25.2 M                  1.1 GB
    bf16 embeddings + lm_head           2 x 129,280 x 4,096          2.1 GB
    FP8 indexers, compressors; bf16 hc, scorers ...                  ~0.4 GB
    FP8 routed experts                  E x 43 x 25.17 M        E x 1.08 GB   (E = 48: 52 GB)
                                                      total ~ 61.6 GB = 57.3 GiB

Why 48: on the paper's two V4.1 decode GPUs each holds 128 of 256 experts, 128 x 43 x 25.17 M =
138 G parameters (FP4: ~70 GB), streamed every step. One H200 cannot hold that in FP8 beside the
pools of 500K-token sessions; 48 experts (52 GB) leave ~80 GiB for pools, activations and a
drafter. Whether the experts then take the paper's share of a step (53% alone) is to be measured
(bench/step_profile.py's `moe` family), not assumed.

`build_v41_faithful(seed, dtype, device, num_layers=None, overrides=None)` builds layer by layer on
`device`: each layer is made in `dtype`, initialized, its big projections quantized and their bf16
copies freed, so the peak is the FP8 model plus one bf16 layer (~1.6 GB).
"""

from __future__ import annotations

import torch
from torch import nn

from dhisparse.core.v4_config import CSA, HCA, SLIDING, V4Config
from dhisparse.core.v4_sources import FULL, REINDEX, REUSE
from dhisparse.layers.v4_moe import Fp8V4Experts
from dhisparse.models.dsv4 import DeepseekV4ForCausalLM
from dhisparse.models.faithful import check_head_vocab, offset_blind, offset_free_head, quantize_module
from dhisparse.models.loader import LoadedModel
from dhisparse.models.scaled import EMBED_OFFSET, INDEX_GAIN, bump_index_query
from dhisparse.models.v4_loader import _FP32
from dhisparse.models.v4_scaled import BYTE_VOCAB, V41_SCALED, init_rule

ROUTED_EXPERTS = 48  # a layer's routed experts on one H200 (module docstring)
FP8_LINEARS = ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj")


def v41_flash_plan(num_layers: int = 43, groups: int = 4, swa_head: int = 2) -> dict:
    """V4-Flash's layer types (`swa_head` sliding, then CSA / HCA in turn) with the CSA layers split
    into `groups` shared sources of consecutive CSA layers (the last group takes the remainder):
    Full, Reuse, Reindex, then Reuse. Keys: layer_types, kv_source_layer_ids, selection_types,
    mlp_layer_types (3 hash-routed MoE layers, then routed)."""
    types = [SLIDING] * swa_head + [CSA if i % 2 == 0 else HCA for i in range(num_layers - swa_head)]
    csa = [i for i, t in enumerate(types) if t == CSA]
    if not 1 <= groups <= len(csa):
        raise ValueError(f"groups must be 1..{len(csa)} (the CSA layers), got {groups}")
    src, sel = list(range(num_layers)), [FULL] * num_layers
    per = len(csa) // groups
    for g in range(groups):
        members = csa[g * per:] if g == groups - 1 else csa[g * per:(g + 1) * per]
        for j, layer in enumerate(members):
            src[layer] = members[0]
            sel[layer] = FULL if j == 0 else REINDEX if j == 2 else REUSE
    return {"num_hidden_layers": num_layers, "layer_types": types, "kv_source_layer_ids": src,
            "selection_types": sel, "mlp_layer_types": ["hash_moe"] * min(3, num_layers) + ["moe"] * max(0, num_layers - 3)}


V41_FAITHFUL: dict = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "sliding_window": 128, "compress_rates": {CSA: 4, HCA: 128}, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512, "n_routed_experts": ROUTED_EXPERTS, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1048576, "num_nextn_predict_layers": 0,
    **{k: V41_SCALED[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id", "dtype")}, **v41_flash_plan(),
}


def v41_faithful_hf_config(num_layers: int | None = None, overrides: dict | None = None) -> dict:
    """config.json-style dict; `num_layers` truncates the plan (one source per 5 CSA layers, 1 to 4),
    `overrides` replaces keys (tests build a small geometry through the same code)."""
    d = {**V41_FAITHFUL, **(overrides or {})}
    if num_layers is not None:
        n_csa = max(0, num_layers - 1) // 2
        d.update(v41_flash_plan(num_layers, groups=min(4, max(1, n_csa // 5))))
    return d


def v41_faithful_config(num_layers: int | None = None, overrides: dict | None = None) -> V4Config:
    """V4Config of v41-faithful (no weights are built)."""
    return V4Config.from_hf(v41_faithful_hf_config(num_layers, overrides))


def _materialize(module: nn.Module, prefix: str, cfg: V4Config, dtype: torch.dtype, device: torch.device,
                 gen: torch.Generator) -> None:
    """A meta `module` on `device` with seeded values; fp32 where the checkpoint loader keeps fp32."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = prefix + name
            mean, std = init_rule(full, p.shape, cfg.num_layers)
            v = torch.randn(p.shape, generator=gen, device=p.device) * std + mean
            p.data = v.to(torch.float32 if _FP32.search(full) else dtype)
        for name, b in module.named_buffers():
            if name.endswith("tid2eid"):
                E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                b.copy_(torch.rand(b.shape[0], E, generator=gen, device=device).argsort(dim=1)[:, :k])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen, device=device) * 0.05)


def stable_v4_index_query(layer: nn.Module, shared: torch.Tensor, gain: float, gen: torch.Generator) -> None:
    """glm5-faithful's selection locality (`scaled.stable_index_query`) for a V4 layer's index query
    (the CSA indexer of a Full layer, or a Reindex layer's own): q_b_proj += gain / sqrt(q_lora) *
    d c^T, c the unit direction of the shared embedding offset in the q latent, d ~ N(0, 1) per
    index dim and zero on the trailing RoPE'd dims. Every index query then carries a fixed part
    along d, so a compressed key's score has a query-independent term (d . k_s) and consecutive
    steps select overlapping rows, as a trained model's do. No-op on layers without an index query."""
    a = layer.self_attn
    ix = a.reindexer if a.reindexer is not None else getattr(a.compressor, "indexer", None)
    if ix is None:
        return
    bump_index_query(ix.q_b_proj.weight, a.q_a_proj.weight, shared, ix.n_heads, ix.d,
                     slice(ix.d - a.cfg.rope_head_dim, ix.d), gain, gen)


def v4_offset_direction(hidden: int, seed: int, device: str | torch.device) -> torch.Tensor:
    """[hidden] fp32: the locality offset's shared direction of the V4 build with `seed` on `device`
    (`scaled.offset_direction`'s twin, drawn as this builder always has)."""
    return torch.randn(hidden, generator=torch.Generator(device=device).manual_seed(seed + 1), device=device)


# `faithful.offset_blind`'s weights in V4's names: the sliding-window and compressed KV projections
# and the experts' gate / up sides (not q_a, the compressors' gates or indexers, nor the mixing of the
# hyper-connections)
V4_OFFSET_BLIND = ("self_attn.kv_proj.weight", "self_attn.compressor.kv_proj.weight", "mlp.experts.gate_up_proj",
                   "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")


def quantize_v4_module(module: nn.Module) -> None:
    """`faithful.quantize_module` with V4's projection names and clamped experts (in place)."""
    quantize_module(module, FP8_LINEARS, Fp8V4Experts.from_v4)


@torch.no_grad()
def build_v41_faithful(seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                       num_layers: int | None = None, overrides: dict | None = None,
                       embed_offset: float = EMBED_OFFSET, index_gain: float = INDEX_GAIN,
                       head_vocab: str = "full") -> LoadedModel:
    """Deterministic random v41-faithful on `device`, built one layer at a time (module docstring);
    embed_offset / index_gain: the selection locality (0, 0: none; `stable_v4_index_query`);
    head_vocab "full" (the default): lm_head scores every id, its rows as `build_v4_random`'s rules
    draw them; "byte": rows past the byte ids zeroed, the build before session 40."""
    check_head_vocab(head_vocab)
    cfg = v41_faithful_config(num_layers, overrides)
    device = torch.device(device)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    m = model.model
    gen = torch.Generator(device=device).manual_seed(seed)
    for prefix, module in (("model.embed_tokens.", m.embed_tokens), ("model.norm.", m.norm),
                           ("model.hc_head.", m.hc_head), ("lm_head.", model.lm_head)):
        _materialize(module, prefix, cfg, dtype, device, gen)
    shared = v4_offset_direction(cfg.hidden_size, seed, device)
    if embed_offset:
        m.embed_tokens.weight.data += (embed_offset * shared).to(m.embed_tokens.weight.dtype)
        offset_free_head(model, shared)
    if head_vocab == "byte" and cfg.vocab_size > BYTE_VOCAB and not cfg.tie_word_embeddings:
        model.lm_head.weight[BYTE_VOCAB:] = 0
    index_gen = torch.Generator(device="cpu").manual_seed(seed + 3)
    for i, layer in enumerate(m.layers):
        _materialize(layer, f"model.layers.{i}.", cfg, dtype, device,
                     torch.Generator(device=device).manual_seed(seed * 1_000_003 + 17 + i))
        if index_gain and embed_offset:
            stable_v4_index_query(layer, shared, index_gain, index_gen)
        if embed_offset:
            offset_blind(layer, shared, V4_OFFSET_BLIND)
        quantize_v4_module(layer)
    m.build_ropes(cfg, device)
    return LoadedModel(model.eval(), cfg, {})
