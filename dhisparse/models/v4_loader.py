"""Load a DeepSeek-V4 checkpoint folder (config.json + safetensors) into `DeepseekV4ForCausalLM`.

Three spellings of the tensor names are accepted, even mixed in one folder:

    upstream (canonical)   embed.weight  head.weight  norm.weight  hc_head_fn
                           layers.i.attn.wq_a.weight  layers.i.attn.compressor.ape
                           layers.i.ffn.experts.e.w1.weight  layers.i.ffn.gate.bias ...
    transformers modules   model.embed_tokens.weight  lm_head.weight  model.layers.i.self_attn.q_a_proj.weight
                           model.layers.i.mlp.experts.gate_up_proj (stacked) ...
    transformers-saved     what save_pretrained writes: model.layers.i.attn.*, model.layers.i.ffn.*,
                           head.weight, model.hc_head.hc_fn, attn.norm.weight (= kv_norm) ...

Per-expert tensors (w1 / w3 / w2, or gate_proj / up_proj / down_proj) are stacked into
gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]. FP8 (e4m3) weights with a
block-128 `.scale` / `_scale_inv` sibling are dequantized; FP4 experts are refused. hyper-connection
tensors, sinks, position_bias, norms and the router bias stay fp32; tid2eid stays int64. MTP tensors
(`mtp.*`, layers >= num_hidden_layers) go to `LoadedModel.extra`, and also onto the model as
`model.mtp_weights` (a dict, empty without MTP tensors; `spec/mtp_v4_io.py` reads it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from dhisparse.models.dsv4 import DeepseekV4ForCausalLM
from dhisparse.models.loader import LoadedModel, ModelLoadError, dequantize_fp8, resolve_dtype, shard_files
from dhisparse.core.v4_config import V4Config

_TOP = {
    "embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight", "lm_head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale", "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base", "hc_head.hc_scale": "model.hc_head.hc_scale",
}
_IDX = "self_attn.compressor.indexer."
_LAYER = {  # upstream / HF-saved per-layer suffix -> our (transformers module) suffix
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{b}_{p}": f"{b}_hc.{p}" for b in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "attn.attn_sink": "self_attn.sinks", "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight", "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight", "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight", "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": _IDX + "q_b_proj.weight",
    "attn.indexer.weights_proj.weight": _IDX + "scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": _IDX + "kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": _IDX + "gate_proj.weight",
    "attn.indexer.compressor.ape": _IDX + "position_bias",
    "attn.indexer.compressor.norm.weight": _IDX + "kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight", "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid", "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_EXPERT = re.compile(r"^(?:ffn|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
# fp32 tensors by our names, and by the upstream spellings the MTP tensors keep in `extra` (hc_attn_fn, attn_sink, ...)
_FP32 = re.compile(r"(_hc\.|hc_head\.|\.sinks$|position_bias$|e_score_correction_bias$|norm\.weight$"
                   r"|hc_[a-z]+_(fn|base|scale)$|attn_sink$|\.gate\.bias$)")


def canonical_name(name: str, num_layers: int) -> str | tuple[int, int, str] | None:
    """Our state-dict name for a checkpoint name; (layer, expert, gate|up|down) for per-expert
    tensors; None for tensors the model does not use (MTP, unknown)."""
    bare = name[len("model."):] if name.startswith("model.") else name
    if bare in _TOP:
        return _TOP[bare]
    m = re.match(r"^layers\.(\d+)\.(.+)$", bare)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= num_layers:
        return None
    e = _EXPERT.match(rest)
    if e is not None:
        return layer, int(e.group(1)), _EXPERT_KIND[e.group(2)]
    return f"model.layers.{layer}.{_LAYER.get(rest, rest)}"


def is_mtp_name(name: str, num_layers: int) -> bool:
    """`mtp.{i}.*` (upstream) or a layer index >= num_hidden_layers (`[model.]layers.{L}.*`)."""
    m = re.match(r"^(?:model\.)?layers\.(\d+)\.", name)
    return name.startswith("mtp.") or (m is not None and int(m.group(1)) >= num_layers)


def read_v4_config(folder: str | Path) -> V4Config:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json next to the safetensors")
    try:
        return V4Config.from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None


def is_v4_folder(folder: str | Path) -> bool:
    """True when folder/config.json says model_type "deepseek_v4" (dispatch hook for the registry)."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type") == "deepseek_v4"
    except (OSError, json.JSONDecodeError):
        return False


def _is_scale(name: str, where: dict) -> bool:
    """Block-scale tensors of quantized weights (not the hyper-connection `*.scale` parameters)."""
    if name.endswith("_scale_inv"):
        return True
    return name.endswith(".scale") and name[: -len(".scale")] + ".weight" in where


