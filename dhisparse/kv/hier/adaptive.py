"""`AdaptiveKV`: the `adaptive` preset (Adaptive HiSparse) = hisparse + load-adaptive residency.

Differences from `HierarchicalKV`:
  admission  resident-first: if admitting leaves a deficit (eq. 3 with the reserve), optional
             pages of other requests are reclaimed first (eq. 4); if they cannot cover it, the
             admission waits
  handoff    complete prompt pages stay on device as published optional pages; their host backup
             is deferred until memory pressure: then `backup_ahead_pages` per step are backed up
             while they stay published, so a reclaim rarely copies on the admission path
  decode     the resolver's direct path reads the ready optional map (`opt_loc`) before scanning
  each step  right after the launch (`before_sync`): finished copies are published / retired,
             drained pages freed, and a bounded round-robin repopulates reclaimed history from
             host while pages are spare and no admission waits for memory
"""

from __future__ import annotations

import logging

import torch

from dhisparse.kv.memory.copies import CopyItem, copy_engine_for
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from dhisparse.kv.hier.residency import ResidencyManager, opt_owner
from dhisparse.kv.hier.tables import ReqKV
from dhisparse.kernels.resolver_ref import ResolverState

log = logging.getLogger("dhisparse.kv")


class AdaptiveKV(HierarchicalKV):
    can_cover = True

    def __init__(self, *args, reserve_pages: int | None = None, reclaim_order: str = "remaining",
                 repopulate_pages: int = 4, max_len: int = 4096, side_stream: bool = True, backup_ahead_pages: int = 32,
                 keep_decode_pages: bool = True, **kw) -> None:
        """side_stream: on CUDA, backup / repopulation copies run on a side stream (kv/memory/copies.py).
        backup_ahead_pages: host backups started per step under memory pressure (0: only when a
        reclaim needs them, on the admission path). reserve_pages: M_res of eq. 3; None =
        `default_reserve`. keep_decode_pages: completed decode pages stay as optional history (our
        extension; False: the paper's rule, decode rows stay under the tail and hot-cache rules)."""
        self.keep_decode_pages = keep_decode_pages
        super().__init__(*args, max_len=max_len, **kw)
        if reserve_pages is None:
            reserve_pages = self.default_reserve(max_len)
        S = self.hot_pos.shape[0]
        width = -(-max_len // self.page_size) * self.page_size  # whole pages
        self._opt_loc = torch.full((S, width), -1, dtype=torch.int64, device=self.device)
        self._pending_map: dict[tuple[int, int], int] = {}  # (slot, page index) -> device page, -1: unpublished
        self.copies = copy_engine_for(self.device, self.copy_page, side_stream, copy_many=self.copy_pages)
        self.res = ResidencyManager(self.pool, reserve_pages, self.copies, reclaim_order, repopulate_pages,
                                    self._publish, self._unpublish)
        self.max_total: dict[object, int] = {}
        self._waiting_logged: object = None
        self._published: dict[object, set[int]] = {}  # req -> published page indices (host-side mirror of opt_loc)
        self.backup_ahead_pages = backup_ahead_pages
        self._last_need = 0  # pages the latest admission attempt needed: the pressure test's yardstick
        self._steps = 0  # steps finished (after_step calls)
        self._blocked_at = -1  # the step whose admission attempt lacked memory (see `_waiting`)

    # -- publication (ready map) ----------------------------------------------------------------
    @property
    def opt_loc(self) -> torch.Tensor:
        """[S, max_len rounded up to whole pages] ready map: location of each published optional
        row (-1: none). Pending
        publications are applied first, so every reader sees them."""
        if self._pending_map:
            self._flush_ready_map()
        return self._opt_loc

    def prepare_replay(self) -> None:
        """Apply pending ready-map changes now: a replayed step graph reads `_opt_loc` directly
        (the eager forward flushes on its first `opt_loc` read)."""
        self.opt_loc

    def _publish(self, req: object, j: int, page: int) -> None:
        self._pending_map[(self.reqs[req].slot, j)] = page
        self._published.setdefault(req, set()).add(j)

    def _unpublish(self, req: object, j: int) -> None:
        self._published.get(req, set()).discard(j)
        st = self.reqs.get(req)
        if st is not None:
            self._pending_map[(st.slot, j)] = -1

    def _flush_ready_map(self) -> None:
        """Pending (un)publications -> the ready map in one batched write, the last change of each
        page winning (a handoff publishes a whole prompt at once: one small copy, not one per page).

            opt_loc[slot, j*ps : (j+1)*ps] = page*ps + 0..ps-1   (or -1)
        """
        items = list(self._pending_map.items())
        self._pending_map.clear()
        meta = torch.tensor([[s, j, p] for (s, j), p in items], dtype=torch.int64)  # host: [n, 3]
        ps, width = self.page_size, self._opt_loc.shape[1]
        off = torch.arange(ps)
        pos = meta[:, :1] * width + meta[:, 1:2] * ps + off  # [n, ps] flat positions in the map
        val = torch.where(meta[:, 2:] >= 0, meta[:, 2:] * ps + off, -1)  # [n, ps] row locations
        both = torch.stack([pos.reshape(-1), val.reshape(-1)]).to(self.device, non_blocking=True)  # one copy
        self._opt_loc.view(-1).index_copy_(0, both[0], both[1])

    def copy_page(self, kind: str, req: object, j: int, page: int) -> None:
        """Copy page index j of req between its device page and its host page (all layers: both
        are [L, ps, d]); asynchronous on CUDA, ordered before later kernels by the stream. A copy
        of a released request is skipped (it was cancelled; nothing reads it)."""
        self.copy_pages([(kind, req, j, page)])

    def copy_pages(self, items: list[CopyItem]) -> None:
        """A launched batch of `copy_page`s: pages consecutive on both sides move in one copy
        (`page_runs`; the pool hands out and takes back pages in FIFO order, so a request's pages
        often are)."""
        pairs = []
        for kind, req, j, page in items:
            table = self.host.tables.get(req)
            if table is not None:
                pairs.append((kind, table[j], page))
        self._copy_runs(pairs)

    def progress(self) -> None:
        for kind, req, j in self.copies.poll():
            self.res.on_copy_done(kind, req, j)
        self.res.collect()

    # -- admission --------------------------------------------------------------------------------
    def admit(self, req: object, max_total: int, prompt_len: int | None = None) -> bool:
        if not self.free_slots:
            return False  # no request slot: reclaiming memory would not help
        self.progress()
        need, host_first = self._placement(req, max_total, prompt_len)
        self._last_need = need
        if self.res.deficit(need) > 0:
            self._blocked_at = self._steps  # this step's attempt lacks memory (reset if it succeeds)
            if not self.res.reclaim(need):
                if self._waiting_logged != req:
                    log.info("request %s waits: %d pages needed, optional history cannot cover the deficit", req, need)
                    self._waiting_logged = req
                return False
            self.progress()
            if self.res.deficit(need) > 0:
                return False  # backups / readers still in flight; retry next step
        if not self._admit_with(req, max_total, need, host_first):
            return False
        self.max_total[req] = max_total
        self._blocked_at = -1
        return True

    def _import_fits(self, pages: int) -> bool:
        """The import fits without reclaiming optional history (the reserve stays untouched)."""
        return self.res.deficit(pages) <= 0

    def _place_host_first(self, req: object, full: int, n: int) -> None:
        """Host-first: the `full` borrowed prefix pages are req's eligible history, all backed up
        (on host), none resident: repopulation may bring them onto the device while memory is spare."""
        self.res.register(req, full, {}, set(range(full)), self.max_total.get(req, n) - n)

    def _host_backed(self, req: object, st: ReqKV, j: int) -> bool:
        """Complete pages before the tail that are not optional history were backed up when they
        left the tail (or retired only after their backup, I1); optional pages once `backed`."""
        r = self.res.reqs.get(req)
        if r is not None and j in r.pages and j not in r.backed:
            return False
        return super()._host_backed(req, st, j)

    def residency(self) -> ResidencyManager:
        return self.res

    def default_reserve(self, max_len: int) -> int:
        """M_res by default: the pages a request holds for its whole life at the longest context
        (hot cache, tail, index history: `required_pages(max_len)`), capped at an eighth of the
        pool. An arrival then finds its fixed state free at once, and a reclaim of optional
        history only has to cover its prompt's workspace; the cap keeps small pools usable."""
        return min(self.required_pages(max_len), self.pool.capacity // 8)

    def never_fits(self, max_total: int, prompt_len: int | None = None) -> str | None:
        """Also: optional history never takes the reserve, so even an idle pool gives a request at
        most its capacity less M_res (eq. 3)."""
        msg = super().never_fits(max_total, prompt_len)
        need, room = self.pages_for(max_total, prompt_len), self.pool.capacity - self.res.reserve
        if msg is None and need > room:
            msg = (f"the request needs {need} KV pages but the pool less the admission reserve "
                   f"({self.res.reserve} pages) gives at most {room}; raise --kv-pool-bytes, lower "
                   "--admission-reserve-pages or lower max_tokens")
        return msg

    def covers(self, reqs: list[object]) -> bool:
        """Every complete history page of every request in `reqs` is published (host-side check):
        any selection then resolves from the tail and the ready map, with no resolver call."""
        ps = self.page_size
        return all(len(self._published.get(q, ())) * ps >= self.reqs[q].tail_start for q in reqs)

    def _next_tail_page(self, req: object, st: ReqKV, done: int) -> int:
        """While a pool page beyond the reserve is free, the completed page (backed up to host as
        under hisparse) also stays on the device as published optional history and a fresh spare
        page takes its place in the tail, so low-load decoding keeps resolving directly. This is
        our extension (`--decode-pages optional`); with "hot-cache" (the paper's rule) the page is
        recycled as under hisparse."""
        if not self.keep_decode_pages or not self.res.can_keep():
            return done
        fresh = self.pool.alloc(req, 1, spare=True)[0]  # a spare page: req's reservation still covers its own growth
        self.res.keep(req, st.tail_start // self.page_size, done)
        return fresh

    def free(self, req: object) -> None:
        st = self.reqs.get(req)
        self.res.release(req)
        self._published.pop(req, None)
        if st is not None:
            self._pending_map = {k: v for k, v in self._pending_map.items() if k[0] != st.slot}
            self._opt_loc[st.slot] = -1
        self.max_total.pop(req, None)
        super().free(req)
        # optional pages still draining stay owned by ("opt", req) until collected

    # -- passes -----------------------------------------------------------------------------------
    def context(self, batch, reqs):
        self.res.begin_pass()
        return super().context(batch, reqs)

    def before_sync(self) -> None:
        """Residency upkeep that needs none of this step's results, run while the device computes
        the step (the engine calls it right after the launch, before it waits for tokens or
        acceptances): finished copies, repopulation while pages are spare, backups ahead of
        need under pressure. Its copies are ordered after the step's kernels (copies.py)."""
        super().before_sync()
        self.progress()
        if not self._waiting():  # while an admission waits for memory a refilled page would only be reclaimed
            self.res.repopulate()
        if self.backup_ahead_pages and self.res.deficit(self._last_need) > 0:  # the next admission would reclaim
            self.res.backup_ahead(self.backup_ahead_pages)
        self.progress()

    def idle(self) -> None:
        """Also wait out backups and repopulations in flight: a finished request's optional pages
        still draining (owned by ("opt", req)) are collected, so an idle pool holds no dead pages."""
        super().idle()
        self.progress()
        while self.copies.in_flight():
            self.progress()

    def _waiting(self) -> bool:
        """An admission attempt of this step lacked memory (the scheduler retries the head of its
        queue every step, so an aborted or admitted waiter stops counting by the next step)."""
        return self._blocked_at == self._steps

    def after_step(self, computed: dict[object, tuple[int, bool]]) -> None:
        try:
            super().after_step(computed)
        finally:  # per-request failures (RequestFailures) still end the step's residency bookkeeping
            self._finish_step(computed)

    def _finish_step(self, computed: dict[object, tuple[int, bool]]) -> None:
        self._steps += 1
        self.res.end_pass()
        for req, (n, _) in computed.items():
            if req in self.max_total:
                self.res.set_remaining(req, self.max_total[req] - n)

    def _place_prompt_pages(self, req: object, pages: list[int], n: int) -> None:
        """Resident-first: the complete prompt pages stay on device as optional history (no host
        copy yet; borrowed shared prefix pages count as backed up)."""
        self.host.ensure(req, n)
        self.sync_host_table(req)
        backed = set(range(self.host.borrowed_pages(req)))  # borrowed shared prefix pages: on host already
        self.res.register(req, len(pages), dict(enumerate(pages)), backed, self.max_total.get(req, n) - n)

    def resolver_state(self, group: int) -> ResolverState:
        st = super().resolver_state(group)
        st.direct_loc = self.opt_loc
        return st

    def check_integrity(self) -> None:
        super().check_integrity()
        self.res.check()
        assert self.pool.available >= 0

    def owned_pages(self, req: object) -> list[int]:
        return self.pool.owned_by(opt_owner(req))
