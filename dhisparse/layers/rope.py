"""Rotary position embeddings: default and YaRN frequencies, interleaved and half-split rotation.

DeepSeek MLA rotates interleaved pairs (x[2j], x[2j+1]); transformers writes the result
de-interleaved as [rotated evens | rotated odds]. We keep that layout so cached k_pe rows equal
transformers' cache rows. The V3.2 indexer rotates half-split pairs (x[j], x[j + d/2]) instead;
GLM's indexer uses the interleaved form.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from dhisparse.core.config import RopeConfig


def _yarn_inv_freq(cfg: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = cfg.theta, cfg.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if cfg.attention_factor is not None:
        attn = float(cfg.attention_factor)
    elif cfg.mscale and cfg.mscale_all_dim:
        attn = mscale(factor, cfg.mscale) / mscale(factor, cfg.mscale_all_dim)
    else:
        attn = mscale(factor)

    def corr_dim(rot: float) -> float:
        return dim * math.log(cfg.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(cfg.beta_fast), corr_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return inter * (1 - keep) + extra * keep, attn


def softmax_mscale(cfg: RopeConfig) -> float:
    """Multiplier of the MLA softmax scale: mscale(factor, mscale_all_dim)^2 under YaRN."""
    if cfg.rope_type == "default" or not cfg.mscale_all_dim:
        return 1.0
    m = 0.1 * cfg.mscale_all_dim * math.log(cfg.factor) + 1.0 if cfg.factor > 1 else 1.0
    return m * m


class RotaryEmbedding(nn.Module):
    """Produces per-position (cos, sin) of shape [T, dim/2] (one angle per rotated pair)."""

    def __init__(self, cfg: RopeConfig, dim: int) -> None:
        super().__init__()
        if cfg.rope_type == "yarn":
            inv_freq, attn = _yarn_inv_freq(cfg, dim)
        else:
            inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            attn = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attn

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)


class RopeTables(NamedTuple):
    """One pass's rotation tables. cos, sin [T, r/2]; C = [cos | cos], S = [-sin | sin] [T, r].

    With a = the input in [first | second] half order and b = its halves swapped, a rotation is
    a * C + b * S (see `rope_fused`): two gathers and two arithmetic ops per call."""

    cos: torch.Tensor
    sin: torch.Tensor
    C: torch.Tensor
    S: torch.Tensor

    @classmethod
    def build(cls, cos: torch.Tensor, sin: torch.Tensor) -> "RopeTables":
        return cls(cos, sin, torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))


_PERMS: dict[tuple, torch.Tensor] = {}


def _perm(r: int, interleaved: bool, swapped: bool, device: torch.device) -> torch.Tensor:
    """Channel order [first | second] of a rotary slice of width r (interleaved: evens | odds),
    halves swapped when `swapped`."""
    key = (r, interleaved, swapped, str(device))
    if key not in _PERMS:
        idx = torch.arange(r)
        first, second = (idx[0::2], idx[1::2]) if interleaved else (idx[: r // 2], idx[r // 2 :])
        _PERMS[key] = (torch.cat([second, first]) if swapped else torch.cat([first, second])).to(device)
    return _PERMS[key]


def rope_fused(x: torch.Tensor, t: RopeTables, interleaved: bool) -> torch.Tensor:
    """Same result as `rope_interleaved` / `rope_half_split` (x [T, ..., r] -> [T, ..., r]) in four
    or five ops; the output is in [first' | second'] half order, as theirs."""
    r = x.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r,)
    a = x.index_select(-1, _perm(r, True, False, x.device)) if interleaved else x
    b = x.index_select(-1, _perm(r, interleaved, True, x.device))
    return torch.addcmul(a * t.C.view(shape), b, t.S.view(shape))


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., d]; cos/sin [T, d/2]. Rotates pairs (2j, 2j+1); returns [evens' | odds']."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., d]; cos/sin [T, d/2]. NeoX rotation of pairs (j, j + d/2)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c = torch.cat([cos, cos], -1).view(shape[:-1] + (2 * cos.shape[-1],))
    s = torch.cat([sin, sin], -1).view(shape[:-1] + (2 * sin.shape[-1],))
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rot * s
