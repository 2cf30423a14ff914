"""The resolver: selected positions in, device locations out (paper §3.2, eq. 5-6, 11-12).

Plan / run shape. `plan` (the producer layer of a selection) decides, per request, where every
selected row will be read from and which host rows must be copied where; `run` performs the
copies for one layer's bytes. Follower layers of a shared selection (GLM `shared` layers) call
`run` with the same plan and their own row spaces: no second scan.

Per request, over the union U of its K queries' selections (each distinct row handled once):
  1. direct:  positions in the tail (>= tail_start) or in the ready optional map (direct_loc >= 0)
  2. hot:     positions held by a hot-cache slot (hits; their LRU stamps are refreshed)
  3. host:    the rest, in the plan's miss order (`MISS_ORDERS`): by host location ("host"), or by
              first entry in the selection ("selection"); the i-th miss takes the i-th victim. The
              victims are the first m unselected slots in LRU order (empty slots first, then oldest
              stamp, then slot id), paired in slot order: which slots are evicted is LRU, how misses
              pair with them is free, and slot order needs no sort of the victims (issue 33). When
              misses outnumber victims, the first m in miss order take them (the rest overflow).
Locations come back in selection order, [N, K, k], -1 where the selection is -1.

State (one group g = one selection producer; all layers of a group share the slot state):
  hot_pos   [S, B] int64  position held by each slot, -1 empty        (mutated)
  hot_stamp [S, B] int64  step of last use, -1 empty                  (mutated)
  hot_loc   [S, B] int64  device location of each slot
  tail_start [S], tail_loc [S, TT]: position p >= tail_start lives at tail_loc[s, p - tail_start]
  host_table [S, HPmax]: host page of each page-of-positions, host_ps rows per host page
  direct_loc [S, Lmax] or None: ready optional-history location of each position, -1 if none
  hot_entry [S, Lh] int16 or None: the hot entry holding each position, -1 none     (mutated)
             the inverse of hot_pos (`hot_entry_of`): hot_pos[s, v] = p >= 0 <=> hot_entry[s, p] = v.
             An index, not state of its own: the plan's result is the same with or without it; with
             it the Triton plan looks each selected row up (one load) instead of scanning the hot
             cache against the selection (issue 33). Lh covers every position (>= the plan's bound).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch


MISS_ORDERS = ("host", "selection")
# Whole-call selection entries (N * K * k) below which a one-query call fetches in selection order: the copy's
# host reads ran as fast unsorted there (bench/results/copy_order_s38_h100.json: 0.98-1.02x at batch 8, up to
# 16,384 rows; 1.03-1.52x slower from batch 32), so the plan kernel skips sorting the misses (issue 33).
SELECTION_ORDER_ENTRIES = 32768


def miss_order_for(n: int, kk: int, distinct: bool) -> str:
    """The miss order a call of n requests of kk = K*k entries each should plan in: "selection" for a
    distinct (one top-k query a request) call of fewer than `SELECTION_ORDER_ENTRIES` entries, where the
    copy is small enough that host-address order does not pay for its sort; "host" otherwise. (With
    repeated positions the Triton plan's representative of a row is whichever entry won its claim, not
    the first, so selection order needs distinct selections.)"""
    return "selection" if distinct and n * kk < SELECTION_ORDER_ENTRIES else "host"


def check_miss_order(miss_order: str) -> None:
    if miss_order not in MISS_ORDERS:
        raise ValueError(f"miss_order must be one of {MISS_ORDERS}, got {miss_order!r}")


class ResolveCounters(NamedTuple):
    """selected: valid selection entries; direct/hot/host: distinct rows by where they resolved;
    host_selected: selection entries whose row came from host; overflow: misses with no victim."""

    selected: int
    direct: int
    hot: int
    host: int
    host_selected: int
    overflow: int


@dataclass
class ResolvePlan:
    """loc [N, K, k] device locations; copy_src [M] host locations, copy_dst [M] device locations
    (request by request, each in the plan's miss order: by host location, or by selection). deferred:
    the plan's copy plan and counters are still on the device (a `TritonResolvePlan` from
    `plan_triton(defer=True)`); a reference plan never is."""

    deferred: ClassVar[bool] = False
    loc: torch.Tensor
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    counters: ResolveCounters


@dataclass
class ResolverState:
    hot_pos: torch.Tensor
    hot_stamp: torch.Tensor
    hot_loc: torch.Tensor
    tail_start: torch.Tensor
    tail_loc: torch.Tensor
    host_table: torch.Tensor
    host_page_size: int
    direct_loc: torch.Tensor | None = None
    hot_entry: torch.Tensor | None = None


def position_bound(st: ResolverState) -> int:
    """Positions a plan on st can see: the host table's reach or the optional map's width, plus the
    tail (I1). The plan kernel's claim table, and a hot_entry index, cover this many."""
    lmax = st.direct_loc.shape[1] if st.direct_loc is not None else 0
    return max(st.host_table.shape[1] * st.host_page_size, lmax) + st.tail_loc.shape[1]


def with_hot_entry(st: ResolverState) -> ResolverState:
    """st with a hot_entry index built from its hot_pos, `position_bound(st)` wide (tests, benches)."""
    return dataclasses.replace(st, hot_entry=hot_entry_of(st.hot_pos, position_bound(st)))


