"""`glm5-faithful`: GLM-5's attention and KV exactly, an MoE sized for one H200, FP8 weights.

The `*-scaled` models (models/scaled.py) keep the KV shape of GLM-5.2 but compute ~74x less per
token (hidden 1,024), and their head fixes the greedy tokens whatever attention returns. This
model computes what GLM-5 computes per token, except for how many experts there are to choose from:

- GLM-5's geometry (transformers' `GlmMoeDsaConfig` defaults, checkpoint zai-org/GLM-5): hidden
  6,144, 78 layers, 64 heads, q_lora 2,048, kv_lora 512, nope 192 / rope 64 / value 256, 32
  indexer heads of 128, top-k 2,048, 3 dense layers of width 12,288, every MoE token through 8
  routed experts of width 2,048 plus one shared expert, vocabulary 154,880. GLM-5.2's index
  sharing (21 `full` indexers, 57 `shared` layers: index_topk_freq 4, offset 3), as glm52-scaled.
- **24 routed experts a layer instead of 256** (top-8 of 24, n_group 1). That is what one H200
  holds next to the KV pools; see the arithmetic below.
- **Block-scaled FP8 weights** (float8_e4m3fn + one fp32 scale per 128x128 block, as GLM-5-FP8
  and DeepSeek-V3 checkpoints store them) for the projections that dominate: q_a, q_b, kv_a,
  o_proj, the dense and shared MLPs and the routed experts, run by the weight-only FP8 GEMMs of
  kernels/fp8_gemm.py (`layers/fp8_linear.py`). kv_b (split into the absorbed W_UK / W_UV), the
  indexers, embeddings, the head and the norms stay bf16; the router stays fp32.
- Seeded random weights (scaled.py's `init_tensor` scales), an embedding offset and index gain of its
  own (FAITHFUL_EMBED_OFFSET 4.5, FAITHFUL_INDEX_GAIN 12: calibrated at full geometry over a 100K history
  against the paper's locality), routers balanced over every expert
  (`balance_router`), and **no confident head**: lm_head is an ordinary
  random matrix over the whole vocabulary (rows 0-2, the special ids, are zero; `full_vocab_head`) with the
  locality offset's direction projected out of its rows (`offset_free_head`; before session 36 the
  offset decided the output: one token repeated for every prompt) and out of the inputs through
  which a layer's output depends on the stream (`offset_blind`: the KV latent and the FFN; before
  session 37 the layers turned the offset into new parts common to every position, and the output
  was still one token), so the greedy tokens depend on the context and on what attention returns,
  and a broken KV path changes them. Until session 40 the head scored only the 256 byte ids (rows
  past 259 zero; `head_vocab="byte"` keeps that build), and over a long fixed context its greedy
  output fell into a short cycle -- one token after 128-500 tokens at 100K on
  the H200 (session 39), four tokens from the 8th on a small CPU build over 16K (session 40), where
  a head over every id gave 974 distinct ids in 1,024 tokens. The likely reason (not measured): over
  a long context whose selected rows barely change, the next token is nearly a function of the
  last one, and a random map on 256 ids soon cycles; on 154,880 its cycles are hundreds long. Ids
  past the byte ids decode to no text (ByteTokenizer): a benchmark model. The price of no confident
  head: near-tied logits, so greedy output can differ between batch compositions (GEMM rounding), as
  a real model's can.

Memory (one H200, ~139 GiB usable):

    FP8 q_a + q_b + kv_a + o_proj   78 x 150.3 M          11.7 GB
    bf16 kv_b, indexers             78 x 14.7 M, 21 x 9.4 M  2.7 GB
    FP8 dense (3) + shared (75)     0.68 G + 2.83 G          3.5 GB
    bf16 embeddings + lm_head       2 x 154,880 x 6,144      3.8 GB
    FP8 routed experts              E x 75 x 37.75 M       E x 2.83 GB   (E = 24: 68 GB)
                                                   total ~ 89.7 GB = 83.6 GiB

leaving ~55 GiB for the 27.4-GiB KV pools of the 100K benchmarks, a drafter of the paper's
shape (DFlash2, 6 layers at hidden 6,144: ~5 GiB) and activations.

Why the expert count, from GLM-5 on the paper's four decode GPUs: with expert parallelism each
GPU holds 64 of 256 experts in each of 75 MoE layers, 64 x 75 x 37.75 M = 181 GB of FP8 expert
weights. The global decode batch (tens of tokens per GPU, exchanged to their experts) touches
nearly all of them, so a step streams ~181 GB at B300's ~8 TB/s: ~23 ms (were that the paper's
38%, its step would be ~60 ms). One H200 streams its experts at ~4.8 TB/s and cannot hold 181 GB
beside its pools; 24 experts (68 GB) is about what fits and streams in ~14-20 ms a step at full
bandwidth. Whether that is the paper's share at our high-load point is measured, not assumed
(bench/step_profile.py's `moe` family: the routed experts' fp8_moe_kernel and, from session 30,
the shared experts' GEMMs, which `quantize_module` marks to launch as fp8_expert_linear_kernel;
docs/benchmarks.md: routed experts 23.3% of a 117.8-ms step at 100K C47 in session 30).

`build_faithful(name, seed, dtype, device, num_layers=None, overrides=None)` builds layer by layer
on `device`: each layer is made in `dtype`, initialised, quantized and its bf16 copies freed, so the
peak is the FP8 model plus one bf16 layer (~2 GB). `overrides` changes config keys (tests build a
small geometry through the same code).

Expert parallelism (`ep=(rank, world)`, `--ep-size` under DP attention): every rank builds every
layer from the same seeds, on its own device, then keeps only its block of each MoE layer's routed
experts (`layers/ep_moe.EPMoE`: experts [rank * 24/W, (rank + 1) * 24/W), FP8 weights and scales);
the rest (attention, dense and shared MLPs, embeddings, head: 20.3 GiB) is replicated. A rank's
weights: 20.3 + 63.3 / W GiB (W = 2: 51.9 GiB, 4: 36.1, 8: 28.2), so the full model never exists
on one device; the peak is that plus one layer being built. Tensor parallelism is not built here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dhisparse.core.config import ModelConfig
from dhisparse.layers.ep_moe import EPMoE
from dhisparse.layers.fp8_linear import Fp8Experts, Fp8Linear
from dhisparse.layers.moe import MoE
from dhisparse.layers.rope import RotaryEmbedding
from dhisparse.models.dsa import DsaForCausalLM
from dhisparse.models.loader import LoadedModel
from dhisparse.models.scaled import SHARED_CONFIG as SCALED_SHARED
from dhisparse.models.scaled import BYTE_VOCAB, init_module, offset_direction, stable_index_query

ROUTED_EXPERTS = 24  # a layer's routed experts on one H200 (module docstring)
SPECIAL_IDS = 3  # ByteTokenizer's pad / bos / eos: their head rows are zero
# glm5-faithful's small geometry for CPU runs (`overrides=SMALL_OVERRIDES`): the KV row shape (latent 512 +
# rope 64) and index keys of 128 stay, so the engine's row formats are the real ones; 6 routed experts, top 2
SMALL_OVERRIDES = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=4, q_lora_rank=128, qk_nope_head_dim=32, v_head_dim=32, index_n_heads=8,
                       index_topk=64, n_routed_experts=6, num_experts_per_tok=2, vocab_size=512)

FAITHFUL_CONFIGS: dict[str, dict] = {
    "glm5-faithful": {
        **SCALED_SHARED,  # routing scale, RoPE, special ids and dtype as the scaled models'; the rest is GLM-5's
        "model_type": "glm_moe_dsa",
        "architectures": ["GlmMoeDsaForCausalLM"],
        "vocab_size": 154880,
        "hidden_size": 6144,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 78,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 2048,
        "qk_nope_head_dim": 192,
        "v_head_dim": 256,
        "index_n_heads": 32,
        "index_topk_freq": 4,
        "index_skip_topk_offset": 3,
        "n_routed_experts": ROUTED_EXPERTS,
        "num_experts_per_tok": 8,
        "rms_norm_eps": 1e-5,
    },
}

FP8_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj")


def faithful_hf_config(name: str, num_layers: int | None = None, overrides: dict | None = None) -> dict:
    """The config.json-style dict of a faithful model; `num_layers` truncates it, `overrides`
    replaces keys (tests)."""
    if name not in FAITHFUL_CONFIGS:
        raise KeyError(f"unknown faithful model {name!r}; known: {', '.join(FAITHFUL_CONFIGS)}")
    d = {**FAITHFUL_CONFIGS[name], **(overrides or {})}
    if num_layers is not None:
        d["num_hidden_layers"] = num_layers
    return d


def faithful_config(name: str, num_layers: int | None = None, overrides: dict | None = None) -> ModelConfig:
    """ModelConfig of a faithful model (no weights are built)."""
    return ModelConfig.from_hf(faithful_hf_config(name, num_layers, overrides))


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Device bytes of a built model's weights: {'fp8': FP8 weights + their scales, 'other': the rest}."""
    out = {"fp8": 0, "other": 0}
    for mod in model.modules():
        fp8 = isinstance(mod, (Fp8Linear, Fp8Experts))
        for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
            out["fp8" if fp8 else "other"] += t.numel() * t.element_size()
    return out


