"""The plain-PyTorch resolver (`plan_reference` + `run_copies`) on hand-checkable cases.

Also home of the state/row builders that tests/test_resolver_kernel.py reuses.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dhisparse.kernels.resolver_ref import ResolverState, plan_reference, run_copies

W = 4  # row width of the test row spaces
HOST_PS = 4  # host rows per host page
DEV_PS = 8  # device rows per device page


def make_state(S=4, B=8, L=64, TT=8, *, tail_start=None, direct=False, seed=0) -> ResolverState:
    """Empty hot caches. Slot s: hot_loc s*B + b, tail rows after all hot rows, host pages of
    every slot a permutation of distinct global host pages (host order != position order)."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-L // HOST_PS)
    table = torch.randperm(S * pages, generator=g).view(S, pages)
    ts = torch.full((S,), L - TT, dtype=torch.int64) if tail_start is None else torch.as_tensor(tail_start)
    dmap = torch.full((S, L), -1, dtype=torch.int64) if direct else None
    return ResolverState(
        hot_pos=torch.full((S, B), -1, dtype=torch.int64), hot_stamp=torch.full((S, B), -1, dtype=torch.int64),
        hot_loc=torch.arange(S * B, dtype=torch.int64).view(S, B),
        tail_start=ts.to(torch.int64), tail_loc=S * B + torch.arange(S * TT, dtype=torch.int64).view(S, TT),
        host_table=table, host_page_size=HOST_PS, direct_loc=dmap)


def clone_state(st: ResolverState, device="cpu") -> ResolverState:
    return ResolverState(**{f.name: (v.clone().to(device) if torch.is_tensor(v := getattr(st, f.name)) else v)
                            for f in dataclasses.fields(st)})


