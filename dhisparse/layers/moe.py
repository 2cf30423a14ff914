"""Feed-forward blocks: SiLU-GLU MLP and the DeepSeek MoE (sigmoid router with correction bias,
group-limited routing, routed scaling, shared experts). Expert weights are stacked like
transformers' in-memory layout: gate_up_proj [E, 2I, H] (gate first), down_proj [E, H, I].
Tensor parallelism (layers/tp.py) keeps each expert's intermediate block r of both halves
(gate_up_proj [E, 2I/N, H], still gate first) and of down_proj [E, H, I/N]; a rank's MoE output is
then a partial sum, combined over its experts in the same order as here, and summed over ranks."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dhisparse.core.config import ModelConfig
from dhisparse.kernels.fp8_dispatch import shared_activations


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); x [T, H]."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with shared_activations(x):  # FP8 w8a8: gate and up quantize x once
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class Routing(NamedTuple):
    """experts [T, top_k] int64 expert ids; weights [T, top_k] fp32 (normalized, scaled)."""

    experts: torch.Tensor
    weights: torch.Tensor


class Router(nn.Module):
    """Sigmoid scores; `e_score_correction_bias` only steers selection; top `topk_group` groups
    (group score = sum of its best two biased scores), then top-k experts inside them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(E, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> Routing:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        T, E = choice.shape
        if self.n_group > 1:
            grouped = choice.view(T, self.n_group, E // self.n_group)
            gscore = grouped.topk(min(2, E // self.n_group), dim=-1).values.sum(-1)
            keep = torch.zeros_like(gscore).scatter_(1, gscore.topk(self.topk_group, dim=-1).indices, 1.0)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return Routing(idx, w * self.scaling)


DENSE_ROWS = 1 << 16  # T * E at or below which every expert runs on every token (see Experts.forward)
DENSE_MAX_EXPERTS = 64  # beyond this, running every expert wastes more than the loop's launches cost


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, H] -> [T, H]: sum over chosen experts of weight * expert(x).

        Small batches (T * E <= DENSE_ROWS, i.e. decode steps) of models with at most
        DENSE_MAX_EXPERTS experts (the scaled benchmark models) run every expert on every token as
        two batched matmuls and weight them with a dense [T, E] routing matrix (zero for experts
        not chosen): a fixed number of kernels and no host sync. Larger batches (prefill) loop over
        the experts that received tokens (one sync for their counts)."""
        E = self.gate_up_proj.shape[0]
        if E <= DENSE_MAX_EXPERTS and x.shape[0] * E <= DENSE_ROWS:
            return self._dense(x, routing)
        return self._grouped(x, routing)

    def _dense(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        E = self.gate_up_proj.shape[0]
        w = torch.zeros(x.shape[0], E, dtype=routing.weights.dtype, device=x.device)
        w.scatter_add_(1, routing.experts, routing.weights)  # [T, E]
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
        y = torch.matmul(self.act(gate, up), self.down_proj.transpose(1, 2))  # [E, T, H]
        return torch.einsum("eth,te->th", y.float(), w.float()).to(x.dtype)

    def _grouped(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat = routing.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        tok = order // routing.experts.shape[1]
        wts = routing.weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            t, w = tok[start : start + n], wts[start : start + n]
            start += n
            gate, up = F.linear(x[t], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate, up), self.down_proj[e])
            out.index_add_(0, t, (y * w[:, None]).to(out.dtype))
        return out

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Gated activation (SiLU-GLU); subclasses change it (V4 clamps)."""
        return F.silu(gate) * up


class MoE(nn.Module):
    """Routed experts plus shared experts (HF names: gate, experts, shared_experts)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        n_sh = cfg.n_shared_experts
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * n_sh) if n_sh > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with shared_activations(x):  # FP8 w8a8: the routed gate-up and the shared gate and up quantize x once
            y = self.experts(x, self.gate(x))
            return y + self.shared_experts(x) if self.shared_experts is not None else y