def _init_module(module: nn.Module, prefix: str, layers: int, dtype: torch.dtype, device: torch.device,
                 gen: torch.Generator) -> None:
    """Materialize a meta `module` on `device` with scaled.py's seeded values (names `prefix` + own)."""
    module.to_empty(device=device)
    init_module(module, prefix, layers, dtype, device, gen)


def without_direction(weight: torch.Tensor, direction: torch.Tensor, rows: int = 16384) -> torch.Tensor:
    """weight [R, D] with each row's component along `direction` [D] removed (in fp32, back in
    weight's dtype), `rows` rows at a time (the 154,880-row head stays in a few hundred MB of fp32)."""
    u = direction.float() / direction.float().norm()
    out = torch.empty_like(weight)
    for r in range(0, weight.shape[0], rows):
        w = weight[r:r + rows].float()
        out[r:r + rows] = (w - (w @ u)[:, None] * u[None, :]).to(weight.dtype)
    return out


def offset_free_head(model: nn.Module, shared: torch.Tensor) -> None:
    """Project the shared embedding direction out of lm_head's rows (zero rows stay zero). Every
    token's residual stream carries FAITHFUL_EMBED_OFFSET x `shared` (the locality offset) on top of its own
    part, and a random head scores that common part alike for every position: at GLM-5's 78 layers
    the greedy output was then one token repeated, the same for every prompt (session 36: glm5-faithful's
    100K reference, 20 prompts x 1,024 tokens, 2 distinct ids). Without it the head reads the
    token- and context-dependent part, so the greedy tokens vary with what attention returns (the
    router's twin: `balance_router`). A head tied to the embeddings is left alone: projecting it would
    take the offset out of the embeddings too."""
    head = model.lm_head.weight
    if head is model.model.embed_tokens.weight:
        return
    head.data = without_direction(head.data, shared)


