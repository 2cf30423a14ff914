"""Test helpers for V4 / V4.1 through the engine (helper module, not a test file).

- `tiny_v41()`: a tiny DeepSeek-V4.1-style config with two shared CSA sources
      0 SWA | 1 CSA full | 2 CSA full | 3 CSA reuse(1) | 4 HCA | 5 CSA reindex(1) | 6 CSA reuse(1)
        | 7 CSA reindex(2) | 8 CSA reuse(2)
  (layer 3 reuses source 1 after source 2's call: the staging replay path).
- `engine(loaded, **kw)`: an Engine over an already loaded model (shared, stateless).
- `SourceCheck`: patches `V4HierPass` so that every pass is checked against a shadow copy of
  every emitted compressed row: located and reused rows are exactly the selected rows of the
  right request (I2), a resolver call copies from host exactly the distinct selected rows absent
  from the source's tail / ready optional map / hot cache before the call, and rollbacks that cut
  a compression window (rejected drafts inside a window) are recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.core.rows import gather_rows
from dhisparse.kv.v4.hier_pass import V4HierPass
from dhisparse.kv.v4.state import V4RequestState
from dhisparse.models.loader import LoadedModel
from dhisparse.models.tokenizer import ByteTokenizer
from dhisparse.core.v4_config import V4Config
from dhisparse.models.v4_scaled import build_v4_random
from v4_fixtures import CSA, HCA, SWA, V4_TINY

V41_LAYERS = dict(
    num_hidden_layers=9, layer_types=[SWA, CSA, CSA, CSA, HCA, CSA, CSA, CSA, CSA],
    kv_source_layer_ids=[0, 1, 2, 1, 4, 1, 1, 2, 2],
    selection_types=["full", "full", "full", "reuse", "full", "reindex", "reuse", "reindex", "reuse"],
    mlp_layer_types=["hash_moe"] + ["moe"] * 8,
)


def tiny_v41(**over) -> V4Config:
    return V4Config.from_hf({**V4_TINY, **V41_LAYERS, **over})


def loaded_v41(seed: int = 5) -> LoadedModel:
    cfg = tiny_v41()
    return LoadedModel(build_v4_random(cfg, seed), cfg, {}, ByteTokenizer())


def engine(loaded: LoadedModel, reference: dict | None = None, **kw) -> Engine:
    base = dict(page_size=4, max_num_batched_tokens=10, debug_checks=True)
    return Engine(EngineConfig(**{**base, **kw}), loaded=loaded, oracle_reference=reference)


def generate(eng: Engine, prompts, params) -> list[list[int]]:
    """Run `prompts` to completion. Request ids are fixed (`g0`, `g1`, ...): the oracle drafter
    seeds its corruption per request id, so a process-wide id counter would make a test's draft
    stream (and whether a rollback cuts a compression window) depend on the tests before it."""
    ids = [eng.add_request(p, params, request_id=f"g{i}") for i, p in enumerate(prompts)]
    done: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    return [done[i] for i in ids]


@dataclass
class SourceCheck:
    rows: dict = field(default_factory=dict)  # (rid, source, row) -> latest emitted row
    last_sel: dict = field(default_factory=dict)  # source -> latest selection [T, k]
    located: int = 0
    reused: int = 0
    calls: dict = field(default_factory=dict)  # source layer -> resolver calls
    host_rows: dict = field(default_factory=dict)  # source layer -> rows copied from host
    reindex_hits: int = 0  # rows a reindex call found already present (fetched by earlier layers)
    window_cuts: int = 0  # rollbacks inside a compression window that dropped an emitted row
    decode_passes: int = 0  # passes that resolved for decoding requests

    def install(self, mp) -> "SourceCheck":
        ck = self
        orig_append, orig_locate, orig_reuse = V4HierPass.append_rows, V4HierPass.locate, V4HierPass.reuse
        orig_rollback = V4RequestState.rollback

        def append_rows(p, layer, kind, req, rows):
            orig_append(p, layer, kind, req, rows)
            if kind == "kv" and layer in p.group:
                first = p.store.count(p.rids[req], layer, kind) - rows.shape[0]
                stored = p.kv.arena.formats.latent.encode(rows)  # the bytes the arena holds (FP8 or plain)
                for j in range(rows.shape[0]):
                    ck.rows[(p.rids[req], layer, first + j)] = stored[j].clone()

        def locate(p, layer, kind, sel):
            if layer not in p.group:
                return orig_locate(p, layer, kind, sel)
            absent = ck._absent(p, layer, sel)
            host0, calls0, hot0 = p.kv.census.host, p.kv.census.calls, p.kv.census.hot
            space = orig_locate(p, layer, kind, sel)
            if p.rc.decode_rows:
                assert p.kv.census.calls == calls0 + 1
                assert p.kv.census.host - host0 == absent, "a call copied rows that were already on device"
                ck.calls[layer] = ck.calls.get(layer, 0) + 1
                ck.host_rows[layer] = ck.host_rows.get(layer, 0) + absent
                seen = p.__dict__.setdefault("_ck_seen", set())
                ck.decode_passes += not seen
                if layer in seen:  # a later call on the source in this pass: a reindex layer
                    ck.reindex_hits += p.kv.census.hot - hot0
                seen.add(layer)
            ck.last_sel[layer] = sel
            ck._check(p, layer, sel, space)
            ck.located += 1
            return space

        def reuse(p, source):
            calls0 = p.kv.census.calls
            space = orig_reuse(p, source)
            assert p.kv.census.calls == calls0, "a reuse consumer made a resolver call"
            ck._check(p, source, ck.last_sel[source], space)
            ck.reused += 1
            return space

        def rollback(st, pos):
            m = st.cfg.csa_rate
            if pos % m and any(st.rows(i, "kv") > pos // m for i in st.cfg.csa_sources):
                ck.window_cuts += 1
            orig_rollback(st, pos)

        mp.setattr(V4HierPass, "append_rows", append_rows)
        mp.setattr(V4HierPass, "locate", locate)
        mp.setattr(V4HierPass, "reuse", reuse)
        mp.setattr(V4RequestState, "rollback", rollback)
        return self

    def _check(self, p, layer, sel, space) -> None:
        """I2: every valid location holds exactly the selected row of the token's request."""
        ok = sel >= 0
        assert torch.equal(ok, space.loc >= 0)
        t, i = ok.nonzero(as_tuple=True)
        got = gather_rows(space.rows, space.loc[t, i])
        want = torch.stack([self.rows[(p.rids[int(p.batch.req_idx[a])], layer, int(sel[a, b]))]
                            for a, b in zip(t.tolist(), i.tolist())]) if t.numel() else got
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    @staticmethod
    def _absent(p, layer, sel) -> int:
        """Distinct selected rows of decoding requests not in their tail, ready map or hot cache."""
        kv, g, qs, total = p.kv, p.group[layer], p.batch.query_start, 0
        for slot, r in zip(p.rc.slots, p.rc.decode_rows):
            rows = torch.unique(sel[qs[r] : qs[r + 1]])
            rows = rows[rows >= 0]
            here = rows >= int(kv.tail_start[slot])
            opt = getattr(kv, "opt_loc", None)
            if opt is not None:
                here |= opt[slot, rows.clamp(max=opt.shape[1] - 1)] >= 0
            here |= torch.isin(rows, kv.hot_pos[slot, g])
            total += int((~here).sum())
        return total
