"""DFlash2's two additions to the DFlash block drafter (our own implementation of the published design).

`GroupedDynamicConv`: a causal convolution along the block, per channel group, whose kernel is a
learnt base kernel plus a per-token kernel predicted from the input. `prepare(x)` convolves a
layer's input with base[0] + dynamic[0] and also returns dynamic[1], which `finish(y, dynamic)`
applies with base[1] to the sub-layer's output:

    out[t, g, :] = sum_{o < ks} (base[o, g, :] + dyn[t, o, g]) * x[t - o, g, :]     (x[<0] = 0)

`CandidateSelector`: the drafter's logits give, at each block position i, the top-k candidate
tokens c_{i,1..k} with their logits u_{i,j}. A path through that lattice is picked left to right,
each step conditioned on the token picked before it (the anchor for i = 1):

    s_{i,j} = u_{i,j} + < pred[x_{i-1}] * P h_i , succ[c_{i,j}] >      (pred, succ: [V, r] codebooks,
                                                                        P: [r, H])
    x_i = c_{i, argmax_j s_{i,j}}   (greedy)   or   x_i ~ q_i = softmax(s_i / T) over the candidates

A sampled request's proposal distribution q_i (zero outside the candidates) is what rejection
sampling needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """x [N, L, H]; dynamic [N, L, ks, G]; base [ks, H] (G = H / group) -> [N, L, H] (causal along L)."""
    n, length, h = x.shape
    ks, groups = base.shape[0], h // group
    xs = F.pad(x.view(n, length, groups, group), (0, 0, 0, 0, ks - 1, 0))  # [N, L + ks - 1, G, g]
    shifted = xs.unfold(1, ks, 1).flip(-1)  # [N, L, G, g, ks]: [..., o] = x[t - o] (0 before the block)
    kernel = base.view(ks, groups, group).to(x.dtype) + dynamic[..., None]  # [N, L, ks, G, g]
    return (kernel.permute(0, 1, 3, 4, 2) * shifted).sum(-1).view(n, length, h)  # every tap at once


class GroupedDynamicConv(nn.Module):
    """base_kernel [2, ks, H]; kernel_projection: H -> 2 * ks * G (G = H / group_size)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size), bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, L, H] -> (the convolved input, the output-side kernels [N, L, ks, G])."""
        groups = x.shape[-1] // self.group_size
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, groups)
        return grouped_dynamic_conv(x, dyn[..., 0, :, :], self.base_kernel[0], self.group_size), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(y, dynamic, self.base_kernel[1], self.group_size)


@dataclass
class Selection:
    """tokens [N, L]; candidates [N, L, k]; q [N, L, k] (rows of greedy requests: one-hot on the
    pick); confidence [N, L] (q of the pick; greedy: softmax of the scores at the pick)."""

    tokens: torch.Tensor
    candidates: torch.Tensor
    q: torch.Tensor
    confidence: torch.Tensor

    def dense_q(self, row: int, k: int, vocab: int) -> torch.Tensor:
        """Request `row`'s first k proposal distributions over the vocabulary [k, V] fp32."""
        out = torch.zeros(k, vocab, dtype=torch.float32, device=self.q.device)
        return out.scatter_add_(1, self.candidates[row, :k], self.q[row, :k].float())


class CandidateSelector(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    @torch.inference_mode()
    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
               temperatures: list[float], generators: list[torch.Generator | None]) -> Selection:
        """hidden [N, L, H]; logits [N, L, V] fp32; anchors [N]; temperature 0 = greedy per request."""
        unary, cand = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1)
        proj = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        prev = anchors
        picks, qs, confs = [], [], []
        for i in range(hidden.shape[1]):
            pair = self.predecessor_codebook(prev) * proj[:, i]  # [N, r]
            scores = unary[:, i] + torch.einsum("nr,nkr->nk", pair, self.successor_codebook(cand[:, i])).float()
            index, q, conf = self._pick(scores, temperatures, generators)
            prev = cand[:, i].gather(1, index[:, None])[:, 0]
            picks.append(prev), qs.append(q), confs.append(conf)
        return Selection(torch.stack(picks, 1), cand, torch.stack(qs, 1), torch.stack(confs, 1))

    @staticmethod
    def _pick(scores: torch.Tensor, temperatures: list[float], generators: list) -> tuple:
        index = scores.argmax(dim=-1)
        q = F.one_hot(index, scores.shape[-1]).to(torch.float32)
        conf = torch.softmax(scores, dim=-1).gather(1, index[:, None])[:, 0]
        for r, (t, g) in enumerate(zip(temperatures, generators)):
            if t > 0:
                row = torch.softmax(scores[r] / t, dim=-1)
                index[r] = torch.multinomial(row, 1, generator=g)[0]
                q[r], conf[r] = row, row[index[r]]
        return index, q, conf
