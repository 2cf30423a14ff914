"""Load a Hugging Face-format DSA checkpoint (config.json + safetensors) into `DsaForCausalLM`.

    folder/config.json                       -> ModelConfig.from_hf
    folder/model.safetensors                 single file, or
    folder/model.safetensors.index.json      {"weight_map": {name: shard}} + shards

Tensors are read lazily with `safetensors.safe_open`, shard by shard, and mapped onto our module:

- per-expert `model.layers.i.mlp.experts.{e}.{gate,up,down}_proj.weight` are stacked into
  `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first) and `mlp.experts.down_proj [E, H, I]`;
  already stacked names are taken as they are;
- FP8 block-scaled weights (`float8_e4m3fn` plus a sibling `<name>_scale_inv` fp32 tensor of shape
  [ceil(out/bo), ceil(in/bi)]) are dequantized: `w.float() * scale` expanded per block, cropped;
- MTP layers (`model.layers.{j}.*` with j >= num_layers, `mtp.*`), indexer tensors on GLM
  `shared` layers and any other unknown tensor go to `LoadedModel.extra` under their own name, in
  host memory (not on the device: nothing reads them there, and an MTP layer is a whole layer's
  weights); the MTP layers' tensors are also set on the returned model as `model.mtp_weights` (a
  dict, empty when the checkpoint has none), so the MTP drafter finds them from the model the
  engine hands it and moves its own (stacked) copy to the device.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from dhisparse.core.config import ModelConfig
from dhisparse.models.dsa import DsaForCausalLM
from dhisparse.layers.rope import RotaryEmbedding

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
FP32_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}  # fp64: parity tests
_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class ModelLoadError(ValueError):
    """A checkpoint we cannot load; the message names what is wrong and how to fix it."""


@dataclass(frozen=True)
class LoadedModel:
    """A ready-to-run target model.

    model: DsaForCausalLM in eval mode; config: its ModelConfig; extra: checkpoint tensors the
    target does not use (MTP layers, indexers of shared layers, unknown names), dequantized and
    cast like the model; tokenizer: attached by `registry.load_model` (None from the loader);
    report: a `shard_load.LoadReport` (what a sharded load read and cost) or None.
    """

    model: DsaForCausalLM
    config: ModelConfig
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    tokenizer: Any = None
    report: Any = None


def resolve_dtype(dtype: torch.dtype | str | None, cfg: ModelConfig) -> torch.dtype:
    """Explicit `dtype` (torch dtype or name) wins, else config `torch_dtype`/`dtype`, else fp32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelLoadError(f"dtype={dtype} is not supported; use float32, bfloat16, float16 or float64")
        return dtype
    name = dtype if dtype is not None else cfg.torch_dtype
    key = str(name).lower().removeprefix("torch.")
    if key in DTYPES:
        return DTYPES[key]
    if dtype is None:  # "auto" or an odd config value: fall back quietly
        return torch.float32
    raise ModelLoadError(f"dtype={dtype!r} is not supported; use one of float32, bfloat16, float16, float64")


