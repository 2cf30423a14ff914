"""Page allocator with ownership tracking.

Pages are integer ids 0..num_pages-1; a page is free or owned by exactly one owner (a request
id or a named required allocation). `check_integrity()` asserts free + used == total and that
no page is owned twice (invariant I4's pool half).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class PoolExhausted(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


@dataclass(frozen=True)
class PoolUsage:
    """Pages: total, used (allocated), reserved (promised, not yet allocated), permanent (held
    for the pool's life: the staging arena, the step graphs' scratch; counted in used)."""

    total: int
    used: int
    reserved: int
    permanent: int = 0

    @property
    def free(self) -> int:
        return self.total - self.used


class PagePool:
    """Free-list page allocator. Reservations promise pages to an owner without allocating them,
    so lazy allocation inside a reservation can never fail."""

    def __init__(self, num_pages: int, name: str = "pages") -> None:
        if num_pages < 1:
            raise ValueError(f"{name}: the pool needs at least one page, got {num_pages}")
        self.name, self.num_pages = name, num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owner: dict[int, object] = {}
        self._reserved: dict[object, int] = {}
        self._permanent: set[object] = set()  # owners whose pages are held for the pool's life
        self._permanent_pages = 0  # pages they own (an int: `capacity` is read off the engine thread)

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reserved(self) -> int:
        return sum(self._reserved.values())

    @property
    def available(self) -> int:
        """Pages neither allocated nor promised by a reservation."""
        return len(self._free) - self.num_reserved

    def usage(self) -> PoolUsage:
        return PoolUsage(self.num_pages, len(self._owner), self.num_reserved, self._permanent_pages)

    @property
    def capacity(self) -> int:
        """Pages a request could ever hold: the pool less the pages held for good (`alloc_permanent`).
        O(1) and reads no container the engine thread mutates (the server validates requests on
        other threads)."""
        return self.num_pages - self._permanent_pages

    def owned_by(self, owner: object) -> list[int]:
        return [p for p, o in self._owner.items() if o == owner]

    # -- reservations ----------------------------------------------------------------------------
    def reserve(self, owner: object, n: int) -> bool:
        """Promise n more pages to owner; False (nothing changes) if they are not available."""
        if n > self.available:
            return False
        self._reserved[owner] = self._reserved.get(owner, 0) + n
        return True

    def unreserve(self, owner: object) -> None:
        self._reserved.pop(owner, None)

    def shrink_reservation(self, owner: object, n: int) -> int:
        """Give back up to n pages of owner's reservation (it will not need them); returns how many."""
        held = self._reserved.get(owner, 0)
        n = min(max(n, 0), held)
        if n:
            self._reserved[owner] = held - n
        return n

    # -- allocation ------------------------------------------------------------------------------
    def alloc(self, owner: object, n: int, spare: bool = False) -> list[int]:
        """Allocate n pages to owner, drawing on its reservation first (with `spare`, only on
        pages beyond every reservation: the reservation stays whole for what it was made for)."""
        held = 0 if spare else self._reserved.get(owner, 0)
        from_res = min(held, n)
        if n - from_res > self.available:
            raise PoolExhausted(f"{self.name}: asked for {n} pages, {self.available} available")
        if from_res:
            self._reserved[owner] = held - from_res
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def alloc_permanent(self, owner: object, n: int) -> list[int]:
        """Allocate n pages held for the pool's life (staging arena, step-graph scratch): they are
        left out of `capacity`, which admission validation compares a request with."""
        self._permanent.add(owner)
        pages = self.alloc(owner, n)
        self._permanent_pages += n
        return pages

    def transfer(self, owner: object, new_owner: object, pages: list[int]) -> None:
        """Hand allocated pages from owner to new_owner (no page is freed or taken)."""
        for p in pages:
            if self._owner.get(p) != owner:
                raise ValueError(f"{self.name}: page {p} is not owned by {owner!r}")
            self._owner[p] = new_owner
        self._permanent_pages += len(pages) * ((new_owner in self._permanent) - (owner in self._permanent))

    def count_owned(self, pred) -> int:
        """Number of allocated pages whose owner satisfies pred."""
        return sum(1 for o in self._owner.values() if pred(o))

    def free(self, owner: object, pages: list[int]) -> None:
        for p in pages:
            if self._owner.get(p) != owner:
                raise ValueError(f"{self.name}: page {p} is not owned by {owner!r}")
            del self._owner[p]
            self._free.append(p)
        if owner in self._permanent:
            self._permanent_pages -= len(pages)

    def release(self, owner: object) -> int:
        """Free every page of owner and drop its reservation; returns pages freed."""
        pages = self.owned_by(owner)
        self.free(owner, pages)
        self.unreserve(owner)
        return len(pages)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: a page is free twice"
        assert not free & self._owner.keys(), f"{self.name}: a page is free and owned"
        assert len(free) + len(self._owner) == self.num_pages, f"{self.name}: pages lost"
        assert self.num_reserved <= len(self._free), f"{self.name}: reservations exceed free pages"
        assert self._permanent_pages == self.count_owned(lambda o: o in self._permanent), f"{self.name}: permanent pages miscounted"
