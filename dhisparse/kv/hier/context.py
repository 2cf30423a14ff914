"""KVContext of one pass over a HierarchicalKV.

Requests still prefilling read and write their transient workspace exactly like resident
serving. Decoding requests write new rows to their tail and read history through the resolver:
the producer layer of a selection plans (scan + copies for its own bytes), follower layers replay
the plan's copies for their bytes. The resolver step of one selection group is
kv/hier/resolver_step.py's, shared with DeepSeek-V4's `V4HierPass`.

    requests       | prefilling ...................... | decoding ...........................
    lat_of [N, W]  | workspace rows of 0 .. len-1      | tail rows (all-direct: + ready map), else -1
    locate(layer)  | lat_of's rows                     | the group's plan, made by its producer layer
"""

from __future__ import annotations

import torch

from dhisparse.core.rows import table_locations
from dhisparse.kv.resident.store import PagedContext
from dhisparse.core.batch import ForwardBatch, GraphPass, ScratchRows
from dhisparse.kernels.resolver_ref import ResolveCounters, ResolvePlan
from dhisparse.kv.hier.promotion import Promotion
from dhisparse.kv.hier.resolver_step import (DecodeTokens, copy_group, decode_locations, decode_token_lists,
                                             flush_promotion, locate_group)

RESOLVER_COPIES = ("separate", "fused")  # EngineConfig.resolver_copy: the producer's copies in a launch of their own, or
                                          # by the plan kernel (HierarchicalKV.fuse_copies)
RESOLVER_LOOKUPS = ("scan", "index")  # EngineConfig.resolver_lookup: hits found by scanning the hot cache, or through
                                      # a position -> hot entry index (HierarchicalKV.hot_index, tables.py)