def read_config(folder: str | Path) -> ModelConfig:
    """Parse folder/config.json (ConfigError from ModelConfig.from_hf propagates)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(
            f"model folder {str(folder)!r} does not exist; pass a folder holding config.json and *.safetensors"
        )
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{folder}: no config.json; a Hugging Face checkpoint folder needs config.json next to its safetensors"
        )
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e}); fix or re-export the config") from None
    return ModelConfig.from_hf(d)


def shard_files(folder: Path) -> dict[Path, list[str] | None]:
    """{shard path: tensor names from the index, or None = every tensor in the file}."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ModelLoadError(f"{index}: expected JSON with a 'weight_map' object {{tensor name: shard file}}") from None
        shards: dict[Path, list[str] | None] = {}
        for name, fname in weight_map.items():
            shards.setdefault(folder / fname, []).append(name)
        absent = [p.name for p in shards if not p.is_file()]
        if absent:
            raise ModelLoadError(f"{index} names shard(s) missing from the folder: {absent[:3]}; copy them or fix the index")
        return shards
    if (folder / SINGLE_FILE).is_file():
        return {folder / SINGLE_FILE: None}
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"{folder}: no safetensors weights (expected {SINGLE_FILE} or {INDEX_FILE} + shards)")
    return {p: None for p in found}


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight") -> torch.Tensor:
    """w [out, in] float8, scale_inv [ceil(out/bo), ceil(in/bi)] -> fp32 [out, in] = w * scale per block."""
    bo, bi = block
    out_f, in_f = w.shape[-2:]
    want = (-(-out_f // bo), -(-in_f // bi))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ModelLoadError(
            f"{name}{SCALE_SUFFIX}: shape {tuple(scale_inv.shape)} does not match weight {tuple(w.shape)} with "
            f"block {list(block)} (expected {list(want)}); check quantization_config.weight_block_size"
        )
    s = scale_inv.float().repeat_interleave(bo, dim=-2).repeat_interleave(bi, dim=-1)
    return w.float() * s[..., :out_f, :in_f]


class _Reader:
    """Yields (name, tensor) over all shards, FP8 weights already dequantized to fp32."""

    def __init__(self, folder: Path, cfg: ModelConfig) -> None:
        self.shards = shard_files(folder)
        self.block = cfg.fp8_block_size or (128, 128)
        self.where: dict[str, Path] = {}
        self.handles: dict[Path, Any] = {}  # open safe_open handles (memory-mapped), one per shard
        for path, names in self.shards.items():
            for n in names if names is not None else self._open(path).keys():
                self.where[n] = path

    def _open(self, path: Path) -> Any:
        if path not in self.handles:
            try:
                self.handles[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"{path}: not a readable safetensors file ({e}); re-download or re-export it") from None
        return self.handles[path]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.iterate(progress=False)

    def iterate(self, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) over every shard; progress: a tqdm bar over the shards on stderr."""
        shards = list(self.shards)
        if progress:
            from tqdm import tqdm

            shards = tqdm(shards, desc="Loading safetensors checkpoint shards", unit="shard", dynamic_ncols=True)
        for path in shards:
            f = self._open(path)
            for name in f.keys():
                if name.endswith(SCALE_SUFFIX) or self.where.get(name) != path:
                    continue
                yield name, self._finish(name, f.get_tensor(name))
        self.handles.clear()

    def _finish(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return t
        sname = name + SCALE_SUFFIX
        if sname not in self.where:
            raise ModelLoadError(f"{name} is {t.dtype} but has no {sname} tensor; FP8 weights need their block scales")
        return dequantize_fp8(t, self._open(self.where[sname]).get_tensor(sname), self.block, name)


class _ExpertStacks:
    """Collects per-expert tensors into the stacked layout, slice by slice."""

    def __init__(self, expected: dict[str, torch.Size], cfg: ModelConfig, dtype: torch.dtype, device) -> None:
        self.expected, self.cfg, self.dtype, self.device = expected, cfg, dtype, device
        self.stacks: dict[str, torch.Tensor] = {}
        self.filled: dict[str, set[tuple[int, str]]] = {}

    def add(self, m: re.Match, t: torch.Tensor) -> None:
        prefix, e, kind = m.group(1), int(m.group(3)), m.group(4)
        E, I = self.cfg.n_routed_experts, self.cfg.moe_intermediate_size
        if e >= E:
            raise ModelLoadError(
                f"{m.group(0)}: expert {e} but config n_routed_experts is {E}; the config does not match the weights"
            )
        target = f"{prefix}.down_proj" if kind == "down_proj" else f"{prefix}.gate_up_proj"
        if target not in self.expected:
            raise ModelLoadError(
                f"{m.group(0)}: layer {m.group(2)} is not a MoE layer in config.json "
                "(check first_k_dense_replace / mlp_layer_types)"
            )
        full = self.expected[target]
        want = tuple(full[1:]) if kind == "down_proj" else (I, full[2])
        _check_shape(m.group(0), tuple(t.shape), want)
        if target not in self.stacks:
            self.stacks[target] = torch.empty(tuple(full), dtype=self.dtype, device=self.device)
            self.filled[target] = set()
        rows = slice(None) if kind == "down_proj" else (slice(0, I) if kind == "gate_proj" else slice(I, 2 * I))
        self.stacks[target][e, rows] = t.to(device=self.device, dtype=self.dtype)
        self.filled[target].add((e, kind))

    def missing(self) -> list[str]:
        out = []
        for target, done in self.filled.items():
            prefix = target.rsplit(".", 1)[0]
            kinds = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
            experts = range(self.cfg.n_routed_experts)
            out += [f"{prefix}.{e}.{k}.weight" for e in experts for k in kinds if (e, k) not in done]
        return out


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ModelLoadError(
            f"{name}: checkpoint shape {list(got)} but the model expects {list(want)}; "
            "config.json does not match these weights"
        )


def _is_extra(name: str, cfg: ModelConfig) -> bool:
    """MTP layers, `mtp.*`, and indexer tensors of GLM shared layers."""
    if name.startswith("mtp."):
        return True
    m = _LAYER.match(name)
    if m is None:
        return False
    layer = int(m.group(1))
    return layer >= cfg.num_layers or (".self_attn.indexer." in name and not cfg.indexer_full[layer])


def _is_mtp(name: str, cfg: ModelConfig) -> bool:
    """A tensor of an MTP layer in the DeepSeek-V3 layout (`model.layers.{j}.*`, j >= num_layers)."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= cfg.num_layers


def _target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_SUFFIXES) else dtype


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    if not t.is_floating_point():
        return t.to(device)
    return t.to(device=device, dtype=_target_dtype(name, dtype))


