"""`V4HierPass`: a V4 model pass whose CSA sources' compressed rows live in the row hierarchy.

Window rows, streaming tails and HCA rows go through `V4Pass` unchanged (device state). For a
tiered source s (a "full" CSA layer, arena layer g):

    emission   append_rows(s, "kv" | "index", r, rows)  -> the row batch's write locations
               (prefilling requests: their workspace; decoding requests: their tail); rows exist
               only for complete windows, and rows of rejected drafts are overwritten next pass
    index keys index_keys(s, r)                          -> all of r's keys of s (device pages)
    locate     locate(s, "kv", selection [T, k])         -> one resolver call on s's state:
               prefilling requests read the workspace; decoding requests' K queries resolve
               as one union (direct / hot / host, staging for overflow), copies for s's bytes
    reuse      reuse(s)                                  -> the latest located RowSpace of s:
               no resolver call, same locations; if another source's call refilled the shared
               staging arena since, s's staged copies are replayed first (exactness)

One cache state per physical source is shared by all its consumers: a "reindex" layer's call
finds the rows earlier consumers fetched (hits) and copies only rows absent from s's tail,
ready optional map and hot cache. Layers run one after another, so a call's cache updates happen
after every earlier reader of that state finished (I3 for the hot cache).
"""

from __future__ import annotations

import torch

from dhisparse.core.rows import scatter_rows
from dhisparse.core.batch import ForwardBatch
from dhisparse.kv.hier.staging import direct_plan, stage_overflow
from dhisparse.kernels.resolver_ref import ResolvePlan
from dhisparse.kv.v4.passes import RowSpace, V4Pass
from dhisparse.kv.v4.state import StateError


class V4HierPass(V4Pass):
    def __init__(self, batch: ForwardBatch, states, store, rows_ctx, owner) -> None:
        """rows_ctx: the row hierarchy's HierContext over the pass's row batch (row r of the
        token batch = row r of the row batch); owner: the V4HierStore."""
        super().__init__(batch, states, store)
        self.rc, self.kv, self.group, self.counters = rows_ctx, owner.kv, owner.group, owner.counters
        self.row_start = rows_ctx.batch.query_start
        self.staged: dict[int, ResolvePlan | None] = {}
        self.stage_holds: int | None = None  # source whose staged rows the staging arena holds

    def append_rows(self, layer: int, kind: str, req: int, rows: torch.Tensor) -> None:
        if layer not in self.group:
            return super().append_rows(layer, kind, req, rows)
        g, a, n = self.group[layer], self.row_start[req], int(rows.shape[0])
        if a + n > self.row_start[req + 1]:
            raise StateError(f"source {layer}: request row {req} emitted {n} rows, the pass expected "
                             f"{self.row_start[req + 1] - a}")
        if kind == "kv":
            scatter_rows(self.kv.arena.latent_rows(g), self.rc.lat_write[a : a + n], rows)
        else:
            scatter_rows(self.kv.arena.index_rows(g), self.rc.idx_write[a : a + n], rows)
        self.store.append(self.rids[req], layer, kind, rows)

    def index_keys(self, layer: int, req: int) -> torch.Tensor:
        """[rows of req, index_head_dim] index keys of source `layer` (this pass included)."""
        if layer not in self.group:
            return super().index_keys(layer, req)
        return self.rc.index_keys(self.group[layer], req)

    def locate(self, layer: int, kind: str, selection: torch.Tensor) -> RowSpace:
        """selection [T, k] row ids of source `layer` (-1 = none) -> RowSpace (I2)."""
        if layer not in self.group:
            return super().locate(layer, kind, selection)
        kv, g, rc = self.kv, self.group[layer], self.rc
        loc = rc.lat_of[self.batch.req_idx[:, None], selection.clamp(min=0)]
        loc = torch.where(selection >= 0, loc, torch.full_like(loc, -1))
        staged = None
        if rc.decode_rows:
            plan, staged = self._resolve(g, selection)
            qs = self.batch.query_start
            for i, r in enumerate(rc.decode_rows):
                loc[qs[r] : qs[r + 1]] = plan.loc[i, : qs[r + 1] - qs[r]]
        self.staged[layer] = staged
        rows = kv.arena.latent_rows(g)
        self.last[layer] = RowSpace((rows, kv.stage) if staged is not None else rows, loc)
        return self.last[layer]

    def _resolve(self, g: int, selection: torch.Tensor) -> tuple[ResolvePlan, ResolvePlan | None]:
        """One resolver call on source g for the decoding requests (their K queries as a union)."""
        kv, rc = self.kv, self.rc
        slots = torch.tensor(rc.slots, dtype=torch.int64, device=selection.device)
        per_req = self._per_request(selection)
        plan = direct_plan(per_req, slots, kv)
        if plan is None:
            plan = kv.plan_fn(per_req, slots, kv.resolver_state(g), kv.now)
        else:
            kv.census.direct_calls += 1
        plan, staged = stage_overflow(plan, per_req, slots, kv)
        nbytes = kv.copy_fn(plan, kv.host.layer_rows(g), kv.arena.latent_rows(g))
        if staged is not None:
            nbytes += kv.copy_fn(staged, kv.host.layer_rows(g), kv.stage)
            self.stage_holds = g
        kv.census.add(plan.counters, nbytes)
        return plan, staged

    def _per_request(self, selection: torch.Tensor) -> torch.Tensor:
        """[Nd, Kmax, k] selections of the decoding requests' queries (-1 padded)."""
        qs, rows = self.batch.query_start, self.rc.decode_rows
        K = max((qs[r + 1] - qs[r] for r in rows), default=1)
        out = torch.full((len(rows), max(K, 1), selection.shape[1]), -1, dtype=torch.int64, device=selection.device)
        for i, r in enumerate(rows):
            out[i, : qs[r + 1] - qs[r]] = selection[qs[r] : qs[r + 1]]
        return out

    def reuse(self, source: int) -> RowSpace:
        """The latest RowSpace of `source`, with its staged rows re-materialized if the shared
        staging arena was refilled by another source since (no resolver call either way)."""
        space = super().reuse(source)
        self.counters.reuse_reads += 1
        staged = self.staged.get(source)
        g = self.group.get(source)
        if staged is not None and self.stage_holds != g:
            self.kv.census.bytes_moved += self.kv.copy_fn(staged, self.kv.host.layer_rows(g), self.kv.stage)
            self.counters.stage_replays += 1
            self.stage_holds = g
        return space
