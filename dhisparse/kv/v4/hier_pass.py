"""`V4HierPass`: a V4 model pass whose CSA sources' compressed rows live in the row hierarchy.

Window rows, streaming tails and HCA rows go through `V4Pass` unchanged (device state). For a
tiered source s (a "full" CSA layer, arena layer g):

    emission   append_rows(s, "kv" | "index", r, rows)  -> the row batch's write locations
               (prefilling requests: their workspace; decoding requests: their tail); rows exist
               only for complete windows, and rows of rejected drafts are overwritten next pass
    index keys index_keys(s, r)                          -> all of r's keys of s (device pages)
    locate     locate(s, "kv", selection [T, k])         -> one resolver call on s's state:
               prefilling requests read the workspace; decoding requests' K queries resolve
               as one union (direct / hot / host, staging for overflow), copies for s's bytes;
               the GLM path's resolver step (`locate_group` / `copy_group` in
               kv/hier/resolver_step.py): with the Triton resolver deferred (no host sync), staging
               by device ops; under `adaptive`, an all-direct pass makes no resolver call
    reuse      reuse(s)                                  -> the latest LocatedRows of s:
               no resolver call, same locations; if another source's call refilled the shared
               staging arena since, s's staged copies are replayed first (exactness; a deferred
               plan's staged copy is launched again, its bytes counted at `after_step`)

One cache state per physical source is shared by all its consumers: a "reindex" layer's call
finds the rows earlier consumers fetched (hits) and copies only rows absent from s's tail,
ready optional map and hot cache. Layers run one after another, so a call's cache updates happen
after every earlier reader of that state finished (I3 for the hot cache).
"""

from __future__ import annotations

import torch

from dhisparse.core.rows import scatter_rows
from dhisparse.core.batch import ForwardBatch
from dhisparse.kv.hier.resolver_step import DecodeTokens, copy_group, decode_tokens, locate_group, restage
from dhisparse.kv.hier.staging import StagePlan
from dhisparse.kernels.resolver_ref import ResolvePlan
from dhisparse.kv.v4.passes import LocatedRows, V4Pass
from dhisparse.kv.v4.state import StateError


class V4HierPass(V4Pass):
    def __init__(self, batch: ForwardBatch, states, store, rows_ctx, owner) -> None:
        """rows_ctx: the row hierarchy's HierContext over the pass's row batch (row r of the
        token batch = row r of the row batch: same requests, same slots `rows_ctx.slots_t`, but
        other token counts, so the token batch gets its own `DecodeTokens`); owner: the
        V4HierStore."""
        super().__init__(batch, states, store)
        self.rc, self.kv, self.group, self.counters = rows_ctx, owner.kv, owner.group, owner.counters
        self.owner = owner
        self.row_start = rows_ctx.batch.query_start
        self.tokens = self._decode_tokens()
        self._zero = torch.zeros((), dtype=torch.int64, device=self.kv.device)  # bytes copied by a direct call
        self.staged: dict[int, ResolvePlan | StagePlan | None] = {}
        self.stage_holds: int | None = None  # source whose staged rows the staging arena holds

    def _decode_tokens(self) -> DecodeTokens:
        """Where the decoding requests' tokens sit in the token batch (one host -> device copy)."""
        if not self.rc.decode_rows:
            empty = torch.empty(0, dtype=torch.int64, device=self.kv.device)
            return DecodeTokens(empty, empty, empty, 0, 1, False)
        return decode_tokens(self.batch.query_start, self.rc.decode_rows, self.kv.device)

    def append_rows(self, layer: int, kind: str, req: int, rows: torch.Tensor) -> None:
        if layer not in self.group:
            return super().append_rows(layer, kind, req, rows)
        g, a, n = self.group[layer], self.row_start[req], int(rows.shape[0])
        if a + n > self.row_start[req + 1]:
            raise StateError(f"source {layer}: request row {req} emitted {n} rows, the pass expected "
                             f"{self.row_start[req + 1] - a}")
        fmts = self.kv.arena.formats  # rows are encoded once, here (core/kvformat.py)
        if kind == "kv":
            scatter_rows(self.kv.arena.latent_rows(g), self.rc.lat_write[a : a + n], fmts.latent.encode(rows))
        else:
            self.kv.arena.write_index(g, self.rc.idx_write[a : a + n], fmts.index.encode(rows))
        self.store.append(self.rids[req], layer, kind, rows)

    def index_keys(self, layer: int, req: int) -> torch.Tensor:
        """[rows of req, index_head_dim] index keys of source `layer` (this pass included)."""
        if layer not in self.group:
            return super().index_keys(layer, req)
        return self.rc.index_keys(self.group[layer], req)

    def locate(self, layer: int, kind: str, selection: torch.Tensor) -> LocatedRows:
        """selection [T, k] row ids of source `layer` (-1 = none) -> LocatedRows (I2): one
        resolver step on the source's group g (its only layer: no followers)."""
        if layer not in self.group:
            return super().locate(layer, kind, selection)
        kv, g, rc = self.kv, self.group[layer], self.rc
        # V4's row passes count every call on the device (host_census = False): count_direct
        loc, plan, staged, _ = locate_group(kv, g, selection, self.tokens, rc.slots_t, rc.lat_of, self.batch.req_idx,
                                         rc.all_direct, count_direct=True)
        rows = kv.arena.latent_rows(g)
        if plan is not None:
            copy_group(kv, g, plan, staged, rows, True, self._zero)
        if staged is not None:
            self.stage_holds = g
        self.staged[layer] = staged
        fmt = kv.arena.formats.latent
        self.last[layer] = LocatedRows((rows, kv.stage) if staged is not None else rows, loc, fmt if fmt.fp8 else None)
        return self.last[layer]

    def reuse(self, source: int) -> LocatedRows:
        """The latest LocatedRows of `source`, with its staged rows re-materialized if the shared
        staging arena was refilled by another source since (no resolver call either way)."""
        space = super().reuse(source)
        self.counters.reuse_reads += 1
        staged = self.staged.get(source)
        g = self.group.get(source)
        if staged is not None and self.stage_holds != g:
            self.owner.count_restaged(restage(self.kv, g, staged))
            self.counters.stage_replays += 1
            self.stage_holds = g
        return space
