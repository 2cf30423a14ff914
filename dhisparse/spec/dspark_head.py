"""DSpark's lightweight sequential head on a parallel DFlash backbone (semi-autoregressive drafting).

There is no public reference package for DSpark; this is our reading of the paper (Cheng et al.,
2026: "a lightweight sequential module coupled with a parallel backbone", "confidence-scheduled
verification"; the adaptive-DHiSparse paper §2.3: "DSpark adds a lightweight sequential head and
confidence-scheduled verification prefixes") and of public write-ups of its DeepSpec code (a
low-rank Markov transition bias over the vocabulary, optionally gated by the backbone's hidden
state, and a confidence head on [hidden ; previous-token code]). What we implement:

    backbone     the DFlash block pass gives, at block rows k = 1..B-1, hidden h_k [H] and base
                 logits U_k [V] (spec/dflash_model.py), all positions in one parallel pass
    head         left to right, with x_0 = the anchor:
                     e_k   = W1[x_{k-1}]                          (W1: [V, r])
                     g_k   = sigmoid(G h_k)  (gated)  or  1       (G: [r, H])
                     B_k   = (e_k * g_k) @ W2^T                   (W2: [V, r]) -> [V]
                     p_k   = processed(U_k + B_k)                 (the request's temperature / top-k / top-p)
                     x_k   = argmax p_k (greedy) or x_k ~ p_k (sampled; q_k = p_k for rejection sampling)
    confidence   c_k = sigmoid(w . [h_k ; e_k] + b): the head's estimate that x_k is accepted given
                 x_1..x_{k-1} were; it feeds the confidence-scheduled width (spec/dspark.py)

Only the head is sequential: r-dimensional work per position, against the backbone's full layers.
Checkpoint keys (beside the DFlash ones; config `dflash_config` / top level: dspark_markov_rank,
dspark_markov_gated): sequential_head.markov_head.{w1,w2}.weight [V, r],
sequential_head.markov_head.gate.weight [r, H] (gated), sequential_head.confidence_head.weight
[1, H + r], sequential_head.confidence_head.bias [1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dhisparse.core.params import SamplingParams
from dhisparse.core.sampling import processed_probs


@dataclass
class HeadDrafts:
    """tokens [N, K]; q: per request its [K, V] proposal distributions (None for greedy requests);
    confidence [N, K] from the confidence head."""

    tokens: torch.Tensor
    q: list[torch.Tensor | None]
    confidence: torch.Tensor


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, gated: bool) -> None:
        super().__init__()
        self.w1 = nn.Embedding(vocab, rank)
        self.w2 = nn.Embedding(vocab, rank)
        self.gate = nn.Linear(hidden, rank, bias=False) if gated else None

    def code(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """prev [N] token ids, hidden [N, H] -> e_k * g_k [N, r] (e_k alone when not gated)."""
        e = self.w1(prev)
        return e if self.gate is None else e * torch.sigmoid(self.gate(hidden.to(self.gate.weight.dtype)))

    def bias(self, code: torch.Tensor) -> torch.Tensor:
        """[N, r] -> B_k [N, V] fp32."""
        return (code @ self.w2.weight.T).float()


class SequentialHead(nn.Module):
    """The Markov head and the confidence head, applied left to right over a block's rows."""

    def __init__(self, vocab: int, hidden: int, rank: int, gated: bool) -> None:
        super().__init__()
        self.markov_head = MarkovHead(vocab, hidden, rank, gated)
        self.confidence_head = nn.Linear(hidden + rank, 1)

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
              params: list[SamplingParams], generators: list[torch.Generator | None]) -> HeadDrafts:
        """hidden [N, K, H]; logits [N, K, V] fp32 (base U_k); anchors [N] -> K drafts per request."""
        n, k = logits.shape[:2]
        prev = anchors
        tokens = torch.empty(n, k, dtype=torch.int64, device=logits.device)
        conf = torch.empty(n, k, dtype=torch.float32, device=logits.device)
        qs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        greedy = [p.greedy for p in params]
        for i in range(k):
            h = hidden[:, i]
            e = self.markov_head.w1(prev)
            scores = logits[:, i] + self.markov_head.bias(self.markov_head.code(prev, h))
            pick = scores.argmax(dim=-1)
            for r in range(n):
                if not greedy[r]:
                    q = processed_probs(scores[r : r + 1], [params[r]])[0]
                    pick[r] = torch.multinomial(q, 1, generator=generators[r])[0]
                    qs[r].append(q)
            feats = torch.cat([h.to(e.dtype), e], dim=-1).to(self.confidence_head.weight.dtype)
            conf[:, i] = torch.sigmoid(self.confidence_head(feats)[:, 0]).float()
            tokens[:, i] = prev = pick
        return HeadDrafts(tokens, [None if greedy[r] else torch.stack(qs[r]) for r in range(n)], conf)
