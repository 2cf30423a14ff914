"""Expert-parallel MoE: the routed experts sharded over the ranks, tokens sent to their experts'
ranks and the results sent back (`core.parallel.exchange`: all-to-all with uneven splits).
One path serves both MoE kinds (`MOE_KINDS`): GLM-5.x / V3.2's `MoE` and DeepSeek-V4's `V4MoE`
(scored or hash-routed by token id, clamped SwiGLU experts, one shared expert). Either is a
router producing `Routing`, stacked experts with an `act`, and replicated shared experts.

    rank r owns experts [r * E/W, (r + 1) * E/W)        (contiguous blocks, W = world size)
    1. route locally (the router and the shared experts are replicated; a V4 router reads the
       token ids: hash-routed layers route by them, so the ids travel with the rows into `forward`);
    2. the (token, slot) pairs, sorted by (owner rank, token, slot), go to their owners as hidden
       rows + expert ids (the weights stay home);
    3. an owner runs each local expert, ascending, over its rows in fixed tiles of `EP_TILE` rows
       (zero-padded), so a row's GEMM has the same shape whatever else arrived (batch invariance);
    4. the outputs come back in the order they left; each token combines its own:

           out[t] = sum over its slots in ascending expert id of (w_j * y_j).to(dtype),  from zeros,

       then the shared experts are added. A token's routed result depends on its own row and
       routing only, never on which requests share the step or which rank they run on (the
       replicated router and shared experts are GEMMs over this rank's rows, as in one process).

A rank with no tokens still calls every EPMoE layer of the model (`idle_pass`: zero rows, and zero
token ids), so each all-to-all has every rank in it (the engine's lock-step, SGLang's idle batch).

The expert block is one `Cut` (layers/tp.py) along the stacks' expert dim, `expert_cuts`: the same
description drives `EPMoE` (copying the block out of a built MoE, or keeping a meta MoE's shapes)
and the sharded checkpoint loader (models/shard_load.py: other ranks' expert tensors are never read).

Block-scaled FP8 experts (`layers/fp8_linear.Fp8Experts`, glm5-faithful's and v41-faithful's) are
cut the same way, weights and their scale blocks along the expert dim, and an owner runs all its
received rows through them at once (`Fp8Experts.each_row`: the two grouped FP8 GEMMs, one expert a
row), not in 16-row tiles: one launch a GEMM and no host sync, for the throughput runs these
models exist for. Batch invariance is then NOT kept for FP8 experts: the FP8 kernel picks its tile
shape from the rows per expert and the CPU reference's matmul rounds by batch shape, so a token's
result can move in the last bits with the other rows of the launch (as the one-GPU FP8 MoE's
already does; glm5-faithful's greedy tokens are batch-dependent anyway: models/faithful.py). EP
exactness is the bf16 / fp32 path's (tests/test_parallel_ep.py); tests/test_ep_fp8.py checks the
FP8 path against the whole FP8 MoE to a tolerance.
"""

from __future__ import annotations

import torch
from torch import nn

from dhisparse.core.parallel import exchange
from dhisparse.layers.fp8_linear import Fp8Experts
from dhisparse.layers.moe import MoE, Routing
from dhisparse.layers.tp import Cut
from dhisparse.layers.v4_moe import V4MoE

EP_TILE = 16  # rows per expert GEMM on the owner: every row of an expert runs in a [EP_TILE, H] matmul
MOE_KINDS = (MoE, V4MoE)  # the decoder-layer MoEs EPMoE shards (V4's router takes the token ids)


def expert_block(n_experts: int, rank: int, world: int) -> Cut:
    """Rank's experts [r*E/W, (r+1)*E/W) as a Cut of the stacks' dim 0 (ValueError naming --ep-size
    when W does not divide E)."""
    if n_experts % world:
        raise ValueError(f"--ep-size {world} must divide the model's {n_experts} routed experts")
    n = n_experts // world
    return Cut(0, ((rank * n, (rank + 1) * n),))


def expert_cuts(model: nn.Module, rank: int, world: int) -> dict[str, Cut]:
    """{full name of every MoE layer's `experts.gate_up_proj` / `experts.down_proj`: rank's expert
    block} of an unsharded target; everything else is replicated."""
    cuts = {}
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MOE_KINDS):
            cut = expert_block(layer.mlp.experts.gate_up_proj.shape[0], rank, world)
            cuts |= {f"model.layers.{i}.mlp.experts.{p}": cut for p in ("gate_up_proj", "down_proj")}
    return cuts


