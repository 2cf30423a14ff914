"""Prefix KV store: prepared prompt prefixes whose KV a request imports instead of recomputing.

The paper's closed-loop benchmark gives every request the same long input from a prepared prefix,
with independent decode KV per request: each admitted request imports a *private copy* of the
prefix rows into its device pages. Stored rows live on the host (pinned when CUDA is available);
under the hierarchy the prefix's complete pages are also written to the host store once and
borrowed by every importer as its host copy (kv/hier/prefix_pages.py). A store whose KV is not
rows by position keeps its own item beside them (`put`; DeepSeek-V4: kv/v4/prefix.py `V4Prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class PagedPrefix(NamedTuple):
    """A stored prefix in the KV pools' page layout, so an import copies whole pages:
    latent [NP, L, ps, d] (page j holds positions j*ps .. j*ps+ps-1 of every layer), index
    [NI, F, ips, iD] (or [NI, F, ips * Wi] in the split FP8 layout); the last page is zero-padded. Host tensors (pinned with the store)."""

    latent: torch.Tensor
    index: torch.Tensor


def to_pages(rows: torch.Tensor, per_page: int, pin: bool) -> torch.Tensor:
    """rows [X, n, d] -> [cdiv(n, per_page), X, per_page, d] (zero padding past n)."""
    X, n, d = rows.shape
    full = n // per_page
    out = torch.zeros((-(-n // per_page), X, per_page, d), dtype=rows.dtype, pin_memory=pin)
    if full:
        out[:full] = rows[:, : full * per_page].reshape(X, full, per_page, d).transpose(0, 1)
    if n > full * per_page:
        out[full, :, : n - full * per_page] = rows[:, full * per_page :]
    return out


@dataclass(frozen=True)
class StoredPrefix:
    """token_ids (n,); latent [L, n, latent_dim]; index [F, n, index_head_dim] (host tensors);
    features {layer: [f, hidden]}: target hidden states of the last f positions (for a drafter's
    window), empty without speculation.

    whole_prompt: the KV of one request's whole prompt, computed elsewhere (prefill/decode
    disaggregation, engine/disagg.py): that request alone imports all n rows and decodes from
    position n at once (the hand-off's end state, `HierarchicalKV._import_prompt`); never kept in
    a `PrefixStore` nor shared on host. `PrefixStore.match` never offers a whole prompt (its last
    token runs for logits), so only such an item is imported whole by a request of n tokens."""

    token_ids: tuple[int, ...]
    latent: torch.Tensor
    index: torch.Tensor
    features: dict = field(default_factory=dict)
    whole_prompt: bool = False
    _paged: dict = field(default_factory=dict, compare=False, repr=False)  # (ps, ips) -> PagedPrefix

    @property
    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size() + self.index.numel() * self.index.element_size()

    def paged(self, page_size: int, index_page_size: int, index_split: int = 0) -> PagedPrefix:
        """This prefix in page layout (built once per page geometry, then kept: a second host
        copy of the prefix, pinned like the first). index_split D > 0: index pages in the arena's
        split FP8 layout ([NI, F, ips * Wi]: every key's D values, then their scales)."""
        key = (page_size, index_page_size, index_split)
        if key not in self._paged:
            pin = self.latent.is_pinned()
            index = to_pages(self.index, index_page_size, pin)
            if index_split:
                NI, F, ips, W = index.shape  # explicit sizes: an empty prefix has NI = 0
                index = torch.cat([index[..., :index_split].reshape(NI, F, ips * index_split),
                                   index[..., index_split:].reshape(NI, F, ips * (W - index_split))], -1)
                index = index.pin_memory() if pin else index
            self._paged[key] = PagedPrefix(to_pages(self.latent, page_size, pin), index)
        return self._paged[key]


class PrefixStore:
    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._items: dict[tuple[int, ...], Any] = {}  # StoredPrefix, or a store's own item (`put`)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, token_ids: list[int], latent: torch.Tensor, index: torch.Tensor, features: dict | None = None) -> StoredPrefix:
        lat, idx = latent.cpu(), index.cpu()
        if self.pin:
            lat, idx = lat.pin_memory(), idx.pin_memory()
        item = StoredPrefix(tuple(token_ids), lat, idx, {l: f.cpu() for l, f in (features or {}).items()})
        self._items[item.token_ids] = item
        return item

    def put(self, item: Any) -> Any:
        """Keep a store's own prefix item (`KVStore.export_prefix`: host tensors, a `token_ids`
        tuple and `features`, e.g. kv/v4/prefix.py `V4Prefix`), matched like a `StoredPrefix`."""
        self._items[tuple(item.token_ids)] = item
        return item

    def get(self, token_ids: list[int]) -> StoredPrefix | None:
        """The stored prefix of exactly these tokens, if any."""
        return self._items.get(tuple(token_ids))

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
