"""Hypothesis state machine of the residency manager against a simple model.

Copies complete in any order (the test picks which); passes (readers) begin and end. After every
transition: I1 (every eligible page of a live request is published with valid data or has a
complete host copy), I3 (a page is published only after its copy completed and freed only after
its backup and every reader launched while it was published completed) and I4 (optional pages
never eat into the reserve; the manager's pages match the pool).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dhisparse.kv.memory.pool import PagePool
from dhisparse.kv.hier.residency import ResidencyManager

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

    @rule(eligible=st.integers(0, 6), remaining=st.integers(0, 50))
    def admit(self, eligible, remaining):
        need = eligible + 1  # eligible history pages + one required page
        if not self.mgr.reclaim(need) or self.mgr.deficit(need) > 0:
            return  # the admission waits
        req = f"r{self.n}"
        self.n += 1
        pages = self.pool.alloc(req, need)
        for j, p in enumerate(pages[:eligible]):
            self.data[p] = (req, j)
        self.live[req] = pages[-1]
        self.mgr.register(req, eligible, dict(enumerate(pages[:eligible])), set(), remaining)

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
        self.mgr.repopulate()

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
        assert self.pool.available >= 0
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
