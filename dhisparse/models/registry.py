"""`load_model(spec)`: one entry point for the CLI, server and benchmarks.

spec is the name of a built-in model (`tiny-code`: the trained checkpoint shipped in
`models/builtin/`; `tiny`, the `*-scaled` models and `glm5-faithful`: seeded random weights), a checkpoint folder
(config.json + safetensors, optionally tokenizer.json) or a Hub id `org/name` already in the local
Hugging Face cache (found offline, `resolve_hub`; nothing is downloaded). The result carries its tokenizer.
`load_for_config(config, device)` also applies the EngineConfig's revision, tokenizer, chat
template and quantization settings. With `shard` (a `shard_load.ShardSpec`: a TP or EP rank) a
GLM-5.x / V3.2 checkpoint folder is read shard-wise (each rank reads only what it keeps), and so is
a DeepSeek-V4 folder for an EP rank (models/v4_shard_load.py: its expert block, the rest whole); a
built-in random model is built whole on the CPU and sharded in memory, except `glm5-faithful` under
EP, which each rank builds on its own device keeping only its experts (models/faithful.py; TP refused).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from dhisparse.core.config import ModelConfig
from dhisparse.models.loader import LoadedModel, ModelLoadError, load_checkpoint, resolve_dtype
from dhisparse.models.faithful import FAITHFUL_CONFIGS, build_faithful, faithful_config
from dhisparse.models.scaled import build_scaled, scaled_config
from dhisparse.models.shard_load import ShardSpec, load_sharded, shard_in_memory
from dhisparse.models.tiny import build_tiny, tiny_config
from dhisparse.models.tokenizer import ByteTokenizer, load_tokenizer, with_chat_template
from dhisparse.models.v4_loader import is_v4_folder, load_v4_checkpoint
from dhisparse.models.v4_shard_load import load_v4_sharded
from dhisparse.models.v4_faithful import build_v41_faithful, v41_faithful_config
from dhisparse.models.v4_scaled import build_v41_scaled, v41_scaled_config

log = logging.getLogger(__name__)
SUPPORTED_FAMILIES = ("glm_moe_dsa", "deepseek_v32", "deepseek_v4")  # config.json model_type values we load
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def _tiny(dtype: torch.dtype | str | None, device: str | torch.device, seed: int) -> LoadedModel:
    target = resolve_dtype(dtype, tiny_config())
    return dataclasses.replace(build_tiny(seed, target, device), tokenizer=ByteTokenizer())


def _scaled(name: str) -> Callable[[torch.dtype | str | None, str | torch.device, int], LoadedModel]:
    """Loader of a scaled benchmark model (dhisparse.models.scaled); default dtype bfloat16."""

    def load(dtype: torch.dtype | str | None, device: str | torch.device, seed: int) -> LoadedModel:
        target = resolve_dtype(dtype, scaled_config(name, 1))  # None -> the config's bfloat16
        return dataclasses.replace(build_scaled(name, seed, target, device), tokenizer=ByteTokenizer())

    return load


def _faithful(name: str) -> Callable[[torch.dtype | str | None, str | torch.device, int], LoadedModel]:
    """Loader of a compute-faithful benchmark model (dhisparse.models.faithful: FP8 weights, the
    rest bfloat16 by default); ep=(rank, world): a rank's expert-parallel part, built on `device`."""

    def load(dtype: torch.dtype | str | None, device: str | torch.device, seed: int,
             ep: tuple[int, int] | None = None) -> LoadedModel:
        target = resolve_dtype(dtype, faithful_config(name, 1))
        return dataclasses.replace(build_faithful(name, seed, target, device, ep=ep), tokenizer=ByteTokenizer())

    return load


def _v41(dtype: torch.dtype | str | None, device: str | torch.device, seed: int) -> LoadedModel:
    """`v41-scaled`: DeepSeek-V4.1-shaped random model (models/v4_scaled.py); default bfloat16."""
    target = resolve_dtype(dtype, v41_scaled_config())  # None -> the config's bfloat16
    return dataclasses.replace(build_v41_scaled(seed, target, device), tokenizer=ByteTokenizer())


def _v41_faithful(dtype: torch.dtype | str | None, device: str | torch.device, seed: int) -> LoadedModel:
    """`v41-faithful`: DeepSeek-V4.1-Flash's compute with FP8 weights (models/v4_faithful.py)."""
    target = resolve_dtype(dtype, v41_faithful_config(3))
    return dataclasses.replace(build_v41_faithful(seed, target, device), tokenizer=ByteTokenizer())


BUILTINS: dict[str, Callable[[torch.dtype | str | None, str | torch.device, int], LoadedModel]] = {
    "tiny": _tiny, "dsv32-scaled": _scaled("dsv32-scaled"), "v41-scaled": _v41, "v41-faithful": _v41_faithful,
    **{name: _scaled(name) for name in ("glm52-scaled", "glm52-scaled-k512")},
    **{name: _faithful(name) for name in FAITHFUL_CONFIGS},
}


