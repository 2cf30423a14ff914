"""A stored prefix's rows as shared host pages, borrowed by the requests that import it.

Under the hierarchy every committed row needs a host copy (I1). A request that imports a stored
prefix (kv/memory/prefix_store.py) used to get that copy by backing its imported rows up again at the hand-off
(hisparse) or at reclaim (adaptive): the same bytes, 2.9 GB per 32K admission of the scaled GLM
model, copied device -> host once per request. Instead the prefix's complete pages are written to
host pages once (`HostStore.share`, from the prefix's page layout: the very bytes every import
copies to the device) and each importing request borrows them (`HostStore.borrow`):

  prefix        positions 0 ..................... m*ps | m*ps .. len-1 (partial page: not shared)
  request       positions 0 .......... b*ps | b*ps .. n-1 (imported) | n .. (prefilled, decoded)
  host table    shared pages 0 .. b-1       | pages the request owns
                b = n // ps complete imported pages (b <= m)

The borrowed positions already have their host copy when the request is admitted, so the
hand-off copies none of them and adaptive residency registers them as backed (a reclaim frees
them without a copy). Nothing ever writes a shared page (`HierarchicalKV._copy_runs` refuses).
When the host pool has no room for a prefix's pages beyond the requests' reservations, requests
keep private copies as before (logged once per prefix).
"""

from __future__ import annotations

import logging

import torch

from dhisparse.kv.memory.host import HostStore

log = logging.getLogger("dhisparse.kv")


class PrefixPages:
    """Shares stored prefixes into one host store (keys: small ints, one per prefix item; an item
    is kept alive while it has a key, so its id names it)."""

    def __init__(self, host: HostStore, page_size: int, index_page_size: int, index_split: int = 0) -> None:
        """index_split: the arena's index layout (`KVArena.index_split`), so a prefix is paged once
        in the layout its importers copy (`StoredPrefix.paged` keeps one host copy per layout)."""
        self.host, self.page_size, self.index_page_size, self.index_split = host, page_size, index_page_size, index_split
        self._keys: dict[int, tuple[object, int]] = {}  # id(item) -> (item, key); the item is kept alive
        self._refused: set[int] = set()
        self._next = 0

    def borrow(self, req: object, item, n: int) -> int:
        """req imported positions 0 .. n-1 of `item` and has no host page yet: its complete
        imported pages become borrowed shared pages. Returns how many (0: none shared)."""
        full = n // self.page_size
        count = len(item.token_ids) // self.page_size
        if full < 1 or count < 1:
            return 0
        key = self._key(item)
        got = self.host.borrow(req, key, min(full, count), share=(count, lambda pages: self._fill(item, pages)))
        if not got and key not in self._refused:
            self._refused.add(key)
            log.info("prefix of %d tokens not shared on host: %d host pages are not free beyond "
                     "reservations; its importers back it up privately", len(item.token_ids), count)
        return got

    def borrowable(self, item, n: int) -> int:
        """Host pages a request importing n rows of `item` would borrow if admitted now (0 until
        the prefix is shared): its admission reserves that many fewer."""
        return self.host.borrowable(self._key(item), n // self.page_size)  # a new item retires replaced ones

    def _key(self, item) -> int:
        """item's key. A new item with the token ids of older ones replaced them in the prefix
        store (a prefix prepared again): their pages are no longer borrowed by new importers and
        are freed once their borrowers are (its bytes may differ, so they are never reused for it)."""
        entry = self._keys.get(id(item))
        if entry is None or entry[0] is not item:
            for old_id, (old, key) in list(self._keys.items()):
                if old.token_ids == item.token_ids:
                    self.host.unshare(key)
                    del self._keys[old_id]
            self._next += 1
            entry = self._keys[id(item)] = (item, self._next)
        return entry[1]

    def _fill(self, item, pages: list[int]) -> None:
        """Host pages <- the prefix's first len(pages) pages, from its page layout [NP, L, ps, d]."""
        paged = item.paged(self.page_size, self.index_page_size, self.index_split)
        idx = torch.tensor(pages, dtype=torch.int64, device=self.host.rows.device)
        self.host.rows.index_copy_(0, idx, paged.latent[: len(pages)].to(self.host.rows.device))
