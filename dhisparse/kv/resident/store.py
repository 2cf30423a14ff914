"""`ResidentKV`: the `resident` preset's store, full history on device.

Each request has two block tables over the arena: latent pages (page_size positions each) and
index pages (index_page_size positions each):

  latent table [p0, p1, ...]   position t -> location p[t // ps] * ps + t % ps
  index  table [q0, ...]       position t -> location q[t // ips] * ips + t % ips
"""

from __future__ import annotations

import torch

from dhisparse.core.batch import ForwardBatch, GraphPass, IndexTable, KVContext, ScratchRows
from dhisparse.core.contracts import KVStore, RowPlace
from dhisparse.core.kvformat import KVFormats
from dhisparse.core.rows import cdiv, gather_rows, scatter_rows, table_locations
from dhisparse.kv.memory.arena import KVArena
from dhisparse.kv.memory.copies import page_runs
from dhisparse.kv.memory.loads import make_loads
from dhisparse.kv.memory.pool import PoolUsage


def copy_index_pages(arena: KVArena, paged, pages: list[int]) -> None:
    """A stored prefix's index pages 0 .. len(pages)-1 (`paged.index`, the arena's layout) into
    the arena's index pages `pages`: an index page is a slice of its storage row, one copy a page
    (asynchronous from pinned memory on CUDA)."""
    for s, d in enumerate(pages):
        arena.index_pages[d].copy_(paged.index[s].view(arena.index_pages.shape[1:]), non_blocking=True)


def _to_host(read, layers: list[int], pin: bool) -> torch.Tensor:
    """torch.stack([read(l) for l in layers]) on the host (pinned when `pin`), each layer's device read copied
    out before the next is made. layers: non-empty; read(l): tensors of one shape and dtype."""
    first = read(layers[0])
    out = torch.empty((len(layers), *first.shape), dtype=first.dtype, pin_memory=pin)
    out[0].copy_(first)
    for i, l in enumerate(layers[1:], 1):
        out[i].copy_(read(l))
    return out


