"""A `HierarchicalKV`'s per-slot device tables: the selection groups' hot-cache budgets, the hot
cache, the tail and the slot mirrors of the host / index page lists, and their upkeep.

Every table is indexed by request slot (S = max_slots) and lives for the store's life (a captured
step graph bakes their addresses in; only the slot tables may grow, `SlotTable.sync`):

    hot_pos   [S, G, B_max]  position held by each hot entry of group g (-1: empty); group g uses
    hot_stamp [S, G, B_max]  entries 0 .. B_g - 1, the rest stay -1 forever; each has one trailing
                             trash entry (`_hot_pos_flat`, promotion.py's masked writes)
    hot_loc   [S, B_max]     device row of each hot entry (the slot's hot pages, shared by groups)
    hot_entry [S, G, W] int16  (hot_index only) the hot entry of group g holding each position, -1
                             none: the inverse of hot_pos, kept so by every writer of hot_pos (the
                             resolver, `close_slot`, promotion.py's flush); W covers every position
                             the resolver sees; one trailing trash cell (`_hot_entry_flat`)
    tail_start [S]           first tail position; tail_loc [S, tail_pages * ps] its device rows
    host_pages, index_pages  `SlotTable`s: the resolver's host table, the index page table

    positions   0 ........................... tail_start ........ n (computed)
    tables      hot_pos / hot_loc (+ host_pages) | tail_loc[slot, p - tail_start]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhisparse.core.rows import cdiv
from dhisparse.kernels.resolver_ref import ResolverState
from dhisparse.kv.memory.slot_tables import SlotTable


@dataclass
class ReqKV:
    """One admitted request's device state: its slot, hot-cache pages (B / ps), tail pages, whether
    it decodes (its prompt was handed off), and the first position its tail holds."""

    slot: int
    hot_pages: list[int]
    tail_pages: list[int]
    decoding: bool = False
    tail_start: int = 0


def span(layers: list[int], producer: int) -> slice | None:
    """slice(first, last + 1) of a group whose layers are consecutive and start at its producer
    (one layered copy serves the whole group), else None (each layer copies its own rows)."""
    ok = layers and layers[0] == producer and layers[-1] - layers[0] + 1 == len(layers)
    return slice(layers[0], layers[-1] + 1) if ok else None


def build_groups(kv, hot_rows: int, source_hot_rows: tuple[int, ...] | None) -> None:
    """kv's selection groups (one per producer layer / KV source) and their hot-cache budgets:
    groups (producer layers), B_of (B_g per group, page-rounded), B (max_g B_g), group_of (layer ->
    group), group_size, group_span (`span`) and followers (a group's layers but its producer)."""
    ps, layout = kv.page_size, kv.arena.layout
    kv.groups = layout.index_layers
    budgets = source_hot_rows if source_hot_rows is not None else (hot_rows,) * len(kv.groups)
    if len(budgets) != len(kv.groups):
        raise ValueError(f"source_hot_cache_rows needs one budget per KV source ({len(kv.groups)}); got {len(budgets)}")
    kv.B_of = tuple(cdiv(b, ps) * ps for b in budgets)
    kv.B = max(kv.B_of, default=cdiv(hot_rows, ps) * ps)
    kv.group_of = {p.layer: kv.groups.index(p.producer) for p in layout.layers}
    members = [sorted(l for l, g in kv.group_of.items() if g == i) for i in range(len(kv.groups))]
    kv.group_size = [len(m) for m in members]
    kv.group_span = [span(m, p) for m, p in zip(members, kv.groups)]
    kv.followers = [[l for l in m if l != p] for m, p in zip(members, kv.groups)]


def index_width(kv, max_len: int) -> int:
    """Positions a hot_entry row covers: the resolver's position bound for requests of max_len (the
    host table's reach or the optional map's width, whole pages, plus the tail's rows)."""
    ps, hps = kv.page_size, kv.host.page_size
    return max(cdiv(max_len, hps) * hps, cdiv(max_len, ps) * ps) + kv.tail_pages * ps


def build_tables(kv, slots: int, max_len: int | None, hot_index: bool = False) -> None:
    """The tables of the module docstring for `slots` request slots (after `build_groups`), all
    slots free. max_len sizes the slot tables up front, so they never move while serving; hot_index
    (which needs it) adds `hot_entry`."""
    G, S, dev = len(kv.groups), slots, kv.device
    # one trailing trash entry each: a graph-safe masked update writes there (kv/hier/promotion.py)
    kv._hot_pos_flat = torch.full((S * G * kv.B + 1,), -1, dtype=torch.int64, device=dev)
    kv._hot_stamp_flat = torch.full_like(kv._hot_pos_flat, -1)
    kv.hot_pos = kv._hot_pos_flat[:-1].view(S, G, kv.B)
    kv.hot_stamp = kv._hot_stamp_flat[:-1].view(S, G, kv.B)
    kv.hot_loc = torch.zeros(S, kv.B, dtype=torch.int64, device=dev)
    kv.hot_entry = kv._hot_entry_flat = None
    if hot_index:
        if not max_len:
            raise ValueError("hot_index needs max_len (the hot_entry index covers every position up front)")
        if kv.B > 32768:
            raise ValueError(f"hot_index: an int16 hot_entry indexes at most 32,768 hot entries, got {kv.B}")
        W = index_width(kv, max_len)
        kv._hot_entry_flat = torch.full((S * G * W + 1,), -1, dtype=torch.int16, device=dev)
        kv.hot_entry = kv._hot_entry_flat[:-1].view(S, G, W)
    kv.tail_start = torch.zeros(S, dtype=torch.int64, device=dev)
    kv.tail_loc = torch.zeros(S, kv.tail_pages * kv.page_size, dtype=torch.int64, device=dev)
    kv.free_slots = list(range(S))
    ml = max_len or 1
    kv.host_pages = SlotTable(S, dev, cdiv(ml, kv.host.page_size))  # each slot's host page list (the resolver's host_table)
    kv.index_pages = SlotTable(S, dev, cdiv(ml, kv.arena.index_page_size))  # each slot's index page list (index_locations)


def open_slot(kv, req: object) -> ReqKV:
    """req (its pages reserved) takes the first free slot with its hot-cache and tail pages; the
    slot's hot entries start empty and its tail at position 0."""
    ps = kv.page_size
    st = ReqKV(kv.free_slots.pop(0), kv.pool.alloc(req, kv.B // ps), kv.pool.alloc(req, kv.tail_pages))
    kv.reqs[req] = st
    kv.hot_loc[st.slot] = kv.arena.locations(st.hot_pages, kv.B, ps)
    kv.hot_pos[st.slot], kv.hot_stamp[st.slot] = -1, -1
    set_tail(kv, st)
    return st


def close_slot(kv, st: ReqKV) -> None:
    """A freed request's slot: hot entries emptied (and their index), slot tables reset (its next
    owner never reads the previous owner's pages), and the slot free again."""
    kv.hot_pos[st.slot], kv.hot_stamp[st.slot] = -1, -1
    if kv.hot_entry is not None:
        kv.hot_entry[st.slot] = -1
    kv.host_pages.reset(st.slot)
    kv.index_pages.reset(st.slot)
    kv.free_slots.append(st.slot)


def set_tail(kv, st: ReqKV) -> None:
    """Mirror st's tail (tail_start, the rows of its tail pages) into the slot's device tables."""
    kv.tail_start[st.slot] = st.tail_start
    kv.tail_loc[st.slot] = kv.arena.locations(st.tail_pages, kv.tail_pages * kv.page_size, kv.page_size)


def sync_index_pages(kv, reqs: list[object]) -> None:
    """Bring the device index page table up to date for `reqs` (only pages added since the
    last sync travel, `SlotTable.sync`)."""
    kv.index_pages.sync((kv.reqs[q].slot, kv.resident.index_tables[q]) for q in reqs)


def sync_host_table(kv, req: object) -> None:
    """Mirror req's host page list into the device table the resolver reads (pages added since
    the last sync only)."""
    kv.host_pages.sync([(kv.reqs[req].slot, kv.host.tables[req])])


def resolver_state(kv, group: int) -> ResolverState:
    """Group `group`'s resolver state (`HierarchicalKV.resolver_state`), built once a group and
    kept in `kv._states`; only its host table is refreshed per call.

        hot_pos[:, group, :B_g]  hot_stamp[:, group, :B_g]  hot_loc[:, :B_g]  hot_entry[:, group]
        (strided views)"""
    table = kv.host_table
    st = kv._states.get(group)
    if st is None:
        b = kv.B_of[group]
        st = kv._states[group] = ResolverState(kv.hot_pos[:, group, :b], kv.hot_stamp[:, group, :b],
                                               kv.hot_loc[:, :b], kv.tail_start, kv.tail_loc, table,
                                               kv.host.page_size,
                                               hot_entry=None if kv.hot_entry is None else kv.hot_entry[:, group])
    st.host_table = table
    return st
