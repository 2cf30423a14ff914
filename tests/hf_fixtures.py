"""Tiny transformers checkpoints for parity tests (helper module, not a test file).

`save_hf_checkpoint(d, folder)` builds `AutoModelForCausalLM.from_config` (eager attention) with a
seeded random init and a random non-zero `e_score_correction_bias`, and `save_pretrained`s it:
config.json + model.safetensors with per-expert names, exactly like a real HF checkpoint.
Variants: `v32_config()` (3 layers, dense layer 0, n_group 2 / topk_group 1) and `glm_config()`
(5 layers full, full, shared, shared, full). All use 8 indexer heads and index_topk 4 < prompts.

Also small helpers shared by tests: reference / our greedy decoding, state-dict <-> checkpoint
names, writing a sharded checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tie_rule import tie_rule

V32: dict = dict(
    model_type="deepseek_v32", vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=32, q_lora_rank=48,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=4, index_head_dim=16,
    index_n_heads=8, first_k_dense_replace=1, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
GLM: dict = dict(
    V32, model_type="glm_moe_dsa", num_hidden_layers=5, n_group=1, topk_group=1,
    indexer_types=["full", "full", "shared", "shared", "full"],
)


def v32_config(**over) -> dict:
    return dict(V32, **over)


def glm_config(**over) -> dict:
    return dict(GLM, **over)


def build_hf_model(d: dict, seed: int = 0):
    """Random transformers model for config dict `d` (fp32, eager), correction bias ~ N(0, 0.1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**d), attn_implementation="eager").eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    return tie_rule(model)


def save_hf_checkpoint(d: dict, folder: str | Path, seed: int = 0) -> Path:
    """build_hf_model(d, seed).save_pretrained(folder); returns the folder."""
    folder = Path(folder)
    build_hf_model(d, seed).save_pretrained(folder)
    return folder


def load_hf(folder: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' own from_pretrained of a saved fixture (the parity reference)."""
    from transformers import AutoModelForCausalLM

    return tie_rule(AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager", dtype=dtype).eval())


def checkpoint_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file fixture, under their checkpoint (per-expert) names."""
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def copy_config(src: str | Path, dst: str | Path, **updates) -> Path:
    """Copy src/config.json into dst (created), applying key updates."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    d = json.loads((Path(src) / "config.json").read_text())
    d.update(updates)
    (dst / "config.json").write_text(json.dumps(d, indent=1))
    return dst


def save_single(state: dict[str, torch.Tensor], folder: str | Path, config_from: str | Path, **config_updates) -> Path:
    """Write `state` as folder/model.safetensors next to a copied config.json."""
    from safetensors.torch import save_file

    folder = copy_config(config_from, folder, **config_updates)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def save_sharded(state: dict[str, torch.Tensor], folder: str | Path, config_from: str | Path, n_shards: int = 2) -> Path:
    """Write `state` as n shards + model.safetensors.index.json (names alternate between shards)."""
    from safetensors.torch import save_file

    folder = copy_config(config_from, folder)
    names = sorted(state)
    weight_map = {}
    for s in range(n_shards):
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: state[n].contiguous() for n in names[s::n_shards]}
        save_file(part, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def copy_checkpoint(src: str | Path, dst: str | Path) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


def prefill_logits(lm, ids: list[int]) -> torch.Tensor:
    """Our model's fp32 logits [len(ids), vocab] for one prompt, through DenseKV."""
    from dhisparse.core.batch import ForwardBatch
    from dhisparse.kv.resident.dense import DenseKV

    kv = DenseKV(lm.config)
    batch = ForwardBatch.build([(list(ids), 0)])
    return lm.model.logits(lm.model(batch, kv.begin(batch, [0])).hidden)


def greedy_ours(lm, prompt: list[int], n: int, ban: tuple[int, ...] = ()) -> list[int]:
    """Greedy decode with our model and DenseKV: prefill, then one token per pass. `ban` ids are
    never chosen (mirrors transformers' min_new_tokens suppressing EOS)."""
    from dhisparse.core.batch import ForwardBatch
    from dhisparse.kv.resident.dense import DenseKV

    kv = DenseKV(lm.config)
    batch = ForwardBatch.build([(list(prompt), 0)])
    hidden = lm.model(batch, kv.begin(batch, [0])).hidden[-1:]
    out: list[int] = []
    for step in range(n):
        logits = lm.model.logits(hidden)[0].clone()
        if ban:
            logits[list(ban)] = float("-inf")
        tok = int(logits.argmax())
        out.append(tok)
        if step + 1 < n:
            batch = ForwardBatch.build([([tok], len(prompt) + step)])
            hidden = lm.model(batch, kv.begin(batch, [0])).hidden
    return out


def greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' generate(do_sample=False) of exactly n new tokens (EOS suppressed)."""
    ids = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        out = hf.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()
