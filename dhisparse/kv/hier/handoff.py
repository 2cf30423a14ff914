"""How a prompt's rows reach a `HierarchicalKV`'s decode state: the hand-off of its prefill
workspace when the prompt is done, or, admitted host-first, an import that never fills one. Either
way req then decodes with every row before its tail recoverable (I1: on host, or adaptive's
published optional history); a whole prompt computed elsewhere takes kv/hier/arrival.py's path to
the same state.

    positions   0 .............. full*ps | full*ps .. n-1 | n ..
    hand-off    workspace pages, placed  | workspace page | tail
                by `_place_prompt_pages` | -> tail page 0 |
    host-first  borrowed shared host     | item's page    | tail (the prompt's rest, K_max
                pages: the history       | -> tail page 0 |       tokens a pass)

`_place_prompt_pages` is the store's hook: hisparse copies the pages to host
(`prompt_pages_to_host`), adaptive keeps them as published optional history.
"""

from __future__ import annotations

from dhisparse.core.rows import cdiv
from dhisparse.kv.hier import tables
from dhisparse.kv.hier.tail import host_pages
from dhisparse.kv.resident.store import copy_index_pages


def handoff(kv, req: object, st, n: int) -> None:
    """req's prompt (n rows, in its workspace) is done: the partial page becomes tail page 0 now,
    the workspace pages past the complete ones are freed, and the complete pages go where
    `kv._place_prompt_pages` puts them (hisparse: to host; adaptive: kept as optional history).

        positions  0 ............ full | full .. n-1
        workspace  pages[: full/ps]    | pages[full/ps] -> tail page 0 (same in-page offsets)
    """
    ps = kv.page_size
    full = n // ps
    pages = kv.resident.latent_tables[req]
    st.tail_start = full * ps
    tables.set_tail(kv, st)
    if n > full * ps:
        kv.arena.latent[st.tail_pages[0]].copy_(kv.arena.latent[pages[full]])
    kv.pool.free(req, pages[full:])
    kv.resident.latent_tables[req] = []
    st.decoding = True
    kv._place_prompt_pages(req, pages[:full], n)


def prompt_pages_to_host(kv, req: object, pages: list[int]) -> None:
    """hisparse's placement of a finished prompt's complete workspace pages `pages` (positions
    0 .. len(pages) * ps): to host through `kv.handoffs` (in stream order, or on a side stream
    with req `loading` until they are there), freed once their copy is done (owned by
    ("handoff", req) meanwhile). Pages whose host copy is a borrowed shared prefix page are freed
    at once, with no copy.

        pages      [0 .. b)  borrowed: freed now | [b .. full) -> host, then freed
    """
    hosts = host_pages(kv, req, 0, len(pages))  # borrowed ones first, then req's own
    b = kv.host.borrowed_pages(req)
    kv.pool.free(req, pages[:b])  # already on host (read by this step's kernels: stream order)
    moving = pages[b:]
    if not moving:
        return
    owner = ("handoff", req)
    kv.pool.transfer(req, owner, moving)
    pairs = [("backup", h, d) for d, h in zip(moving, hosts[b:])]
    kv.handoffs.run(req, lambda: kv._copy_runs(pairs), on_done=lambda: kv.pool.free(owner, moving))


def import_host_first(kv, req: object, item, n: int) -> None:
    """The prefix's complete pages become req's history as borrowed shared host pages (I1 by
    construction); its index keys are imported (they stay on device); the partial last page's
    rows become tail page 0; req then decodes from position n, its prompt's rest fed K_max tokens
    a pass through the resolver (`HierarchicalKV.prompt_chunk_limit`).

        positions  0 ........... full*ps | full*ps .. n-1 | n ..
        host       borrowed shared pages | (also on host)  |
        device     index keys 0 .. n-1   | tail page 0     | tail: the suffix, backed up as it fills
    """
    ps, st = kv.page_size, kv.reqs[req]
    full = n // ps
    if kv.prefix_pages.borrow(req, item, n) < full:
        raise RuntimeError(f"host-first admission of {req!r}: its prefix's {full} host pages are not all shared")
    kv.sync_host_table(req)
    res = kv.resident
    res.ensure_index(req, n)
    paged = item.paged(*res.prefix_layout())
    idx = res.index_tables[req][: cdiv(n, kv.arena.index_page_size)]
    st.tail_start, st.decoding = full * ps, True
    tables.set_tail(kv, st)
    arena, tail0 = kv.arena, st.tail_pages[0]

    def copies() -> None:
        copy_index_pages(arena, paged, idx)
        if n > full * ps:
            arena.latent[tail0].copy_(paged.latent[full], non_blocking=True)

    res.loads.run(req, copies)
    kv.host_first_admits += 1
    kv._place_host_first(req, full, n)
