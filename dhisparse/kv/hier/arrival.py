"""A whole prompt's KV computed elsewhere, admitted into the hierarchy (prefill/decode
disaggregation: the decode side, engine/disagg.py; the item is a `StoredPrefix` with
`whole_prompt`). The request decodes from position n at once, in the state a local prefill leaves
at its hand-off (kv/hier/handoff.py), placed where its admission put it
(`--admission-placement`, `HierarchicalKV._placement`: `auto` = resident-first while the prompt's
pages fit in spare pages, else host-first):

    positions    0 .................... full*ps | full*ps .. n-1 | n ..
    resident     complete pages -> device pages, then `_place_prompt_pages` (adaptive: published
                 optional history, backup deferred; hisparse: to host, as a local hand-off)
    host-first   complete pages -> req's own host pages (I1 from admission on); adaptive registers
                 them backed and not resident (repopulation may bring them in while pages are spare)
    both         index keys 0 .. n-1 -> index pages | partial page -> tail page 0 | tail_start = full*ps

Every device copy runs in stream order on the compute stream, from the item's page layout
(`StoredPrefix.paged`), so a hisparse hand-off's side-stream backup of the same pages (fenced after
the compute stream) reads them complete, and the request is never `loading` for them.
"""

from __future__ import annotations

import torch

from dhisparse.core.rows import cdiv
from dhisparse.kv.hier import tables
from dhisparse.kv.hier.tail import host_pages
from dhisparse.kv.memory.copies import page_runs
from dhisparse.kv.memory.prefix_store import PagedPrefix
from dhisparse.kv.resident.store import copy_index_pages


def import_prompt(kv, req: object, item, n: int) -> None:
    """req (admitted by `kv`, a `HierarchicalKV`) <- positions 0 .. n-1 of `item`, its whole prompt;
    req is decoding from position n when this returns (module docstring)."""
    ps, st, res, arena = kv.page_size, kv.reqs[req], kv.resident, kv.arena
    full = n // ps
    paged = item.paged(*res.prefix_layout())
    res.ensure_index(req, n)
    copy_index_pages(arena, paged, res.index_tables[req][: cdiv(n, arena.index_page_size)])
    st.tail_start, st.decoding = full * ps, True
    tables.set_tail(kv, st)
    if n > full * ps:
        arena.latent[st.tail_pages[0]].copy_(paged.latent[full], non_blocking=True)
    if req in kv._host_first:
        _to_host(kv, req, paged, full)
        kv.host_first_admits += 1
        kv._place_host_first(req, full, n)
        return
    pages = kv.pool.alloc(req, full)  # from the workspace reservation of its admission
    for run in page_runs([("import", j, d) for j, d in enumerate(pages)]):  # host = the item's page j
        s, d, c = run.host, run.device, run.count
        arena.latent[d : d + c].copy_(paged.latent[s : s + c], non_blocking=True)
    kv.pool.shrink_reservation(req, cdiv(n, ps) - full)  # the partial page went to the tail instead
    kv._place_prompt_pages(req, pages, n)


def _to_host(kv, req: object, paged: PagedPrefix, full: int) -> None:
    """req's own host pages for positions 0 .. full*ps <- the item's first `full` pages [full, L, ps, d]
    (host to host; the resolver's device table is synced by `host_pages`)."""
    if not full:
        return
    pages = host_pages(kv, req, 0, full)
    idx = torch.tensor(pages, dtype=torch.int64, device=kv.host.rows.device)
    kv.host.rows.index_copy_(0, idx, paged.latent[:full].to(kv.host.rows.device))