class ResidentKV(KVStore):
    def __init__(self, arena: KVArena, side_loads: bool = False) -> None:
        self.arena, self.pool = arena, arena.pool
        self.page_size, self.device = arena.page_size, arena.device
        self.latent_tables: dict[object, list[int]] = {}
        self.index_tables: dict[object, list[int]] = {}
        self.loads = make_loads(arena.device, side_loads)  # prefix imports (kv/memory/loads.py)

    # -- request lifecycle -----------------------------------------------------------------------
    def pages_for(self, max_total: int, prompt_len: int | None = None) -> int:
        return self.arena.latent_pages_for(max_total) + self.arena.index_pages_for(max_total)

    def admit(self, req: object, max_total: int, prompt_len: int | None = None) -> bool:
        """Reserve pages for the request's whole life; False (nothing reserved) if it must wait."""
        if not self.pool.reserve(req, self.pages_for(max_total)):
            return False
        self.latent_tables[req], self.index_tables[req] = [], []
        return True

    def ensure(self, req: object, n_tokens: int) -> None:
        """Grow req's tables to cover positions 0..n_tokens-1 (inside its reservation)."""
        for table, per in ((self.latent_tables[req], self.page_size), (self.index_tables[req], self.arena.index_page_size)):
            need = cdiv(n_tokens, per) - len(table)
            if need > 0:
                table.extend(self.pool.alloc(req, need))

    def ensure_index(self, req: object, n_tokens: int) -> None:
        """Grow only the index table (hierarchical presets keep latent rows elsewhere)."""
        table = self.index_tables[req]
        need = cdiv(n_tokens, self.arena.index_page_size) - len(table)
        if need > 0:
            table.extend(self.pool.alloc(req, need))

    def before_sync(self) -> None:
        """Nothing to do (see AdaptiveKV.before_sync)."""

    def after_step(self, computed: dict[object, tuple[int, bool]]) -> None:
        """Nothing to do: resident rows never move."""

    def free(self, req: object) -> None:
        self.loads.settle(req)  # a retired request's import finishes before its pages are reused
        self.pool.release(req)
        self.latent_tables.pop(req, None)
        self.index_tables.pop(req, None)

    def loading(self, req: object) -> bool:
        """Whether req's KV is still being copied in (the scheduler does not run it yet)."""
        return self.loads.loading(req)

    def usage(self) -> PoolUsage:
        return self.pool.usage()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        for req, table in self.latent_tables.items():
            assert sorted(self.pool.owned_by(req)) == sorted(table + self.index_tables[req]), f"tables of {req!r} disagree with the pool"

    # -- rows ------------------------------------------------------------------------------------
    def latent_locs(self, req: object, n: int) -> torch.Tensor:
        return self.arena.locations(self.latent_tables[req], n, self.page_size)

    def index_locs(self, req: object, n: int) -> torch.Tensor:
        return self.arena.locations(self.index_tables[req], n, self.arena.index_page_size)

    def write_rows(self, req: object, latent: torch.Tensor, index: torch.Tensor, start: int = 0) -> None:
        """Import positions start..start+n-1: latent [L, n, d], index [F, n, iD]."""
        n = latent.shape[1]
        self.ensure(req, start + n)
        lat, idx = self.latent_locs(req, start + n)[start:], self.index_locs(req, start + n)[start:]
        for layer in range(latent.shape[0]):
            scatter_rows(self.arena.latent_rows(layer), lat, latent[layer].to(self.device))
        for j, layer in enumerate(self.arena.layout.index_layers):
            self.arena.write_index(layer, idx, index[j].to(self.device))

    def prefix_layout(self) -> tuple[int, int, int]:
        """Stored prefixes are imported as whole pages of this layout (`import_prefix`): page size,
        index page size, index split (StoredPrefix.paged)."""
        return self.page_size, self.arena.index_page_size, self.arena.index_split

    def import_prefix(self, req: object, item, n: int) -> None:
        """Import positions 0..n-1 of a stored prefix `item` (kv/memory/prefix_store.py) into req's pages as
        whole-page copies through `loads` (in stream order, or on a side stream with req `loading`
        until they are done). The last page is copied whole; its positions >= n are written by
        req's prefill before any read (attention and the indexer read positions < the request's
        length only).

            prefix pages  0 1 2 ... j          (item.paged: [NP, L, ps, d])
            req pages     t0 t1 t2 ... tj      (consecutive ones move as one copy)
        """
        self.ensure(req, n)
        paged = item.paged(*self.prefix_layout())
        lat = self.latent_tables[req][: cdiv(n, self.page_size)]
        idx = self.index_tables[req][: cdiv(n, self.arena.index_page_size)]
        arena = self.arena

        def copies() -> None:
            for run in page_runs([("import", j, d) for j, d in enumerate(lat)]):  # host = the prefix's page j
                s, d, c = run.host, run.device, run.count
                arena.latent[d : d + c].copy_(paged.latent[s : s + c], non_blocking=True)
            copy_index_pages(arena, paged, idx)

        self.loads.run(req, copies)

    def read_rows(self, req: object, n: int, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of positions 0..n-1: (latent [L, n, d], index [F, n, iD]), pinned when `pin`. Read one
        layer at a time into the host tensors, so the device holds one layer's rows at once, not the whole
        prompt's twice (a 100K-token glm5-faithful prompt: 4.9 GiB, which failed an export on an H100)."""
        lat, idx = self.latent_locs(req, n), self.index_locs(req, n)
        a = self.arena
        latent = _to_host(lambda l: gather_rows(a.latent_rows(l), lat), list(range(a.cfg.num_layers)), pin)
        index = _to_host(lambda l: a.read_index(l, idx), list(a.layout.index_layers), pin)
        return latent, index

    def row_place(self, req: object, position: int, layer: int = 0) -> RowPlace:
        """Every written position of an admitted request is on its latent pages (tier resident)."""
        table = self.latent_tables[req]
        if not 0 <= position < len(table) * self.page_size:
            return RowPlace("none")
        return RowPlace("resident", table[position // self.page_size] * self.page_size + position % self.page_size)

    def context(self, batch: ForwardBatch, reqs: list[object]) -> "ResidentContext":
        for r, req in enumerate(reqs):
            self.ensure(req, batch.lens[r])
        return ResidentContext(self, batch, reqs)

    def graph_context(self) -> type:
        """The context class of this store's passes (its step graphs' `graph_templates`)."""
        return ResidentContext


class _LazyTable:
    """A PagedContext location table [N, Lmax] (-1: no row) kept in `_<name>`: set directly, or
    built on first read by the context's `_build_tables`."""

    def __set_name__(self, owner, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, ctx, owner=None):
        if ctx is None:
            return self
        if getattr(ctx, self.attr) is None:
            ctx._build_tables()
        return getattr(ctx, self.attr)

    def __set__(self, ctx, value: torch.Tensor) -> None:
        setattr(ctx, self.attr, value)


class PagedContext(KVContext):
    """Shared part of the paged KVContexts: per-request location tables lat_of / idx_of [N, Lmax]
    (-1 where a position has no device row), writes at the batch's positions, index-key reads.
    A subclass either sets the tables or builds them on first use (`_build_tables`), so a pass
    that replays a step graph (which computes its own) need not build them at all."""

    lat_of = _LazyTable()  # [N, Lmax] latent location of position s of request r (-1: none on the device)
    idx_of = _LazyTable()  # [N, Lmax] index-row location of position s of request r (-1 past its length)

    def __init__(self, kv, batch: ForwardBatch, n_reqs: int) -> None:
        self.kv, self.batch, self.arena = kv, batch, kv.arena
        self.lens = list(batch.lens)
        self._lat_of = self._idx_of = None

    def _build_tables(self) -> None:
        raise NotImplementedError  # contexts that set their tables never get here

    def _finish_tables(self, scratch: ScratchRows | None = None) -> None:
        """The tables are final: write locations follow on first use (`writes`), so a pass that
        replays a step graph (which computes its own) never builds them. With `scratch` (a step
        graph's static context) tokens without a location (padding) write to the scratch rows."""
        self._scratch, self._writes = scratch, None

    @property
    def writes(self):
        """The pass's `WriteRows` (lat_write / idx_write [T]: each token's write locations)."""
        if self._writes is None:
            lat = self.lat_of[self.batch.req_idx, self.batch.positions]
            idx = self.idx_of[self.batch.req_idx, self.batch.positions]
            if self._scratch is not None:  # padding: a padded request (-1 tables) or a padded token (position -1)
                pad = (lat < 0) | (self.batch.positions < 0)
                lat = torch.where(pad, self._scratch.latent, lat)
                idx = torch.where(pad | (idx < 0), self._scratch.index, idx)
            self._lat_write, self._idx_write = lat, idx
            self._writes = self.arena.write_rows(lat, idx)
        return self._writes

    @property
    def lat_write(self) -> torch.Tensor:
        """[T] latent write location of each token."""
        self.writes  # noqa: B018  (built on first use)
        return self._lat_write

    @property
    def idx_write(self) -> torch.Tensor:
        """[T] index write location of each token."""
        self.writes  # noqa: B018  (built on first use)
        return self._idx_write

    def max_k(self) -> int:
        """Tokens of the pass's longest request."""
        qs = self.batch.query_start
        return max((qs[r + 1] - qs[r] for r in range(len(qs) - 1)), default=0)

    def store(self, layer: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        self.writes.latent(layer, latent)
        if index_key is not None:
            self.writes.index(layer, index_key, self.idx_write)

    def row_formats(self) -> KVFormats:
        return self.arena.formats

    def index_keys(self, layer: int, req: int) -> torch.Tensor:
        """[seq_lens[req], iD] decoded index keys of request `req`."""
        return self.arena.formats.index.decode(self.arena.read_index(layer, self.idx_of[req, : self.lens[req]]))

    def index_table(self, layer: int) -> IndexTable:
        """All requests' index keys: rows [P, ips, Wi] (strided arena view; split FP8 keys: values
        [P, ips, D] and scales), idx_of, seq_lens, format."""
        lens = self.batch.seq_lens.to(self.idx_of.device)
        vals, scales = self.arena.index_spaces(layer)
        return IndexTable(vals, self.idx_of, lens, self.arena.formats.index, scales)


class ResidentContext(PagedContext):
    """KVContext of one pass over a ResidentKV."""

    def __init__(self, kv: ResidentKV, batch: ForwardBatch, reqs: list[object]) -> None:
        super().__init__(kv, batch, len(reqs))
        self.lat_of = table_locations([kv.latent_tables[r] for r in reqs], self.lens, kv.page_size, kv.device)
        self.idx_of = table_locations([kv.index_tables[r] for r in reqs], self.lens, kv.arena.index_page_size, kv.device)
        self._finish_tables()
        self._memo: tuple[torch.Tensor, torch.Tensor] | None = None  # (selection, locations) of the last layer

    def graph_pass(self) -> GraphPass:
        """Any pass can replay as N requests x (its longest request's) K tokens; `StepGraphs`
        decides whether that padding is worth a graph."""
        return GraphPass(self.max_k(), ("resident",), {"lat_of": (self.lat_of, -1), "idx_of": (self.idx_of, -1)})

    @classmethod
    def graph_templates(cls, kv: ResidentKV, K: int) -> list[GraphPass]:
        """The shapes of `graph_pass` for passes of K tokens a request (start-up capture)."""
        empty = torch.empty(0, 1, dtype=torch.int64, device=kv.device)
        return [GraphPass(K, ("resident",), {"lat_of": (empty, -1), "idx_of": (empty, -1)})]

    @classmethod
    def for_graph(cls, kv: ResidentKV, batch: ForwardBatch, gp: GraphPass, rows: dict, scratch: ScratchRows) -> "ResidentContext":
        """The context a step graph captures: tables are the graph's static buffers `rows`
        (padded requests: -1 everywhere, seq_len 0), write locations computed in the graph."""
        ctx = cls.__new__(cls)
        PagedContext.__init__(ctx, kv, batch, batch.num_reqs)
        ctx.lat_of, ctx.idx_of = rows["lat_of"], rows["idx_of"]
        ctx._finish_tables(scratch)
        ctx._memo = None
        return ctx

    def locate(self, layer: int, selection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Locations are layer-independent: layers sharing a selection (GLM `shared`) reuse them."""
        if self._memo is None or self._memo[0] is not selection:
            loc = self.lat_of[self.batch.req_idx[:, None], selection.clamp(min=0)]
            self._memo = (selection, torch.where(selection >= 0, loc, torch.full_like(loc, -1)))
        return self.arena.latent_rows(layer), self._memo[1]
