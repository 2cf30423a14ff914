"""Tensor parallelism of a GLM-5.x / DeepSeek-V3.2 target: every rank runs the same tokens with its
1/N share of each layer's weights, and the partial outputs are summed over the ranks
(`core.parallel.tp_sum`: an all-gather and a rank-ordered sum, the same bits on every rank).

    rank r of N, per decoder layer (contiguous blocks; X/N must be whole, else ParallelConfigError):
      attention  heads [r*H/N, (r+1)*H/N): q_b_proj out rows, kv_b_proj out rows (W_UK, W_UV of
                 those heads), o_proj in columns; q_a_proj, kv_a_proj_with_mqa, the norms
                 replicated                                  -> o_proj's output summed   (1 sum)
      indexer    index heads [r*iH/N, ...): wq_b out rows, weights_proj out rows (the weight scale
                 stays iH^-0.5); wk, k_norm replicated       -> head-weighted scores [T, L]
                                                                summed BEFORE top-k      (1 sum)
      dense MLP  intermediate [r*I/N, ...): gate / up out rows, down in columns
      MoE        per expert: gate_up_proj [E, 2I, H] -> [E, 2I/N, H] = (gate rows block r, up
                 rows block r), down_proj [E, H, I] -> [E, H, I/N]; shared experts as the dense
                 MLP; the router replicated (every rank routes the same replicated rows the same
                 way)                                        -> routed + shared summed   (1 sum)
      embedding, final norm, LM head: replicated; drafters with their own networks (MTP, DFlash)
      are not in `model.model.layers`: replicated (small), every rank drafts the same tokens.

One table says which rows / columns a rank keeps: `TP_TABLE` (module type -> the count that is
split and, per parameter, the dim and the number of equal halves), turned into `Cut`s (dim, kept
[lo, hi) spans) by `module_cuts` / `tp_cuts`. The in-memory sharding below applies them to a built
model; the sharded checkpoint loader (models/shard_load.py) reads exactly those spans from the files.

Inside a rank the code paths are the unsharded layers' own (a rank's MoE combines its experts in
the same fixed order as one process); only the sums are added, as `Summed` wrappers of o_proj and
of the FFN and as the indexers' `score_reduce`. A model that is never sharded runs none of this.

KV: the MLA latent row [c_kv | k_pe] belongs to every head, so every rank stores full rows: per
rank one GPU's KV bytes per token (GLM-5 FP8: 656 B latent + 132 B index key per layer), N copies
over the group (layers/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dhisparse.core.parallel import ParallelConfigError, tp_sum
from dhisparse.layers.attention import MLAttention
from dhisparse.layers.indexer import Indexer
from dhisparse.layers.moe import MLP, Experts, MoE

Reduce = Callable[[torch.Tensor], torch.Tensor]
Span = tuple[int, int]


class Summed(nn.Module):
    """`inner`'s output summed over the TP ranks: forward(x) = reduce(inner(x)) (a test may set
    `reduce` to a simulated sum)."""

    def __init__(self, inner: nn.Module, reduce: Reduce = tp_sum) -> None:
        super().__init__()
        self.inner, self.reduce = inner, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out], the sum of every rank's partial."""
        return self.reduce(self.inner(x))


