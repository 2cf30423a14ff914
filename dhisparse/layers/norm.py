"""RMSNorm with transformers' numerics (normalize in fp32, cast back, then scale)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); x [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
