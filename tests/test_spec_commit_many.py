"""A verification round's drafter commits in one call (`Drafter.commit_many`): the DFlash drafter's
batched ingest leaves the ring and the drafts as one-at-a-time commits do, a bad item fails alone,
a failing batched pass falls back to one item at a time, and the host work no longer grows by a
projection pass per request (ops counted on CPU; issue 31: the costed drafter's 22.6 ms a round).

Breakages tried: `RingAllocator.rows_batch` without the slot offset (caught by
test_batched_commits_match_one_at_a_time, test_spec_ring.py's wraparound test and the DFlash drafter
tests: reads find other positions' tags); the states
advanced before the writes in `_ingest_many` with the fallback on (caught by
test_a_failing_batched_pass_falls_back_per_item: positions double-counted)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spec_loop import one_thread  # noqa: F401
from test_spec_dflash import HIDDEN, feats, req  # noqa: F401

from dhisparse.models.tiny import build_tiny
from dhisparse.spec.dflash import DFlashDrafter
from dhisparse.spec.drafter import Commit, commit_each
from dhisparse.spec.factory import random_dflash_config
from dhisparse.spec.ngram import NgramDrafter
from dhisparse.spec.ring import DraftKVRing

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return build_tiny(seed=0)


def _drafter(target, n_requests: int = 6) -> DFlashDrafter:
    cfg = random_dflash_config(target, block_size=8, num_layers=2)
    return DFlashDrafter.random(cfg, target, seed=3, window=32, page=8, max_requests=n_requests)


def _admitted(d: DFlashDrafter, n: int) -> list[str]:
    ids = [f"r{i}" for i in range(n)]
    d.propose([req(rid, 10 + 3 * i, 4, d.capture_layers, seed=i) for i, rid in enumerate(ids)])
    return ids


def _round(d: DFlashDrafter, ids: list[str], seed: int) -> list[Commit]:
    """Each request accepts (i % 3) drafts: accepted + 1 feature rows."""
    return [Commit(rid, i % 3, feats(d.capture_layers, i % 3 + 1, seed + i)) for i, rid in enumerate(ids)]


def _state(d: DFlashDrafter) -> tuple:
    return (tuple(torch.cat(d.kv.k + d.kv.v).flatten().tolist()), tuple(d.kv.tags.flatten().tolist()),
            tuple((rid, s.num_context) for rid, s in sorted(d._states.items())))


def test_write_batch_is_write_per_slot():
    a, b = DraftKVRing(2, 3, 8, 1, 4), DraftKVRing(2, 3, 8, 1, 4)
    pos = [torch.arange(5, 9), torch.arange(0, 3), torch.arange(14, 16)]
    k = torch.randn(9, 1, 4)
    v = torch.randn(9, 1, 4)
    slots = [2, 0, 1]
    b.write_batch(slots, 1, pos, k, v)
    start = 0
    for s, p in zip(slots, pos):
        a.write(s, 1, p, k[start : start + len(p)], v[start : start + len(p)])
        start += len(p)
    assert all(torch.equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v)) and torch.equal(a.tags, b.tags)
    c = DraftKVRing(2, 3, 8, 1, 4)  # every layer at once: layer 0 gets its own values, layer 1 b's
    c.write_layers(slots, pos, [(v, k), (k, v)])
    b.write_batch(slots, 0, pos, v, k)
    assert all(torch.equal(x, y) for x, y in zip(b.k + b.v, c.k + c.v)) and torch.equal(b.tags, c.tags)
    with pytest.raises(ValueError, match="exceed R_d"):
        b.write_batch([0], 0, [torch.arange(9)], torch.zeros(9, 1, 4), torch.zeros(9, 1, 4))


def test_batched_commits_match_one_at_a_time(target):
    one, many = _drafter(target), _drafter(target)
    ids = _admitted(one, 5)
    assert _admitted(many, 5) == ids
    for r in range(3):
        items = _round(one, ids, 100 * r)
        assert commit_each(one, items) == [None] * 5
        assert many.commit_many(items) == [None] * 5
        a, b = _state(one), _state(many)
        assert a[1:] == b[1:]
        torch.testing.assert_close(torch.tensor(a[0]), torch.tensor(b[0]), rtol=1e-5, atol=1e-6)
    n = [s.num_context for _, s in sorted(one._states.items())]
    nxt = [req(rid, n[i], 4, one.capture_layers, new=0) for i, rid in enumerate(sorted(one._states))]
    assert [p.tokens for p in one.propose(nxt)] == [p.tokens for p in many.propose(nxt)]


def test_a_bad_item_fails_alone(target):
    d = _drafter(target)
    ids = _admitted(d, 3)
    before = {rid: s.num_context for rid, s in d._states.items()}
    items = _round(d, ids, 7)
    items[1] = Commit(ids[1], 2, feats(d.capture_layers, 1, 9))  # 1 row for 2 accepted drafts
    items.append(Commit("ghost", 0, feats(d.capture_layers, 1, 9)))
    errors = d.commit_many(items)
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], ValueError) and "accepted=2" in str(errors[1])
    assert isinstance(errors[3], KeyError)
    assert d._states[ids[1]].num_context == before[ids[1]]
    assert d._states[ids[0]].num_context == before[ids[0]] + 1 and d._states[ids[2]].num_context == before[ids[2]] + 3


def test_a_failing_batched_pass_falls_back_per_item(target, monkeypatch):
    """The batched pass fails inside its ring writes (after the projections): the items are then
    ingested one at a time, and every state ends as if each had been committed once."""
    d, ref = _drafter(target), _drafter(target)
    ids = _admitted(d, 4)
    _admitted(ref, 4)
    real = d.kv.write_layers

    def flaky(slots, positions, kv):
        if len(slots) > 1:
            raise RuntimeError("batched write failed")
        return real(slots, positions, kv)

    monkeypatch.setattr(d.kv, "write_layers", flaky)
    items = _round(d, ids, 11)
    assert d.commit_many(items) == [None] * 4
    assert ref.commit_many(items) == [None] * 4
    assert _state(d)[1:] == _state(ref)[1:]


def test_assertion_errors_propagate(target, monkeypatch):
    d = _drafter(target)
    ids = _admitted(d, 2)

    def broken(self, states, features):
        raise AssertionError("invariant")

    monkeypatch.setattr(DFlashDrafter, "_ingest_many", broken)
    with pytest.raises(AssertionError, match="invariant"):
        d.commit_many(_round(d, ids, 1))
    assert NgramDrafter().commit_many([Commit("x", 0), Commit("y", -1)])[0] is None


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _commit_ops(target, n: int, batched: bool) -> int:
    d = _drafter(target, n)
    ids = _admitted(d, n)
    items = _round(d, ids, 5)
    with _Ops() as ops:
        errors = d.commit_many(items) if batched else commit_each(d, items)
    assert errors == [None] * n
    return sum(ops.n.values())


def test_batched_commits_dispatch_one_projection_pass(target):
    """Ops of a round's commits (a host-time proxy): one at a time they grow by a projection pass
    per request; batched, by a few slicing ops per request."""
    each1, each6 = _commit_ops(target, 1, False), _commit_ops(target, 6, False)
    many1, many6 = _commit_ops(target, 1, True), _commit_ops(target, 6, True)
    per_each, per_many = (each6 - each1) / 5, (many6 - many1) / 5
    assert per_many * 4 < per_each, (per_each, per_many)
    assert many6 < each6 / 2


def test_ring_rows_of_a_round_take_no_repeat_interleave():
    """The round's ring rows (`RingAllocator.rows_batch`) are each position's slot offset plus its
    remainder, with the offsets built as a host list: no `repeat_interleave`, whose CPU kernel forks
    torch's thread pool for a few dozen rows (1.9-3.6 ms of a costed round's host time on the H100 host,
    session 45), and a fixed number of ops however many requests commit."""
    from dhisparse.spec.ring import RingAllocator

    alloc = RingAllocator(8, 16)

    def ops_for(n: int) -> collections.Counter:
        slots = list(range(n))[::-1]
        positions = [torch.arange(20 + i, 20 + i + 1 + i % 4) for i in range(n)]
        with _Ops() as ops:
            rows = alloc.rows_batch(slots, positions)
        want = torch.cat([alloc.rows(s, p) for s, p in zip(slots, positions)])
        assert torch.equal(rows, want)
        return ops.n

    few, many = ops_for(2), ops_for(7)
    assert "aten.repeat_interleave" not in many
    assert few == many, (few, many)