def _finalize(model: DsaForCausalLM, cfg: ModelConfig, state: dict[str, torch.Tensor], device) -> None:
    """Assign the collected tensors, rebuild non-persistent buffers, re-tie embeddings."""
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.model.rotary_emb = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # pragma: no cover - a new module with an unknown buffer
        raise ModelLoadError(f"internal: tensors left unmaterialized after load: {left[:5]}")


def load_checkpoint(
    folder: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
    progress: bool = False,
) -> LoadedModel:
    """Load config.json + safetensors from `folder` into a DsaForCausalLM on `device`.

    dtype: explicit target dtype, else the config's `torch_dtype`/`dtype`; the router weight and
    `e_score_correction_bias` stay fp32. Raises ModelLoadError (or ConfigError) with a fix.
    """
    folder = Path(folder)
    cfg = read_config(folder)
    target = resolve_dtype(dtype, cfg)
    reader = _Reader(folder, cfg)
    with torch.device("meta"):
        model = DsaForCausalLM(cfg)
    expected = {n: t.shape for n, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    stacks = _ExpertStacks(expected, cfg, target, device)
    state: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    for name, t in reader.iterate(progress):
        m = _EXPERT.match(name)
        if m is not None and not _is_extra(name, cfg):
            stacks.add(m, t)
        elif name in expected:
            _check_shape(name, tuple(t.shape), tuple(expected[name]))
            state[name] = _cast(name, t, target, device)
        else:
            extra[name] = _cast(name, t, target, "cpu")  # set aside in host memory: the MTP drafter moves what it uses
    state.update(stacks.stacks)
    missing = sorted(set(expected) - set(state) - set(stacks.stacks)) + stacks.missing()
    if missing:
        odd = sorted(n for n in extra if not _is_extra(n, cfg))
        hint = f"; unrecognized checkpoint names such as {odd[:3]}" if odd else ""
        raise ModelLoadError(
            f"{folder}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:5]}{hint}; "
            "check that config.json matches the weights (num_hidden_layers, indexer_types, first_k_dense_replace)"
        )
    _finalize(model, cfg, state, device)
    model.mtp_weights = {n: t for n, t in extra.items() if _is_mtp(n, cfg)}
    return LoadedModel(model.eval(), cfg, extra)
