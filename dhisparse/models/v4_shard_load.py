"""Expert-parallel loading of a DeepSeek-V4 checkpoint folder: rank r of N reads only its routed
expert block, experts [r*E/N, (r+1)*E/N) of every V4 MoE layer, and everything else whole,
straight into a `DeepseekV4ForCausalLM` built at its EP-sharded shapes.

    1. the model is built on meta at full shapes, `expert_cuts` taken, and `shard_experts` applied
       in place (models/shard_load.py `plan_load`: EPMoE of a meta V4MoE keeps only the shapes);
    2. each checkpoint name is mapped to our names by `v4_loader.canonical_name` (upstream,
       transformers and transformers-saved spellings, mixed): a per-expert w1 / w3 / w2 (gate / up /
       down [I, H] / [H, I]) of the rank's block goes into its stack rows (gate_up_proj [E/N, 2I, H],
       gate rows first; down_proj [E/N, H, I]), another rank's is never read (`tensors_skipped`); a
       stacked transformers tensor is read along its expert rows only; the rest is read whole
       (`shard_load.ShardJob` over `slice_read.CheckpointFiles`, FP8 e4m3 / e5m2 dequantized from
       their own `.scale` / `_scale_inv` 128 x 128 blocks, the same fp32 products as `load_v4_checkpoint`);
    3. the local tensors are assigned to the meta model and the ropes built.

The result equals `load_v4_checkpoint` then `shard_experts` bitwise, with a `LoadReport`. fp32 stays
fp32 for hyper-connection tensors, sinks, position_bias, norms and the router bias; tid2eid is
int64; MTP and unknown tensors go whole to `LoadedModel.extra` (and `model.mtp_weights`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

import torch

from dhisparse.core.v4_config import V4Config
from dhisparse.models.dsv4 import DeepseekV4ForCausalLM
from dhisparse.models.loader import LoadedModel, ModelLoadError, resolve_dtype
from dhisparse.models.shard_load import ShardJob, ShardSpec, plan_load, read_all, report_load
from dhisparse.models.slice_read import FP8, WINDOW_BYTES, CheckpointFiles
from dhisparse.models.v4_loader import _FP32, _is_scale, canonical_name, is_mtp_name, read_v4_config

V4_BLOCK = (128, 128)  # FP8 block of V4 exports (as load_v4_checkpoint)
_STACK = {"gate": ("gate_up_proj", "gate_proj"), "up": ("gate_up_proj", "up_proj"), "down": ("down_proj", "down_proj")}


def v4_scale_pairs(names: Iterable[str]) -> dict[str, str]:
    """{weight name: its block-scale tensor}: `<stem>.scale` (preferred) or `<name>_scale_inv`;
    hyper-connection `*.scale` parameters (no `.weight` sibling) are not scales."""
    names = set(names)
    out: dict[str, str] = {}
    for n in sorted(names, key=lambda n: n.endswith(".scale")):  # `.scale` last: it wins
        if _is_scale(n, names):
            out[n.removesuffix("_scale_inv") if n.endswith("_scale_inv") else n[: -len(".scale")] + ".weight"] = n
    return out


def v4_dtype_of(target: torch.dtype):
    """(name, stored dtype) -> loaded dtype: int64 for integer tensors, fp32 for V4's fp32 names, else target."""
    def dtype_of(name: str, stored: torch.dtype) -> torch.dtype:
        if not stored.is_floating_point:
            return torch.int64
        return torch.float32 if _FP32.search(name) else target

    return dtype_of


def _add_v4(job: ShardJob, cfg: V4Config, src: str) -> None:
    """Route one V4 checkpoint name into `job` (module docstring, step 2)."""
    stored = job.files.info(src)[1]
    if stored not in FP8 and not stored.is_floating_point and src in job.files.scale_of:
        raise ModelLoadError(f"{src}: FP4-packed expert weights are not supported yet; use a bf16 / fp8 export")
    name = canonical_name(src, cfg.num_layers)
    if isinstance(name, tuple):
        layer, e, kind = name
        if e >= cfg.n_routed_experts:
            raise ModelLoadError(f"{src}: expert {e} but config n_routed_experts is {cfg.n_routed_experts}")
        stack, ckpt_kind = _STACK[kind]
        target = f"model.layers.{layer}.mlp.experts.{stack}"
        if target not in job.full:
            raise ModelLoadError(f"{src}: layer {layer} has no routed experts in config.json (check mlp_layer_types)")
        job.expert(src, target, e, ckpt_kind, cfg.moe_intermediate_size, cfg.hidden_size)
    elif name in job.full:
        job.whole(src, name)
    elif not (cfg.tie_word_embeddings and name == "lm_head.weight"):  # a tied head is the embedding
        job.set_aside(src)  # MTP / unknown: host memory, the drafter moves what it uses


def load_v4_sharded(folder: str | Path, shard: ShardSpec, dtype: torch.dtype | str | None = None,
                    device: str | torch.device = "cpu", progress: bool = False,
                    window_bytes: int = WINDOW_BYTES) -> LoadedModel:
    """EP rank `shard.rank` of `shard.world`'s part of a V4 folder (module docstring) on `device`,
    with `report` a LoadReport. TP is refused (V4 serves expert parallel only); ValueError when
    the world does not divide the experts; ModelLoadError naming missing or mismatched tensors."""
    if shard.mode != "ep":
        raise ValueError(f"DeepSeek-V4 checkpoints load expert-parallel only, not {shard.mode!r}; use --ep-size")
    t0, device, folder = time.monotonic(), torch.device(device), Path(folder)
    cfg = read_v4_config(folder)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    plan = plan_load(model, shard, device, t0, drop=("lm_head.weight",) if cfg.tie_word_embeddings else ())
    files = CheckpointFiles(folder, window_bytes, pair_scales=v4_scale_pairs)
    job = ShardJob(files, device, V4_BLOCK, plan, v4_dtype_of(resolve_dtype(dtype, cfg)))
    read_all(job, lambda src: _add_v4(job, cfg, src), folder, progress)
    _finalize_v4(model, cfg, job.state, device)
    model.mtp_weights = {n: t for n, t in job.extra.items() if is_mtp_name(n, cfg.num_layers)}  # spec/mtp_v4_io.py
    return LoadedModel(model.eval(), cfg, job.extra, report=report_load(shard, plan, job, device, folder))


def _finalize_v4(model: DeepseekV4ForCausalLM, cfg: V4Config, state: dict[str, torch.Tensor], device) -> None:
    """Assign the local tensors to the meta model, build the ropes, tie the head."""
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.model.build_ropes(cfg, device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:  # pragma: no cover - a new module with an unknown buffer
        raise ModelLoadError(f"internal: tensors left unmaterialized after the V4 load: {left[:5]}")
