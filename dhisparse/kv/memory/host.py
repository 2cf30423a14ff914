"""Host backing store: every immutable latent row of every request has a host copy (I1).

Host rows live in a host arena of pages `[HP, L, page_size, latent_dim]` (pinned at its exact
size when CUDA is available, a plain tensor on CPU: same code path). Index keys never go to host (the indexer
scores the whole history on device).

  host table of request r: [h0, h1, ...]   position t -> host location h[t // ps] * ps + t % ps

Shared pages: an immutable page sequence (a stored prompt prefix) is written to host pages once
(`share`, owned by ("shared", key)); a request whose first positions are that prefix *borrows* the
leading pages (`borrow`): its table starts with them, it reads them like its own, and it never
writes or frees them. Its hand-off and backups then skip those positions (their host copy exists:
I1 holds from admission on), and its host reservation shrinks by the pages borrowed.

  positions  0 .............. b*ps | b*ps ....................
  table      shared[key][:b]        | pages owned by the request
"""

from __future__ import annotations

from typing import Callable

import torch

from dhisparse.core.rows import cdiv
from dhisparse.kv.memory.pinned import pinned_zeros
from dhisparse.kv.memory.pool import PagePool


class HostStore:
    def __init__(self, num_pages: int, num_layers: int, page_size: int, width: int, dtype: torch.dtype, pin: bool, device: str = "cpu") -> None:
        self.page_size = page_size
        shape = (num_pages, num_layers, page_size, width)
        # pinned at its exact size (kv/memory/pinned.py): torch's pinned allocator would round up to 2^n
        self.rows = pinned_zeros(shape, dtype) if pin else torch.zeros(shape, dtype=dtype, device=device)
        self.pool = PagePool(num_pages, "host pages")
        self.tables: dict[object, list[int]] = {}
        self.shared: dict[object, list[int]] = {}  # key -> its host pages (owned by ("shared", key))
        self.borrowed: dict[object, tuple[object, int]] = {}  # req -> (key, leading pages borrowed)
        self._shared_pages: set[int] = set()
        self._prepaid: dict[object, int] = {}  # req -> pages its admission did not reserve (to borrow)
        self._stale: set[object] = set()  # keys freed once their last borrower is (`unshare`)

    @property
    def page_nbytes(self) -> int:
        return self.rows[0].numel() * self.rows.element_size()

    def layer_rows(self, layer: int) -> torch.Tensor:
        """[HP, page_size, width] host row space of `layer`."""
        return self.rows[:, layer]

    def admit(self, req: object, max_tokens_total: int, prepaid: int = 0) -> bool:
        """Reserve req's host pages; `prepaid`: leading pages it will borrow from an already shared
        prefix (`borrow`), which it does not reserve."""
        if not self.pool.reserve(req, cdiv(max_tokens_total, self.page_size) - prepaid):
            return False
        self.tables[req] = []
        self._prepaid[req] = prepaid
        return True

    def ensure(self, req: object, n_tokens: int) -> None:
        table = self.tables[req]
        need = cdiv(n_tokens, self.page_size) - len(table)
        if need > 0:
            table.extend(self.pool.alloc(req, need))

    def free(self, req: object) -> None:
        """Release req's own pages and reservation (borrowed pages stay with their key)."""
        self.pool.release(req)
        self.tables.pop(req, None)
        self._prepaid.pop(req, None)
        key, _ = self.borrowed.pop(req, (None, 0))
        if key in self._stale:
            self._collect(key)

    # -- shared pages ------------------------------------------------------------------------------
    def share(self, key: object, count: int, fill: Callable[[list[int]], None]) -> list[int] | None:
        """`count` host pages holding key's rows, written once by `fill(pages)` and kept for
        requests to borrow; None when the pool has not `count` pages beyond its reservations
        (requests then keep private copies)."""
        if key in self.shared:
            return self.shared[key]
        if count < 1 or count > self.pool.available:
            return None
        self._stale.discard(key)
        pages = self.pool.alloc(("shared", key), count)
        fill(pages)
        self.shared[key] = pages
        self._shared_pages.update(pages)
        return pages

    def borrow(self, req: object, key: object, count: int,
               share: tuple[int, Callable[[list[int]], None]] | None = None) -> int:
        """req's positions 0 .. count*ps - 1 are key's first `count` pages (req has no host page
        yet): its table starts with them and it reserves as many pages fewer. share = (pages,
        fill): share key first if it is not shared yet, counting the pages req stops reserving as
        free (so the first importer of a prefix can share it in a pool its own reservation
        fills). Returns the pages borrowed (0: key is not shared)."""
        if self.tables[req]:
            raise RuntimeError(f"request {req!r} already has host pages; it can borrow only before its first")
        prepaid = self._prepaid.pop(req, 0)
        freed = self.pool.shrink_reservation(req, count - prepaid)
        if share is not None:
            self.share(key, *share)
        count = self.borrowable(key, count)
        self._adjust(req, prepaid + freed - count)  # reservation: the pages req still has to own
        if count < 1:
            return 0
        self.tables[req].extend(self.shared[key][:count])
        self.borrowed[req] = (key, count)
        return count

    def _adjust(self, req: object, more: int) -> None:
        """Reserve `more` pages for req (give back -more when negative)."""
        if more < 0:
            self.pool.shrink_reservation(req, -more)
        elif more and not self.pool.reserve(req, more):  # the pages just shrunk away or prepaid for a shared key
            raise RuntimeError(f"host pages promised to {req!r} were taken while it borrowed")

    def unshare(self, key: object) -> None:
        """No new request should borrow key's pages (its prefix was replaced): free them now if
        nobody borrows them, else when the last borrower is freed."""
        if key in self.shared:
            self._stale.add(key)
            self._collect(key)

    def _collect(self, key: object) -> None:
        if any(k == key for k, _ in self.borrowed.values()):
            return
        pages = self.shared.pop(key)
        self._shared_pages.difference_update(pages)
        self.pool.free(("shared", key), pages)
        self._stale.discard(key)

    def borrowable(self, key: object, count: int) -> int:
        """Pages a request importing `count` complete pages of key would borrow now."""
        return min(count, len(self.shared.get(key, [])))

    def borrowed_pages(self, req: object) -> int:
        """Leading table entries of req that are shared pages (never written or freed by req)."""
        return self.borrowed.get(req, (None, 0))[1]

    def is_shared(self, page: int) -> bool:
        return page in self._shared_pages

    def locations(self, req: object, start: int, end: int) -> torch.Tensor:
        """[end - start] host locations of positions start..end-1 (pages must exist)."""
        ps = self.page_size
        pos = torch.arange(start, end)
        table = torch.tensor(self.tables[req], dtype=torch.int64)
        return table[pos // ps] * ps + pos % ps

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        for key, pages in self.shared.items():
            assert sorted(self.pool.owned_by(("shared", key))) == sorted(pages), f"shared pages of {key!r} lost"
        for req, table in self.tables.items():
            key, b = self.borrowed.get(req, (None, 0))
            assert table[:b] == self.shared.get(key, [])[:b], f"borrowed pages of {req!r} are not its key's"
            assert sorted(self.pool.owned_by(req)) == sorted(table[b:]), f"host table of {req!r} disagrees with its pool"
