"""`HierarchicalKV`: the `hisparse` preset (HiSparse baseline): host backing + fixed hot cache.

Per request (slot s) on device: index pages for the whole history (the indexer scores all of it),
a hot cache of B latent rows (B/ps pages, every layer), two tail pages, and - only while its
prompt is being prefilled - a transient workspace holding the prompt's latent rows. On host:
every immutable latent row.

  positions:  0 ............................ tail_start ........ n (computed)
              |<- host (+ hot cache copies) ->|<- tail (device) ->|

Life of a request's latent rows:
  prefill   rows go to the workspace (resident-style); imported prefixes are copied there too
  handoff   when the prompt is done: complete pages -> host, the partial page -> tail page 0,
            workspace freed (this is the prefill/KV handoff of the paper)
  decode    new rows land in the tail; when a tail page is complete it is backed up to host
            (per completed page) and recycled; from then on the row follows hot-cache rules
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dhisparse.core.batch import ForwardBatch
from dhisparse.core.contracts import KVStore, PrefixMatch, RequestFailures, RowPlace
from dhisparse.core.rows import SPACE, cdiv, next_pow2
from dhisparse.kv.hier.arrival import import_prompt
from dhisparse.kv.hier.census import Census
from dhisparse.kv.hier.context import HierContext
from dhisparse.kv.memory.arena import KVArena
from dhisparse.kv.memory.host import HostStore
from dhisparse.kv.memory.copies import page_runs
from dhisparse.kv.memory.loads import make_loads
from dhisparse.kv.memory.pool import PoolUsage
from dhisparse.kv.hier.prefetch import make_prefetch
from dhisparse.kv.hier.prefix_pages import PrefixPages
from dhisparse.kv.resident.store import ResidentKV, copy_index_pages
from dhisparse.kernels.resolver_ref import ResolverState, plan_reference, run_copies
from dhisparse.kernels.resolver_workspace import PlanWorkspace
from dhisparse.kv.memory.slot_tables import SlotTable

log = logging.getLogger("dhisparse.kv")


@dataclass
class ReqKV:
    slot: int
    hot_pages: list[int]
    tail_pages: list[int]
    decoding: bool = False
    tail_start: int = 0


PLACEMENTS = ("import", "host", "auto")  # where a prefix-matched admission puts the prefix (`_placement`)
STAGING_MODES = ("auto", "paper", "single")  # verification staging (`_build_staging`, kv/hier/promotion.py)


def _page_run(storage: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """The flat storage [len(pages) * page_elems] of consecutive `pages` of an arena's storage
    [P, page_elems] (a view: no copy, no new allocation)."""
    if pages != list(range(pages[0], pages[0] + len(pages))):
        raise RuntimeError(f"staging needs consecutive pages, got {pages[:4]}...: build it before other allocations")
    return storage[pages[0] : pages[0] + len(pages)].reshape(-1)


def _span(layers: list[int], producer: int) -> slice | None:
    """slice(first, last + 1) of a group whose layers are consecutive and start at its producer
    (one layered copy serves the whole group), else None (each layer copies its own rows)."""
    ok = layers and layers[0] == producer and layers[-1] - layers[0] + 1 == len(layers)
    return slice(layers[0], layers[-1] + 1) if ok else None


class HierarchicalKV(KVStore):
    """The `hisparse` store (module docstring). Subclasses (AdaptiveKV) extend it through the
    declared hooks `_next_tail_page` (a completed tail page's successor) and `_place_prompt_pages`
    (where a finished prompt's complete pages go), and the abilities below."""

    can_cover = False
    """Whether `covers` can ever be True (adaptive's ready map): step graphs capture an
    all-direct variant only then."""
    host_census = True
    """Whether an all-direct pass of one query a request may be counted on the host (False for
    DeepSeek-V4's row passes, which are not one call per layer group)."""
    opt_loc: torch.Tensor | None = None
    """[S, W] ready map of published optional rows (adaptive), None without residency."""

    def __init__(self, arena: KVArena, host: HostStore, hot_rows: int, max_slots: int, plan_fn=plan_reference,
                 debug: bool = False, max_queries: int = 1, copy_fn=run_copies, max_len: int | None = None,
                 side_loads: bool = False, deferred: bool = False, source_hot_rows: tuple[int, ...] | None = None,
                 prefetch: str = "compute", placement: str = "import", staging_mode: str = "auto",
                 fuse_copies: bool = False) -> None:
        """max_queries: K_max, the most tokens a decoding request runs per pass (speculative
        verification width); sizes the tail (ps - 1 + K_max positions, page-rounded) and, when
        K_max > 1, a staging arena of K_max * index_topk rows per request slot (eq. 11) for
        union rows that do not fit the hot cache. max_len: the longest request (prompt + output);
        sizes the slot tables up front, so they never move (a captured step graph keeps them).
        side_loads: prefix imports and hand-off backups run beside the batch (kv/memory/loads.py).
        prefetch: "compute" or "side": where follower layers copy a deferred plan's rows
        (kv/hier/prefetch.py; "side" takes effect on CUDA only). placement: "import", "host" or
        "auto", where a prefix-matched admission puts the prefix (`_placement`). staging_mode:
        "paper", "single" or "auto" (`STAGING_MODES`, kv/hier/promotion.py).
        deferred: plan_fn can be enqueued without a host sync (`plan(..., defer=True, workspace=ws)`,
        the Triton resolver: kv/build.py's `Resolver`; `plan_ws` is its persistent scratch).
        fuse_copies (deferred only): the plan kernel copies the rows of the group's producer itself
        (`plan(..., copy=...)`, one launch; kv/hier/context.py's `producer_rows`).
        source_hot_rows: one hot-cache budget B_g per selection group / KV source (the paper's V4.1 setting: 8,192 rows for the source five layers select
        from, 4,096 for the others), each page-rounded and >= index_topk; None: `hot_rows` for every
        one. A request holds max_g B_g rows of pages (a page holds every source's rows), and group
        g's resolver sees only its first B_g entries (`resolver_state`).

          hot_pos [S, G, B_max]   group g uses entries 0 .. B_g - 1; the rest stay -1 forever"""
        self.arena, self.host, self.pool, self.debug = arena, host, arena.pool, debug
        self.page_size, self.device = arena.page_size, arena.device
        self.tail_pages = 1 + cdiv(max_queries, arena.page_size)
        self.resident = ResidentKV(arena, side_loads)  # index pages + prefill workspace (+ its imports)
        self.handoffs = make_loads(arena.device, side_loads)  # hand-off backups device -> host
        self.prefix_pages = PrefixPages(host, arena.page_size, arena.index_page_size, arena.index_split)  # shared prefix host pages
        self.prefix_match = None  # set by the engine: req -> (stored prefix or None, rows it imports)
        self.groups = arena.layout.index_layers
        budgets = source_hot_rows if source_hot_rows is not None else (hot_rows,) * len(self.groups)
        if len(budgets) != len(self.groups):
            raise ValueError(f"source_hot_cache_rows needs one budget per KV source ({len(self.groups)}); got {len(budgets)}")
        self.B_of = tuple(cdiv(b, self.page_size) * self.page_size for b in budgets)  # B_g per group
        self.B = max(self.B_of, default=cdiv(hot_rows, self.page_size) * self.page_size)
        self.group_of = {p.layer: self.groups.index(p.producer) for p in arena.layout.layers}
        self.group_size = [sum(1 for g in self.group_of.values() if g == i) for i in range(len(self.groups))]
        self.group_span = [_span(sorted(l for l, g in self.group_of.items() if g == i), p)
                           for i, p in enumerate(self.groups)]
        G, S, dev = len(self.groups), max_slots, self.device
        # one trailing trash entry each: a graph-safe masked update writes there (kv/hier/promotion.py)
        self._hot_pos_flat = torch.full((S * G * self.B + 1,), -1, dtype=torch.int64, device=dev)
        self._hot_stamp_flat = torch.full_like(self._hot_pos_flat, -1)
        self.hot_pos = self._hot_pos_flat[:-1].view(S, G, self.B)
        self.hot_stamp = self._hot_stamp_flat[:-1].view(S, G, self.B)
        self.hot_loc = torch.zeros(S, self.B, dtype=torch.int64, device=dev)
        self.tail_start = torch.zeros(S, dtype=torch.int64, device=dev)
        self.tail_loc = torch.zeros(S, self.tail_pages * self.page_size, dtype=torch.int64, device=dev)
        self.free_slots = list(range(S))
        ml = max_len or 1
        self.host_pages = SlotTable(S, dev, cdiv(ml, host.page_size))  # each slot's host page list (the resolver's host_table)
        self.index_pages = SlotTable(S, dev, cdiv(ml, arena.index_page_size))  # each slot's index page list (index_locations)
        self.stage = self.stage_loc = self.stage_arenas = None
        self.staging_mode = self._staging_mode(staging_mode)
        paper = self.staging_mode == "paper"
        ks = next_pow2(max_queries) if paper else 1
        self.rank_span, self.stamp_scale = ks, ks * ks  # stamps are now * KS^2 + rank (promotion.py)
        # layer -> its staging arena: its place in its group (paper), else the one arena
        self.arena_of = {l: l - self.groups[g] if paper else 0 for l, g in self.group_of.items()}
        if max_queries > 1:
            self._build_staging(S, max_queries)
        self.reqs: dict[object, ReqKV] = {}
        self.plan_fn, self.copy_fn, self.census, self.now = plan_fn, copy_fn, Census(), 0
        self.now_t = torch.zeros(1, dtype=torch.int64, device=dev)  # `now` on the device (the Triton resolver reads it)
        self.deferred = deferred  # plan(defer=True) never waits for the device
        self.fuse_copies = fuse_copies and deferred
        self.copy_targets: dict[int, object] = {}  # group -> its producer's prepared copy target (context.producer_target)
        self._states: dict[int, ResolverState] = {}  # group -> its resolver state (`resolver_state`)
        # the deferred (Triton) plan's persistent scratch: no allocation or zero-fill launch per call
        self.plan_ws = PlanWorkspace(dev) if deferred else None
        self.prefetch = make_prefetch(self.device, prefetch)  # None: the producer copies for the whole group
        if placement not in PLACEMENTS:
            raise ValueError(f"admission placement must be one of {PLACEMENTS}, got {placement!r}")
        self.placement, self.max_queries = placement, max_queries
        self._host_first: set[object] = set()  # admitted host-first, until freed
        self.host_first_admits = 0
        self.followers = [[l for l in sorted(self.group_of) if self.group_of[l] == i and l != p]
                          for i, p in enumerate(self.groups)]  # group -> its follower layers

    STAGING_PAPER = True  # DeepSeek-V4's row hierarchy keeps one arena (its sources' readers interleave)

    def _staging_mode(self, mode: str) -> str:
        """`staging_mode` resolved: "auto" is "single" (on the H200, adaptive+spec at 8K C18, paper
        staging ran 0.76x single's throughput: docs/benchmarks.md, nineteenth round)."""
        if mode not in STAGING_MODES:
            raise ValueError(f"staging_mode must be one of {STAGING_MODES}, got {mode!r}")
        if mode == "paper" and not self.STAGING_PAPER:
            raise ValueError("staging_mode 'paper' (chi arenas with promotion) is not available for this model's "
                             "row hierarchy (DeepSeek-V4 restages per source); use 'single' or 'auto'")
        if mode == "auto":
            return "single"
        return mode

    def _build_staging(self, slots: int, max_queries: int) -> None:
        """Verification staging (eq. 11): chi arenas of K_max * k rows per request slot.

        single  chi = 1: layers run one after another, so the next layer reuses the arena after the
                previous layer's attention; every layer stages its own rows again
        paper   chi = the most layers of one selection group (4 for GLM-5's groups, 1 for V3.2):
                the group's producer stages every layer of the group at once, layer l of the group
                into arena l - producer; the arenas stay live until the group's promoted rows are
                copied back to the hot cache (`promotion.flush`), then the next group reuses them

        A required allocation living in the pool's own pages: [1, chi, slots * K_max * k, W] is a
        view of the permanent pages' storage (consecutive pages, taken first from a fresh pool), so
        its bytes are counted once and allocated once. stage_loc [slots, K_max * k]: SPACE + the
        staging rows of each slot (the same rows in every arena)."""
        a = self.arena
        if self.staging_mode == "paper" and any(sp is None for sp in self.group_span):
            raise ValueError("staging_mode 'paper' needs every selection group's layers consecutive")
        chi = max(self.arena_of.values(), default=0) + 1
        per_slot = max_queries * a.cfg.index_topk
        n = chi * slots * per_slot * a.row_width  # storage elements
        pages = self.pool.alloc_permanent("staging", cdiv(n, a.page_elems))
        self.stage_arenas = _page_run(a.storage, pages)[:n].view(1, chi, slots * per_slot, a.row_width)
        self.stage = self.stage_arenas[:, 0]
        base = torch.arange(slots * per_slot, dtype=torch.int64, device=self.device).view(slots, per_slot)
        self.stage_loc = SPACE + base

    @property
    def chi(self) -> int:
        """Staging arenas (eq. 11's chi); 0 without staging."""
        return 0 if self.stage_arenas is None else self.stage_arenas.shape[1]

    # -- admission / release -------------------------------------------------------------------
    def required_pages(self, max_total: int) -> int:
        """Pages a request holds for its whole life: hot cache, tail, index history."""
        return self.B // self.page_size + self.tail_pages + self.arena.index_pages_for(max_total)

    def pages_for(self, max_total: int, prompt_len: int | None = None) -> int:
        return self.required_pages(max_total) + self.arena.latent_pages_for(prompt_len if prompt_len is not None else max_total)

    def admit(self, req: object, max_total: int, prompt_len: int | None = None) -> bool:
        if not self.free_slots:
            return False
        return self._admit_with(req, max_total, *self._placement(req, max_total, prompt_len))

    # -- host-first admission: a shared prefix's host pages become the history directly ----------
    HOST_FIRST = True  # DeepSeek-V4's row hierarchy imports its own prefixes (kv/v4/prefix.py): False there

    def _placement(self, req: object, max_total: int, prompt_len: int | None) -> tuple[int, bool]:
        """(pages to reserve, host-first) for admitting req (`placement`, the module docstring):

            import   the prompt's workspace too: the prefix is imported onto the device first
            host     host-first whenever req's prefix is shared on host: no workspace
            auto     import while the workspace fits (`_import_fits`), else host-first
        """
        full = self.pages_for(max_total, prompt_len)
        if self.placement == "import" or not self._can_host_first(req):
            return full, False
        if self.placement == "host" or not self._import_fits(full):
            return self.required_pages(max_total), True
        return full, False

    def _import_fits(self, pages: int) -> bool:
        """Hook: whether `pages` can be reserved now without taking anything back (AdaptiveKV: no
        reclaim of optional history)."""
        return self.pool.available >= pages

    def _can_host_first(self, req: object) -> bool:
        """req's prefix match is shared on host for every complete page it imports, or is a whole
        prompt computed elsewhere (`StoredPrefix.whole_prompt`: its rows go to req's own host pages)."""
        if not self.HOST_FIRST or self.prefix_match is None:
            return False
        item, n = self.prefix_match(req)
        if item is not None and item.whole_prompt:
            return True
        full = n // self.page_size  # 0 without a match
        return full >= 1 and self._borrowable(req) >= full

    def prompt_chunk_limit(self, req: object) -> int | None:
        """A host-first request feeds its prompt through the decode path: at most K_max tokens a
        pass (the tail and staging are sized for that)."""
        return self.max_queries if req in self._host_first else None

    def _import_host_first(self, req: object, item, n: int) -> None:
        """The prefix's complete pages become req's history as borrowed shared host pages (I1 by
        construction); its index keys are imported (they stay on device); the partial last page's
        rows become tail page 0; req then decodes from position n, its prompt's rest fed K_max tokens
        a pass through the resolver (`prompt_chunk_limit`).

            positions  0 ........... full*ps | full*ps .. n-1 | n ..
            host       borrowed shared pages | (also on host)  |
            device     index keys 0 .. n-1   | tail page 0     | tail: the suffix, backed up as it fills
        """
        ps, st = self.page_size, self.reqs[req]
        full = n // ps
        if self.prefix_pages.borrow(req, item, n) < full:
            raise RuntimeError(f"host-first admission of {req!r}: its prefix's {full} host pages are not all shared")
        self.sync_host_table(req)
        res = self.resident
        res.ensure_index(req, n)
        paged = item.paged(*res.prefix_layout())
        idx = res.index_tables[req][: cdiv(n, self.arena.index_page_size)]
        st.tail_start, st.decoding = full * ps, True
        self._set_tail(st)
        arena, tail0 = self.arena, st.tail_pages[0]

        def copies() -> None:
            copy_index_pages(arena, paged, idx)
            if n > full * ps:
                arena.latent[tail0].copy_(paged.latent[full], non_blocking=True)

        res.loads.run(req, copies)
        self.host_first_admits += 1
        self._place_host_first(req, full, n)

    def _place_host_first(self, req: object, full: int, n: int) -> None:
        """Hook: a host-first request's history is its `full` borrowed pages (AdaptiveKV registers
        them as eligible optional history, all backed, none resident)."""

    def _admit_with(self, req: object, max_total: int, need: int, host_first: bool) -> bool:
        if not self.pool.reserve(req, need):
            return False
        if not self.host.admit(req, max_total, self._borrowable(req)):
            self.pool.unreserve(req)
            log.info("request %s waits: host pool cannot hold %d tokens", req, max_total)
            return False
        self.resident.latent_tables[req], self.resident.index_tables[req] = [], []
        st = ReqKV(self.free_slots.pop(0), self.pool.alloc(req, self.B // self.page_size), self.pool.alloc(req, self.tail_pages))
        self.reqs[req] = st
        self.hot_loc[st.slot] = self.arena.locations(st.hot_pages, self.B, self.page_size)
        self.hot_pos[st.slot], self.hot_stamp[st.slot] = -1, -1
        self._set_tail(st)
        if host_first:
            self._host_first.add(req)
        return True

    def never_fits(self, max_total: int, prompt_len: int | None = None) -> str | None:
        """The device pool (KVStore.never_fits), then the host pool: every row of the request's
        history has a host page (I1)."""
        msg = super().never_fits(max_total, prompt_len)
        need, cap = cdiv(max_total, self.host.page_size), self.host.pool.num_pages
        if msg is None and need > cap:
            msg = (f"the request needs {need} host pages but the host pool has {cap}; "
                   "raise --host-pool-bytes or lower max_tokens")
        return msg

    def free(self, req: object) -> None:
        self._host_first.discard(req)
        self.handoffs.settle(req)  # its host pages are reused only after its hand-off copy
        st = self.reqs.pop(req, None)
        self.resident.loads.settle(req)
        self.pool.release(req)
        self.host.free(req)
        self.resident.latent_tables.pop(req, None)
        self.resident.index_tables.pop(req, None)
        if st is not None:
            self.hot_pos[st.slot], self.hot_stamp[st.slot] = -1, -1
            self.host_pages.reset(st.slot)
            self.index_pages.reset(st.slot)
            self.free_slots.append(st.slot)

    def usage(self) -> PoolUsage:
        return self.pool.usage()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.host.check_integrity()
        if self.stage is not None:
            pages = self.pool.owned_by("staging")
            assert len(pages) * self.arena.page_nbytes >= self.stage_arenas.numel() * self.stage.element_size()
            assert self.stage.data_ptr() == self.arena.storage[min(pages)].data_ptr(), "staging is not its pages' storage"
        for req, st in self.reqs.items():
            held = self.resident.latent_tables[req] + self.resident.index_tables[req] + st.hot_pages + st.tail_pages
            assert sorted(self.pool.owned_by(req)) == sorted(held), f"pages of {req!r} disagree with the pool"
            if st.decoding:  # I1: every row before the tail has a host page, mirrored for the resolver
                pages = self.host.tables[req]
                assert len(pages) * self.host.page_size >= st.tail_start
                assert self.host_table[st.slot, : len(pages)].tolist() == pages
                for p in {0, st.tail_start // 2, st.tail_start - 1} if st.tail_start else ():
                    place = self.row_place(req, p)
                    assert place.host >= 0 or place.tier == "optional", f"I1: row {p} of {req!r} has no host copy ({place})"
                if not self.loading(req):
                    self._check_hot_rows(req, st)

    def _check_hot_rows(self, req: object, st: ReqKV) -> None:
        """I2 at rest: every hot-cache entry of req names a history position whose row, in every
        layer of its group, is byte-identical to its host copy (paper staging's copy-back and
        promotion write these entries outside the resolver)."""
        ps, hps = self.page_size, self.host.page_size
        table = torch.tensor(self.host.tables[req], dtype=torch.int64)
        for g in range(len(self.groups)):
            pos = self.hot_pos[st.slot, g, : self.B_of[g]]
            live = (pos >= 0).nonzero().squeeze(1)
            if not live.numel():
                continue
            p = pos[live].cpu()
            assert bool((p < st.tail_start).all()), f"hot entries of {req!r} hold tail positions {p.tolist()[:4]}"
            hloc = table[p // hps] * hps + p % hps
            dloc = self.hot_loc[st.slot, live].cpu()
            for layer in [self.groups[g]] + self.followers[g]:
                dev = self.arena.latent_rows(layer)[dloc // ps, dloc % ps].cpu()
                host = self.host.layer_rows(layer)[hloc // hps, hloc % hps].cpu()
                assert torch.equal(dev.view(torch.uint8), host.view(torch.uint8)), \
                    f"hot rows of {req!r}, group {g}, layer {layer} differ from their host copies"

    # -- prefix import / export (prefill workspace) --------------------------------------------
    def write_rows(self, req: object, latent: torch.Tensor, index: torch.Tensor, start: int = 0) -> None:
        self.resident.write_rows(req, latent, index, start)

    def import_prefix(self, req: object, item, n: int) -> None:
        """A stored prefix into req's prefill workspace (ResidentKV.import_prefix); its complete
        imported pages borrow the prefix's shared host pages (kv/hier/prefix_pages.py). A request
        admitted host-first takes `_import_host_first` instead; a whole prompt computed elsewhere
        (`StoredPrefix.whole_prompt`) is imported and handed off at once (kv/hier/arrival.py)."""
        if item.whole_prompt:
            return import_prompt(self, req, item, n)
        if req in self._host_first:
            return self._import_host_first(req, item, n)
        self.resident.import_prefix(req, item, n)
        self.prefix_pages.borrow(req, item, n)

    def prefix_layout(self) -> tuple[int, int]:
        return self.resident.prefix_layout()

    def set_prefix_match(self, match: PrefixMatch) -> None:
        """Admission reserves no host page for the complete pages a request will borrow."""
        self.prefix_match = match

    def staging_rows(self, layer: int = 0) -> torch.Tensor | None:
        """[1, slots * K_max * k, W] the staging arena layer `layer` reads (None: no staging)."""
        return None if self.stage is None else self.stage_arenas[:, self.arena_of[layer]]

    @property
    def stamp_now(self) -> int:
        """The LRU stamp of this pass's resolver calls: now * KS^2 (paper staging: a row's rank in
        its round is added, `promotion.rank_stamps`); `now_t` holds the same on the device."""
        return self.now * self.stamp_scale

    @property
    def hot_cache_rows(self) -> int:
        return self.B

    def host_usage(self):
        return self.host.pool.usage()

    def resolver_census(self) -> Census:
        return self.census

    def covers(self, reqs: list[object]) -> bool:
        """Whether every complete history page of `reqs` is on the device (published): then every
        selection resolves from the tail and the ready map with no resolver call. Never under
        hisparse (AdaptiveKV)."""
        return False

    def row_place(self, req: object, position: int, layer: int = 0) -> RowPlace:
        """Where row `position` of req lives for `layer` (the one answer the debug checks and tests
        use). A prefilling request's rows are in its workspace. A decoding request's row is read
        from the first tier that holds it, in the resolver's order:

            positions  0 ................................ tail_start ........ n-1
            tail                                          |<- tail_loc[slot] ->|
            optional   opt_loc[slot, p] >= 0 (adaptive: published pages)
            hot        hot_pos[slot, group] == p -> hot_loc[slot, that entry]
            host       host.tables[req][p // ps] * ps + p % ps   (every p < tail_start: I1)

        `host` is reported whenever the row has a host copy, whatever tier attention reads.
        Staged rows exist only inside one verification pass: a location >= SPACE of that pass.
        """
        st, ps = self.reqs[req], self.page_size
        pages = self.host.tables.get(req, [])
        backed = position // ps < len(pages) and self._host_backed(req, st, position // ps)
        host = pages[position // ps] * ps + position % ps if backed else -1
        if not st.decoding:
            table = self.resident.latent_tables[req]
            if position // ps >= len(table):
                return RowPlace("none", host=host)
            return RowPlace("workspace", table[position // ps] * ps + position % ps, host)
        if position >= st.tail_start:
            j = position - st.tail_start
            if j >= self.tail_loc.shape[1]:
                return RowPlace("none", host=host)
            return RowPlace("tail", int(self.tail_loc[st.slot, j]), host)
        if self.opt_loc is not None and int(self.opt_loc[st.slot, position]) >= 0:
            return RowPlace("optional", int(self.opt_loc[st.slot, position]), host)
        g = self.group_of[layer]
        hit = (self.hot_pos[st.slot, g] == position).nonzero()
        if hit.numel():
            return RowPlace("hot", int(self.hot_loc[st.slot, int(hit[0, 0])]), host)
        return RowPlace("host" if host >= 0 else "none", -1, host)

    def _host_backed(self, req: object, st: ReqKV, j: int) -> bool:
        """Hook: whether page index j of decoding req has its host copy (issued in stream order).
        hisparse: every complete page before the tail (the hand-off and tail backups)."""
        return st.decoding and (j + 1) * self.page_size <= st.tail_start

    def _borrowable(self, req: object) -> int:
        """Host pages req will borrow from its shared prefix (its host reservation skips them)."""
        item, n = self.prefix_match(req) if self.prefix_match is not None else (None, 0)
        if item is None or item.whole_prompt:  # a whole prompt computed elsewhere is never shared
            return 0
        return self.prefix_pages.borrowable(item, n)

    def loading(self, req: object) -> bool:
        """Whether req waits for its prefix import or its hand-off backup (kv/memory/loads.py)."""
        return self.resident.loading(req) or self.handoffs.loading(req)

    def read_rows(self, req: object, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.resident.read_rows(req, n)

    # -- passes --------------------------------------------------------------------------------
    def graph_context(self) -> type:
        """The context class of this store's passes (its step graphs' `graph_templates`)."""
        return HierContext

    def context(self, batch: ForwardBatch, reqs: list[object]) -> HierContext:
        self.now += 1
        if self.deferred:
            self.now_t.fill_(self.stamp_now)  # no sync; a replayed step graph reads the stamp from here
        for r, req in enumerate(reqs):
            n = batch.lens[r]
            self.resident.ensure_index(req, n) if self.reqs[req].decoding else self.resident.ensure(req, n)
        self._sync_index_pages(reqs)
        return HierContext(self, batch, reqs)

    def _sync_index_pages(self, reqs: list[object]) -> None:
        """Bring the device index page table up to date for `reqs` (only pages added since the
        last sync travel, `SlotTable.sync`)."""
        self.index_pages.sync((self.reqs[q].slot, self.resident.index_tables[q]) for q in reqs)

    @property
    def idx_pages(self) -> torch.Tensor:
        """[S, width] index page of each page-of-positions of each slot's request (-1: none)."""
        return self.index_pages.t

    @property
    def host_table(self) -> torch.Tensor:
        """[S, width] host page of each page-of-positions of each slot's request (-1: none)."""
        return self.host_pages.t

    def index_locations(self, slots_t: torch.Tensor, lens_t: torch.Tensor, W: int) -> torch.Tensor:
        """[N, W] index-row locations of positions 0..W-1 of the requests in slots `slots_t` [N]
        (-1 at and past lens_t [N]): device ops only (a step graph computes them in the graph)."""
        return self.index_pages.locations(slots_t, lens_t, W, self.arena.index_page_size)

    def before_sync(self) -> None:
        """Upkeep that needs no result of the step just launched, run while it computes: free the
        workspace pages of finished hand-offs (AdaptiveKV's residency adds more)."""
        self.handoffs.poll()

    def idle(self) -> None:
        """Wait out the hand-offs in flight (their workspace pages are freed as each finishes)."""
        while self.handoffs.pending:
            self.handoffs.poll()

    def after_step(self, computed: dict[object, tuple[int, bool]]) -> None:
        """computed: req -> (positions with KV, prompt done). Hand off requests whose prompt just
        finished; back up completed tail pages of decoding requests. A request whose work raises
        does not stop the others': the failures are raised together at the end (RequestFailures)."""
        failures = {}
        for req, (n, prompt_done) in computed.items():
            st = self.reqs.get(req)
            if st is None:
                continue
            try:
                if st.decoding:
                    self._backup_tail(req, st, n)
                elif prompt_done:
                    self._handoff(req, st, n)
            except AssertionError:  # a violated invariant or debug check: never a request's own fault
                raise
            except Exception as e:  # noqa: BLE001 - that request is aborted by the engine
                failures[req] = e
        if failures:
            raise RequestFailures(failures)

    def _set_tail(self, st: ReqKV) -> None:
        self.tail_start[st.slot] = st.tail_start
        self.tail_loc[st.slot] = self.arena.locations(st.tail_pages, self.tail_pages * self.page_size, self.page_size)

    def _pages_to_host(self, req: object, dev_pages: list[int], start: int) -> None:
        """Back up whole device pages (every layer's rows) into req's host pages for positions
        start .. start + len(dev_pages) * ps (start page aligned). Device and host pages share the
        layout [L, ps, d], so each run of pages consecutive on both sides is one copy, asynchronous
        on CUDA (pinned host memory) and ordered before any later kernel that reuses the device
        page (I3 by stream order).

            positions  | start ............ | +ps .............. | ...
            device     dev_pages[0]          dev_pages[1]
            host       host.tables[req][start / ps], ...
        """
        host_pages = self._host_pages(req, start, len(dev_pages))
        self._copy_runs([("backup", h, d) for d, h in zip(dev_pages, host_pages)])

    def _host_pages(self, req: object, start: int, count: int) -> list[int]:
        """req's host pages for positions start .. start + count * ps (start page aligned),
        allocated if new and mirrored into the resolver's device table."""
        ps = self.page_size
        self.host.ensure(req, start + count * ps)
        self.sync_host_table(req)
        return self.host.tables[req][start // ps : start // ps + count]

    def _copy_runs(self, pairs: list[tuple[str, int, int]]) -> None:
        """(kind, host page, device page) whole-page copies, one per run of pages consecutive on
        both sides (`page_runs`): 'backup' device -> host, otherwise host -> device; asynchronous
        on CUDA (pinned host memory), in order on the current stream."""
        for run in page_runs(pairs):
            host = self.host.rows[run.host : run.host + run.count]
            dev = self.arena.latent[run.device : run.device + run.count]
            if run.kind == "backup":
                if any(self.host.is_shared(h) for h in range(run.host, run.host + run.count)):
                    raise RuntimeError(f"a backup would write shared host pages {run.host}..{run.host + run.count - 1}")
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)

    def _handoff(self, req: object, st: ReqKV, n: int) -> None:
        """The prompt is done: the partial page becomes tail page 0 now, the workspace pages past
        the complete ones are freed, and the complete pages go where `_place_prompt_pages` puts
        them (hisparse: to host; adaptive: kept as optional history).

            positions  0 ............ full | full .. n-1
            workspace  pages[: full/ps]    | pages[full/ps] -> tail page 0 (same in-page offsets)
        """
        ps = self.page_size
        full = n // ps
        pages = self.resident.latent_tables[req]
        st.tail_start = full * ps
        self._set_tail(st)
        if n > full * ps:
            self.arena.latent[st.tail_pages[0]].copy_(self.arena.latent[pages[full]])
        self.pool.free(req, pages[full:])
        self.resident.latent_tables[req] = []
        st.decoding = True
        self._place_prompt_pages(req, pages[:full], n)

    def _place_prompt_pages(self, req: object, pages: list[int], n: int) -> None:
        """Hook: hisparse's hand-off of a finished prompt's complete workspace pages `pages`
        (positions 0 .. len(pages) * ps). They go to host (`handoffs`: in stream order, or on a
        side stream with req `loading` until they are there, since its history is read from host
        from the next pass on) and are freed once their copy is done (they belong to
        ("handoff", req) meanwhile). Pages whose host copy is a borrowed shared prefix page are
        freed at once, with no copy.

            pages      [0 .. b)  borrowed: freed now | [b .. full) -> host, then freed
        """
        host_pages = self._host_pages(req, 0, len(pages))  # borrowed ones first, then req's own
        b = self.host.borrowed_pages(req)
        self.pool.free(req, pages[:b])  # already on host (read by this step's kernels: stream order)
        moving = pages[b:]
        if not moving:
            return
        owner = ("handoff", req)
        self.pool.transfer(req, owner, moving)
        pairs = [("backup", h, d) for d, h in zip(moving, host_pages[b:])]
        self.handoffs.run(req, lambda: self._copy_runs(pairs), on_done=lambda: self.pool.free(owner, moving))

    def _backup_tail(self, req: object, st: ReqKV, n: int) -> None:
        """Completed tail pages go to host, one page at a time; `_next_tail_page` says what takes
        the completed page's place at the tail's end.

            tail   [done | t1 | ...]  ->  [t1 | ... | next]      tail_start += ps
        """
        ps = self.page_size
        while n - st.tail_start >= ps:
            done = st.tail_pages[0]
            self._pages_to_host(req, [done], st.tail_start)
            st.tail_pages = st.tail_pages[1:] + [self._next_tail_page(req, st, done)]
            st.tail_start += ps
            self._set_tail(st)

    def _next_tail_page(self, req: object, st: ReqKV, done: int) -> int:
        """Hook: the page that takes completed tail page `done`'s place (positions st.tail_start ..
        + ps, already backed up). hisparse recycles it."""
        return done

    def sync_host_table(self, req: object) -> None:
        """Mirror req's host page list into the device table the resolver reads (pages added since
        the last sync only); called when host pages are added, not on every resolver call."""
        self.host_pages.sync([(self.reqs[req].slot, self.host.tables[req])])

    @property
    def replayable(self) -> bool:
        """Whether decode passes can replay from a step graph: the deferred (sync-free) resolver
        and no debug checks (they read the device)."""
        return self.deferred and not self.debug

    def graph_fingerprint(self) -> tuple:
        """Addresses a captured step graph bakes in that can change while serving: the host table
        and the index page table are reallocated when a history outgrows them (`sync_host_table`,
        `_sync_index_pages`), which retires graphs."""
        return self.host_pages.fingerprint() + self.index_pages.fingerprint()

    def resolver_state(self, group: int) -> ResolverState:
        """Group `group`'s resolver state: its B_g hot entries (strided views of the [S, G, B_max]
        tables), the tails and the host table. Built once a group and kept (`_states`): its views
        never move, and the host table is re-read every call (it is reallocated when a history
        outgrows it, `sync_host_table`), so a call costs no tensor ops (host time per resolver call)."""
        table = self.host_table
        st = self._states.get(group)
        if st is None:
            b = self.B_of[group]
            st = self._states[group] = ResolverState(self.hot_pos[:, group, :b], self.hot_stamp[:, group, :b],
                                                     self.hot_loc[:, :b], self.tail_start, self.tail_loc, table,
                                                     self.host.page_size)
        st.host_table = table
        return st
