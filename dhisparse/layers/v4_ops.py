"""Small numeric building blocks of DeepSeek-V4 with transformers' numerics.

- `V4RMSNorm`: fp32 weight, normalize AND scale in fp32, cast once at the end (V4 keeps norm
  weights in fp32; the GLM `RMSNorm` casts before scaling, which differs in bf16).
- `unweighted_rms_norm`: x / rms(x) (q per head, hyper-connection inputs).
- `rope_trailing`: interleaved RoPE on the LAST `2 * cos.shape[-1]` channels, in place layout:

      x = [ nope ........................ | r0 r1 | r2 r3 | ... ]    pairs (2j, 2j+1) of the rope slice
                                           rotated by angle pos * inv_freq[j]

  so rows stay in checkpoint channel order (unlike `layers.rope.rope_interleaved`, which writes
  [evens | odds]). `inverse=True` rotates by -angle (V4 de-rotates the attention output).
"""

from __future__ import annotations

import torch
from torch import nn


class V4RMSNorm(nn.Module):
    """y = (weight * x / sqrt(mean(x^2) + eps)) in fp32, cast to x's dtype; x [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] -> x * rsqrt(mean(x^2) + eps), the factor computed in fp32 and cast to x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing rope slice of x in place-layout.

    x [T, ..., d] (any number of middle dims, e.g. heads); cos/sin [T, r/2] with r <= d.
    Returns a new tensor [T, ..., d]; the leading d - r channels are untouched.
    """
    half = cos.shape[-1]
    r = 2 * half
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.float().view(shape), sin.float().view(shape)
    if inverse:
        s = -s
    rope = x[..., -r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)