class HierContext(PagedContext):
    def __init__(self, kv, batch: ForwardBatch, reqs: list[object]) -> None:
        super().__init__(kv, batch, len(reqs))
        states = [kv.reqs[req] for req in reqs]
        self._prefill_tables = [[] if st.decoding else kv.resident.latent_tables[q] for q, st in zip(reqs, states)]
        self.decode_rows = [r for r, st in enumerate(states) if st.decoding]
        self.slots = [states[r].slot for r in self.decode_rows]
        self._decode_map(batch.query_start, [st.slot for st in states], kv.device)
        # adaptive: every decoding request's history is published (False in the base hierarchy)
        self.all_direct = bool(self.decode_rows) and kv.covers([reqs[r] for r in self.decode_rows])
        if self.host_counted:
            self._count_direct_pass()
        self._finish_tables()
        self.plans: dict[int, tuple[ResolvePlan, ResolvePlan | None]] = {}
        self._zero = torch.zeros((), dtype=torch.int64, device=kv.device)  # bytes copied by a direct call
        self.memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # group -> (selection, locations)
        self.pending: dict[int, Promotion] = {}  # group -> its promotion, flushed after its last layer

    HOST_CENSUS = True  # count K = 1 all-direct passes on the host (False: per group on the device)

    @property
    def host_counted(self) -> bool:
        """An all-direct pass of one query per decoding request over a store whose passes call
        every layer group once (not V4's row passes: `host_census = False`): its census is known
        on the host (`_count_direct_pass`), so no layer group adds device counters (in a step
        graph that is ~9 tiny kernels per group)."""
        return self.HOST_CENSUS and self.all_direct and self.K == 1 and self.kv.host_census

    def _count_direct_pass(self) -> None:
        """The census of every group's call in this pass, from host lengths: a decoding request of
        length n selects min(k, n) distinct positions (top-k over its visible history), all
        resolved directly; one call per group, each wholly direct."""
        kv, k = self.kv, self.kv.arena.cfg.index_topk
        selected = sum(min(k, self.lens[r]) for r in self.decode_rows)
        G = len(kv.groups)
        kv.census.add(ResolveCounters(selected * G, selected * G, 0, 0, 0, 0), 0, calls=G, direct_calls=G)

    def _build_tables(self) -> None:
        """idx_of from the device index page table; lat_of: prefilling requests' workspace rows
        (their page tables), decoding requests' tail (and, all-direct, ready-map) rows from their
        slots' persistent state (`decode_locations`). Built on first use: a pass
        that replays a step graph computes the same inside the graph (`for_graph`)."""
        kv, W = self.kv, max(max(self.lens, default=1), 1)
        self.idx_of = kv.index_locations(self.all_slots_t, self.batch.seq_lens, W)
        if len(self.decode_rows) == len(self.lens):  # a decode / verification pass
            self.lat_of = decode_locations(kv, self.slots_t, self.batch.seq_lens, W, self.all_direct)
            return
        lens = [0 if not t else n for t, n in zip(self._prefill_tables, self.lens)]
        lat = table_locations(self._prefill_tables, lens, kv.page_size, kv.device)
        self.lat_of = torch.nn.functional.pad(lat, (0, W - lat.shape[1]), value=-1)
        if self.decode_rows:
            lens_t = self.batch.seq_lens[self.dec_rows_t]
            self.lat_of[self.dec_rows_t] = decode_locations(kv, self.slots_t, lens_t, W, self.all_direct)

    def graph_pass(self) -> GraphPass | None:
        """A pass of decoding requests only (up to K tokens each) on the deferred (sync-free)
        resolver: a step graph can replay it. The graph reads each request's slot and computes
        its tables from the slots' persistent state. Padded requests take the first real slot:
        they select nothing (seq_len 0), so the resolver's direct exit leaves that slot's state
        untouched; a ragged pass's padded tokens select nothing either (position -1), so each
        request's union of selections is the eager pass's."""
        if not (self.decode_rows and len(self.decode_rows) == self.batch.num_reqs and self.kv.replayable):
            return None
        return GraphPass(self.K, ("hier", self.all_direct), {"slots_t": (self.slots_t, self.slots[0])})

    @classmethod
    def graph_templates(cls, kv, K: int) -> list[GraphPass]:
        """The shapes of `graph_pass` for passes of K tokens a request (start-up capture): one
        per variant the store's passes take (all-direct only where residency can cover)."""
        if not kv.replayable:
            return []
        slots = (torch.empty(0, dtype=torch.int64, device=kv.device), 0)
        direct = (False, True) if kv.can_cover else (False,)
        return [GraphPass(K, ("hier", d), {"slots_t": slots}) for d in direct]

    @classmethod
    def for_graph(cls, kv, batch: ForwardBatch, gp: GraphPass, rows: dict, scratch: ScratchRows) -> "HierContext":
        """The context a step graph captures over its static buffers `rows` (see `graph_pass`):
        every request decodes with K graph tokens (dense), request r owning tokens r*K .. r*K+K-1
        (padding where the pass's request had fewer); tables gp.width wide, computed in the graph."""
        ctx = cls.__new__(cls)
        PagedContext.__init__(ctx, kv, batch, batch.num_reqs)
        N, K, dev = batch.num_reqs, gp.K, kv.device
        ctx.slots_t = ctx.all_slots_t = rows["slots_t"]
        ctx.decode_rows, ctx.slots = list(range(N)), []
        ctx.K, ctx.dense, ctx.all_direct = K, True, gp.variant[1]
        ctx.dec_tok = torch.arange(N * K, device=dev)
        ctx.dec_i, ctx.dec_j = ctx.dec_tok // K, ctx.dec_tok % K
        ctx.tokens = DecodeTokens(ctx.dec_tok, ctx.dec_i, ctx.dec_j, N, K, True)
        ctx.dec_rows_t = torch.arange(N, device=dev)
        ctx.idx_of = kv.index_locations(ctx.slots_t, batch.seq_lens, gp.width)
        ctx.lat_of = decode_locations(kv, ctx.slots_t, batch.seq_lens, gp.width, ctx.all_direct)
        ctx._finish_tables(scratch)
        ctx.plans, ctx.memo, ctx.pending = {}, {}, {}
        ctx._zero = torch.zeros((), dtype=torch.int64, device=dev)
        return ctx

    def _decode_map(self, qs: list[int], all_slots: list[int], device) -> None:
        """Where decoding requests' tokens sit (`tokens`, a `DecodeTokens`: token dec_tok[m] of
        the flattened batch is query dec_j[m] of decoding request dec_i[m], an index into
        decode_rows), plus every request's slot and the decoding requests' batch rows. One
        host->device copy per pass; every layer then moves selections and locations with one
        indexed op each (`per_request`, `locate_group`)."""
        tok, ii, jj, self.K, self.dense = decode_token_lists(qs, self.decode_rows)
        T, N, Nd = len(tok), len(all_slots), len(self.decode_rows)
        m = torch.tensor(tok + ii + jj + all_slots + self.slots + self.decode_rows, dtype=torch.int64).to(device, non_blocking=True)
        self.dec_tok, self.dec_i, self.dec_j = m[:T], m[T : 2 * T], m[2 * T : 3 * T]
        self.tokens = DecodeTokens(self.dec_tok, self.dec_i, self.dec_j, Nd, self.K, self.dense)
        self.all_slots_t = m[3 * T : 3 * T + N]
        self.slots_t = m[3 * T + N : 3 * T + N + Nd]
        self.dec_rows_t = m[3 * T + N + Nd :]  # [Nd] batch rows of the decoding requests

    def _check(self, selection: torch.Tensor) -> None:
        lens = self.batch.seq_lens[self.batch.req_idx][:, None]
        bad = (selection >= lens) | (selection < -1)
        if bool(bad.any()):
            t = int(bad.any(1).nonzero()[0])
            raise ValueError(f"selection of token {t} holds position(s) outside its request's history "
                             f"[0, {int(lens[t])}): {selection[t][bad[t]].tolist()[:4]}")

    def locate(self, layer: int, selection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and locations of `selection` [T, k] (positions, -1 padding) for `layer`."""
        kv = self.kv
        g = kv.group_of[layer]
        self._flush(but=g)  # an earlier group's layers have all run (groups are consecutive layers)
        memo = self.memo.get(g)
        if memo is not None and memo[0] is selection:  # a follower layer: same selection, same locations
            loc = memo[1]
        else:
            if kv.debug:
                self._check(selection)
            loc = self._locate_new(g, layer, selection)
            self.memo[g] = (selection, loc)
        rows = self.arena.latent_rows(layer)
        if not self.decode_rows:
            return rows, loc
        plan, staged = self.plans[g]
        copy_group(kv, layer, plan, staged, rows, layer == kv.groups[g], self._zero)
        return ((rows, kv.staging_rows(layer)) if staged is not None else rows), loc

    def finish(self) -> None:
        """After the model's last layer: flush the last group's promotion (`KVContext.finish`)."""
        self._flush(but=None)

    def _flush(self, but: int | None) -> None:
        """Apply the pending promotions of every group but `but` (kv/hier/promotion.py), in stream
        order after those groups' attention."""
        for g in [g for g in self.pending if g != but]:
            flush_promotion(self.kv, self.pending.pop(g))

    def _locate_new(self, g: int, layer: int, selection: torch.Tensor) -> torch.Tensor:
        """Locations [T, k] of a new selection (`locate_group`): workspace rows for prefilling
        requests, the resolver's plan (run by the group's producer layer) for decoding ones.
        Locations are layer-independent (every layer's row space has the same page layout), so
        the group's followers reuse them."""
        kv = self.kv
        if self.decode_rows and layer != kv.groups[g]:
            raise RuntimeError(f"layer {layer} brings a new selection but is a follower of layer {kv.groups[g]}")
        # positions past a request's length are errors (the indexer masks them; `_check` in debug)
        loc, plan, staged, promo = locate_group(kv, g, selection, self.tokens, self.slots_t, self.lat_of,
                                                self.batch.req_idx, self.all_direct, count_direct=not self.host_counted)
        if plan is not None:
            self.plans[g] = (plan, staged)
        if promo is not None:
            self.pending[g] = promo
        return loc
