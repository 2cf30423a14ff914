"""A `HierarchicalKV`'s admission and release of a request: where a prefix-matched admission puts
its prefix (`placement`), the reservation of its device and host pages, its slot, and everything
it holds given back at free.

A request reserves its whole life at admission (I4): hot cache, tail and index pages
(`HierarchicalKV.required_pages`), the prompt's workspace unless it is admitted host-first, and
host pages for every row of its history less the complete pages it will borrow from a prefix
shared on host (kv/hier/prefix_pages.py):

    device   | hot cache B/ps | tail | index pages (max_total) | workspace (prompt; not host-first) |
    host     | borrowed shared prefix pages (reserved by nobody) | req's own pages ........ max_total |
"""

from __future__ import annotations

import logging

from dhisparse.kv.hier import tables

log = logging.getLogger("dhisparse.kv")


def placement(kv, req: object, max_total: int, prompt_len: int | None) -> tuple[int, bool]:
    """(pages to reserve, host-first) for admitting req under `kv.placement`:

        import   the prompt's workspace too: the prefix is imported onto the device first
        host     host-first whenever req's prefix is shared on host: no workspace
        auto     import while the workspace fits (`_import_fits`), else host-first
    """
    full = kv.pages_for(max_total, prompt_len)
    if kv.placement == "import" or not can_host_first(kv, req):
        return full, False
    if kv.placement == "host" or not kv._import_fits(full):
        return kv.required_pages(max_total), True
    return full, False


def can_host_first(kv, req: object) -> bool:
    """req's prefix match is shared on host for every complete page it imports, or is a whole
    prompt computed elsewhere (`StoredPrefix.whole_prompt`: its rows go to req's own host pages)."""
    if not kv.HOST_FIRST or kv.prefix_match is None:
        return False
    item, n = kv.prefix_match(req)
    if item is not None and item.whole_prompt:
        return True
    full = n // kv.page_size  # 0 without a match
    return full >= 1 and borrowable(kv, req) >= full


def borrowable(kv, req: object) -> int:
    """Host pages req will borrow from its shared prefix (its host reservation skips them)."""
    item, n = kv.prefix_match(req) if kv.prefix_match is not None else (None, 0)
    if item is None or item.whole_prompt:  # a whole prompt computed elsewhere is never shared
        return 0
    return kv.prefix_pages.borrowable(item, n)


def admit_with(kv, req: object, max_total: int, need: int, host_first: bool) -> bool:
    """Reserve `need` device pages and req's host pages, then open its slot (`tables.open_slot`);
    False, with nothing held, when either pool cannot."""
    if not kv.pool.reserve(req, need):
        return False
    if not kv.host.admit(req, max_total, borrowable(kv, req)):
        kv.pool.unreserve(req)
        log.info("request %s waits: host pool cannot hold %d tokens", req, max_total)
        return False
    kv.resident.latent_tables[req], kv.resident.index_tables[req] = [], []
    tables.open_slot(kv, req)
    if host_first:
        kv._host_first.add(req)
    return True


def release(kv, req: object) -> None:
    """Everything req holds: its hand-off and import copies settled first (its pages are reused
    only after them), then its device pages, host pages, page lists and slot."""
    kv._host_first.discard(req)
    kv.handoffs.settle(req)  # its host pages are reused only after its hand-off copy
    st = kv.reqs.pop(req, None)
    kv.resident.loads.settle(req)
    kv.pool.release(req)
    kv.host.free(req)
    kv.resident.latent_tables.pop(req, None)
    kv.resident.index_tables.pop(req, None)
    if st is not None:
        tables.close_slot(kv, st)
