"""Hypothesis state machine of the residency manager against a simple model.

Copies complete in any order (the test picks which); passes (readers) begin and end; tail pages
complete and stay as optional history when `can_keep` allows. After every transition: I1 (every
eligible page of a live request is published with valid data or has a complete host copy), I3 (a
page is published only after its copy completed and freed only after its backup and every reader
launched while it was published completed), I4 (the manager's pages match the pool) and eq. 3
(required + optional + reserve <= capacity: the free pages never drop below the reserve). Each
admission checks eq. 4: it reclaims exactly the first q requests of the reclaim order whose ready
pages cover the deficit, and reclaims nothing (and waits) when all ready pages cannot; each refill
starts at most `per_attempt` pages, beginning with the next request of the round-robin.
`test_breakages_are_caught` applies three breakages (reclaim every request, refill without bound or
reserve, `can_keep` without the reserve) and shows the machine fails on each.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from dhisparse.kv.hier.residency import OptPage, PageState, ResidencyManager
from dhisparse.kv.memory.pool import PagePool

CAPACITY, RESERVE = 24, 2


class FakeCopies:
    def __init__(self) -> None:
        self.pending: list[tuple[str, object, int, int]] = []

    def issue(self, kind, req, index, page):
        self.pending.append((kind, req, index, page))


class ResidencyMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.pool = PagePool(CAPACITY)
        self.copies = FakeCopies()
        self.data: dict[int, tuple] = {}  # device page -> (req, index) it holds
        self.published: dict[tuple, int] = {}  # (req, index) -> page
        self.reader_snapshots: list[set[int]] = []  # pages published when an in-flight pass began
        self.mgr = ResidencyManager(self.pool, RESERVE, self.copies, "remaining", per_attempt=3,
                                    on_publish=self._publish, on_unpublish=self._unpublish)
        free = self.pool.free

        def checked_free(owner, pages):
            for p in pages:
                assert not any(p in snap for snap in self.reader_snapshots), "I3: page freed under a reader"
                assert not any(c[3] == p for c in self.copies.pending), "I3: page freed with a copy in flight"
                self.data.pop(p, None)
            free(owner, pages)

        self.pool.free = checked_free
        self.live: dict[str, int] = {}
        self.n = 0
        self.releasing = None

    def _publish(self, req, j, page):
        assert not any(c[3] == page and c[0] == "populate" for c in self.copies.pending), "I3: published before copy done"
        assert self.data.get(page) == (req, j), "I2: published page holds the wrong rows"
        self.published[(req, j)] = page

    def _unpublish(self, req, j):
        if req != self.releasing:  # a finished request needs no host copy
            assert j in self.mgr.reqs[req].backed, "I1: unpublished a page without a host copy"
        self.published.pop((req, j), None)

    def _ready(self) -> dict:
        return {r: sum(op.state is PageState.READY for op in st_.pages.values()) for r, st_ in self.mgr.reqs.items()}

    def _expected_q(self, need: int) -> list | None:
        """Eq. 4: the first q requests of the reclaim order whose ready pages cover the deficit
        ([] when none is needed, None when all ready pages together cannot: the admission waits)."""
        ready = {r: k for r, k in self._ready().items() if k}
        delta = self.mgr.deficit(need) - self.mgr.retiring()
        if delta <= 0:
            return []
        if sum(ready.values()) < delta:
            return None
        chosen, total = [], 0
        for r in self.mgr.order({r: self.mgr.reqs[r] for r in ready}):
            chosen.append(r)
            total += ready[r]
            if total >= delta:
                return chosen
        return chosen

    @rule(eligible=st.integers(0, 6), on_host=st.integers(0, 6), remaining=st.integers(0, 50))
    def admit(self, eligible, on_host, remaining):
        """A request with `eligible` history pages, the last `on_host` of them only on host (e.g.
        a prefix's shared host pages): the rest are resident, plus one required page."""
        on_host = min(on_host, eligible)
        resident = eligible - on_host
        need = resident + 1
        before, q = self._ready(), self._expected_q(need)
        ok = self.mgr.reclaim(need)
        after = self._ready()
        assert ok == (q is not None), "eq. 4: reclaim must refuse exactly when ready pages cannot cover the deficit"
        taken = {r for r in before if before[r] and not after.get(r)}
        untouched = {r for r in before if r not in (q or []) and after.get(r, 0) == before[r]}
        assert taken == set(q or []), f"eq. 4: reclaimed {sorted(taken)}, the minimal prefix is {q}"
        assert untouched == {r for r in before if r not in (q or [])}, "eq. 4: a request past the prefix lost pages"
        if not ok or self.mgr.deficit(need) > 0:
            return  # the admission waits
        req = f"r{self.n}"
        self.n += 1
        pages = self.pool.alloc(req, need)
        for j, p in enumerate(pages[:resident]):
            self.data[p] = (req, j)
        self.live[req] = pages[-1]
        self.mgr.register(req, eligible, dict(enumerate(pages[:resident])), set(range(resident, eligible)), remaining)

    @precondition(lambda self: self.copies.pending)
    @rule(pick=st.integers(0, 1000))
    def complete_copy(self, pick):
        kind, req, j, page = self.copies.pending.pop(pick % len(self.copies.pending))
        if kind == "populate":
            self.data[page] = (req, j)
        self.mgr.on_copy_done(kind, req, j)

    @rule()
    def begin_pass(self):
        if not self.reader_snapshots:
            self.mgr.begin_pass()
            self.reader_snapshots.append(set(self.published.values()))

    @rule()
    def end_pass(self):
        self.reader_snapshots.clear()
        self.mgr.end_pass()

    @rule()
    def repopulate(self):
        def missing(r):
            st_ = self.mgr.reqs[r]
            return any(j not in st_.pages and j in st_.backed for j in range(st_.eligible))

        head = next((r for r in self.mgr._rr if missing(r)), None)
        before = {r: set(st_.pages) for r, st_ in self.mgr.reqs.items()}
        room = self.pool.available - RESERVE > 0
        started = self.mgr.repopulate()
        assert started <= self.mgr.per_attempt, "refill bound: more pages than per_attempt in one attempt"
        if head is not None and room:  # round robin: the next request in the rotation is served first
            assert set(self.mgr.reqs[head].pages) - before[head], f"round robin: {head} was skipped"

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000))
    def complete_tail(self, pick):
        """A request's tail page completes (backed up to host); it stays as optional history when
        a page beyond the reserve can replace it in the tail, else the tail page is reused."""
        req = sorted(self.live)[pick % len(self.live)]
        if not self.mgr.can_keep():
            return
        j = self.mgr.reqs[req].eligible
        old = self.live[req]
        self.data[old] = (req, j)
        self.live[req] = self.pool.alloc(req, 1)[0]
        self.mgr.keep(req, j, old)

    @rule(limit=st.integers(1, 4))
    def backup_ahead(self, limit):
        self.mgr.backup_ahead(limit)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1000))
    def finish(self, pick):
        req = sorted(self.live)[pick % len(self.live)]
        self.releasing = req
        self.mgr.release(req)
        self.releasing = None
        self.pool.free(req, [self.live.pop(req)])

    @invariant()
    def invariants(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check()
        assert self.pool.available >= RESERVE, "eq. 3: required + optional + reserve exceeds the pool"
        self.pool.check_integrity()
        for req in self.live:
            st_ = self.mgr.reqs[req]
            for j in range(st_.eligible):  # I1
                published = (req, j) in self.published
                assert published or j in st_.backed, f"I1: {req} page {j} neither ready nor backed"
                if published:
                    assert self.data[self.published[(req, j)]] == (req, j)


ResidencyMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestResidencyMachine = ResidencyMachine.TestCase


def _reclaim_every_request(self, need):
    ready, retiring = self._tally()
    if self.deficit(need) - retiring <= 0:
        return True
    for req in self.order({r: self.reqs[r] for r in ready}):  # no stop once the deficit is covered
        self._retire_request(req)
    return True


def _refill_without_bound(self):
    started = 0
    for req in list(self._rr):
        st_ = self.reqs[req]
        for j in [j for j in range(st_.eligible) if j not in st_.pages and j in st_.backed]:
            if self.pool.available < 1:
                return started
            page = self.pool.alloc(("opt", req), 1)[0]
            st_.pages[j] = OptPage(page, PageState.POPULATING)
            self.copies.issue("populate", req, j, page)
            started += 1
    return started


BREAKAGES = {
    "reclaim every request, not the first q": ("reclaim", _reclaim_every_request),
    "refill without bound, ignoring the reserve": ("repopulate", _refill_without_bound),
    "can_keep ignoring the reserve": ("can_keep", lambda self: self.pool.available - 1 >= 0),
}


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_breakages_are_caught(name, monkeypatch):
    method, broken = BREAKAGES[name]
    monkeypatch.setattr(ResidencyManager, method, broken)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(ResidencyMachine, settings=settings(  # no shrinking: finding the bug is the test
            max_examples=300, stateful_step_count=40, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck), print_blob=False, report_multiple_bugs=False,
            phases=[Phase.explicit, Phase.reuse, Phase.generate]))