def balance_router(layer: nn.Module, shared: torch.Tensor) -> None:
    """Project the shared embedding direction out of a MoE layer's router rows (no-op for dense
    layers). The locality offset (FAITHFUL_EMBED_OFFSET x `shared` in every embedding) is the largest common
    part of every token's residual stream, so random router rows would score it alike for every
    token: a batch of 47 tokens then chose 14 of 24 experts, most of them for every token (routing
    collapse; an H200 step streamed about half the expert weights). A trained router is kept
    balanced (GLM-5's aux-loss-free bias); without the common part the choice spreads over every
    expert, as there. The selection bias (`e_score_correction_bias`) is zeroed: a trained one is what
    balances the load, and a random one (std 0.05) has nothing to balance but outweighs the scores once
    the offset shrinks their spread after the norm (0.95 / 0.29 / 0.20 at offset 0 / 3 / 4.5): at 4.5 one
    expert took 42 of 47 tokens, against 21 with the bias at zero (session 43)."""
    gate = getattr(layer.mlp, "gate", None)
    if gate is None:
        return
    gate.weight.data = without_direction(gate.weight.data, shared)
    gate.e_score_correction_bias.zero_()


# The locality: the embedding offset (FAITHFUL_EMBED_OFFSET x `shared` in every embedding row) and the index
# queries' stable part (`stable_index_query`, FAITHFUL_INDEX_GAIN x its own spread), calibrated where the
# model is served: hisparse, one request over a 102,400-token history, B = 2k = 4,096 rows, 78 layers in bf16
# with 12 routed experts so that it fits an H100 (session 43, locality_glm5_faithful_100k_e12_s43_h100.json).
# At glm52-scaled's offset 3 the gain saturates: 4 / 8 / 12 / 20 / 32 -> 33.1 / 24.9 / 22.8 / 20.9 / 19.6%
# host-fetched (session 42's serving run at gain 0: 50.2%); offset 4.5 with gain 12 gives 13.9% (the paper:
# 14.2%, GLM-5.2 low load), offset 6 11.7%. The outputs still follow their context there (32K, 4 prompts:
# 128 distinct ids of 128, common share 0.030; faithful_diversity_glm5_o4.5_g12_32k_e12_s43_h100.json).
# Session 38's calibration at an 8K history (offset 3, gain 0: 13.1%) held k / L at 25%; at 100K it is 2%.
# v41-faithful keeps EMBED_OFFSET and INDEX_GAIN (8: 13.6% at B = 2k a source, locality_v41_faithful_gains_s38_h100.json).
FAITHFUL_EMBED_OFFSET = 4.5
FAITHFUL_INDEX_GAIN = 12.0