class EPMoE(nn.Module):
    """A `MoE` or `V4MoE` with its routed experts sharded (module docstring). `EPMoE(moe, rank,
    world)` keeps the full module's router and shared experts, copies the rank's expert block out
    of the stacks and drops the full stacks (of a meta module: only the shapes, gate_up_proj
    [E/W, 2I, H]). `takes_ids`: the router reads the token ids (V4)."""

    def __init__(self, moe: MoE | V4MoE, rank: int, world: int) -> None:
        super().__init__()
        cut = expert_block(moe.experts.gate_up_proj.shape[0], rank, world)
        self.rank, self.world, self.n_local = rank, world, cut.size
        self.gate, self.shared_experts = moe.gate, moe.shared_experts
        self.takes_ids = isinstance(moe, V4MoE)
        self.experts = ex = moe.experts
        if isinstance(ex, Fp8Experts):  # FP8 weights and their scale blocks are buffers, cut alike
            for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
                ex.register_buffer(name, cut.take(getattr(ex, name)))
            ex.n_experts = cut.size
            return
        ex.gate_up_proj = nn.Parameter(cut.take(ex.gate_up_proj.data), requires_grad=False)
        ex.down_proj = nn.Parameter(cut.take(ex.down_proj.data), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] (T may be 0: an idle rank), input_ids [T] int64 token ids (read by a V4 router,
        required there; GLM / V3.2's ignore them) -> [T, H]: the routed experts, then the shared ones."""
        y = self.routed(x, self.route(x, input_ids))
        return y + self.shared_experts(x) if self.shared_experts is not None else y

    def route(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> Routing:
        """The replicated router over this rank's rows: Routing(experts [T, k], weights [T, k])."""
        if not self.takes_ids:
            return self.gate(x)
        if input_ids is None or input_ids.shape[0] != x.shape[0]:
            raise ValueError("a DeepSeek-V4 EPMoE layer routes by token id: pass input_ids [T] with x [T, H]")
        return self.gate(x, input_ids)

    def routed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' weighted sum per token [T, H]: a token's result depends on its own
        row and routing only (not on the other rows of this rank or of any other)."""
        T, H = x.shape
        k = routing.experts.shape[1]
        flat_e = routing.experts.reshape(-1)  # [T*k]
        owner = flat_e // self.n_local
        order = torch.argsort(owner * (T * k) + torch.arange(T * k, device=x.device), stable=True)
        send = x.index_select(0, order // k) if T else x.new_zeros(0, H)
        counts = torch.bincount(owner, minlength=self.world).tolist() if T else [0] * self.world
        rows, recv_counts = exchange(send, counts)
        ids, _ = exchange(flat_e[order].to(torch.int64), counts)
        y = self._run_local(rows, ids - self.rank * self.n_local)
        back, _ = exchange(y, recv_counts)  # [T*k, H], in `order`
        out_pairs = torch.empty_like(back)
        out_pairs[order] = back  # pair p = (token p // k, slot p % k)
        return self._combine(x, routing, out_pairs.view(T, k, H))

    def _run_local(self, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Each received row through its (local) expert, in [EP_TILE, H] tiles per expert."""
        out = torch.empty_like(rows)
        if rows.shape[0] == 0:
            return out
        ex = self.experts
        if isinstance(ex, Fp8Experts):  # one grouped FP8 launch a GEMM (not batch-invariant: module docstring)
            return ex.each_row(rows, local)
        for e in torch.unique(local).tolist():  # ascending
            idx = (local == e).nonzero().flatten()
            for a in range(0, idx.numel(), EP_TILE):
                part = idx[a : a + EP_TILE]
                tile = rows.new_zeros(EP_TILE, rows.shape[1])
                tile[: part.numel()] = rows[part]
                gate, up = nn.functional.linear(tile, ex.gate_up_proj[e]).chunk(2, dim=-1)
                out[part] = nn.functional.linear(ex.act(gate, up), ex.down_proj[e])[: part.numel()]
        return out

    def _combine(self, x: torch.Tensor, routing: Routing, y: torch.Tensor) -> torch.Tensor:
        """y [T, k, H] per (token, slot) -> out [T, H]: slots in ascending expert id, from zeros."""
        slot_order = torch.argsort(routing.experts, dim=1, stable=True)  # [T, k]
        w = routing.weights.gather(1, slot_order)
        ys = y.gather(1, slot_order[:, :, None].expand_as(y))
        out = torch.zeros_like(x)
        for j in range(y.shape[1]):
            out = out + (ys[:, j] * w[:, j, None]).to(x.dtype)  # as MoE._grouped: y x fp32 weight
        return out


def shard_experts(model: nn.Module, rank: int, world: int) -> int:
    """Replace every `MoE` / `V4MoE` of the target's decoder layers by its EPMoE shard; returns how
    many. (Drafters keep their own replicated MoE: they are not in `model.model.layers`.)"""
    n = 0
    for layer in model.model.layers:
        if isinstance(layer.mlp, MOE_KINDS):
            layer.mlp = EPMoE(layer.mlp, rank, world)
            n += 1
    return n


def ep_layers(model: nn.Module) -> int:
    """How many of the target's decoder layers run an EPMoE."""
    return sum(isinstance(layer.mlp, EPMoE) for layer in model.model.layers)


def idle_pass(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """A rank with nothing to run joins every EPMoE exchange of a pass with zero rows, in layer
    order: x [0, H] in the model dtype (a V4 layer's MoE input is its collapsed hyper-connection
    streams after the norm: [T, H] too) and input_ids [0] int64 (V4's routers index by them)."""
    layers = [layer for layer in model.model.layers if isinstance(layer.mlp, EPMoE)]
    if not layers:
        return
    x = torch.zeros(0, layers[0].mlp.gate.weight.shape[1], dtype=dtype, device=device)
    ids = torch.zeros(0, dtype=torch.int64, device=device)
    with torch.inference_mode():
        for layer in layers:
            layer.mlp(x, ids)
