"""`load_model(spec)`: one entry point for the CLI, server and benchmarks.

spec is the name of a built-in model (`tiny`) or a checkpoint folder (config.json + safetensors,
optionally tokenizer.json). The result carries its tokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Callable

import torch

from dhisparse.models.loader import LoadedModel, ModelLoadError, load_checkpoint, resolve_dtype
from dhisparse.models.scaled import build_scaled, scaled_config
from dhisparse.models.tiny import build_tiny, tiny_config
from dhisparse.models.tokenizer import ByteTokenizer, load_tokenizer
from dhisparse.models.v4_loader import is_v4_folder, load_v4_checkpoint
from dhisparse.models.v4_scaled import build_v41_scaled, v41_scaled_config

log = logging.getLogger(__name__)


def _tiny(dtype: torch.dtype | str | None, device: str | torch.device, seed: int) -> LoadedModel:
    target = resolve_dtype(dtype, tiny_config())
    return dataclasses.replace(build_tiny(seed, target, device), tokenizer=ByteTokenizer())


def _scaled(name: str) -> Callable[[torch.dtype | str | None, str | torch.device, int], LoadedModel]:
    """Loader of a scaled benchmark model (dhisparse.models.scaled); default dtype bfloat16."""

    def load(dtype: torch.dtype | str | None, device: str | torch.device, seed: int) -> LoadedModel:
        target = resolve_dtype(dtype, scaled_config(name, 1))  # None -> the config's bfloat16
        return dataclasses.replace(build_scaled(name, seed, target, device), tokenizer=ByteTokenizer())

    return load


def _v41(dtype: torch.dtype | str | None, device: str | torch.device, seed: int) -> LoadedModel:
    """`v41-scaled`: DeepSeek-V4.1-shaped random model (models/v4_scaled.py); default bfloat16."""
    target = resolve_dtype(dtype, v41_scaled_config())  # None -> the config's bfloat16
    return dataclasses.replace(build_v41_scaled(seed, target, device), tokenizer=ByteTokenizer())


BUILTINS: dict[str, Callable[[torch.dtype | str | None, str | torch.device, int], LoadedModel]] = {
    "tiny": _tiny, "dsv32-scaled": _scaled("dsv32-scaled"), "v41-scaled": _v41,
    **{name: _scaled(name) for name in ("glm52-scaled", "glm52-scaled-k512")},
}


def load_model(
    spec: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu", seed: int = 0
) -> LoadedModel:
    """Built-in name or checkpoint folder -> LoadedModel with `tokenizer` set.

    dtype: torch dtype or name (float32 / bfloat16 / float16); None = the checkpoint's dtype
    (float32 for built-ins). seed: weights of built-in random models (ignored for folders).
    """
    name = str(spec)
    if name in BUILTINS:
        return BUILTINS[name](dtype, device, seed)
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"--model {name!r} is neither a built-in model ({', '.join(sorted(BUILTINS))}) nor an existing folder; "
            "pass a built-in name or a folder holding config.json and *.safetensors"
        )
    loaded = (load_v4_checkpoint if is_v4_folder(folder) else load_checkpoint)(folder, dtype=dtype, device=device)
    tok = load_tokenizer(folder)
    if tok.vocab_size > loaded.config.vocab_size:
        log.warning(
            "%s: tokenizer has %d ids but the model vocab_size is %d; ids past the vocabulary will fail",
            folder, tok.vocab_size, loaded.config.vocab_size,
        )
    return dataclasses.replace(loaded, tokenizer=tok)