# the weights through which a layer's output depends on its input: the KV latent (keys and values)
# and the FFN's gate / up sides (dense, shared and routed experts). Not q_a (the index queries read the
# offset through it: the locality, with `stable_index_query`'s part where a gain is set), not the
# indexer's keys, not the router (`balance_router`)
OFFSET_BLIND = ("self_attn.kv_a_proj_with_mqa.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight", "mlp.experts.gate_up_proj")


def offset_blind(layer: nn.Module, shared: torch.Tensor, names: tuple[str, ...] = OFFSET_BLIND) -> None:
    """Project the shared embedding direction out of the input side of `names` (each [..., hidden]),
    so what the layer adds to the residual stream does not depend on the locality offset. Random
    weights otherwise turn the offset, common to every token, into new common parts at every
    layer (an FFN of 3u + e_t has a large mean over t; attention averages the values' common part):
    at 78 layers 36-39% of the final hidden state's energy (the offset itself aside) was one vector
    shared by every position, and the offset-free head alone did not help -- glm5-faithful's 100K
    reference on the H200 was one token repeated for every prompt again (session 37). With the
    direction out of these inputs that share is ~3% and the head reads what the context makes;
    the offset still reaches the index queries (q_a) and keys, where the locality needs it."""
    params = dict(layer.named_parameters())
    for name in names:
        p = params.get(name)
        if p is not None:
            p.data = without_direction(p.data.reshape(-1, p.shape[-1]), shared).reshape(p.shape)


def quantize_module(module: nn.Module, linears: tuple[str, ...] = FP8_LINEARS,
                    fp8_experts: Callable[[nn.Module], nn.Module] = Fp8Experts.from_experts) -> None:
    """Swap the `linears` children and the routed experts (`fp8_experts` of each `experts` child) of
    `module`'s subtree for FP8 ones, in place; the shared experts' projections are marked `expert`
    (a profile counts them as expert GEMMs)."""
    for path, parent in list(module.named_modules()):
        shared = "shared_experts" in path.split(".")
        for name, child in list(parent.named_children()):
            if name in linears and isinstance(child, nn.Linear):
                setattr(parent, name, Fp8Linear.from_linear(child, expert=shared))
            elif name == "experts" and not isinstance(child, Fp8Experts):
                setattr(parent, name, fp8_experts(child))