def host_loc(st: ResolverState, s: int, pos: int) -> int:
    return int(st.host_table[s, pos // HOST_PS]) * HOST_PS + pos % HOST_PS


def encode(layer: int, slot: int, pos: int) -> float:
    return float(layer * 1_000_000 + slot * 10_000 + pos)


def host_rows_for(st: ResolverState, layer: int) -> torch.Tensor:
    """[HP, HOST_PS, W] float64 rows; the row of (slot, pos) holds encode(layer, slot, pos)."""
    S, pages = st.host_table.shape
    rows = torch.full((S * pages * HOST_PS, W), -7.0, dtype=torch.float64)
    for s in range(S):
        for pos in range(pages * HOST_PS):
            rows[host_loc(st, s, pos)] = encode(layer, s, pos)
    return rows.view(-1, HOST_PS, W)


def dev_rows_for(st: ResolverState, layer: int) -> torch.Tensor:
    """[P, DEV_PS, W] device rows: tail rows and ready optional-map rows pre-filled, rest -1."""
    S, B = st.hot_loc.shape
    n = 1 + max(int(st.hot_loc.max()), int(st.tail_loc.max()),
                int(st.direct_loc.max()) if st.direct_loc is not None else 0)
    rows = torch.full((-(-n // DEV_PS) * DEV_PS, W), -1.0, dtype=torch.float64)
    for s in range(S):
        for t in range(st.tail_loc.shape[1]):
            rows[st.tail_loc[s, t]] = encode(layer, s, int(st.tail_start[s]) + t)
        if st.direct_loc is not None:
            for p in (st.direct_loc[s] >= 0).nonzero().flatten().tolist():
                rows[st.direct_loc[s, p]] = encode(layer, s, p)
    return rows.view(-1, DEV_PS, W)


def assert_rows_right(plan, sel, slots, dev_rows, layer):
    """I2: every returned location holds exactly the selected row of its request."""
    flat = dev_rows.view(-1, W)
    for n in range(sel.shape[0]):
        for pos, loc in zip(sel[n].flatten().tolist(), plan.loc[n].flatten().tolist()):
            if pos < 0:
                assert loc == -1
            else:
                assert loc >= 0 and torch.all(flat[loc] == encode(layer, int(slots[n]), pos)), (n, pos, loc)


def sel_of(*queries, k=None):
    """[1, K, k] selection from lists (padded with -1)."""
    k = k or max(len(q) for q in queries)
    return torch.tensor([[list(q) + [-1] * (k - len(q)) for q in queries]], dtype=torch.int64)


def test_all_misses_then_all_hits():
    st = make_state(B=8)
    sel = sel_of([3, 9, 1, 20])
    p = plan_reference(sel, torch.tensor([1]), st, now=5)
    assert p.counters == (4, 0, 0, 4, 4, 0)
    order = sorted([3, 9, 1, 20], key=lambda q: host_loc(st, 1, q))
    assert p.copy_src.tolist() == [host_loc(st, 1, q) for q in order]
    # empty slots (stamp -1) are taken in slot order by misses in host order
    assert p.copy_dst.tolist() == [8 + i for i in range(4)]
    assert st.hot_pos[1, :4].tolist() == order and st.hot_stamp[1, :4].tolist() == [5] * 4
    again = plan_reference(sel, torch.tensor([1]), st, now=6)
    assert again.counters == (4, 0, 4, 0, 0, 0) and again.copy_src.numel() == 0
    assert torch.equal(again.loc, p.loc) and st.hot_stamp[1, :4].tolist() == [6] * 4


def test_padding_b_equals_k_and_overflow():
    st = make_state(B=4)
    p = plan_reference(sel_of([5, -1, 7, -1]), torch.tensor([0]), st, now=1)
    assert p.loc[0, 0, 1] == -1 and p.loc[0, 0, 3] == -1 and p.counters.selected == 2
    p = plan_reference(sel_of([10, 11, 12, 13]), torch.tensor([0]), st, now=2)  # B == k: all evicted
    assert p.counters == (4, 0, 0, 4, 4, 0) and sorted(st.hot_pos[0].tolist()) == [10, 11, 12, 13]
    p = plan_reference(sel_of([10, 30, 31, 32, 33, 34]), torch.tensor([0]), st, now=3)
    assert p.counters == (6, 0, 1, 3, 3, 2)  # 5 misses, 3 victims left
    assert (p.loc[0, 0] == -1).sum() == 2


def test_tail_and_optional_map_are_direct():
    st = make_state(B=4, L=64, TT=8, direct=True)  # tail_start 56
    st.direct_loc[2, 17] = 99
    st.hot_pos[2, 0], st.hot_stamp[2, 0] = 17, 0  # direct wins over the hot cache; no stamp refresh
    p = plan_reference(sel_of([57, 17, 3]), torch.tensor([2]), st, now=4)
    assert p.loc[0, 0].tolist()[:2] == [int(st.tail_loc[2, 1]), 99]
    assert p.counters == (3, 2, 0, 1, 1, 0) and st.hot_stamp[2, 0] == 0


def test_lru_victim_order_exact():
    st = make_state(B=6)
    st.hot_pos[0] = torch.tensor([40, 41, 42, 43, 44, 45])
    st.hot_stamp[0] = torch.tensor([3, 1, 1, 0, 2, 0])
    p = plan_reference(sel_of([43, 1, 2, 5]), torch.tensor([0]), st, now=9)  # 43 is a hit: protected
    # unprotected by (stamp, slot): 5 (0), 1 (1), 2 (1), 4 (2), 0 (3): the first three are evicted and
    # paired in slot order with the misses in host order
    order = sorted([1, 2, 5], key=lambda q: host_loc(st, 0, q))
    assert p.copy_dst.tolist() == [1, 2, 5]
    assert [int(st.hot_pos[0, v]) for v in (1, 2, 5)] == order
    assert st.hot_stamp[0].tolist() == [3, 9, 9, 9, 2, 9]


def test_dedup_across_queries_copies_each_row_once():
    st = make_state(B=16)
    sel = sel_of([1, 2, 3, 4], [3, 4, 5, 6], [6, 1, 7, -1])
    host, dev = host_rows_for(st, 0), dev_rows_for(st, 0)
    p = plan_reference(sel, torch.tensor([3]), st, now=1)
    assert p.counters == (11, 0, 0, 7, 11, 0)
    assert run_copies(p, host, dev) == 7 * W * 8  # 7 distinct rows, once each
    loc = dict()
    for pos, l in zip(sel.flatten().tolist(), p.loc.flatten().tolist()):
        assert pos < 0 or loc.setdefault(pos, l) == l  # every query gets the same location
    assert_rows_right(p, sel, torch.tensor([3]), dev, 0)


@pytest.mark.parametrize("direct", [False, True])
def test_every_location_holds_its_row_across_steps_and_layers(direct):
    st = make_state(S=3, B=6, L=40, TT=4, direct=direct, seed=3)
    if direct:
        st.direct_loc[:, 10:14] = torch.arange(200, 212).view(3, 4)
    g = torch.Generator().manual_seed(1)
    layers = [(host_rows_for(st, ly), dev_rows_for(st, ly)) for ly in range(2)]
    slots = torch.tensor([2, 0])
    for step in range(6):
        sel = torch.randint(-1, 40, (2, 2, 3), generator=g)
        p = plan_reference(sel, slots, st, now=step)
        for ly, (host, dev) in enumerate(layers):  # follower layer replays the plan with its bytes
            run_copies(p, host, dev)
            assert_rows_right(p, sel, slots, dev, ly)
