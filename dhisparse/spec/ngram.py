"""Prompt-lookup / n-gram drafter: no weights, real acceptance on repetitive text.

For a history h = committed tokens + anchor, try n = max_n down to min_n: find the most recent
earlier occurrence j of the suffix h[-n:] and propose the tokens that followed it, h[j+n],
h[j+n+1], ... A continuation that runs into the suffix keeps reading from the tokens it has
just proposed, so a period-P loop yields a full block. No match -> an empty proposal (the round
degenerates to a plain decode step). Deterministic: `probs` is None (point masses).

Confidence of each drafted token is n / (n + 1) for a match of length n (a heuristic: longer
matches repeat more reliably); DSpark-style scheduling can use it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dhisparse.spec.drafter import DraftProposal, DraftRequest, StatelessDrafter


class NgramDrafter(StatelessDrafter):
    """Suffix n-gram lookup over each request's own history."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramDrafter needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._history: dict[str, torch.Tensor] = {}

    def release(self, request_id: str) -> None:
        self._history.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, req: DraftRequest) -> DraftProposal:
        if req.max_drafts < 1:
            return DraftProposal.empty()
        hist = self._tensor(req)
        for n in range(min(self.max_n, hist.numel() - 1), self.min_n - 1, -1):
            j = find_last_match(hist, n)
            if j >= 0:
                tokens = continuation(hist[j + n :].tolist(), 0, req.max_drafts)  # only the tail: no 100K-long list
                return DraftProposal(tokens, None, [n / (n + 1)] * len(tokens))
        return DraftProposal.empty()

    def _tensor(self, req: DraftRequest) -> torch.Tensor:
        """History [n + 1] int64 (committed + anchor), extended incrementally (committed ids only grow)."""
        committed = self._history.get(req.request_id)
        n = req.num_committed
        if committed is None or committed.numel() > n:
            committed = torch.tensor(list(req.token_ids), dtype=torch.int64)
        elif committed.numel() < n:
            tail = torch.tensor(list(req.token_ids[committed.numel():]), dtype=torch.int64)
            committed = torch.cat([committed, tail])
        self._history[req.request_id] = committed
        return torch.cat([committed, torch.tensor([req.anchor], dtype=torch.int64)])


def find_last_match(hist: torch.Tensor, n: int) -> int:
    """Start j of the latest earlier occurrence of the suffix hist[-n:] (j + n < len), or -1.

    hist [L] int64. Vectorised: windows [L - n, n] compared against the suffix."""
    length = hist.numel()
    if n < 1 or length <= n:
        return -1
    windows = hist[: length - 1].unfold(0, n, 1)  # starts 0..L-1-n: every window followed by a token
    hits = (windows == hist[length - n:]).all(dim=1).nonzero()
    return int(hits[-1]) if hits.numel() else -1


def continuation(hist: list[int], start: int, k: int) -> list[int]:
    """Up to k tokens read from `start`, reading on into the proposal itself past the end."""
    ext = list(hist)
    out: list[int] = []
    for i in range(k):
        if start + i >= len(ext):
            break
        out.append(ext[start + i])
        ext.append(out[-1])
    return out
