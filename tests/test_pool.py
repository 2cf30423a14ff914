"""PagePool: reservations, allocation, transfer, release and the integrity check (I4's pool half),
including a hypothesis run of random operations against a simple model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse.kv.memory.pool import PagePool, PoolExhausted


def test_reserve_alloc_release():
    pool = PagePool(10)
    assert pool.reserve("a", 6) and not pool.reserve("b", 5)
    assert pool.available == 4
    pages = pool.alloc("a", 4)  # inside a's reservation
    assert pool.available == 4 and pool.num_reserved == 2
    with pytest.raises(PoolExhausted):
        pool.alloc("b", 5)
    pool.transfer("a", ("opt", "a"), pages[:2])
    assert sorted(pool.owned_by(("opt", "a"))) == sorted(pages[:2])
    with pytest.raises(ValueError, match="not owned"):
        pool.free("a", pages[:1])
    assert pool.release("a") == 2 and pool.num_reserved == 0
    pool.check_integrity()


def test_integrity_check_catches_corruption():
    pool = PagePool(4)
    pool.alloc("a", 2)
    pool._free.append(pool.owned_by("a")[0])  # a page both free and owned
    with pytest.raises(AssertionError):
        pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "alloc", "free", "release"]), st.integers(0, 3), st.integers(0, 5)),
                max_size=40))
def test_random_operations_keep_the_pool_consistent(ops):
    pool, owned, reserved = PagePool(12), {}, {}
    for op, who, n in ops:
        if op == "reserve":
            ok = pool.reserve(who, n)
            assert ok == (n <= 12 - sum(len(v) for v in owned.values()) - sum(reserved.values()))
            if ok:
                reserved[who] = reserved.get(who, 0) + n
        elif op == "alloc":
            mine = reserved.get(who, 0)
            avail = 12 - sum(len(v) for v in owned.values()) - sum(reserved.values())
            if n - min(mine, n) > avail:
                with pytest.raises(PoolExhausted):
                    pool.alloc(who, n)
            else:
                owned.setdefault(who, []).extend(pool.alloc(who, n))
                reserved[who] = mine - min(mine, n)
        elif op == "free" and owned.get(who):
            pool.free(who, owned[who][:n])
            owned[who] = owned[who][n:]
        elif op == "release":
            pool.release(who)
            owned.pop(who, None)
            reserved.pop(who, None)
        pool.check_integrity()
        assert pool.usage().used == sum(len(v) for v in owned.values())
        assert pool.num_reserved == sum(reserved.values())
