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

from array import array
from typing import Sequence

import torch

from dhisparse.spec.drafter import DraftProposal, DraftRequest, StatelessDrafter


class NgramDrafter(StatelessDrafter):
    """Suffix n-gram lookup over each request's own history."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramDrafter needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._history: dict[str, bytearray] = {}  # request -> committed ids as int32 bytes

    def release(self, request_id: str) -> None:
        self._history.pop(request_id, None)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, req: DraftRequest) -> DraftProposal:
        if req.max_drafts < 1:
            return DraftProposal.empty()
        buf = self._history_bytes(req)  # committed ids; the anchor follows them (not copied in)
        anchor = _ids_bytes([req.anchor])
        length = len(buf) // _ITEM + 1
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            j = find_last_match_bytes(buf, n, anchor)
            if j >= 0:
                tail = array("i", buf[(j + n) * _ITEM : (j + n + req.max_drafts) * _ITEM]).tolist()
                if len(tail) < req.max_drafts and j + n + len(tail) == length - 1:
                    tail.append(req.anchor)  # the match's continuation reaches the anchor
                tokens = continuation(tail, 0, req.max_drafts)
                return DraftProposal(tokens, None, [n / (n + 1)] * len(tokens))
        return DraftProposal.empty()

    def _history_bytes(self, req: DraftRequest) -> bytearray:
        """Committed ids as int32 bytes, extended incrementally (committed ids only grow)."""
        buf = self._history.get(req.request_id)
        n = req.num_committed
        if buf is None or len(buf) // _ITEM > n:
            buf = bytearray(_ids_bytes(req.token_ids[:n]))
        elif len(buf) // _ITEM < n:
            buf += _ids_bytes(req.token_ids[len(buf) // _ITEM : n])
        self._history[req.request_id] = buf
        return buf


_ITEM = 4  # bytes per id in the search buffers (int32)


def _ids_bytes(ids) -> bytes:
    return array("i", ids).tobytes()


def find_last_match_bytes(buf: bytes | bytearray, n: int, last: bytes = b"") -> int:
    """`find_last_match` over ids packed as int32 bytes (the drafter's history) followed by the
    packed id `last` (at most one; not copied in: the drafter's anchor): a C substring search
    from the end instead of comparing every window; only id-aligned hits count."""
    if len(last) > _ITEM:
        raise ValueError(f"find_last_match_bytes: `last` holds at most one packed id, got {len(last)} bytes")
    length = (len(buf) + len(last)) // _ITEM
    if n < 1 or length <= n:
        return -1
    k = len(last) // _ITEM  # ids of the suffix taken from `last`
    suffix = bytes(buf[(length - n) * _ITEM :]) + last if n > k else last[(k - n) * _ITEM :]
    end = (length - 1) * _ITEM  # an occurrence must end before the last id (a token follows it)
    while True:
        i = buf.rfind(suffix, 0, end)
        if i < 0:
            return -1
        if i % _ITEM == 0:
            return i // _ITEM
        end = i + len(suffix) - 1  # misaligned hit: look further left


def find_last_match(hist: torch.Tensor, n: int) -> int:
    """Start j of the latest earlier occurrence of the suffix hist[-n:] (j + n < len), or -1.

    hist [L] int64. Vectorised: windows [L - n, n] compared against the suffix (the reference of
    `find_last_match_bytes`, which the drafter uses)."""
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
