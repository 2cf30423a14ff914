"""RMSNorm with transformers' numerics (normalize in fp32, cast back, then scale)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); x [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One fused op, statistics in fp32. Identical to transformers in fp32; in bf16 the
        normalized value is not rounded before the weight multiply as transformers does, so about a
        quarter of outputs differ from it by one bf16 rounding step (every preset shares this)."""
        if self.weight.dtype == x.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)