@torch.no_grad()
def full_vocab_head(head: torch.Tensor, seed: int) -> None:
    """Draw lm_head's rows past the byte ids (zero after `init_tensor`) from their own seeded generator at
    the byte rows' scale, so every one of the vocabulary's ids can be the greedy token (GLM-5's 154,880);
    the byte rows, the special rows and the other tensors' draws are left as they were. Ids past the
    byte ids decode to no text (ByteTokenizer)."""
    rows = head.data[BYTE_VOCAB:]
    if rows.numel() == 0:
        return
    gen = torch.Generator(device=head.device).manual_seed(seed * 1_000_003 + 11)
    std = float(head.data[SPECIAL_IDS:BYTE_VOCAB].float().std())
    rows.copy_(torch.empty(rows.shape, device=head.device, dtype=torch.float32).normal_(0.0, std, generator=gen))


# build_faithful's / build_v41_faithful's head_vocab: every id (the default from session 40), or the byte ids
# only (the build before it: over a long fixed context its greedy output cycled through a few of them)
HEAD_VOCABS = ("full", "byte")


def check_head_vocab(head_vocab: str) -> None:
    """ValueError naming `head_vocab` unless it is one of HEAD_VOCABS."""
    if head_vocab not in HEAD_VOCABS:
        raise ValueError(f"head_vocab must be one of {HEAD_VOCABS}, got {head_vocab!r}")


def build_faithful(name: str = "glm5-faithful", seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   device: str | torch.device = "cpu", num_layers: int | None = None,
                   overrides: dict | None = None, embed_offset: float = FAITHFUL_EMBED_OFFSET,
                   index_gain: float = FAITHFUL_INDEX_GAIN, ep: tuple[int, int] | None = None,
                   head_vocab: str = "full") -> LoadedModel:
    """Deterministic random faithful model on `device` (same seed, device and config -> identical
    weights), built one layer at a time (module docstring). ep=(rank, world): expert parallelism,
    each MoE layer keeping only the rank's block of its routed experts (an `EPMoE`). head_vocab
    "full" (`full_vocab_head`, the default): lm_head scores every id; "byte": only the byte ids, the
    build of sessions 36-39 (module docstring)."""
    check_head_vocab(head_vocab)
    cfg = faithful_config(name, num_layers, overrides)
    device = torch.device(device)
    with torch.device("meta"):
        model = DsaForCausalLM(cfg)
    m = model.model
    gen = torch.Generator(device=device).manual_seed(seed)
    shared = offset_direction(cfg.hidden_size, seed, device)
    for prefix, module in (("model.embed_tokens.", m.embed_tokens), ("model.norm.", m.norm), ("lm_head.", model.lm_head)):
        _init_module(module, prefix, cfg.num_layers, dtype, device, gen)
    if head_vocab == "full":
        full_vocab_head(model.lm_head.weight, seed)
    if embed_offset:
        m.embed_tokens.weight.data += (embed_offset * shared).to(dtype)
        offset_free_head(model, shared)
    model.lm_head.weight.data[:SPECIAL_IDS] = 0.0
    with torch.device(device):
        m.rotary_emb = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)  # its inv_freq buffer is computed
    index_gen = torch.Generator(device="cpu").manual_seed(seed + 3)
    for i, layer in enumerate(m.layers):
        layer_gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 17 + i)
        _init_module(layer, f"model.layers.{i}.", cfg.num_layers, dtype, device, layer_gen)
        if index_gain and embed_offset:
            stable_index_query(layer, shared, index_gain, index_gen)
        if embed_offset:
            balance_router(layer, shared)
            offset_blind(layer, shared)
        quantize_module(layer)
        if ep is not None and isinstance(layer.mlp, MoE):
            layer.mlp = EPMoE(layer.mlp, *ep)  # the rank's expert block; the full stacks are freed here
    return LoadedModel(model.eval(), cfg, {})
