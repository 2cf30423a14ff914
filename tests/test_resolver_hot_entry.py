"""The `hot_entry` index (position -> hot entry, the inverse of hot_pos): the plan kernel's lookup of
hits in place of the hot-cache scan (resolver_one.py, MAP), against the PyTorch reference bit for bit
(TRITON_INTERPRET on CPU), with the index compared after every call. Unions with duplicates run in
test_resolver_kernel.py's `test_random_against_reference[index]`.

Breakages tried (each fails a test here): P4d not unmapping the victim's old position; P4d mapping
the miss to entry 0; the hit flags not cleared before P1 (stale flags protect slots); a direct row
that also has a hot entry counted as a hit (direct first, as the reference); duplicates each taken as
a hit (the lookup's representative test dropped); hits' stamps not refreshed; the misses' mask
without its `h < 0` term; and in the chunked path (`_entries`), a direct row taken as a hit, the hit
row not cleared, hits' stamps not refreshed. The store's upkeep (promotion not reindexing or not
unmapping, `close_slot` not clearing) fails the engine runs' debug check (test_staging_paper,
test_hierarchy).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402
from test_resolver_kernel import DEV, Pair, fill_hot, random_state  # noqa: E402
from test_resolver_one import distinct_steps  # noqa: E402
from test_resolver_reference import clone_state, make_state, sel_of  # noqa: E402

from dhisparse.kernels.resolver import PlanWorkspace, plan_triton  # noqa: E402
from dhisparse.kernels.resolver_ref import hot_entry_of, plan_reference, with_hot_entry  # noqa: E402


def test_hot_entry_of_inverts_hot_pos():
    hot_pos = torch.tensor([[5, -1, 0, 9], [-1, -1, -1, -1]])
    m = hot_entry_of(hot_pos, 12)
    assert m.dtype == torch.int16 and m.shape == (2, 12)
    assert m[0].tolist() == [2, -1, -1, -1, -1, 0, -1, -1, -1, 3, -1, -1] and (m[1] == -1).all()


def test_the_reference_plans_the_same_with_the_index_and_keeps_it():
    """The index changes nothing in the reference's results; its evictions keep it the inverse."""
    a = make_state(S=2, B=4, L=40, TT=4)
    fill_hot(a, 1, [3, 7, 11, 20], [2, 0, 1, 3])
    b = with_hot_entry(a)
    a = clone_state(a)
    for now, q in enumerate(([7, 30, 31, 3], [1, 2, 3, 4], [20, 21, 22, 23])):
        pa = plan_reference(sel_of(q), torch.tensor([1]), a, 10 + now)
        pb = plan_reference(sel_of(q), torch.tensor([1]), b, 10 + now)
        assert torch.equal(pa.loc, pb.loc) and torch.equal(pa.copy_src, pb.copy_src) and pa.counters == pb.counters
        assert torch.equal(a.hot_pos, b.hot_pos) and torch.equal(a.hot_stamp, b.hot_stamp)
        assert torch.equal(b.hot_entry, hot_entry_of(b.hot_pos, b.hot_entry.shape[1]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S=hs.integers(1, 5), k=hs.integers(1, 16), B=hs.integers(1, 24), L=hs.integers(8, 64), TT=hs.integers(1, 8),
       direct=hs.booleans(), fill=hs.floats(0, 1), steps=hs.integers(1, 3), seed=hs.integers(0, 2**31 - 1))
def test_distinct_lookup_against_reference_with_stale_scratch(S, k, B, L, TT, direct, fill, steps, seed):
    """The decode step's form (one query, distinct=True, a persistent workspace), with every scratch
    buffer (claims, hit flags) overwritten with garbage between calls."""
    g = torch.Generator().manual_seed(seed)
    st, top = random_state(g, S, B, L, TT, direct, fill, seed)

    def garbage(ws):
        for t in ws.claims() + [b for name, b in ws._bufs.items() if name == "hitf"]:
            t.copy_(torch.randint(-3, k + 3, t.shape, generator=g).to(t))

    distinct_steps(Pair(st, hot_map=True), g, S, k, top, steps, PlanWorkspace(DEV), garbage)


def test_direct_rows_with_a_hot_entry_are_direct_and_leave_their_entry_alone():
    """A position in both the tail and a hot entry resolves from the tail: no hit, no stamp refresh,
    and its entry may be evicted like any unprotected one."""
    st = make_state(S=1, B=3, L=24, TT=4)  # tail from 20
    fill_hot(st, 0, [21, 5, 6], [0, 1, 2])
    p = Pair(st, hot_map=True)
    want, _ = p.step(sel_of([21, 5, 9]), [0], now=7, distinct=True)
    assert want.counters == (3, 1, 1, 1, 1, 0)
    assert p.ref.hot_pos[0].tolist() == [9, 5, 6]  # 21's entry (stamp 0, unprotected) was the victim


def test_registers_and_chunked_paths_keep_one_index():
    """K*k 2,048 (registers) and 2,049+ (chunks) alternate, both looking hits up in one index."""
    g = torch.Generator().manual_seed(2)
    st = make_state(S=2, B=64, L=6000, TT=8)
    fill_hot(st, 1, list(range(0, 128, 2))[:64], [int(v) for v in torch.randint(0, 5, (64,), generator=g)])
    p = Pair(st, hot_map=True)
    for now, (K, k) in enumerate(((1, 2048), (2, 1100), (1, 2000), (3, 700))):
        sel = torch.randint(-1, 6000, (2, K, k), generator=g)
        p.step(sel, [1, 0], now=10 + now)


def test_chunked_lookup_with_stale_flags_direct_rows_and_duplicates():
    """Unions past 2,048 entries (the chunked path) with duplicates, an optional map covering some hot
    positions, and the workspace's hit flags and claims overwritten with garbage between calls."""
    g = torch.Generator().manual_seed(5)
    L = 3000
    st = make_state(S=2, B=64, L=L, TT=8, direct=True)
    for s in range(2):
        fill_hot(st, s, torch.randperm(600, generator=g)[:64].tolist(), torch.randint(0, 4, (64,), generator=g).tolist())
        st.direct_loc[s] = torch.where(torch.rand(L, generator=g) < 0.2, 5000 + torch.arange(L), -1)
    p, ws = Pair(st, hot_map=True), PlanWorkspace(DEV)
    for now in range(3):
        sel = torch.randint(-1, 700, (2, 2, 1100), generator=g)  # many repeats, many hot positions
        want, _ = p.step(sel, [0, 1], now=10 + now, ws=ws)
        assert want.counters.hot > 0 and want.counters.direct > 0 and want.counters.host > 0
        for t in ws.claims() + [b for name, b in ws._bufs.items() if name == "hitf"]:
            t.copy_(torch.randint(-3, 9, t.shape, generator=g).to(t))


def test_repeated_steps_with_the_same_stamp():
    """Two calls at one stamp: an entry stamped `now` by the first is unprotected in the second
    unless hit there (protection comes from this call's flags, not from the stamp's value)."""
    st = make_state(S=1, B=2, L=30, TT=2)
    fill_hot(st, 0, [1, 2], [0, 0])
    p = Pair(st, hot_map=True)
    p.step(sel_of([3]), [0], now=5, distinct=True)  # 3 replaces entry 0 (stamp 5)
    want, _ = p.step(sel_of([2, 4]), [0], now=5, distinct=True)  # 2 hit; 4 evicts 3 (unprotected)
    assert want.counters.hot == 1 and p.ref.hot_pos[0].tolist() == [4, 2]


@pytest.mark.parametrize("bad", ["narrow", "dtype", "rows"])
def test_a_wrong_index_is_refused_by_name(bad):
    st = with_hot_entry(make_state(S=2, B=4, L=40, TT=4))
    m = st.hot_entry
    m = {"narrow": m[:, :-1], "dtype": m.to(torch.int32), "rows": m[:1]}[bad]
    st = clone_state(dataclasses.replace(st, hot_entry=m.contiguous()), DEV)
    with pytest.raises(ValueError, match="hot_entry"):
        plan_triton(sel_of([1, 2]).to(DEV), torch.tensor([0], device=DEV), st, 1)
