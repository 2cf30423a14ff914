"""Where a `HierarchicalKV`'s rows live (`row_place`, the one answer the debug checks and tests
use) and the store's state checked at rest (`check`, `HierarchicalKV.check_integrity`): page
ownership, staging's pages, I1 (every row before the tail has a host copy, mirrored for the
resolver) and I2 at rest (every hot-cache entry holds its row's bytes)."""

from __future__ import annotations

import torch

from dhisparse.core.contracts import RowPlace
from dhisparse.kernels.resolver_ref import hot_entry_of
from dhisparse.kv.hier import staging_arena


def row_place(kv, req: object, position: int, layer: int = 0) -> RowPlace:
    """Where row `position` of req lives for `layer` (`HierarchicalKV.row_place`). A prefilling
    request's rows are in its workspace. A decoding request's row is read from the first tier that
    holds it, in the resolver's order:

        positions  0 ................................ tail_start ........ n-1
        tail                                          |<- tail_loc[slot] ->|
        optional   opt_loc[slot, p] >= 0 (adaptive: published pages)
        hot        hot_pos[slot, group] == p -> hot_loc[slot, that entry]
        host       host.tables[req][p // ps] * ps + p % ps   (every p < tail_start: I1)

    `host` is reported whenever the row has a host copy (`kv._host_backed`), whatever tier
    attention reads."""
    st, ps = kv.reqs[req], kv.page_size
    pages = kv.host.tables.get(req, [])
    backed = position // ps < len(pages) and kv._host_backed(req, st, position // ps)
    host = pages[position // ps] * ps + position % ps if backed else -1
    if not st.decoding:
        table = kv.resident.latent_tables[req]
        if position // ps >= len(table):
            return RowPlace("none", host=host)
        return RowPlace("workspace", table[position // ps] * ps + position % ps, host)
    if position >= st.tail_start:
        j = position - st.tail_start
        if j >= kv.tail_loc.shape[1]:
            return RowPlace("none", host=host)
        return RowPlace("tail", int(kv.tail_loc[st.slot, j]), host)
    if kv.opt_loc is not None and int(kv.opt_loc[st.slot, position]) >= 0:
        return RowPlace("optional", int(kv.opt_loc[st.slot, position]), host)
    g = kv.group_of[layer]
    hit = (kv.hot_pos[st.slot, g] == position).nonzero()
    if hit.numel():
        return RowPlace("hot", int(kv.hot_loc[st.slot, int(hit[0, 0])]), host)
    return RowPlace("host" if host >= 0 else "none", -1, host)


def check(kv) -> None:
    """The pools' own checks, staging's pages, each request's pages against the pool, and for a
    decoding request I1 (its host pages reach tail_start and mirror into the host table; sampled
    rows have a host copy or are optional history) and, once no load of it is in flight, I2 at
    rest (`check_hot_rows`), and the hot_entry index (`check_hot_index`)."""
    kv.pool.check_integrity()
    kv.host.check_integrity()
    staging_arena.check(kv)
    check_hot_index(kv)
    for req, st in kv.reqs.items():
        held = kv.resident.latent_tables[req] + kv.resident.index_tables[req] + st.hot_pages + st.tail_pages
        assert sorted(kv.pool.owned_by(req)) == sorted(held), f"pages of {req!r} disagree with the pool"
        if st.decoding:  # I1: every row before the tail has a host page, mirrored for the resolver
            pages = kv.host.tables[req]
            assert len(pages) * kv.host.page_size >= st.tail_start
            assert kv.host_table[st.slot, : len(pages)].tolist() == pages
            for p in {0, st.tail_start // 2, st.tail_start - 1} if st.tail_start else ():
                place = kv.row_place(req, p)
                assert place.host >= 0 or place.tier == "optional", f"I1: row {p} of {req!r} has no host copy ({place})"
            if not kv.loading(req):
                check_hot_rows(kv, req, st)


def check_hot_index(kv) -> None:
    """With hot_index: every slot's and group's hot_entry row is the inverse of its hot_pos row."""
    if kv.hot_entry is None:
        return
    S, G, W = kv.hot_entry.shape
    want = hot_entry_of(kv.hot_pos.reshape(S * G, -1), W).view(S, G, W)
    bad = (want != kv.hot_entry).any(2).nonzero().tolist()
    assert not bad, f"hot_entry disagrees with hot_pos at (slot, group) {bad[:4]}"


def check_hot_rows(kv, req: object, st) -> None:
    """I2 at rest: every hot-cache entry of req names a history position whose row, in every
    layer of its group, is byte-identical to its host copy (paper staging's copy-back and
    promotion write these entries outside the resolver).

        hot_pos[slot, g, e] = p < tail_start  ->  latent row at hot_loc[slot, e] == host row of p"""
    ps, hps = kv.page_size, kv.host.page_size
    table = torch.tensor(kv.host.tables[req], dtype=torch.int64)
    for g in range(len(kv.groups)):
        pos = kv.hot_pos[st.slot, g, : kv.B_of[g]]
        live = (pos >= 0).nonzero().squeeze(1)
        if not live.numel():
            continue
        p = pos[live].cpu()
        assert bool((p < st.tail_start).all()), f"hot entries of {req!r} hold tail positions {p.tolist()[:4]}"
        hloc = table[p // hps] * hps + p % hps
        dloc = kv.hot_loc[st.slot, live].cpu()
        for layer in [kv.groups[g]] + kv.followers[g]:
            dev = kv.arena.latent_rows(layer)[dloc // ps, dloc % ps].cpu()
            host = kv.host.layer_rows(layer)[hloc // hps, hloc % hps].cpu()
            assert torch.equal(dev.view(torch.uint8), host.view(torch.uint8)), \
                f"hot rows of {req!r}, group {g}, layer {layer} differ from their host copies"
