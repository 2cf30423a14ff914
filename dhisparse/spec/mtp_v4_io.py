"""DeepSeek-V4 MTP block <-> checkpoint tensors.

A V4 checkpoint with `num_nextn_predict_layers >= 1` carries its first MTP block under `mtp.0.`
(DeepSeek's release; vLLM's `deepseek_v4_mtp` loader reads these names; L = num_hidden_layers
spellings `[model.]layers.{L}.` are accepted too). D = hidden, N = hc_mult, V = vocab:

    e_proj.weight  h_proj.weight [D, D]     enorm.weight  hnorm.weight  norm.weight [D]
    hc_head_fn [N, N * D]  hc_head_base [N]  hc_head_scale [1]          (all fp32)
    optional head.weight [V, D] and emb.tok_emb.weight / embed.weight [V, D] (else the target's)
    one V4 decoder layer under the same prefix, in the target layers' spellings: attn_norm,
    ffn_norm, hc_attn_{fn,base,scale}, hc_ffn_*, attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_a,
    wo_b, attn_sink}, ffn.gate.{weight, bias}, ffn.experts.{e}.{w1,w2,w3}, ffn.shared_experts.*

The decoder layer's names go through the V4 loader's own mapping (`canonical_name`), so every
spelling the target accepts is accepted here. The V4 loader sets these tensors aside on the model
(`model.mtp_weights`, FP8 already dequantized). A block with a compressor or an indexer is
refused: the drafter implements the sliding-window MTP layer V4 configs describe.
"""

from __future__ import annotations

import torch

from dhisparse.core.v4_config import V4Config
from dhisparse.models.v4_loader import canonical_name
from dhisparse.spec.config import SpecConfigError
from dhisparse.spec.mtp_io import check_state, stack_experts
from dhisparse.spec.mtp_v4_model import MtpV4Config, MtpV4Module

FLAG = "--speculative-algorithm mtp"
OWN = {  # checkpoint name below the prefix -> MtpV4Module name (outside the decoder layer)
    "e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight", "norm.weight": "norm.weight", "shared_head.norm.weight": "norm.weight",
    **{f"hc_head_{p}": f"hc_head.hc_{p}" for p in ("fn", "base", "scale")},
    **{f"hc_head.hc_{p}": f"hc_head.hc_{p}" for p in ("fn", "base", "scale")},
    "head.weight": "head.weight", "shared_head.head.weight": "head.weight",
    "emb.tok_emb.weight": "embed.weight", "embed.weight": "embed.weight", "embed_tokens.weight": "embed.weight",
}
NEED = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
        "hc_head_fn", "hc_head_base", "hc_head_scale")


def layer_tensors(tensors: dict[str, torch.Tensor], tcfg: V4Config) -> dict[str, torch.Tensor]:
    """The first MTP block's tensors, names relative to its prefix. One-line SpecConfigError when
    the config or the checkpoint lacks it."""
    L = tcfg.num_layers
    prefixes = ("mtp.0.", f"layers.{L}.", f"model.layers.{L}.")
    found = {n[len(p):]: t for n, t in tensors.items() for p in prefixes if n.startswith(p)}
    if tcfg.num_nextn_predict_layers < 1:
        raise SpecConfigError(
            f"{FLAG}: the DeepSeek-V4 target's config.json says num_nextn_predict_layers=0 and the checkpoint has "
            f"{'no' if not found else len(found)} mtp.0.* tensors; use a checkpoint that ships its MTP block, or "
            "another --speculative-algorithm (dflash, dspark, ngram)")
    alias = {"hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale",
             "norm.weight": "shared_head.norm.weight"}
    missing = [f"mtp.0.{n}" for n in NEED if n not in found and alias.get(n) not in found]
    if missing:
        raise SpecConfigError(
            f"{FLAG}: config.json says num_nextn_predict_layers={tcfg.num_nextn_predict_layers} but the DeepSeek-V4 "
            f"checkpoint lacks MTP tensors {missing[:4]}; re-export it with its mtp.* block, or use another "
            "--speculative-algorithm (dflash, dspark, ngram)")
    return found


def module_state(found: dict[str, torch.Tensor], tcfg: V4Config) -> tuple[MtpV4Config, dict[str, torch.Tensor]]:
    """Prefix-relative checkpoint names -> (MtpV4Config, MtpV4Module state dict): decoder tensors
    under `block.`, per-expert tensors stacked into gate_up_proj [E, 2I, D] / down_proj [E, D, I]."""
    L, E = tcfg.num_layers, tcfg.n_routed_experts
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], torch.Tensor] = {}
    for rest, t in found.items():
        if rest in OWN:
            state[OWN[rest]] = t
            continue
        name = canonical_name(f"layers.{L}.{rest}", L + 1)
        if isinstance(name, tuple):
            experts[(name[1], name[2])] = t
            continue
        rel = name.removeprefix(f"model.layers.{L}.")
        if "compressor" in rel or "indexer" in rel:
            raise SpecConfigError(f"{FLAG}: the DeepSeek-V4 MTP block has compressed attention (mtp.0.{rest}); only a "
                                  "sliding-window MTP layer (compress ratio 0) is supported")
        state["block." + rel] = t
    if experts:
        state["block.mlp.experts.gate_up_proj"], state["block.mlp.experts.down_proj"] = stack_experts(
            experts, E, ("gate", "up", "down"), lambda e, k: f"mtp.0.ffn.experts.{e}.{k}", "mtp.0.ffn.experts")
    cfg = MtpV4Config(layer=L, hashed="block.mlp.gate.tid2eid" in state, own_embed="embed.weight" in state,
                      own_head="head.weight" in state)
    return cfg, state


def build_module(tensors: dict[str, torch.Tensor], tcfg: V4Config, dtype: torch.dtype,
                 device: torch.device | str, **cfg_kw) -> MtpV4Module:
    """The MTP block of a loaded V4 checkpoint (`model.mtp_weights`) on the target's device / dtype."""
    cfg, state = module_state(layer_tensors(tensors, tcfg), tcfg)
    cfg = MtpV4Config(**{**cfg.__dict__, **cfg_kw})
    with torch.device("meta"):
        module = MtpV4Module(cfg, tcfg)
    check_state(module, state, "DeepSeek-V4 MTP", lambda n: n, "names of our MtpV4Module")
    module.load_state_dict({n: t.to(device) for n, t in state.items()}, strict=True, assign=True)
    return module.to_target(dtype, device).eval()