def block(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    """Rank's contiguous block [lo, hi) of n items; ParallelConfigError naming --tp-size if N does not divide n."""
    if n % world:
        raise ParallelConfigError(f"--tp-size {world} must divide the model's {n} {what}")
    return rank * (n // world), (rank + 1) * (n // world)


@dataclass(frozen=True)
class Cut:
    """The part of a tensor one rank keeps: along `dim`, the index ranges `spans` ([lo, hi) each,
    ascending), concatenated in that order."""

    dim: int
    spans: tuple[Span, ...]

    @property
    def size(self) -> int:
        """The kept length along `dim`."""
        return sum(hi - lo for lo, hi in self.spans)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """t [..., n, ...] -> a fresh contiguous [..., size, ...] (works on meta tensors too)."""
        return torch.cat([t.narrow(self.dim, lo, hi - lo) for lo, hi in self.spans], dim=self.dim)

    def restrict(self, lo: int, hi: int) -> tuple["Cut | None", int]:
        """The cut of the sub-range [lo, hi) of `dim` (spans clipped and shifted by -lo), and where
        its first kept index lands in the local result; (None, offset) when nothing is kept there."""
        parts, before = [], 0
        for a, b in self.spans:
            a2, b2 = max(a, lo), min(b, hi)
            if a2 < b2:
                parts.append((a2 - lo, b2 - lo))
            elif b <= lo:
                before += b - a
        return (Cut(self.dim, tuple(parts)) if parts else None), before

    def position(self, i: int) -> int | None:
        """Index i of `dim` -> its index in the local result, None if not kept."""
        before = 0
        for lo, hi in self.spans:
            if lo <= i < hi:
                return before + i - lo
            before += hi - lo
        return None


@dataclass(frozen=True)
class Split:
    """One parameter (dotted name inside its module) cut along `dim`: `halves` equal parts, each
    holding the module's `count` items of equal width; a rank keeps its block of each half."""

    param: str
    dim: int
    halves: int = 1


@dataclass(frozen=True)
class Sharding:
    """What a module type splits: `count(module)` items (named `what` in errors) and its Splits."""

    what: str
    count: Callable[[nn.Module], int]
    splits: tuple[Split, ...]


TP_TABLE: dict[type, Sharding] = {
    MLAttention: Sharding("attention heads", lambda m: m.cfg.num_heads,
                          (Split("q_b_proj.weight", 0), Split("kv_b_proj.weight", 0), Split("o_proj.weight", 1))),
    Indexer: Sharding("index heads (index_n_heads)", lambda m: m.n_heads,
                      (Split("wq_b.weight", 0), Split("weights_proj.weight", 0))),
    MLP: Sharding("MLP intermediate size", lambda m: m.gate_proj.out_features,
                  (Split("gate_proj.weight", 0), Split("up_proj.weight", 0), Split("down_proj.weight", 1))),
    Experts: Sharding("MoE expert intermediate size (moe_intermediate_size)", lambda m: m.gate_up_proj.shape[1] // 2,
                      (Split("gate_up_proj", 1, halves=2), Split("down_proj", 2))),
}


def module_cuts(module: nn.Module, rank: int, world: int) -> dict[str, Cut]:
    """{parameter name inside `module`: rank's Cut} for a module type of TP_TABLE (ParallelConfigError
    naming --tp-size when N does not divide its count)."""
    sh = TP_TABLE[type(module)]
    n = sh.count(module)
    lo, hi = block(n, rank, world, sh.what)
    cuts = {}
    for s in sh.splits:
        unit = module.get_parameter(s.param).shape[s.dim] // (s.halves * n)  # rows / columns per item
        cuts[s.param] = Cut(s.dim, tuple((h * n * unit + lo * unit, h * n * unit + hi * unit) for h in range(s.halves)))
    return cuts


def apply_cuts(module: nn.Module, cuts: dict[str, Cut]) -> None:
    """Replace each named parameter by its Cut (a fresh contiguous copy) and refresh the Linear sizes."""
    for name, cut in cuts.items():
        owner, _, leaf = name.rpartition(".")
        m = module.get_submodule(owner)
        setattr(m, leaf, nn.Parameter(cut.take(getattr(m, leaf).data), requires_grad=False))
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.out_features, m.in_features = m.weight.shape


def shard_attention(attn: MLAttention, rank: int, world: int) -> None:
    """Keep heads [r*H/N, (r+1)*H/N) of one MLA layer (and of its indexer); o_proj becomes Summed."""
    apply_cuts(attn, module_cuts(attn, rank, world))  # kv_b_proj [H*(nope+v), C]: W_UK, W_UV of each kept head
    attn.o_proj = Summed(attn.o_proj)
    attn.cfg = attn.cfg.with_updates(num_heads=attn.q_b_proj.out_features // attn.cfg.qk_head_dim)
    if attn.indexer is not None:
        shard_indexer(attn.indexer, rank, world)


def shard_indexer(ix: Indexer, rank: int, world: int) -> None:
    """Keep index heads [r*iH/N, ...): wq_b and weights_proj rows; scores summed before top-k."""
    apply_cuts(ix, module_cuts(ix, rank, world))
    ix.n_heads = ix.weights_proj.out_features  # ix.weight_scale stays the model's iH^-0.5
    ix.score_reduce = tp_sum


def shard_mlp(mlp: MLP, rank: int, world: int) -> None:
    """Keep intermediate block r: gate / up out rows, down in columns (a partial output)."""
    apply_cuts(mlp, module_cuts(mlp, rank, world))


def shard_experts(ex: Experts, rank: int, world: int) -> None:
    """Every expert's intermediate block r: gate_up_proj [E, 2I, H] -> [E, 2I/N, H] as (gate rows
    [lo, hi), up rows [I+lo, I+hi)), so `chunk(2)` still splits gate from up; down_proj [E, H, I]
    -> [E, H, I/N]."""
    apply_cuts(ex, module_cuts(ex, rank, world))


def shard_moe(moe: MoE, rank: int, world: int) -> None:
    """The routed experts and the shared experts sharded; the router untouched (replicated)."""
    shard_experts(moe.experts, rank, world)
    if moe.shared_experts is not None:
        shard_mlp(moe.shared_experts, rank, world)


def _layers(model: nn.Module, world: int) -> list[nn.Module]:
    """The decoder layers to shard (ParallelConfigError naming --tp-size for non-MLA targets or an FFN
    that cannot be sharded)."""
    layers = list(getattr(getattr(model, "model", None), "layers", None) or [])
    if not layers or not all(isinstance(getattr(l, "self_attn", None), MLAttention) for l in layers):
        raise ParallelConfigError(f"--tp-size {world}: tensor parallelism is built for GLM-5.x / DeepSeek-V3.2 "
                                  f"(MLA) targets only; {type(model).__name__} (DeepSeek-V4) is refused")
    for l in layers:
        if not isinstance(l.mlp, (MoE, MLP)):
            raise ParallelConfigError(f"--tp-size {world}: layer FFN {type(l.mlp).__name__} cannot be sharded")
    return layers


def tp_cuts(model: nn.Module, rank: int, world: int) -> dict[str, Cut]:
    """{full parameter name (`model.layers.{i}....`): rank's Cut} of an unsharded target, every
    size checked (ParallelConfigError naming --tp-size); parameters not named are replicated."""
    cuts = {}
    for i, layer in enumerate(_layers(model, world)):
        for path, m in layer.named_modules():
            if type(m) in TP_TABLE:
                prefix = f"model.layers.{i}.{path}." if path else f"model.layers.{i}."
                cuts.update({prefix + name: c for name, c in module_cuts(m, rank, world).items()})
    return cuts


def shard_tensor_parallel(model: nn.Module, rank: int, world: int) -> int:
    """Slice a built target's decoder layers in place to rank's share (module docstring) and
    install the sums; returns the number of layers sharded. ParallelConfigError naming --tp-size
    for a DeepSeek-V4 model or a size N does not divide (checked before anything is cut). Works on
    a model built on the meta device (only the shapes change)."""
    tp_cuts(model, rank, world)  # every size checked before anything is cut
    layers = _layers(model, world)
    for l in layers:
        shard_attention(l.self_attn, rank, world)
        if isinstance(l.mlp, MoE):
            shard_moe(l.mlp, rank, world)
        else:
            shard_mlp(l.mlp, rank, world)
        l.mlp = Summed(l.mlp)
    return len(layers)


def set_reduce(model: nn.Module, reduce: Reduce) -> None:
    """Replace every sum a sharded model runs (Summed wrappers, indexers' score_reduce) by
    `reduce`: tests simulate the ranks' sum in one process."""
    for m in model.modules():
        if isinstance(m, Summed):
            m.reduce = reduce
        elif isinstance(m, Indexer) and m.score_reduce is not None:
            m.score_reduce = reduce
