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

Inside a rank the code paths are the unsharded layers' own (a rank's MoE combines its experts in
the same fixed order as one process); only the sums are added, as `Summed` wrappers of o_proj and
of the FFN and as the indexers' `score_reduce`. A model that is never sharded runs none of this.

KV: the MLA latent row [c_kv | k_pe] belongs to every head, so every rank stores full rows: per
rank one GPU's KV bytes per token (GLM-5 FP8: 656 B latent + 132 B index key per layer), N copies
over the group (layers/attention.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dhisparse.core.parallel import ParallelConfigError, tp_sum
from dhisparse.layers.attention import MLAttention
from dhisparse.layers.indexer import Indexer
from dhisparse.layers.moe import MLP, Experts, MoE

Reduce = Callable[[torch.Tensor], torch.Tensor]


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


def _keep(lin: nn.Linear, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> None:
    """lin's weight [out, in] cut to rows [lo, hi) / cols [lo, hi) in place (a fresh contiguous copy)."""
    w = lin.weight.data
    if rows is not None:
        w = w[rows[0] : rows[1]]
    if cols is not None:
        w = w[:, cols[0] : cols[1]]
    lin.weight = nn.Parameter(w.clone(), requires_grad=False)
    lin.out_features, lin.in_features = w.shape


def shard_attention(attn: MLAttention, rank: int, world: int) -> None:
    """Keep heads [r*H/N, (r+1)*H/N) of one MLA layer (and of its indexer); o_proj becomes Summed."""
    c = attn.cfg
    lo, hi = block(c.num_heads, rank, world, "attention heads")
    qk, nv, v = c.qk_head_dim, c.qk_nope_head_dim + c.v_head_dim, c.v_head_dim
    _keep(attn.q_b_proj, rows=(lo * qk, hi * qk))
    _keep(attn.kv_b_proj, rows=(lo * nv, hi * nv))  # [H*(nope+v), C]: W_UK, W_UV of each kept head
    _keep(attn.o_proj, cols=(lo * v, hi * v))
    attn.o_proj = Summed(attn.o_proj)
    attn.cfg = c.with_updates(num_heads=hi - lo)
    if attn.indexer is not None:
        shard_indexer(attn.indexer, rank, world)


def shard_indexer(ix: Indexer, rank: int, world: int) -> None:
    """Keep index heads [r*iH/N, ...): wq_b and weights_proj rows; scores summed before top-k."""
    lo, hi = block(ix.n_heads, rank, world, "index heads (index_n_heads)")
    _keep(ix.wq_b, rows=(lo * ix.head_dim, hi * ix.head_dim))
    _keep(ix.weights_proj, rows=(lo, hi))
    ix.n_heads = hi - lo  # ix.weight_scale stays the model's iH^-0.5
    ix.score_reduce = tp_sum


def shard_mlp(mlp: MLP, rank: int, world: int) -> None:
    """Keep intermediate block r: gate / up out rows, down in columns (a partial output)."""
    lo, hi = block(mlp.gate_proj.out_features, rank, world, "MLP intermediate size")
    _keep(mlp.gate_proj, rows=(lo, hi))
    _keep(mlp.up_proj, rows=(lo, hi))
    _keep(mlp.down_proj, cols=(lo, hi))


def shard_experts(ex: Experts, rank: int, world: int) -> None:
    """Every expert's intermediate block r: gate_up_proj [E, 2I, H] -> [E, 2I/N, H] as (gate rows
    [lo, hi), up rows [I+lo, I+hi)), so `chunk(2)` still splits gate from up; down_proj [E, H, I]
    -> [E, H, I/N]."""
    I = ex.gate_up_proj.shape[1] // 2
    lo, hi = block(I, rank, world, "MoE expert intermediate size (moe_intermediate_size)")
    gu = ex.gate_up_proj.data
    ex.gate_up_proj = nn.Parameter(torch.cat([gu[:, lo:hi], gu[:, I + lo : I + hi]], dim=1).contiguous(),
                                   requires_grad=False)
    ex.down_proj = nn.Parameter(ex.down_proj.data[:, :, lo:hi].contiguous(), requires_grad=False)


def shard_moe(moe: MoE, rank: int, world: int) -> None:
    """The routed experts and the shared experts sharded; the router untouched (replicated)."""
    shard_experts(moe.experts, rank, world)
    if moe.shared_experts is not None:
        shard_mlp(moe.shared_experts, rank, world)


def _check(model: nn.Module, world: int) -> list[nn.Module]:
    """The decoder layers to shard, after checking every size divides (nothing is cut on an error)."""
    layers = list(getattr(getattr(model, "model", None), "layers", None) or [])
    if not layers or not all(isinstance(getattr(l, "self_attn", None), MLAttention) for l in layers):
        raise ParallelConfigError(f"--tp-size {world}: tensor parallelism is built for GLM-5.x / DeepSeek-V3.2 "
                                  f"(MLA) targets only; {type(model).__name__} (DeepSeek-V4) is refused")
    for l in layers:
        c = l.self_attn.cfg
        block(c.num_heads, 0, world, "attention heads")
        if l.self_attn.indexer is not None:
            block(l.self_attn.indexer.n_heads, 0, world, "index heads (index_n_heads)")
        if isinstance(l.mlp, MoE):
            block(l.mlp.experts.gate_up_proj.shape[1] // 2, 0, world, "MoE expert intermediate size (moe_intermediate_size)")
            if l.mlp.shared_experts is not None:
                block(l.mlp.shared_experts.gate_proj.out_features, 0, world, "MLP intermediate size")
        elif isinstance(l.mlp, MLP):
            block(l.mlp.gate_proj.out_features, 0, world, "MLP intermediate size")
        else:
            raise ParallelConfigError(f"--tp-size {world}: layer FFN {type(l.mlp).__name__} cannot be sharded")
    return layers


def shard_tensor_parallel(model: nn.Module, rank: int, world: int) -> int:
    """Slice a built target's decoder layers in place to rank's share (module docstring) and
    install the sums; returns the number of layers sharded. ParallelConfigError naming --tp-size
    for a DeepSeek-V4 model or a size N does not divide (checked before anything is cut)."""
    layers = _check(model, world)
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
