"""DeepSeek-V4 MoE: scored or hash-routed experts with clamped SwiGLU, plus one shared expert.

    scores  = score_fn(x @ gate.weight^T)          fp32; sqrt(softplus) by default
    experts = topk(scores + e_score_correction_bias)    ("moe": the bias steers selection only)
            | tid2eid[input_id]                         ("hash_moe": a frozen token -> experts table)
    weights = scores[experts] / sum * routed_scaling_factor   (always normalized, like transformers)
    expert(x) = down(silu(min(gate(x), L)) * clamp(up(x), -L, L)),  L = swiglu_limit

Expert weights are stacked like transformers' in-memory layout: gate_up_proj [E, 2I, H] (gate rows
first), down_proj [E, H, I]. Names: gate.{weight, e_score_correction_bias | tid2eid}, experts,
shared_experts.{gate,up,down}_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dhisparse.layers.fp8_linear import Fp8Experts
from dhisparse.layers.moe import Experts, Routing
from dhisparse.core.v4_config import V4Config
from dhisparse.kernels.fp8_dispatch import shared_activations


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _score(logits: torch.Tensor, fn: str) -> torch.Tensor:
    if fn == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if fn == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


class V4Router(nn.Module):
    """Scored ("moe") or hash ("hash_moe") router over fp32 scores."""

    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        super().__init__()
        E, self.top_k, self.hashed = cfg.n_routed_experts, cfg.num_experts_per_tok, hashed
        self.score_fn, self.scaling = cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(E, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.int64))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> Routing:
        """x [T, H], input_ids [T] -> Routing."""
        scores = _score(F.linear(x.float(), self.weight.float()), self.score_fn)  # [T, E]
        if self.hashed:
            idx = self.tid2eid[input_ids].long()
        else:
            idx = torch.topk(scores + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(idx, w * self.scaling)


class V4Experts(Experts):
    """Stacked experts with the clamped SwiGLU of V4 (same layout and loop as `Experts`)."""

    def __init__(self, cfg: V4Config) -> None:
        super().__init__(cfg)
        self.limit = cfg.swiglu_limit

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu_clamped(gate, up, self.limit)


class Fp8V4Experts(Fp8Experts):
    """`V4Experts` over block-scaled FP8 weights (`layers/fp8_linear.py`): the clamped SwiGLU."""

    limit: float = 10.0

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu_clamped(gate, up, self.limit)

    @classmethod
    def from_v4(cls, experts: V4Experts) -> "Fp8V4Experts":
        """`experts` quantized to 128x128-block FP8, with their clamp limit."""
        m = cls.from_experts(experts)
        m.limit = experts.limit
        return m


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with shared_activations(x):  # FP8 w8a8: gate and up quantize x once
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(swiglu_clamped(gate, up, self.limit))


class V4MoE(nn.Module):
    """x [T, H], input_ids [T] -> routed experts + shared expert, [T, H]."""

    def __init__(self, cfg: V4Config, layer: int) -> None:
        super().__init__()
        self.gate = V4Router(cfg, cfg.mlp_hash[layer])
        self.experts = V4Experts(cfg)
        self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        with shared_activations(x):  # FP8 w8a8: the routed gate-up and the shared gate and up quantize x once
            return self.experts(x, self.gate(x, input_ids)) + self.shared_experts(x)