def _tensors(folder: Path):
    """Yields (name, tensor) over all shards with FP8 weights dequantized; scale tensors skipped."""
    shards = shard_files(folder)
    handles = {p: safe_open(str(p), framework="pt") for p in shards}
    where = {n: p for p, names in shards.items() for n in (names if names is not None else handles[p].keys())}
    for name, path in where.items():
        if _is_scale(name, where):
            continue
        t = handles[path].get_tensor(name)
        stem = name.removesuffix(".weight")
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            sname = next((s for s in (stem + ".scale", name + "_scale_inv") if s in where), None)
            if sname is None:
                raise ModelLoadError(f"{name} is {t.dtype} but has no block scale tensor (.scale / _scale_inv)")
            t = dequantize_fp8(t, handles[where[sname]].get_tensor(sname).float(), (128, 128), name)
        elif t.dtype == torch.int8 and stem + ".scale" in where:
            raise ModelLoadError(f"{name}: FP4-packed expert weights are not supported yet; use a bf16 / fp8 export")
        yield name, t


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    if not t.is_floating_point():
        return t.to(device=device, dtype=torch.int64)
    return t.to(device=device, dtype=torch.float32 if _FP32.search(name) else dtype)


def _check(name: str, src: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise ModelLoadError(f"{src} (-> {name}): shape {list(got)} but the model expects {list(want)}; "
                             "config.json does not match these weights")


def load_v4_checkpoint(folder: str | Path, dtype: torch.dtype | str | None = None,
                       device: str | torch.device = "cpu") -> LoadedModel:
    """config.json + safetensors -> LoadedModel(DeepseekV4ForCausalLM, V4Config, extra)."""
    folder = Path(folder)
    cfg = read_v4_config(folder)
    target = resolve_dtype(dtype, cfg)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    expected = {n: t.shape for n, t in model.state_dict().items()}
    E = cfg.n_routed_experts
    state, extra, experts = {}, {}, {}
    for src, t in _tensors(folder):
        name = canonical_name(src, cfg.num_layers)
        if isinstance(name, tuple):
            layer, e, kind = name
            if e >= E:
                raise ModelLoadError(f"{src}: expert {e} but config n_routed_experts is {E}")
            experts[(layer, e, kind)] = (src, t)
        elif name in expected:
            _check(name, src, t.shape, expected[name])
            state[name] = _cast(name, t, target, device)
        else:
            extra[src] = _cast(src, t, target, "cpu")  # set aside in host memory: the MTP drafter moves what it uses
    state.update(_stack_experts(experts, expected, cfg, target, device))
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    if missing:
        odd = sorted(n for n in extra if not n.startswith("mtp."))[:3]
        raise ModelLoadError(f"{folder}: {len(missing)} tensor(s) missing, e.g. {missing[:4]}"
                             + (f"; unrecognized names such as {odd}" if odd else "")
                             + "; check config.json (num_hidden_layers, layer_types / compress_ratios)")
    model.load_state_dict(state, strict=True, assign=True)
    model.model.build_ropes(cfg, device)
    model.mtp_weights = {n: t for n, t in extra.items() if is_mtp_name(n, cfg.num_layers)}  # spec/mtp_v4_io.py
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return LoadedModel(model.eval(), cfg, extra)


def _stack_experts(experts: dict, expected: dict, cfg: V4Config, dtype, device) -> dict[str, torch.Tensor]:
    """{(layer, e, gate|up|down): (src, [out, in])} -> stacked gate_up_proj / down_proj per layer."""
    out: dict[str, torch.Tensor] = {}
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    for layer in sorted({k[0] for k in experts}):
        pre = f"model.layers.{layer}.mlp.experts."
        gu = torch.empty(tuple(expected[pre + "gate_up_proj"]), dtype=dtype, device=device)
        dn = torch.empty(tuple(expected[pre + "down_proj"]), dtype=dtype, device=device)
        for e in range(E):
            for kind, dst, rows in (("gate", gu, slice(0, I)), ("up", gu, slice(I, 2 * I)), ("down", dn, slice(None))):
                if (layer, e, kind) not in experts:
                    raise ModelLoadError(f"layer {layer} expert {e}: {kind} weight missing from the checkpoint")
                src, t = experts[(layer, e, kind)]
                _check(pre + kind, src, t.shape, dst[e, rows].shape)
                dst[e, rows] = t.to(device=device, dtype=dtype)
        out[pre + "gate_up_proj"], out[pre + "down_proj"] = gu, dn
    return out
