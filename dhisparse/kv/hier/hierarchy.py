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

The class holds the store's public surface and its hooks; the work is in modules of its own:

  tables.py         the selection groups, the hot-cache / tail / slot tables and their sync
  staging_arena.py  verification staging's arenas (eq. 11), built once
  admission.py      placement, reservation and slot of an admitted request; its release
  handoff.py        the prompt's hand-off, and the host-first import that skips the workspace
  tail.py           the decode tail's completed pages to host; device <-> host page copies
  integrity.py      `row_place` and the checks at rest (I1, I2, page ownership)
"""

from __future__ import annotations

import torch

from dhisparse.core.batch import ForwardBatch
from dhisparse.core.contracts import KVStore, PrefixMatch, RequestFailures, RowPlace
from dhisparse.core.rows import cdiv
from dhisparse.kv.hier import admission, handoff, integrity, staging_arena, tables, tail
from dhisparse.kv.hier.arrival import import_prompt
from dhisparse.kv.hier.census import Census
from dhisparse.kv.hier.context import HierContext
from dhisparse.kv.hier.staging_arena import STAGING_MODES  # noqa: F401 - engine/config.py reads it here
from dhisparse.kv.hier.tables import ReqKV
from dhisparse.kv.memory.arena import KVArena
from dhisparse.kv.memory.host import HostStore
from dhisparse.kv.memory.loads import make_loads
from dhisparse.kv.memory.pool import PoolUsage
from dhisparse.kv.hier.prefetch import make_prefetch
from dhisparse.kv.hier.prefix_pages import PrefixPages
from dhisparse.kv.resident.store import ResidentKV
from dhisparse.kernels.resolver_ref import ResolverState, plan_reference, run_copies
from dhisparse.kernels.resolver_workspace import PlanWorkspace

PLACEMENTS = ("import", "host", "auto")  # where a prefix-matched admission puts the prefix (`_placement`)


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
                 fuse_copies: bool = False, hot_index: bool = False) -> None:
        """max_queries: K_max, the most tokens a decoding request runs per pass (speculative
        verification width); sizes the tail (ps - 1 + K_max positions, page-rounded) and, when
        K_max > 1, a staging arena of K_max * index_topk rows per request slot (eq. 11) for
        union rows that do not fit the hot cache. max_len: the longest request (prompt + output);
        sizes the slot tables up front, so they never move (a captured step graph keeps them).
        side_loads: prefix imports and hand-off backups run beside the batch (kv/memory/loads.py).
        prefetch: "compute" or "side": where follower layers copy a deferred plan's rows
        (kv/hier/prefetch.py; "side" takes effect on CUDA only). placement: "import", "host" or
        "auto", where a prefix-matched admission puts the prefix (`_placement`). staging_mode:
        "paper", "single" or "auto" (`STAGING_MODES`, kv/hier/staging_arena.py, kv/hier/promotion.py).
        deferred: plan_fn can be enqueued without a host sync (`plan(..., defer=True, workspace=ws)`,
        the Triton resolver: kv/build.py's `Resolver`; `plan_ws` is its persistent scratch).
        fuse_copies (deferred only): the plan kernel copies the rows of the group's producer itself
        (`plan(..., copy=...)`, one launch; kv/hier/resolver_step.py's `producer_rows`).
        hot_index: keep `hot_entry` [S, G, W] int16, each group's position -> hot entry index
        (tables.py; needs max_len): the resolver finds hits by a lookup instead of a scan.
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
        tables.build_groups(self, hot_rows, source_hot_rows)  # groups, B_of, B, group_of, group_span, followers
        tables.build_tables(self, max_slots, max_len, hot_index)  # hot cache (+ index), tail, slot tables; slots free
        staging_arena.build(self, max_slots, max_queries, staging_mode)  # stage, stage_loc, arena_of, stamp_scale
        self.reqs: dict[object, ReqKV] = {}
        self.plan_fn, self.copy_fn, self.census, self.now = plan_fn, copy_fn, Census(), 0
        self.now_t = torch.zeros(1, dtype=torch.int64, device=self.device)  # `now` on the device (the Triton resolver reads it)
        self.deferred = deferred  # plan(defer=True) never waits for the device
        self.fuse_copies = fuse_copies and deferred
        self.copy_targets: dict[int, object] = {}  # group -> its producer's prepared copy target (resolver_step.producer_target)
        self._states: dict[int, ResolverState] = {}  # group -> its resolver state (`resolver_state`)
        # the deferred (Triton) plan's persistent scratch: no allocation or zero-fill launch per call
        self.plan_ws = PlanWorkspace(self.device) if deferred else None
        self.prefetch = make_prefetch(self.device, prefetch)  # None: the producer copies for the whole group
        if placement not in PLACEMENTS:
            raise ValueError(f"admission placement must be one of {PLACEMENTS}, got {placement!r}")
        self.placement, self.max_queries = placement, max_queries
        self._host_first: set[object] = set()  # admitted host-first, until freed
        self.host_first_admits = 0

    STAGING_PAPER = True  # DeepSeek-V4's row hierarchy keeps one arena (its sources' readers interleave)

    @property
    def chi(self) -> int:
        """Staging arenas (eq. 11's chi); 0 without staging."""
        return 0 if self.stage_arenas is None else self.stage_arenas.shape[1]

    # -- admission / release (kv/hier/admission.py) ---------------------------------------------
    def required_pages(self, max_total: int) -> int:
        """Pages a request holds for its whole life: hot cache, tail, index history."""
        return self.B // self.page_size + self.tail_pages + self.arena.index_pages_for(max_total)

    def pages_for(self, max_total: int, prompt_len: int | None = None) -> int:
        return self.required_pages(max_total) + self.arena.latent_pages_for(prompt_len if prompt_len is not None else max_total)

    def admit(self, req: object, max_total: int, prompt_len: int | None = None) -> bool:
        if not self.free_slots:
            return False
        return self._admit_with(req, max_total, *self._placement(req, max_total, prompt_len))

    HOST_FIRST = True  # DeepSeek-V4's row hierarchy imports its own prefixes (kv/v4/prefix.py): False there

    def _placement(self, req: object, max_total: int, prompt_len: int | None) -> tuple[int, bool]:
        """(pages to reserve, host-first) for admitting req (`placement`: import, host or auto;
        `admission.placement`)."""
        return admission.placement(self, req, max_total, prompt_len)

    def _import_fits(self, pages: int) -> bool:
        """Hook: whether `pages` can be reserved now without taking anything back (AdaptiveKV: no
        reclaim of optional history)."""
        return self.pool.available >= pages

    def prompt_chunk_limit(self, req: object) -> int | None:
        """A host-first request feeds its prompt through the decode path: at most K_max tokens a
        pass (the tail and staging are sized for that)."""
        return self.max_queries if req in self._host_first else None

    def _place_host_first(self, req: object, full: int, n: int) -> None:
        """Hook: a host-first request's history is its `full` borrowed pages (AdaptiveKV registers
        them as eligible optional history, all backed, none resident)."""

    def _admit_with(self, req: object, max_total: int, need: int, host_first: bool) -> bool:
        """Reserve `need` device pages and req's host pages and give it a slot (`admission.admit_with`)."""
        return admission.admit_with(self, req, max_total, need, host_first)

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
        admission.release(self, req)

    def usage(self) -> PoolUsage:
        return self.pool.usage()

    def check_integrity(self) -> None:
        """Page ownership, staging's pages, I1 and I2 at rest (kv/hier/integrity.py)."""
        integrity.check(self)

    # -- prefix import / export (prefill workspace) --------------------------------------------
    def write_rows(self, req: object, latent: torch.Tensor, index: torch.Tensor, start: int = 0) -> None:
        self.resident.write_rows(req, latent, index, start)

    def import_prefix(self, req: object, item, n: int) -> None:
        """A stored prefix into req's prefill workspace (ResidentKV.import_prefix); its complete
        imported pages borrow the prefix's shared host pages (kv/hier/prefix_pages.py). A request
        admitted host-first takes `handoff.import_host_first` instead; a whole prompt computed
        elsewhere (`StoredPrefix.whole_prompt`) is imported and handed off at once (kv/hier/arrival.py)."""
        if item.whole_prompt:
            return import_prompt(self, req, item, n)
        if req in self._host_first:
            return handoff.import_host_first(self, req, item, n)
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
        use): its workspace while prefilling; decoding, the first tier that holds it in the
        resolver's order (`integrity.row_place`):

            positions  0 ................................ tail_start ........ n-1
            tiers      optional | hot | host (every p < tail_start: I1)      | tail

        `host` is reported whenever the row has a host copy, whatever tier attention reads.
        Staged rows exist only inside one verification pass: a location >= SPACE of that pass.
        """
        return integrity.row_place(self, req, position, layer)

    def _host_backed(self, req: object, st: ReqKV, j: int) -> bool:
        """Hook: whether page index j of decoding req has its host copy (issued in stream order).
        hisparse: every complete page before the tail (the hand-off and tail backups)."""
        return st.decoding and (j + 1) * self.page_size <= st.tail_start

    def loading(self, req: object) -> bool:
        """Whether req waits for its prefix import or its hand-off backup (kv/memory/loads.py)."""
        return self.resident.loading(req) or self.handoffs.loading(req)

    def read_rows(self, req: object, n: int, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self.resident.read_rows(req, n, pin)

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
        tables.sync_index_pages(self, reqs)
        return HierContext(self, batch, reqs)

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

    # -- upkeep after a step: hand-offs and tail backups (kv/hier/handoff.py, kv/hier/tail.py) ---
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
                    tail.backup_tail(self, req, st, n)
                elif prompt_done:
                    handoff.handoff(self, req, st, n)
            except AssertionError:  # a violated invariant or debug check: never a request's own fault
                raise
            except Exception as e:  # noqa: BLE001 - that request is aborted by the engine
                failures[req] = e
        if failures:
            raise RequestFailures(failures)

    def _pages_to_host(self, req: object, dev_pages: list[int], start: int) -> None:
        """Back up whole device pages (every layer's rows) into req's host pages for positions
        start .. start + len(dev_pages) * ps (start page aligned; `tail.pages_to_host`)."""
        tail.pages_to_host(self, req, dev_pages, start)

    def _copy_runs(self, pairs: list[tuple[str, int, int]]) -> None:
        """(kind, host page, device page) whole-page copies: 'backup' device -> host, otherwise
        host -> device, one per run of pages consecutive on both sides (`tail.copy_runs`)."""
        tail.copy_runs(self, pairs)

    def _place_prompt_pages(self, req: object, pages: list[int], n: int) -> None:
        """Hook: where a finished prompt's complete workspace pages `pages` (positions
        0 .. len(pages) * ps) go at its hand-off. hisparse: to host, then freed; borrowed shared
        prefix pages freed at once, with no copy (`handoff.prompt_pages_to_host`).

            pages      [0 .. b)  borrowed: freed now | [b .. full) -> host, then freed
        """
        handoff.prompt_pages_to_host(self, req, pages)

    def _next_tail_page(self, req: object, st: ReqKV, done: int) -> int:
        """Hook: the page that takes completed tail page `done`'s place (positions st.tail_start ..
        + ps, already backed up). hisparse recycles it."""
        return done

    def sync_host_table(self, req: object) -> None:
        """Mirror req's host page list into the device table the resolver reads (pages added since
        the last sync only); called when host pages are added, not on every resolver call."""
        tables.sync_host_table(self, req)

    @property
    def replayable(self) -> bool:
        """Whether decode passes can replay from a step graph: the deferred (sync-free) resolver
        and no debug checks (they read the device)."""
        return self.deferred and not self.debug

    def graph_fingerprint(self) -> tuple:
        """Addresses a captured step graph bakes in that can change while serving: the host table
        and the index page table are reallocated when a history outgrows them (`sync_host_table`,
        `tables.sync_index_pages`), which retires graphs."""
        return self.host_pages.fingerprint() + self.index_pages.fingerprint()

    def resolver_state(self, group: int) -> ResolverState:
        """Group `group`'s resolver state: its B_g hot entries (strided views of the [S, G, B_max]
        tables), the tails and the host table. Built once a group and kept (`_states`): its views
        never move, and the host table is re-read every call (it is reallocated when a history
        outgrows it, `sync_host_table`), so a call costs no tensor ops (host time per resolver call)."""
        return tables.resolver_state(self, group)
