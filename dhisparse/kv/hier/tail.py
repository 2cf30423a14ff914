"""A decoding request's tail, and the whole-page copies between device and host pages that back
its rows up (the hand-off's too, kv/hier/handoff.py; adaptive's backups and repopulations).

New rows land in the tail (`tail_pages`: ps - 1 + K_max positions, page-rounded). Once a tail page
is complete it is backed up to host (I1) and the tail rolls one page on, tail_start += ps;
`HierarchicalKV._next_tail_page` says which page takes its place at the tail's end:

    positions   ...... | tail_start .. +ps-1 | +ps .. | ... n-1
    before      host   | done (complete)     | t1     | ...        tail pages [done | t1 | ...]
    after       host   | host (done's copy)  | t1     | ...        tail pages [t1 | ... | next]
"""

from __future__ import annotations

from dhisparse.kv.hier import tables
from dhisparse.kv.memory.copies import page_runs


def backup_tail(kv, req: object, st, n: int) -> None:
    """req (state st) has KV for positions 0 .. n-1: its completed tail pages go to host, one page
    at a time (`kv._pages_to_host`), each replaced by `kv._next_tail_page` (module docstring)."""
    ps = kv.page_size
    while n - st.tail_start >= ps:
        done = st.tail_pages[0]
        kv._pages_to_host(req, [done], st.tail_start)
        st.tail_pages = st.tail_pages[1:] + [kv._next_tail_page(req, st, done)]
        st.tail_start += ps
        tables.set_tail(kv, st)


def pages_to_host(kv, req: object, dev_pages: list[int], start: int) -> None:
    """Back up whole device pages (every layer's rows) into req's host pages for positions
    start .. start + len(dev_pages) * ps (start page aligned), through `kv._copy_runs`.

        positions  | start ............ | +ps .............. | ...
        device     dev_pages[0]          dev_pages[1]
        host       host.tables[req][start / ps], ...
    """
    pages = host_pages(kv, req, start, len(dev_pages))
    kv._copy_runs([("backup", h, d) for d, h in zip(dev_pages, pages)])


def host_pages(kv, req: object, start: int, count: int) -> list[int]:
    """req's host pages for positions start .. start + count * ps (start page aligned),
    allocated if new and mirrored into the resolver's device table."""
    ps = kv.page_size
    kv.host.ensure(req, start + count * ps)
    kv.sync_host_table(req)
    return kv.host.tables[req][start // ps : start // ps + count]


def copy_runs(kv, pairs: list[tuple[str, int, int]]) -> None:
    """(kind, host page, device page) whole-page copies, one per run of pages consecutive on
    both sides (`page_runs`): 'backup' device -> host, otherwise host -> device. Device and host
    pages share the layout [L, ps, d]; asynchronous on CUDA (pinned host memory), in order on the
    current stream, so a backup is ordered before any later kernel that reuses the device page
    (I3 by stream order). A backup never writes a shared prefix page (kv/hier/prefix_pages.py)."""
    for run in page_runs(pairs):
        host = kv.host.rows[run.host : run.host + run.count]
        dev = kv.arena.latent[run.device : run.device + run.count]
        if run.kind == "backup":
            if any(kv.host.is_shared(h) for h in range(run.host, run.host + run.count)):
                raise RuntimeError(f"a backup would write shared host pages {run.host}..{run.host + run.count - 1}")
            host.copy_(dev, non_blocking=True)
        else:
            dev.copy_(host, non_blocking=True)