def test_backup_ahead_takes_the_copy_off_the_reclaim():
    """Pages backed up ahead stay published while the copy runs; a reclaim afterwards retires them
    with no new copy, and they drain after the readers of the pass that saw them."""
    pool, copies = PagePool(10), FakeCopies()
    unpublished = []
    mgr = ResidencyManager(pool, 1, copies, on_unpublish=lambda r, j: unpublished.append((r, j)))
    pages = pool.alloc("a", 6)
    mgr.register("a", 6, dict(enumerate(pages)), set(), remaining=5)
    assert mgr.backup_ahead(4) == 4 and mgr.backup_ahead(4) == 2 and mgr.backup_ahead(4) == 0
    assert not unpublished and mgr.coverage() == (6, 6)  # still published while backing up
    for kind, req, j, _ in copies.pending[:5]:
        mgr.on_copy_done(kind, req, j)
    copies.pending = copies.pending[5:]
    assert mgr.reqs["a"].backed == {0, 1, 2, 3, 4} and mgr.coverage() == (6, 6)
    mgr.begin_pass()
    assert mgr.reclaim(8)  # needs all six pages: five retire at once, the sixth's copy is in flight
    assert not copies.pending[1:] and len(unpublished) == 5 and mgr.retiring() == 6
    kind, req, j, _ = copies.pending.pop()
    mgr.on_copy_done(kind, req, j)
    assert len(unpublished) == 6
    free = pool.available
    mgr.end_pass()
    assert pool.available == free + 6


def test_release_during_an_ahead_backup_waits_for_the_copy():
    pool, copies = PagePool(6), FakeCopies()
    mgr = ResidencyManager(pool, 0, copies)
    pages = pool.alloc("a", 2)
    mgr.register("a", 2, dict(enumerate(pages)), set(), remaining=5)
    mgr.backup_ahead(1)
    mgr.release("a")
    assert pool.available == 5  # page 1 drained at once; page 0 is still read by its copy
    kind, req, j, _ = copies.pending.pop()
    mgr.on_copy_done(kind, req, j)
    mgr.collect()
    assert pool.available == 6 and "a" not in mgr.reqs
