"""KVContext of one pass over a HierarchicalKV.

Requests still prefilling read and write their transient workspace exactly like resident
serving. Decoding requests write new rows to their tail and read history through the resolver:
the producer layer of a selection plans (scan + copies for its own bytes), follower layers replay
the plan's copies for their bytes.
"""

from __future__ import annotations

import torch

from dhisparse.kv.arena import SPACE, table_locations
from dhisparse.kv.resident import PagedContext
from dhisparse.kv.context import ForwardBatch
from dhisparse.kv.resolver import ResolveCounters, ResolvePlan


class HierContext(PagedContext):
    def __init__(self, kv, batch: ForwardBatch, reqs: list[object]) -> None:
        super().__init__(kv, batch, len(reqs))
        self.decode_rows: list[int] = []
        self.slots: list[int] = []
        states = [kv.reqs[req] for req in reqs]
        res = kv.resident
        self.idx_of = table_locations([res.index_tables[q] for q in reqs], self.lens, kv.arena.index_page_size, kv.device)
        self.lat_of = table_locations([[] if st.decoding else res.latent_tables[q] for q, st in zip(reqs, states)],
                                      [0 if st.decoding else n for st, n in zip(states, self.lens)], kv.page_size, kv.device)
        if self.lat_of.shape[1] < self.idx_of.shape[1]:
            self.lat_of = torch.nn.functional.pad(self.lat_of, (0, self.idx_of.shape[1] - self.lat_of.shape[1]), value=-1)
        for r, st in enumerate(states):
            if st.decoding:
                self.decode_rows.append(r)
                self.slots.append(st.slot)
                self.lat_of[r, st.tail_start : self.lens[r]] = kv.tail_loc[st.slot, : self.lens[r] - st.tail_start]
        self._finish_tables()
        self.plans: dict[int, tuple[ResolvePlan, ResolvePlan | None]] = {}

    def _check(self, selection: torch.Tensor) -> None:
        lens = self.batch.seq_lens[self.batch.req_idx][:, None]
        bad = (selection >= lens) | (selection < -1)
        if bool(bad.any()):
            t = int(bad.any(1).nonzero()[0])
            raise ValueError(f"selection of token {t} holds position(s) outside its request's history "
                             f"[0, {int(lens[t])}): {selection[t][bad[t]].tolist()[:4]}")

    def _per_request(self, selection: torch.Tensor) -> torch.Tensor:
        """[Nd, Kmax, k] selections of decoding requests (their tokens padded with -1)."""
        qs = self.batch.query_start
        K = max((qs[r + 1] - qs[r] for r in self.decode_rows), default=1)
        out = torch.full((len(self.decode_rows), K, selection.shape[1]), -1, dtype=torch.int64, device=selection.device)
        for i, r in enumerate(self.decode_rows):
            out[i, : qs[r + 1] - qs[r]] = selection[qs[r] : qs[r + 1]]
        return out

    def locate(self, layer: int, selection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv
        if kv.debug:
            self._check(selection)
        sel = torch.where(selection < self.batch.seq_lens[self.batch.req_idx][:, None], selection, torch.full_like(selection, -1))
        loc = self.lat_of[self.batch.req_idx[:, None], sel.clamp(min=0)]
        loc = torch.where(sel >= 0, loc, torch.full_like(loc, -1))
        if self.decode_rows:
            g = kv.group_of[layer]
            if layer == kv.groups[g]:
                slots = torch.tensor(self.slots, dtype=torch.int64, device=sel.device)
                per_req = self._per_request(sel)
                plan = direct_plan(per_req, slots, kv)
                if plan is None:
                    plan = kv.plan_fn(per_req, slots, kv.resolver_state(g), kv.now)
                else:
                    kv.census.direct_calls += 1
                self.plans[g] = stage_overflow(plan, per_req, slots, kv)
            plan, staged = self.plans[g]
            nbytes = kv.copy_fn(plan, kv.host.layer_rows(layer), self.arena.latent_rows(layer))
            nbytes += kv.copy_fn(staged, kv.host.layer_rows(layer), kv.stage) if staged is not None else 0
            if layer == kv.groups[g]:
                kv.census.add(plan.counters, nbytes)
            else:
                kv.census.bytes_moved += nbytes
            qs = self.batch.query_start
            for i, r in enumerate(self.decode_rows):
                loc[qs[r] : qs[r + 1]] = plan.loc[i, : qs[r + 1] - qs[r]]
        rows = self.arena.latent_rows(layer)
        if self.decode_rows and self.plans[kv.group_of[layer]][1] is not None:
            rows = (rows, kv.stage)  # staged rows live in row space 1
        return rows, loc


def direct_plan(sel: torch.Tensor, slots: torch.Tensor, kv) -> ResolvePlan | None:
    """The call-level direct path: when every selected row of every request is in its tail or in
    its ready optional map, return the locations without a resolver call (no hot-cache scan, no
    copy, hot-cache state untouched, as the full resolver would leave it). None otherwise.
    sel [N, K, k] positions (-1 padding); slots [N]."""
    valid = sel >= 0
    s = slots.to(sel.device)[:, None, None].expand_as(sel)
    pos = sel.clamp(min=0)
    start = kv.tail_start[s]
    tail = kv.tail_loc[s, (pos - start).clamp(0, kv.tail_loc.shape[1] - 1)]
    opt_map = getattr(kv, "opt_loc", None)
    opt = opt_map[s, pos.clamp(max=opt_map.shape[1] - 1)] if opt_map is not None else torch.full_like(pos, -1)
    loc = torch.where(pos >= start, tail, opt)
    if not bool(((loc >= 0) | ~valid).all()):
        return None
    distinct = torch.unique(s[valid] * SPACE + pos[valid]).numel()
    empty = torch.zeros(0, dtype=torch.int64, device=sel.device)
    counters = ResolveCounters(int(valid.sum()), distinct, 0, 0, 0, 0)
    return ResolvePlan(torch.where(valid, loc, torch.full_like(loc, -1)), empty, empty, counters)


def stage_overflow(plan: ResolvePlan, sel: torch.Tensor, slots: torch.Tensor, kv) -> tuple[ResolvePlan, ResolvePlan | None]:
    """Rows of a request's union that found no hot-cache victim (the union of K queries can exceed
    B) go to the slot's staging rows: each distinct row copied from host once, its location given
    to every query that selected it. Staged rows are not cached: the hot cache keeps LRU order."""
    missing = (sel >= 0) & (plan.loc < 0)
    if not bool(missing.any()):
        return plan, None
    if kv.stage_loc is None:
        raise RuntimeError("a request's selections exceed its hot cache but the store has no staging arena; "
                           "build it with max_queries = the verification width")
    src, dst, loc, staged, entries = [], [], plan.loc.clone(), 0, 0
    host_ps = kv.host.page_size
    for i in missing.any(-1).any(-1).nonzero().squeeze(1).tolist():
        s, m = int(slots[i]), missing[i]
        uniq, inv = torch.unique(sel[i][m], return_inverse=True)
        rows = kv.stage_loc[s, : uniq.numel()]
        table = kv.host_table[s].to(uniq.device)
        src.append(table[uniq // host_ps] * host_ps + uniq % host_ps)
        dst.append(rows)
        loc[i][m] = rows[inv]
        staged, entries = staged + uniq.numel(), entries + int(m.sum())
    c = plan.counters._replace(host=plan.counters.host + staged, host_selected=plan.counters.host_selected + entries)
    dev = plan.copy_dst.device
    stage_plan = ResolvePlan(loc, torch.cat([t.to(dev) for t in src]), torch.cat([t.to(dev) for t in dst]) - SPACE, c)
    return ResolvePlan(loc, plan.copy_src, plan.copy_dst, c), stage_plan
