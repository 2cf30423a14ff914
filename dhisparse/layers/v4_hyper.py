"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4.

The residual stream is `hc_mult` = N copies per token: streams [T, N, D]. Around each block
(attention, then MoE) a `HyperConnection` computes from the streams

    f    = unweighted_rms(flatten(streams)) @ fn^T                  fp32, [T, (2 + N) * N]
    pre  = sigmoid(f_pre * scale[0] + base_pre) + eps               [T, N]     collapse weights
    post = 2 * sigmoid(f_post * scale[1] + base_post)               [T, N]     expand weights
    comb = Sinkhorn(softmax(f_comb * scale[2] + base_comb) + eps)   [T, N, N]  doubly stochastic

and the block runs on `collapsed = sum_n pre[n] * streams[n]`; then

    new_streams[k] = post[k] * block_out + sum_j comb[j, k] * streams[j]      (comb transposed)

`HyperHead` collapses the streams once more (pre weights only) before the final norm.
Parameter names are transformers' (`fn`, `base`, `scale`; `hc_fn`, `hc_base`, `hc_scale`), all fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dhisparse.layers.v4_ops import unweighted_rms_norm


class HCWeights(NamedTuple):
    """post [T, N] fp32; comb [T, N, N] fp32 (row j = input stream, column k = output stream);
    collapsed [T, D] block input in the streams' dtype."""

    post: torch.Tensor
    comb: torch.Tensor
    collapsed: torch.Tensor


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., N, N] positive -> approximately doubly stochastic: columns once, then
    (iters - 1) x (rows, columns), with eps added to every denominator."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    def __init__(self, hidden: int, n: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        width = (2 + n) * n
        self.fn = nn.Parameter(torch.zeros(width, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> HCWeights:
        """streams [T, N, D] -> HCWeights."""
        T, N = streams.shape[:2]
        f = F.linear(unweighted_rms_norm(streams.reshape(T, -1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = f.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([N, N, N * N])
        s = self.scale.float()
        pre = torch.sigmoid(pre_w * s[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s[1] + post_b)
        comb = torch.softmax(comb_w.view(T, N, N) * s[2] + comb_b.view(N, N), dim=-1) + self.hc_eps
        comb = sinkhorn(comb, self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return HCWeights(post, comb, collapsed)


def hc_expand(w: HCWeights, streams: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """streams [T, N, D], block output out [T, D] -> new streams [T, N, D]."""
    dtype = streams.dtype
    mixed = torch.matmul(w.comb.to(dtype).transpose(-1, -2), streams)
    return w.post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """Final collapse: streams [T, N, D] -> [T, D] with sigmoid pre weights."""

    def __init__(self, hidden: int, n: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        T = streams.shape[0]
        flat = unweighted_rms_norm(streams.reshape(T, -1).float(), self.norm_eps)
        mix = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
