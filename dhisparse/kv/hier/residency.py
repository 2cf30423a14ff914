"""Load-adaptive residency (paper §3.1): optional history pages that grow while memory is spare
and are reclaimed under pressure, with the orderings that keep it exact.

Optional pages hold complete pages of a request's prompt history in reclaimable pool capacity.
Each page is in one state:

  POPULATING --copy done--> READY --reclaim--> BACKING_UP --backup done--> DRAINING --readers done--> free
                                    (backed up)  ------------------------>  DRAINING

  A READY page may also carry a backup started ahead of need (`ahead`: under memory pressure the
  host copy of not-yet-backed pages runs while they stay published), so a later reclaim retires it
  with no copy on the admission path.

  READY / BACKING_UP pages are published (the resolver reads them directly); a page is published
  only after its copy completed, unpublished only after its host backup completed (I1), and freed
  only after every pass launched before the unpublish completed (I3). Accounting (eq. 3, I4):
  required + optional + reserve <= capacity, i.e. the pool's available pages never drop below the
  reserve because of optional allocations.

Copies are issued through a `CopyEngine` and complete later (`on_copy_done`), in any order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Protocol

from dhisparse.kv.memory.pool import PagePool


class PageState(Enum):
    POPULATING = "populating"
    READY = "ready"
    BACKING_UP = "backing_up"
    DRAINING = "draining"


@dataclass
class OptPage:
    page: int
    state: PageState
    epoch: int = 0
    cancelled: bool = False
    ahead: bool = False  # a backup issued by backup_ahead is in flight (the page stays READY)


@dataclass
class ReqResidency:
    """eligible: complete history pages that may be optional; backed: page indices with a
    complete host copy; pages: page index -> OptPage; remaining: expected tokens left."""

    eligible: int
    backed: set[int] = field(default_factory=set)
    pages: dict[int, OptPage] = field(default_factory=dict)
    remaining: int = 0
    admitted: int = 0
    released: bool = False


class CopyEngine(Protocol):
    def issue(self, kind: str, req: object, index: int, page: int) -> None:
        """Start copying page `index` of req: kind 'backup' (device page -> host) or 'populate'
        (host -> device page). Completion is reported through ResidencyManager.on_copy_done."""


def opt_owner(req: object) -> tuple[str, object]:
    return ("opt", req)


def order_remaining(reqs: dict[object, ReqResidency]) -> list[object]:
    """Default reclaim order: fewest expected remaining tokens first (ties: oldest admission).
    In a closed loop with an output cap these requests finish soonest, so taking their history
    costs the fewest future direct hits; whole requests are taken (eq. 4)."""
    return sorted(reqs, key=lambda r: (reqs[r].remaining, reqs[r].admitted))


def order_largest(reqs: dict[object, ReqResidency]) -> list[object]:
    """Most optional pages first: the fewest requests lose residency to cover a deficit."""
    return sorted(reqs, key=lambda r: -len(reqs[r].pages))


def order_newest(reqs: dict[object, ReqResidency]) -> list[object]:
    return sorted(reqs, key=lambda r: -reqs[r].admitted)


RECLAIM_ORDERS: dict[str, Callable[[dict], list]] = {"remaining": order_remaining, "largest": order_largest, "newest": order_newest}


class ResidencyManager:
    def __init__(self, pool: PagePool, reserve: int, copies: CopyEngine, order: str = "remaining", per_attempt: int = 4,
                 on_publish: Callable[[object, int, int], None] | None = None,
                 on_unpublish: Callable[[object, int], None] | None = None) -> None:
        if order not in RECLAIM_ORDERS:
            raise ValueError(f"reclaim_order must be one of {sorted(RECLAIM_ORDERS)}; got {order!r}")
        self.pool, self.reserve, self.copies, self.per_attempt = pool, reserve, copies, per_attempt
        self.order = RECLAIM_ORDERS[order]
        self.on_publish = on_publish or (lambda req, j, page: None)
        self.on_unpublish = on_unpublish or (lambda req, j: None)
        self.reqs: dict[object, ReqResidency] = {}
        self.launched = self.completed = 0
        self._admissions = 0
        self._rr: list[object] = []
        self.reclaimed = self.repopulated = 0  # pages, cumulative
        self._draining: dict[object, set[int]] = {}  # req -> indices of its DRAINING pages

    # -- registration ---------------------------------------------------------------------------
    def register(self, req: object, eligible: int, resident: dict[int, int], backed: set[int], remaining: int) -> None:
        """A request enters decode holding `resident` {page index: device page} (owned by req,
        rows valid); they become published optional pages; host copies exist for `backed`."""
        self._admissions += 1
        st = ReqResidency(eligible, set(backed), remaining=remaining, admitted=self._admissions)
        self.reqs[req] = st
        self.pool.transfer(req, opt_owner(req), list(resident.values()))
        for j, page in resident.items():
            st.pages[j] = OptPage(page, PageState.READY)
            self.on_publish(req, j, page)
        self._rr.append(req)

    def can_keep(self) -> bool:
        """A completed tail page may stay as optional history: a pool page beyond the reserve is
        free to replace it in the tail."""
        return self.pool.available - 1 >= self.reserve

    def keep(self, req: object, j: int, page: int) -> None:
        """Page index j of req, just completed in its tail and backed up to host (copy enqueued on
        the compute stream, so every later reader and the page's reuse are ordered after it), becomes
        a published optional page owned by ("opt", req); j joins the eligible history."""
        st = self.reqs[req]
        self.pool.transfer(req, opt_owner(req), [page])
        st.pages[j] = OptPage(page, PageState.READY)
        st.backed.add(j)
        st.eligible = max(st.eligible, j + 1)
        self.on_publish(req, j, page)

    def set_remaining(self, req: object, remaining: int) -> None:
        if req in self.reqs:
            self.reqs[req].remaining = remaining

    def release(self, req: object) -> None:
        """Request finished or aborted: unpublish everything; pages drain, in-flight copies are
        cancelled and drain when they complete."""
        st = self.reqs.get(req)
        if st is None:
            return
        for j, op in list(st.pages.items()):
            if op.state in (PageState.READY, PageState.BACKING_UP):
                self.on_unpublish(req, j)
            if op.state in (PageState.POPULATING, PageState.BACKING_UP) or op.ahead:
                op.cancelled = True
                if op.ahead:  # the copy still reads the page: it drains when the copy is done
                    op.state = PageState.BACKING_UP
            else:
                self._drain(req, j, op)
        st.eligible, st.remaining, st.released = 0, 0, True
        if req in self._rr:
            self._rr.remove(req)
        self._collect_req(req)

    # -- passes (readers) -------------------------------------------------------------------------
    def begin_pass(self) -> None:
        self.launched += 1

    def end_pass(self) -> None:
        self.completed = self.launched
        self.collect()

    # -- queries ----------------------------------------------------------------------------------
    def optional_pages(self) -> int:
        return sum(len(st.pages) for st in self.reqs.values())

    def reclaimable(self, req: object) -> list[int]:
        return [j for j, op in self.reqs[req].pages.items() if op.state is PageState.READY]

    def retiring(self) -> int:
        return sum(1 for st in self.reqs.values() for op in st.pages.values()
                   if op.state in (PageState.BACKING_UP, PageState.DRAINING) or op.cancelled)

    def coverage(self) -> tuple[int, int]:
        """(ready pages, eligible pages) over registered requests."""
        ready = sum(1 for st in self.reqs.values() for op in st.pages.values() if op.state is PageState.READY)
        return ready, sum(st.eligible for st in self.reqs.values())

    # -- reclaim (eq. 4) --------------------------------------------------------------------------
    def deficit(self, need: int) -> int:
        return max(0, need + self.reserve - self.pool.available)

    def reclaim(self, need: int) -> bool:
        """Make room for an admission needing `need` pages. Counts pages already retiring; walks
        requests in reclaim order taking whole requests' ready pages until the deficit is covered.
        Returns False (and reclaims nothing new) when the optional pages cannot cover it."""
        ready, retiring = self._tally()
        delta = self.deficit(need) - retiring
        if delta <= 0:
            return True
        if sum(ready.values()) < delta:  # every ready page together cannot cover it: wait
            return False
        chosen, total = [], 0
        for req in self.order({r: self.reqs[r] for r in ready}):
            chosen.append(req)
            total += ready[req]
            if total >= delta:
                break
        for req in chosen:
            self._retire_request(req)
        return True

    def _tally(self) -> tuple[dict[object, int], int]:
        """One pass over the optional pages: ({request: its READY pages} for requests with any,
        pages retiring) -- what `reclaimable` and `retiring` give, without a pass per request."""
        ready, retiring = {}, 0
        for req, st in self.reqs.items():
            k = 0
            for op in st.pages.values():
                if op.state is PageState.READY:
                    k += 1
                if op.state is PageState.BACKING_UP or op.state is PageState.DRAINING or op.cancelled:
                    retiring += 1
            if k:
                ready[req] = k
        return ready, retiring

    def _retire_request(self, req: object) -> None:
        st, pages = self.reqs[req], self.reclaimable(req)
        self.reclaimed += len(pages)
        for j in pages:
            op = st.pages[j]
            if j in st.backed:
                self.on_unpublish(req, j)
                self._drain(req, j, op)
            elif op.ahead:  # its backup is already in flight: completion retires it
                op.state = PageState.BACKING_UP
            else:
                op.state = PageState.BACKING_UP
                self.copies.issue("backup", req, j, op.page)

    def backup_ahead(self, limit: int) -> int:
        """Start host backups of up to `limit` READY pages that have none, in reclaim order (the
        pages a reclaim takes first are backed first); they stay published meanwhile. Called under
        memory pressure, it takes the backup off the admission path: a reclaim of a backed page only
        unpublishes it and waits for its readers. Returns the number of copies started."""
        started = 0
        for req in self.order({r: st for r, st in self.reqs.items() if not st.released}):
            st = self.reqs[req]
            todo = [j for j, op in st.pages.items() if op.state is PageState.READY and not op.ahead and j not in st.backed]
            for j in sorted(todo)[: limit - started]:
                op = st.pages[j]
                op.ahead = True
                self.copies.issue("backup", req, j, op.page)
                started += 1
            if started >= limit:
                return started
        return started

    # -- copy completion ------------------------------------------------------------------------
    def on_copy_done(self, kind: str, req: object, j: int) -> None:
        st = self.reqs[req]
        op = st.pages[j]
        if kind == "backup":
            st.backed.add(j)
            if op.ahead:
                op.ahead = False
                if op.state is PageState.READY:
                    return  # backed up ahead of need: stays published
            assert op.state is PageState.BACKING_UP
            if not op.cancelled:
                self.on_unpublish(req, j)
        else:
            assert op.state is PageState.POPULATING
            if not op.cancelled:
                op.state = PageState.READY
                self.on_publish(req, j, op.page)
                return
        op.cancelled = False
        self._drain(req, j, op)
        self._collect_req(req)

    # -- freeing ----------------------------------------------------------------------------------
    def _drain(self, req: object, j: int, op: OptPage) -> None:
        """Page j of req is unpublished (or never was): free once the passes launched so far end."""
        op.state, op.epoch = PageState.DRAINING, self.launched
        self._draining.setdefault(req, set()).add(j)

    def collect(self) -> None:
        for req in list(self._draining):
            self._collect_req(req)

    def _collect_req(self, req: object) -> None:
        """Free req's drained pages whose readers are done (only pages in DRAINING are visited)."""
        st, draining = self.reqs[req], self._draining.get(req, ())
        for j in [j for j in draining if st.pages[j].epoch <= self.completed]:
            self.pool.free(opt_owner(req), [st.pages.pop(j).page])
            draining.discard(j)
        if not draining:
            self._draining.pop(req, None)
        if not st.pages and st.released:
            del self.reqs[req]

    # -- repopulation -----------------------------------------------------------------------------
    def repopulate(self) -> int:
        """Bounded round-robin refill of missing, host-backed eligible pages while pages beyond
        the reserve are free; at most per_attempt pages. Returns pages started."""
        started = 0
        for _ in range(len(self._rr)):
            if started >= self.per_attempt or self.pool.available - 1 < self.reserve:
                break
            req = self._rr.pop(0)
            self._rr.append(req)
            st = self.reqs[req]
            if len(st.pages) >= st.eligible:  # nothing of its history is off the device
                continue
            missing = [j for j in range(st.eligible) if j not in st.pages and j in st.backed]
            for j in missing[: self.per_attempt - started]:
                if self.pool.available - 1 < self.reserve:
                    break
                page = self.pool.alloc(opt_owner(req), 1)[0]
                st.pages[j] = OptPage(page, PageState.POPULATING)
                self.copies.issue("populate", req, j, page)
                started += 1
                self.repopulated += 1
        return started

    def check(self) -> None:
        """I4: optional allocations never eat into the reserve; page bookkeeping matches the pool."""
        for req, st in self.reqs.items():
            owned = sorted(self.pool.owned_by(opt_owner(req)))
            assert owned == sorted(op.page for op in st.pages.values()), f"optional pages of {req!r} disagree with the pool"
            draining = {j for j, op in st.pages.items() if op.state is PageState.DRAINING}
            assert draining == self._draining.get(req, set()), f"draining pages of {req!r} disagree with their states"