# trained checkpoints shipped with the package (package data), loaded like any folder
BUILTIN_FOLDERS: dict[str, Path] = {"tiny-code": Path(__file__).resolve().parent / "builtin" / "tiny-code"}
# each one's own drafter checkpoint, used when --speculative-draft-model-path is left out
BUILTIN_DRAFTERS: dict[str, dict[str, str]] = {"tiny-code": {"dflash2": "dflash2", "dflash": "dflash2"}}


def builtin_config(name: str) -> ModelConfig:
    """The ModelConfig of a built-in random model (`tiny`, `*-scaled` GLM / V3.2, `glm5-faithful`),
    no weights built; KeyError for other names (V4 models have their own `V4Config`)."""
    if name == "tiny":
        return tiny_config()
    if name in FAITHFUL_CONFIGS:
        return faithful_config(name)
    return scaled_config(name)


def builtin_names() -> list[str]:
    return sorted([*BUILTINS, *BUILTIN_FOLDERS])


def builtin_folder(name: str) -> Path:
    """The folder of a shipped trained checkpoint (`tiny-code`); ModelLoadError if it is missing."""
    folder = BUILTIN_FOLDERS[name]
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"--model {name!r}: the built-in checkpoint is missing from {folder} (a broken install?)")
    return folder


def builtin_drafter(model: str, algorithm: str | None) -> str | None:
    """The shipped drafter folder of a built-in trained model for `algorithm`, else None."""
    sub = BUILTIN_DRAFTERS.get(str(model), {}).get(algorithm or "")
    return str(BUILTIN_FOLDERS[str(model)] / sub) if sub else None


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else huggingface_hub's default
    (read from the environment now, not at huggingface_hub's import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_hub(repo_id: str, revision: str | None = None) -> Path:
    """A Hub id `org/name` -> its snapshot folder in the local cache, offline (local_files_only)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(f"--model {repo_id!r} looks like a Hub id but huggingface_hub is not installed "
                             "(pip install huggingface_hub); or pass a checkpoint folder") from None
    cache = hub_cache_dir()
    rev = f" at revision {revision!r}" if revision else ""
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError, a bad revision, ...
        raise ModelLoadError(
            f"--model {repo_id!r}{rev} is not in the local Hugging Face cache ({cache}; {type(e).__name__}); dhisparse "
            f"does not download: fetch it first (`hf download {repo_id}`"
            f"{' --revision ' + revision if revision else ''}), set HF_HUB_CACHE, or pass a folder"
        ) from None


def resolve_folder(spec: str | Path, revision: str | None = None) -> Path:
    """A checkpoint folder, or the cached snapshot of a Hub id (ModelLoadError naming both otherwise)."""
    name = str(spec)
    if name in BUILTIN_FOLDERS:
        if revision is not None:
            raise ModelLoadError(f"--revision applies to Hub ids (org/name), not to the built-in model {name!r}")
        return builtin_folder(name)
    folder = Path(name).expanduser()
    if folder.is_dir():
        if revision is not None:
            raise ModelLoadError(f"--revision {revision!r} applies to Hub ids (org/name), not to the folder {name!r}")
        return folder
    if _HUB_ID.fullmatch(name) and not name.startswith((".", "/")):
        return resolve_hub(name, revision)
    raise ModelLoadError(
        f"--model {name!r} is neither a built-in model ({', '.join(builtin_names())}), an existing folder nor a "
        "Hub id org/name; pass a built-in name, a folder holding config.json and *.safetensors, or a cached Hub id"
    )


def check_family(folder: Path) -> None:
    """Refuse a config.json whose model_type we do not load, listing every supported family."""
    try:
        arch = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError, AttributeError):
        return  # the loaders explain a missing or broken config.json
    if arch not in SUPPORTED_FAMILIES:
        raise ModelLoadError(f"{folder}/config.json: model_type {arch!r} is not supported; dhisparse serves "
                             f"{', '.join(SUPPORTED_FAMILIES)}")


def _is_fp8_folder(folder: Path) -> bool:
    try:
        q = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
    return isinstance(q, dict) and q.get("quant_method") == "fp8"


def load_model(
    spec: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu", seed: int = 0,
    *, revision: str | None = None, tokenizer: str | Path | None = None, chat_template: str | None = None,
    quantization: str | None = None, progress: bool = False, shard: ShardSpec | None = None,
) -> LoadedModel:
    """Built-in name, checkpoint folder or cached Hub id -> LoadedModel with `tokenizer` set.

    dtype: torch dtype or name (float32 / bfloat16 / float16); None = the checkpoint's dtype
    (float32 for built-ins). seed: weights of built-in random models (ignored for folders).
    revision: of a Hub id. tokenizer: another folder (or cached Hub id) for the tokenizer.
    chat_template: a Jinja file or template text replacing the tokenizer's. quantization: None /
    "none" or "fp8" (the checkpoint must be block-scaled FP8). progress: a bar over the shards.
    shard: a rank's part (module docstring), None = the whole model.
    """
    name = str(spec)
    if quantization not in (None, "none", "fp8"):
        raise ModelLoadError(f"--quantization {quantization!r} is not supported; use none or fp8 (block-scaled FP8 "
                             "checkpoints, dequantized at load)")
    if name in BUILTINS:
        if revision is not None:
            raise ModelLoadError(f"--revision applies to Hub ids (org/name), not to the built-in model {name!r}")
        if quantization == "fp8":
            raise ModelLoadError(f"--quantization fp8 needs a block-scaled FP8 checkpoint; the built-in {name!r} is not")
        if shard is not None and name in FAITHFUL_CONFIGS:
            if shard.mode != "ep":
                raise ModelLoadError(f"--model {name!r}: its FP8 weight modules are not tensor-parallel (--tp-size 1); "
                                     "it shards its routed experts under --ep-size (DP attention), and glm52-scaled "
                                     "shards under TP")
            # built on the device layer by layer, each keeping the rank's experts (the whole model, 84 GiB,
            # is never built on the host)
            loaded = BUILTINS[name](dtype, device, seed, ep=(shard.rank, shard.world))
        else:
            loaded = _whole_then_shard(lambda dev: BUILTINS[name](dtype, dev, seed), device, shard)
        tok = loaded.tokenizer if tokenizer is None else load_tokenizer(resolve_folder(tokenizer))
        return dataclasses.replace(loaded, tokenizer=with_chat_template(tok, chat_template))
    folder = resolve_folder(name, revision)
    check_family(folder)
    if quantization == "fp8" and not _is_fp8_folder(folder):
        raise ModelLoadError(f"--quantization fp8: {folder}/config.json has no quantization_config with quant_method "
                             "'fp8'; dhisparse loads block-scaled FP8 checkpoints but does not quantize online "
                             "(leave the flag out for this checkpoint)")
    if is_v4_folder(folder) and shard is not None and shard.mode == "ep":
        loaded = load_v4_sharded(folder, shard, dtype=dtype, device=device, progress=progress)
    elif is_v4_folder(folder):  # whole, or TP: layers/tp.py refuses a V4 model when it is sharded
        loaded = _whole_then_shard(lambda dev: load_v4_checkpoint(folder, dtype=dtype, device=dev), device, shard)
    elif shard is not None:
        loaded = load_sharded(folder, shard, dtype=dtype, device=device, progress=progress)
    else:
        loaded = load_checkpoint(folder, dtype=dtype, device=device, progress=progress)
    tok = load_tokenizer(folder if tokenizer is None else resolve_folder(tokenizer))
    tok = with_chat_template(tok, chat_template)
    if tok.vocab_size > loaded.config.vocab_size:
        log.warning(
            "%s: tokenizer has %d ids but the model vocab_size is %d; ids past the vocabulary will fail",
            folder, tok.vocab_size, loaded.config.vocab_size,
        )
    return dataclasses.replace(loaded, tokenizer=tok)


def _whole_then_shard(load: Callable[[str | torch.device], LoadedModel], device: str | torch.device,
                      shard: ShardSpec | None) -> LoadedModel:
    """load(device), or with `shard`: load on the CPU, shard in memory, then move to `device`."""
    if shard is None:
        return load(device)
    loaded = load("cpu")
    shard_in_memory(loaded.model, shard)
    loaded.model.to(device)
    return loaded


def load_for_config(config: Any, device: str | torch.device, progress: bool = False,
                    shard: ShardSpec | None = None) -> LoadedModel:
    """The model an EngineConfig names (rank `shard`'s part of it when given), with its revision,
    tokenizer, chat template and quantization settings applied; checks kv_cache_dtype against the
    loaded model's dtype."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float64": torch.float64}.get(config.dtype)
    loaded = load_model(config.model, dtype=dtype, device=device, seed=config.seed, revision=config.revision,
                        tokenizer=config.tokenizer, chat_template=config.chat_template,
                        quantization=config.quantization, progress=progress, shard=shard)
    if config.kv_cache_dtype == "bfloat16":
        got = next(loaded.model.parameters()).dtype
        if got != torch.bfloat16:
            raise ModelLoadError(f"--kv-cache-dtype bfloat16 needs a bfloat16 model; {config.model!r} loaded as {got} "
                                 "(pass --dtype bfloat16 or --kv-cache-dtype auto)")
    return loaded
