"""MTP block <-> checkpoint tensors (DeepSeek-V3 layout, also DeepSeek-V3.2 and GLM-5 `glm_moe_dsa`).

With `num_nextn_predict_layers >= 1` in config.json the checkpoint carries, for the MTP layer
L = num_hidden_layers (the layout SGLang's `deepseek_nextn` / GLM-5 NextN and vLLM's
`deepseek_mtp` loaders read):

    model.layers.{L}.enorm.weight  hnorm.weight  [H]        model.layers.{L}.eh_proj.weight [H, 2H]
    model.layers.{L}.shared_head.norm.weight [H]            optional shared_head.head.weight [V, H]
    optional model.layers.{L}.embed_tokens.weight [V, H]    (absent: the target's are shared)
    one ordinary decoder layer under the same prefix: input_layernorm, post_attention_layernorm,
    self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    o_proj, indexer.*}, mlp.{gate, experts.{e}.{gate,up,down}_proj, shared_experts.*} or a dense mlp

The loader (`models/loader.py`) sets these aside (`LoadedModel.extra`, and `model.mtp_weights` on
the model it returns). Further MTP layers (L + 1, ...) are not used: the first one is chained.
The indexer tensors are read and set aside: the drafter's window attention is dense (exact DSA
for a window of at most index_topk rows, `spec/mtp.py`).
"""

from __future__ import annotations

import re

import torch

from dhisparse.core.config import ModelConfig
from dhisparse.spec.config import SpecConfigError
from dhisparse.spec.mtp_model import MtpConfig, MtpModule

OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")  # names outside the decoder layer
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FLAG = "--speculative-algorithm mtp"


def layer_tensors(tensors: dict[str, torch.Tensor], tcfg: ModelConfig) -> tuple[int, dict[str, torch.Tensor]]:
    """The first MTP layer's tensors, names relative to `model.layers.{L}.` -> (L, tensors).
    Raises a one-line SpecConfigError when the config or the tensors lack the MTP layer."""
    L = tcfg.num_layers
    prefix = f"model.layers.{L}."
    found = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
    if tcfg.num_nextn_predict_layers < 1:
        raise SpecConfigError(
            f"{FLAG}: the target's config.json has no num_nextn_predict_layers (or 0) and "
            f"{'no' if not found else len(found)} model.layers.{L}.* tensors; use a checkpoint that ships its "
            "MTP layer, or another --speculative-algorithm (dflash, dspark, ngram)")
    need = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
    missing = [prefix + n for n in need if n not in found]
    if missing:
        raise SpecConfigError(
            f"{FLAG}: config.json says num_nextn_predict_layers={tcfg.num_nextn_predict_layers} but the checkpoint "
            f"lacks MTP tensors {missing}; re-export the checkpoint with its MTP layer, or use another "
            "--speculative-algorithm (dflash, dspark, ngram)")
    return L, found


def module_state(found: dict[str, torch.Tensor], tcfg: ModelConfig) -> tuple[MtpConfig, dict[str, torch.Tensor]]:
    """Checkpoint-relative names -> (MtpConfig, MtpModule state dict): decoder tensors under
    `decoder.`, per-expert tensors stacked into gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
    moe = any(n.startswith(("mlp.experts.", "mlp.gate.")) for n in found)
    cfg = MtpConfig(layer=tcfg.num_layers, moe=moe, own_embed="embed_tokens.weight" in found,
                    own_head="shared_head.head.weight" in found)
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], torch.Tensor] = {}
    for name, t in found.items():
        m = _EXPERT.match(name)
        if m is not None:
            experts[(int(m.group(1)), m.group(2))] = t
        elif ".indexer." in name or name.endswith("rotary_emb.inv_freq"):
            continue  # unused by the dense window attention (see the module docstring)
        else:
            state[name if name.startswith(OWN) else "decoder." + name] = t
    if experts:
        state["decoder.mlp.experts.gate_up_proj"], state["decoder.mlp.experts.down_proj"] = stack_experts(
            experts, tcfg.n_routed_experts, ("gate_proj", "up_proj", "down_proj"),
            lambda e, k: f"mlp.experts.{e}.{k}.weight", f"model.layers.{tcfg.num_layers}.mlp.experts")
    return cfg, state


def stack_experts(experts: dict[tuple[int, str], torch.Tensor], E: int, keys: tuple[str, str, str], missing_name,
                  where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert tensors {(e, gate | up | down key): [I, H] / [H, I]} -> (gate_up_proj [E, 2I, H],
    down_proj [E, H, I]); every expert 0..E-1 must have all three (missing_name(e, key) names an
    absent one in the error, `where` the checkpoint's expert block)."""
    gate, up, down = keys
    absent = [missing_name(e, k) for e in range(E) for k in keys if (e, k) not in experts]
    if absent or max(e for e, _ in experts) >= E:
        raise SpecConfigError(f"{FLAG}: {where} are incomplete for n_routed_experts={E} (e.g. missing "
                              f"{absent[:3]}); the checkpoint does not match config.json")
    return (torch.stack([torch.cat([experts[(e, gate)], experts[(e, up)]]) for e in range(E)]),
            torch.stack([experts[(e, down)] for e in range(E)]))


def build_module(tensors: dict[str, torch.Tensor], tcfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str, **cfg_kw) -> MtpModule:
    """The MTP block of a loaded checkpoint (`model.mtp_weights`), on the target's device / dtype."""
    _, found = layer_tensors(tensors, tcfg)
    cfg, state = module_state(found, tcfg)
    cfg = MtpConfig(**{**cfg.__dict__, **cfg_kw})
    with torch.device("meta"):
        module = MtpModule(cfg, tcfg)
    prefix = f"model.layers.{cfg.layer}."
    check_state(module, state, "MTP layer", lambda n: prefix + n.removeprefix("decoder."),
                "dense vs MoE: first_k_dense_replace / n_routed_experts")
    module.load_state_dict({n: t.to(device) for n, t in state.items()}, strict=True, assign=True)
    module.rotary_emb = type(module.rotary_emb)(tcfg.rope, tcfg.qk_rope_head_dim).to(device)
    return module.to_target(dtype, device).eval()


def check_state(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str, name, hint: str) -> None:
    """The tensors of `state` must be exactly the module's, with its shapes; else a one-line
    SpecConfigError naming the first offenders (`name` maps a module name to the checkpoint's)."""
    expected = {n: t.shape for n, t in module.state_dict().items()}
    missing, unknown = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unknown:
        raise SpecConfigError(f"{FLAG}: {what} tensors do not match config.json: missing "
                              f"{[name(n) for n in missing[:4]]}, unexpected {[name(n) for n in unknown[:4]]} ({hint})")
    bad = [(n, list(t.shape), list(expected[n])) for n, t in state.items() if tuple(t.shape) != tuple(expected[n])]
    if bad:
        raise SpecConfigError(f"{FLAG}: {what} tensor {name(bad[0][0])} has shape {bad[0][1]} but the target's "
                              f"config gives {bad[0][2]}; config.json does not match the weights")


def checkpoint_tensors(module: MtpModule) -> dict[str, torch.Tensor]:
    """The module under its checkpoint names (`model.layers.{L}.*`, per-expert tensors), e.g. to
    write an MTP layer into a safetensors file."""
    prefix, I = f"model.layers.{module.cfg.layer}.", module.tcfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict().items():
        rel = name.removeprefix("decoder.")
        if rel == "mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :I].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, I:].clone()
        elif rel == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[prefix + rel] = t.detach().clone()
    return out

