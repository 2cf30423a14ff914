"""Sharded loading of a GLM-5.x / DeepSeek-V3.2 checkpoint: each rank reads from the safetensors
files only the parts it keeps, into a model built at its local shapes.

    ShardSpec("tp", r, N)   layers/tp.py's cuts (`tp_cuts`): q_b / kv_b rows and o_proj columns of
                            its heads, indexer wq_b / weights_proj rows of its index heads, MLP and
                            per-expert gate / up rows and down columns of its intermediate block
    ShardSpec("ep", r, N)   layers/ep_moe.py's expert block (`expert_cuts`): routed experts
                            [r*E/N, (r+1)*E/N); other experts' tensors are never read
    everything else (embeddings, norms, q_a / kv_a, indexer wk, routers, LM head) is read whole.

    1. the model is built on the meta device at full shapes, the cuts are taken from it, and it is
       sharded in place (`shard_in_memory`: on meta only the shapes change, and the TP sums are installed);
    2. each checkpoint tensor is read into a tensor of its local shape on `device`
       (models/slice_read.py: `get_slice` chunks, FP8 blocks dequantized from the scale blocks
       covering each chunk); per-expert tensors go straight into the rank's local stacks;
    3. the local tensors are assigned to the meta model (`loader._finalize`).

The full weights never exist in one process: host memory is the rank's tensors plus one mapped
window of file. `load_sharded` measures it (`LoadReport`: RSS high-water rise over the load, CUDA
`max_memory_allocated` rise, bytes read) and logs it. MTP layers and other extra tensors are read
whole into host memory (`LoadedModel.extra`), as `loader.load_checkpoint` does: drafters are replicated.
The family-neutral parts (`plan_load`, `ShardJob`, `read_all`, `report_load`) also serve DeepSeek-V4
(models/v4_shard_load.py), which only maps its checkpoint names onto them.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from dhisparse.core.config import ModelConfig
from dhisparse.layers.ep_moe import expert_cuts
from dhisparse.layers.ep_moe import shard_experts as shard_expert_blocks
from dhisparse.layers.tp import Cut, shard_tensor_parallel, tp_cuts
from dhisparse.models.dsa import DsaForCausalLM
from dhisparse.models.loader import (
    _EXPERT, LoadedModel, ModelLoadError, _check_shape, _finalize, _is_extra, _is_mtp, _target_dtype, read_config,
    resolve_dtype,
)
from dhisparse.models.slice_read import WINDOW_BYTES, CheckpointFiles

log = logging.getLogger(__name__)
MODES = ("tp", "ep")


@dataclass(frozen=True)
class ShardSpec:
    """The part of the target a rank keeps: mode "tp" (tensor parallel) or "ep" (expert parallel), rank r of world N."""

    mode: str
    rank: int
    world: int

    def __post_init__(self) -> None:
        if self.mode not in MODES or not 0 <= self.rank < self.world:
            raise ValueError(f"ShardSpec({self.mode!r}, {self.rank}, {self.world}): mode is one of {MODES}, "
                             "0 <= rank < world")


@dataclass(frozen=True)
class LoadReport:
    """What a sharded load cost. host_peak_bytes: the process's RSS high-water rise over the load
    from the meta build on (`host_peak_bytes()` after - before: a fresh process measures the load, an
    earlier higher peak hides it);
    device_peak_bytes: CUDA max_memory_allocated rise over the load, None on CPU; bytes_read: bytes
    copied out of the checkpoint files; bytes_kept: the loaded tensors (parameters and extra);
    tensors_skipped: checkpoint tensors never read (other ranks' experts)."""

    mode: str
    rank: int
    world: int
    host_peak_bytes: int
    device_peak_bytes: int | None
    bytes_read: int
    bytes_kept: int
    tensors_skipped: int
    seconds: float

    def line(self) -> str:
        mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
        dev = "host only" if self.device_peak_bytes is None else f"device peak +{mib(self.device_peak_bytes)}"
        return (f"sharded load {self.mode} rank {self.rank}/{self.world}: read {mib(self.bytes_read)}, kept "
                f"{mib(self.bytes_kept)}, host peak +{mib(self.host_peak_bytes)}, {dev}, "
                f"{self.tensors_skipped} tensors skipped, {self.seconds:.2f} s")


def host_peak_bytes() -> int:
    """This process's RSS high-water mark in bytes: on Linux `VmHWM` of /proc/self/status (its
    address space's own mark; ru_maxrss would carry over the parent's RSS at fork through the exec
    of a spawned process), elsewhere ru_maxrss (bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def plan_cuts(model: nn.Module, shard: ShardSpec) -> dict[str, Cut]:
    """{full parameter name: the rank's Cut} of an unsharded target (names absent: replicated)."""
    if shard.mode == "tp":
        return tp_cuts(model, shard.rank, shard.world)
    return expert_cuts(model, shard.rank, shard.world)


def shard_in_memory(model: nn.Module, shard: ShardSpec) -> int:
    """Shard a built model in place (TP: layers/tp.py; EP: EPMoE layers); the layers sharded."""
    if shard.mode == "tp":
        return shard_tensor_parallel(model, shard.rank, shard.world)
    return shard_expert_blocks(model, shard.rank, shard.world)


def expert_place(cut: Cut | None, e: int, kind: str, I: int, H: int) -> tuple[int | None, Cut | None, slice]:
    """Expert e's checkpoint tensor `kind` (gate_proj / up_proj [I, H], down_proj [H, I]) in the
    rank's stack (gate_up_proj [E', 2I', H] / down_proj [E', H, I']) cut by `cut`: (its local expert
    index, None when another rank's; the Cut to read of the tensor; the local rows of stack dim 1)."""
    r0, r1 = {"gate_proj": (0, I), "up_proj": (I, 2 * I), "down_proj": (0, H)}[kind]
    if cut is None or cut.dim == 0:
        return (e if cut is None else cut.position(e)), None, slice(r0, r1)
    if cut.dim == 1:
        sub, at = cut.restrict(r0, r1)
        return e, Cut(0, sub.spans), slice(at, at + sub.size)
    return e, Cut(cut.dim - 1, cut.spans), slice(r0, r1)


class ShardJob:
    """One rank's reading of checkpoint tensors into local tensors (`state`, keyed by the sharded
    model's names; `extra` whole, on the host). Family-neutral: the caller maps each checkpoint
    name to a target (`whole`, `expert`, `set_aside`). full: {target: full shape}; cuts: {target:
    Cut}; local: {target: (local name, local shape)}; dtype_of(target name, stored dtype) -> dtype."""

    def __init__(self, files: CheckpointFiles, device, block: tuple[int, int], plan: "Plan",
                 dtype_of: Callable[[str, torch.dtype], torch.dtype]) -> None:
        self.files, self.device, self.block, self.dtype_of = files, device, block, dtype_of
        self.cuts, self.full, self.local = plan.cuts, plan.full, plan.local
        self.state: dict[str, torch.Tensor] = {}
        self.extra: dict[str, torch.Tensor] = {}
        self.seen: set[str] = set()
        self.filled: dict[str, set[tuple[int, str]]] = {}
        self.skipped = 0

    def whole(self, src: str, target: str) -> None:
        """Checkpoint tensor `src` -> target `target` (in `full`), its cut read on `device`."""
        _check_shape(src, self.files.info(src)[0], self.full[target])
        local_name, shape = self.local[target]
        self.state[local_name] = self._read(src, target, self.cuts.get(target), shape, self.device)
        self.seen.add(target)

    def set_aside(self, src: str) -> None:
        """MTP layers, unknown names: whole, on the host, into `extra` under the checkpoint name."""
        self.extra[src] = self._read(src, src, None, self.files.info(src)[0], "cpu")

    def _read(self, src: str, target: str, cut: Cut | None, shape: tuple[int, ...], device) -> torch.Tensor:
        dest = torch.empty(shape, dtype=self.dtype_of(target, self.files.info(src)[1]), device=device)
        self.files.read_into(dest, src, cut, self.block)  # FP8: dequantized into dest's dtype
        return dest

    def expert(self, src: str, target: str, e: int, kind: str, I: int, H: int) -> None:
        """Expert e's tensor `src` (kind gate_proj / up_proj [I, H], down_proj [H, I]) into the
        rank's stack `target` (...experts.gate_up_proj [E', 2I', H] / down_proj [E', H, I']); another
        rank's expert is counted in `skipped` and never read."""
        _check_shape(src, self.files.info(src)[0], (H, I) if kind == "down_proj" else (I, H))
        local_e, cut, rows = expert_place(self.cuts.get(target), e, kind, I, H)
        if local_e is None:
            self.skipped += 1
            return
        local_name, shape = self.local[target]
        if local_name not in self.state:
            dtype = self.dtype_of(target, self.files.info(src)[1])
            self.state[local_name] = torch.empty(shape, dtype=dtype, device=self.device)
            self.filled[target] = set()
            self.seen.add(target)
        self.files.read_into(self.state[local_name][local_e, rows], src, cut, self.block)
        self.filled[target].add((local_e, kind))

    def missing(self) -> list[str]:
        """Full names never read, then the rank's own experts absent from the checkpoint."""
        out = sorted(set(self.full) - self.seen)
        for target, done in self.filled.items():
            cut, n_local = self.cuts.get(target), self.local[target][1][0]
            first = cut.spans[0][0] if cut is not None and cut.dim == 0 else 0
            kinds = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
            prefix = target.rsplit(".", 1)[0]
            out += [f"{prefix}.{first + e}.{k}.weight" for e in range(n_local) for k in kinds if (e, k) not in done]
        return out


def _add_glm(job: ShardJob, cfg: ModelConfig, name: str) -> None:
    """Route one GLM-5.x / V3.2 checkpoint name (loader.py's names) into `job`."""
    m = _EXPERT.match(name)
    if m is None or _is_extra(name, cfg):
        if name in job.full:
            job.whole(name, name)
        else:  # MTP layers, shared layers' indexers, unknown names
            job.set_aside(name)
        return
    prefix, e, kind = m.group(1), int(m.group(3)), m.group(4)
    if e >= cfg.n_routed_experts:
        raise ModelLoadError(f"{name}: expert {e} but config n_routed_experts is {cfg.n_routed_experts}; the config "
                             "does not match the weights")
    target = f"{prefix}.down_proj" if kind == "down_proj" else f"{prefix}.gate_up_proj"
    if target not in job.full:
        raise ModelLoadError(f"{name}: layer {m.group(2)} is not a MoE layer in config.json "
                             "(check first_k_dense_replace / mlp_layer_types)")
    job.expert(name, target, e, kind, cfg.moe_intermediate_size, cfg.hidden_size)


@dataclass
class Plan:
    """A rank's load plan over a meta model already sharded in place: full / cuts / local as
    `ShardJob` takes them, and the clocks and memory marks the LoadReport is measured from."""

    full: dict[str, tuple[int, ...]]
    cuts: dict[str, Cut]
    local: dict[str, tuple[str, tuple[int, ...]]]
    t0: float
    host0: int
    dev0: int


def plan_load(model: nn.Module, shard: ShardSpec, device: torch.device, t0: float, drop: tuple[str, ...] = ()) -> Plan:
    """Take the cuts of a meta-built unsharded `model`, shard it in place (meta: only the shapes
    change) and mark host / device memory; `drop`: full names not read (a tied LM head)."""
    host0 = host_peak_bytes()  # after the meta build: a process's first one imports ~800 torch modules
    dev0 = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        dev0 = torch.cuda.memory_allocated(device)
    full = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in drop}
    cuts = plan_cuts(model, shard)
    shard_in_memory(model, shard)
    local = {n.replace(".inner.", "."): (n, tuple(t.shape)) for n, t in model.state_dict().items()}  # Summed wrappers
    return Plan(full, cuts, local, t0, host0, dev0)


def read_all(job: ShardJob, add: Callable[[str], None], folder: Path, progress: bool) -> None:
    """add(name) over every checkpoint tensor, shard by shard; then the files released and a
    ModelLoadError naming what the checkpoint lacks."""
    for path in _shards(job.files, progress):
        for name in job.files.by_shard[path]:
            add(name)
    job.files.release()
    missing = job.missing()
    if missing:
        raise ModelLoadError(f"{folder}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:5]}; "
                             "check that config.json matches the weights (num_hidden_layers, layer types, "
                             "first_k_dense_replace)")


def report_load(shard: ShardSpec, plan: Plan, job: ShardJob, device: torch.device, folder: Path) -> LoadReport:
    """The LoadReport of a finished job (marks taken from `plan`), logged."""
    kept = sum(t.numel() * t.element_size() for t in [*job.state.values(), *job.extra.values()])
    report = LoadReport(shard.mode, shard.rank, shard.world, max(0, host_peak_bytes() - plan.host0),
                        torch.cuda.max_memory_allocated(device) - plan.dev0 if device.type == "cuda" else None,
                        job.files.bytes_read, kept, job.skipped, time.monotonic() - plan.t0)
    log.info("%s: %s", folder, report.line())
    return report


def _shards(files: CheckpointFiles, progress: bool):
    if not progress:
        return list(files.by_shard)
    from tqdm import tqdm

    return tqdm(list(files.by_shard), desc="Loading safetensors shards (sharded)", unit="shard", dynamic_ncols=True)


def load_sharded(folder: str | Path, shard: ShardSpec, dtype: torch.dtype | str | None = None,
                 device: str | torch.device = "cpu", progress: bool = False,
                 window_bytes: int = WINDOW_BYTES) -> LoadedModel:
    """Rank `shard.rank`'s part of config.json + safetensors in `folder` (module docstring), on
    `device`, as DsaForCausalLM already sharded (equal to `load_checkpoint` then `shard_in_memory`).
    dtype: as `load_checkpoint`; window_bytes: mapped file bytes kept before the shards are unmapped.
    The result's `report` is a LoadReport. ModelLoadError / ParallelConfigError / ValueError name the fix."""
    t0, device, folder = time.monotonic(), torch.device(device), Path(folder)
    cfg = read_config(folder)
    with torch.device("meta"):
        model = DsaForCausalLM(cfg)
    plan = plan_load(model, shard, device, t0, drop=("lm_head.weight",) if cfg.tie_word_embeddings else ())
    dtype = resolve_dtype(dtype, cfg)
    job = ShardJob(CheckpointFiles(folder, window_bytes), device, cfg.fp8_block_size or (128, 128), plan,
                   lambda name, stored: _target_dtype(name, dtype) if stored.is_floating_point else stored)
    read_all(job, lambda name: _add_glm(job, cfg, name), folder, progress)
    _finalize(model, cfg, job.state, device)
    model.mtp_weights = {n: t for n, t in job.extra.items() if _is_mtp(n, cfg)}
    return LoadedModel(model.eval(), cfg, job.extra, report=report_load(shard, plan, job, device, folder))
