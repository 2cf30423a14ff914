"""Prefix KV store: prepared prompt prefixes whose KV a request imports instead of recomputing.

The paper's closed-loop benchmark gives every request the same long input from a prepared prefix,
with independent decode KV per request: each admitted request imports a *private copy* of the
prefix rows. Stored rows live on the host (pinned when CUDA is available).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StoredPrefix:
    """token_ids (n,); latent [L, n, latent_dim]; index [F, n, index_head_dim] (host tensors);
    features {layer: [f, hidden]}: target hidden states of the last f positions (for a drafter's
    window), empty without speculation."""

    token_ids: tuple[int, ...]
    latent: torch.Tensor
    index: torch.Tensor
    features: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size() + self.index.numel() * self.index.element_size()


class PrefixStore:
    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._items: dict[tuple[int, ...], StoredPrefix] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, token_ids: list[int], latent: torch.Tensor, index: torch.Tensor, features: dict | None = None) -> StoredPrefix:
        lat, idx = latent.cpu(), index.cpu()
        if self.pin:
            lat, idx = lat.pin_memory(), idx.pin_memory()
        item = StoredPrefix(tuple(token_ids), lat, idx, {l: f.cpu() for l, f in (features or {}).items()})
        self._items[item.token_ids] = item
        return item

    def match(self, prompt: list[int]) -> tuple[StoredPrefix | None, int]:
        """Longest stored prefix of `prompt` and how many of its rows to import. At most
        len(prompt) - 1 rows are imported so the last prompt token still runs and yields logits."""
        best: StoredPrefix | None = None
        for key, item in self._items.items():
            n = len(key)
            if n <= len(prompt) and tuple(prompt[:n]) == key and (best is None or n > len(best.token_ids)):
                best = item
        if best is None:
            return None, 0
        return best, min(len(best.token_ids), len(prompt) - 1)

    def clear(self) -> None:
        self._items.clear()
