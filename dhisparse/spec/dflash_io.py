"""Drafter checkpoints in the public DFlash layout: a folder with config.json + *.safetensors.

config.json: see `dflash_config` (Qwen3-style keys + `dflash_config` {block_size, mask_token_id,
target_layer_ids}). Tensors (names as in `dflash_model`, an optional leading `model.` is
stripped):

    fc.weight                                   [hidden, len(target_layer_ids) * hidden]
    hidden_norm.weight, norm.weight             [hidden]
    layers.{i}.input_layernorm.weight           [hidden]
    layers.{i}.post_attention_layernorm.weight  [hidden]
    layers.{i}.self_attn.q_proj.weight          [heads * head_dim, hidden]
    layers.{i}.self_attn.{k,v}_proj.weight      [kv_heads * head_dim, hidden]
    layers.{i}.self_attn.o_proj.weight          [hidden, heads * head_dim]
    layers.{i}.self_attn.{q,k}_norm.weight      [head_dim]   (optional: absent -> no qk norm)
    layers.{i}.mlp.{gate,up}_proj.weight        [intermediate, hidden]
    layers.{i}.mlp.down_proj.weight             [hidden, intermediate]

DFlash2 (`dflash_config` has conv_kernel_size, conv_group_size, selector_rank, selector_top_k):

    layers.{i}.{attention,mlp}_conv.base_kernel                 [2, kernel_size, hidden]
    layers.{i}.{attention,mlp}_conv.kernel_projection.weight    [2 * kernel_size * hidden / group_size, hidden]
    candidate_selector.{predecessor,successor}_codebook[.weight] [vocab, rank]  (published files omit .weight)
    candidate_selector.hidden_projection.weight                 [rank, hidden]

No embedding or LM head: the drafter uses the target's. Tensors the config does not explain are
refused unless `strict=False`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dhisparse.spec.dflash_config import DFlashConfig, DFlashConfigError
from dhisparse.spec.dflash_model import DFlashModel

PREFIX = "model."
BARE_NAMES = {f"candidate_selector.{n}_codebook": f"candidate_selector.{n}_codebook.weight"
              for n in ("predecessor", "successor")}  # DFlash2 files store the codebooks without ".weight"


def save_dflash(folder: str | Path, cfg: DFlashConfig, model: DFlashModel) -> Path:
    """Write config.json + model.safetensors (our own writer, documented layout above)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's *.safetensors files, `model.` prefix stripped."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DFlashConfigError(f"drafter checkpoint {folder}: no *.safetensors file found")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                name = key[len(PREFIX):] if key.startswith(PREFIX) else key
                out[BARE_NAMES.get(name, name)] = handle.get_tensor(key)
    return out


def load_dflash(folder: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                strict: bool = True) -> tuple[DFlashConfig, DFlashModel]:
    """Read a drafter checkpoint -> (config, model in eval mode). dtype None keeps the stored one."""
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise DFlashConfigError(f"drafter checkpoint {folder}: config.json not found (--speculative-draft-model-path)")
    cfg = DFlashConfig.from_hf(json.loads(cfg_file.read_text()))
    tensors = read_tensors(folder)
    cfg = replace(cfg, qk_norm="layers.0.self_attn.q_norm.weight" in tensors)
    model = DFlashModel(cfg)
    _load_state(model, tensors, folder, strict)
    if dtype is not None:
        model = model.to(dtype)
    return cfg, model.to(device).eval()


def _load_state(model: DFlashModel, tensors: dict[str, torch.Tensor], folder: Path, strict: bool) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise DFlashConfigError(f"drafter checkpoint {folder}: missing tensors {missing[:6]} (of {len(missing)})")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected and strict:
        raise DFlashConfigError(
            f"drafter checkpoint {folder}: unsupported tensors {unexpected[:6]} (of {len(unexpected)}); "
            "its config.json does not describe them (a DFlash2 checkpoint without conv_* / selector_* in "
            "dflash_config?) - pass strict=False to ignore them"
        )
    for name, ref in expected.items():
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise DFlashConfigError(
                f"drafter checkpoint {folder}: {name} has shape {tuple(tensors[name].shape)}, "
                f"config.json implies {tuple(ref.shape)}"
            )
    model.to(tensors["fc.weight"].dtype)  # keep the stored dtype (bf16 checkpoints stay bf16)
    model.load_state_dict({k: tensors[k] for k in expected}, strict=True)
