"""Tiny transformers DeepSeek-V4 checkpoints for parity tests (helper module, not a test file).

`build_v4_hf(d)` builds `AutoModelForCausalLM.from_config` (eager) for a config dict and randomizes
what transformers initializes to constants (so those paths are tested): tid2eid (distinct experts
per token), sinks, compressor / indexer position_bias, router correction bias, every norm weight and
the hyper-connection base / scale. `initializer_range=0.1` makes the sparse selection matter
(sparse vs dense-top-k logits differ by ~1 once a query has more CSA rows than index_topk).

Configs: `v4_config()` (HF keys: SWA / CSA / HCA / CSA, rates 4 / 8, window 8, top-k 3, 8 indexer
heads) and `upstream_v4_config()` (upstream keys: compress_ratios with a trailing MTP entry,
compress_rate_hca 8, num_hash_layers, qk_rope_head_dim, rope_scaling YaRN, rope_theta /
compress_rope_theta). `save_upstream(model, folder, d)` writes upstream tensor names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tie_rule import tie_rule

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
V4_TINY: dict = dict(
    model_type="deepseek_v4", vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=8 / 32, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    layer_types=[SWA, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8}, sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3,
    index_n_heads=8, index_head_dim=16, index_topk=3, num_nextn_predict_layers=0, max_position_embeddings=256,
    initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def v4_config(**over) -> dict:
    return dict(V4_TINY, **over)


def upstream_v4_config(**over) -> dict:
    d = {k: v for k, v in V4_TINY.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                        "partial_rotary_factor", "num_nextn_predict_layers")}
    d.update(compress_ratios=[0, 4, 128, 4, 0], compress_rate_hca=8, num_hash_layers=2, qk_rope_head_dim=8,
             rope_theta=10000.0, compress_rope_theta=160000.0, num_nextn_predict_layers=1,
             max_position_embeddings=128,
             rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1))
    d.update(over)
    return d


def build_v4_hf(d: dict, seed: int = 0):
    """Random transformers V4 model (fp32, eager) with the constant-initialized tensors randomized."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**d)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif n.endswith((".sinks", "position_bias")):
                p.normal_(0.0, 1.0)
            elif n.endswith((".base", "hc_base")):
                p.normal_(0.0, 0.3)
            elif n.endswith((".scale", "hc_scale")):
                p.normal_(1.0, 0.3)
        for n, b in model.named_buffers():
            if n.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(E)[:k] for _ in range(b.shape[0])]))
            elif n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return tie_rule(model)


def save_v4_checkpoint(d: dict, folder: str | Path, seed: int = 0) -> Path:
    """build_v4_hf(d, seed).save_pretrained(folder) (transformers' mixed dialect)."""
    folder = Path(folder)
    build_v4_hf(d, seed).save_pretrained(folder)
    return folder


def load_v4_hf(folder: str | Path):
    from transformers import AutoModelForCausalLM

    return tie_rule(AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager").eval())


# transformers module suffix -> upstream suffix (hand-written, independent of our loader's table)
_UP = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.sinks": "attn.attn_sink", "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight", "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight", "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight", "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid", "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    **{f"{b}_hc.{p}": f"hc_{b}_{p}" for b in ("attn", "ffn") for p in ("fn", "base", "scale")},
}
_UP_TOP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
           "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}


def upstream_state(hf_state: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """transformers in-memory state dict -> upstream names with per-expert w1 / w3 / w2 tensors."""
    out = {}
    for name, t in hf_state.items():
        if name in _UP_TOP:
            out[_UP_TOP[name]] = t
            continue
        _, _, i, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                out[f"layers.{i}.ffn.experts.{e}.w1.weight"] = t[e, :inter]
                out[f"layers.{i}.ffn.experts.{e}.w3.weight"] = t[e, inter:]
        elif rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"layers.{i}.ffn.experts.{e}.w2.weight"] = t[e]
        else:
            out[f"layers.{i}.{_UP[rest]}"] = t
    return out


def save_state(state: dict[str, torch.Tensor], folder: str | Path, config: dict) -> Path:
    """Write folder/config.json + folder/model.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def save_upstream(model, folder: str | Path, config: dict) -> Path:
    return save_state(upstream_state(model.state_dict(), config["moe_intermediate_size"]), folder, config)


# ---- running our model ----------------------------------------------------------------------------
def new_state(lm, rid=0, auto_commit: bool = True):
    """(V4Cache, V4RequestState) for our model."""
    from dhisparse.kv.v4.passes import V4Cache

    cache = V4Cache(lm.config)
    return cache, cache.new_request(rid, auto_commit=auto_commit)


def step(lm, cache, state, ids: list[int]) -> torch.Tensor:
    """Run `ids` at the state's next positions -> fp32 logits [len(ids), vocab]."""
    from dhisparse.core.batch import ForwardBatch

    batch = ForwardBatch.build([(list(ids), state.length)])
    return lm.logits(lm(batch, cache.begin(batch, [state])).hidden)


def chunked_logits(lm, chunks: list[list[int]]) -> torch.Tensor:
    cache, st = new_state(lm)
    return torch.cat([step(lm, cache, st, c) for c in chunks])


def greedy_v4(lm, prompt: list[int], n: int, ban: tuple[int, ...] = ()) -> list[int]:
    """Greedy decode with our model: prefill, then one token per pass; `ban` ids never chosen."""
    cache, st = new_state(lm)
    logits = step(lm, cache, st, prompt)[-1]
    out: list[int] = []
    for i in range(n):
        logits = logits.clone()
        logits[list(ban)] = float("-inf")
        out.append(int(logits.argmax()))
        if i + 1 < n:
            logits = step(lm, cache, st, out[-1:])[0]
    return out


def greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def one_thread():
    """Generator for an autouse fixture: tiny models run ~10x faster on one intra-op thread (no
    spin-waiting on a busy 2-core CI box); restores the thread count afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