def hot_entry_of(hot_pos: torch.Tensor, width: int) -> torch.Tensor:
    """[S, width] int16: the inverse of hot_pos [S, B] (entry v at column hot_pos[s, v], -1
    elsewhere), as `ResolverState.hot_entry` must hold it. Positions must be < width."""
    S, B = hot_pos.shape
    if B > 32768:
        raise ValueError(f"hot_pos: an int16 hot_entry map indexes at most 32,768 entries, got {B}")
    out = torch.full((S, width), -1, dtype=torch.int16, device=hot_pos.device)
    s, v = (hot_pos >= 0).nonzero(as_tuple=True)
    out[s, hot_pos[s, v]] = v.to(torch.int16)
    return out


def _move_entries(st: ResolverState, s: int, v: torch.Tensor, pos: torch.Tensor) -> None:
    """Hot entries v of slot s now hold positions pos (hot_pos and, if kept, the hot_entry index)."""
    if st.hot_entry is not None:
        old = st.hot_pos[s, v]
        st.hot_entry[s, old[old >= 0]] = -1
        st.hot_entry[s, pos] = v.to(st.hot_entry.dtype)
    st.hot_pos[s, v] = pos


def _host_loc(st: ResolverState, s: int, pos: torch.Tensor) -> torch.Tensor:
    ps = st.host_page_size
    return st.host_table[s, pos // ps] * ps + pos % ps


def _first_entry(flat: torch.Tensor, valid: torch.Tensor, inv: torch.Tensor, u: int) -> torch.Tensor:
    """[u] the flattened-selection index of each distinct row's first entry (inv: its valid entries' rows)."""
    idx = valid.nonzero().squeeze(1)
    return torch.full((u,), flat.numel(), dtype=torch.int64, device=flat.device).scatter_reduce_(0, inv, idx, "amin")


def plan_reference(sel: torch.Tensor, slots: torch.Tensor, st: ResolverState, now: int, *,
                   miss_order: str = "host") -> ResolvePlan:
    """Plain-PyTorch resolver plan. sel [N, K, k] int64; slots [N] request slot ids. miss_order (one of
    `MISS_ORDERS`): the order misses take victims and are copied in, by host location or by their
    first entry in the request's flattened selection."""
    check_miss_order(miss_order)
    N = sel.shape[0]
    loc = torch.full_like(sel, -1)
    srcs, dsts = [], []
    c = [0, 0, 0, 0, 0, 0]
    for n in range(N):
        s = int(slots[n])
        flat = sel[n].reshape(-1)
        valid = flat >= 0
        c[0] += int(valid.sum())
        uniq, inv = torch.unique(flat[valid], return_inverse=True)
        out = torch.full_like(uniq, -1)
        # 1. direct: tail, then ready optional history
        in_tail = uniq >= st.tail_start[s]
        out[in_tail] = st.tail_loc[s, uniq[in_tail] - st.tail_start[s]]
        if st.direct_loc is not None:
            opt = ~in_tail & (st.direct_loc[s, uniq.clamp(max=st.direct_loc.shape[1] - 1)] >= 0)
            out[opt] = st.direct_loc[s, uniq[opt]]
        done = out >= 0
        c[1] += int(done.sum())
        # 2. hot-cache scan
        rest = (~done).nonzero().squeeze(1)
        match = st.hot_pos[s][None, :] == uniq[rest][:, None]  # [R, B]
        hit = match.any(1)
        hit_slot = match.float().argmax(1)
        out[rest[hit]] = st.hot_loc[s, hit_slot[hit]]
        st.hot_stamp[s, hit_slot[hit]] = now
        c[2] += int(hit.sum())
        # 3. misses -> LRU victims, fetched in the miss order
        miss = rest[~hit]
        if miss.numel():
            hloc = _host_loc(st, s, uniq[miss])
            order = torch.argsort(hloc if miss_order == "host" else _first_entry(flat, valid, inv, uniq.numel())[miss])
            miss, hloc = miss[order], hloc[order]
            protected = torch.zeros(st.hot_pos.shape[1], dtype=torch.bool, device=st.hot_pos.device)
            protected[hit_slot[hit]] = True
            cand = (~protected).nonzero().squeeze(1)
            key = st.hot_stamp[s, cand] * (cand.numel() + 1) + torch.arange(cand.numel(), device=cand.device)  # stamp, then slot
            victims = cand[torch.argsort(key)]
            m = min(miss.numel(), victims.numel())
            c[5] += miss.numel() - m
            v = victims[:m].sort().values  # the LRU-oldest m, paired in slot order
            out[miss[:m]] = st.hot_loc[s, v]
            _move_entries(st, s, v, uniq[miss[:m]])
            st.hot_stamp[s, v] = now
            srcs.append(hloc[:m])
            dsts.append(st.hot_loc[s, v])
            c[3] += m
            c[4] += int(torch.isin(inv, miss[:m]).sum())
        res = torch.full_like(flat, -1)
        res[valid] = out[inv]
        loc[n] = res.view(sel.shape[1:])
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64, device=sel.device)  # noqa: E731
    return ResolvePlan(loc, cat(srcs), cat(dsts), ResolveCounters(*c))


def run_copies(plan: ResolvePlan, host_rows: torch.Tensor, dev_rows: torch.Tensor) -> int:
    """Copy planned host rows into device rows for one layer. host_rows [HP, ps, W] and
    dev_rows [P, ps, W] paged row spaces. Returns bytes moved."""
    if plan.copy_src.numel() == 0:
        return 0
    hp, dp = host_rows.shape[1], dev_rows.shape[1]
    src = plan.copy_src.to(host_rows.device)
    vals = host_rows[src // hp, src % hp].to(dev_rows.device, non_blocking=True)
    dst = plan.copy_dst.to(dev_rows.device)
    dev_rows[dst // dp, dst % dp] = vals
    return vals.numel() * vals.element_size()
