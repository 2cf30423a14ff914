"""The hierarchical presets (`hisparse`, `adaptive`) for DeepSeek-V4: compressed rows in tiers.

What is tiered and what stays on device, per request:

    tiered (host backing + hot cache + tail [+ optional history under `adaptive`])
        CSA compressed KV rows of every physical source (a "full" CSA layer; "reindex" / "reuse"
        layers read their source's rows): head_dim values per m = csa_rate tokens, selected by
        the lightning indexer's top-k. This is the history that grows with the context.
    on device (required state, reserved for the request's whole life)
        CSA index keys of every source (the indexer scores all of them, like GLM's index keys),
        kept in the arena's index pages;
        sliding windows (W rows per layer) and compressor streaming tails (< 2m raw tokens per
        compressor): constant size; HCA rows (head_dim per 128 tokens): every query attends to
        all of them (dense), so a tier would move every row every step, and they are 32x fewer
        per layer than CSA rows (v41-scaled at 500K tokens: 16 HCA layers = 64 MB against 512 MB
        of CSA rows in its 4 sources). Sizes: `v4_dense_bytes`.

The GLM hierarchy is reused unchanged over a *row space*: `v4_row_geometry` describes the CSA
sources as the "layers" of a `KVArena` (row width head_dim, index keys index_head_dim, every
source its own index producer), and a "position" of that arena is a compressed row id w. So the
hot cache, tail, host backing, staging, handoff (workspace -> host / optional history), residency
and both resolver implementations (PyTorch reference; Triton on CUDA) apply to compressed rows.
Units: the engine speaks tokens, the hierarchy rows (row w exists once tokens (w+1)m are
committed, DESIGN §4 causality); `V4HierStore` converts (rows(n) = n // m).

Prefixes (kv/v4/prefix.py): the exported `V4Prefix` holds the device state (tails, HCA rows) and,
as `tiered`, the CSA sources' rows of the exporter's workspace in row units (a `StoredPrefix` of
the row arena, stored bytes). An import restores the state and imports `tiered` through the row
hierarchy's own `import_prefix`: whole pages into the workspace, and the complete pages borrowed
as the prefix's shared host pages (kv/hier/prefix_pages.py; admission reserves no host page for
them: `set_prefix_match` hands the row hierarchy a matcher in rows). The hand-off then treats
them like any prompt's pages (I1), and the resolver fetches them like any other history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhisparse.kv.hier.adaptive import AdaptiveKV
from dhisparse.core.contracts import KVStore, PrefixMatch
from dhisparse.core.kvformat import KVFormats
from dhisparse.core.rows import cdiv
from dhisparse.core.batch import ForwardBatch
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from dhisparse.kv.memory.pool import PoolUsage
from dhisparse.kv.memory.prefix_store import StoredPrefix
from dhisparse.kv.v4.hier_pass import V4HierPass
from dhisparse.kv.v4.passes import V4Cache
from dhisparse.kv.v4.prefix import (V4Prefix, adopt_tails, export_rows, export_tails, host, import_len, put_rows,
                                    row_matcher, row_token_ids)
from dhisparse.kv.v4.rows import KINDS, DenseRowStore
from dhisparse.kv.v4.store import v4_bytes, v4_row_bytes
from dhisparse.kv.v4.tiered import TieredRows
from dhisparse.kv.memory.layout import RowGeometry
from dhisparse.core.v4_config import V4Config


def v4_row_geometry(cfg: V4Config) -> RowGeometry:
    """The row geometry of V4's CSA sources: one arena "layer" per source (latent width head_dim,
    index keys index_head_dim, each its own index producer, top-k index_topk)."""
    G = len(cfg.csa_sources)
    if G == 0:
        raise ValueError("the hierarchical presets tier CSA compressed rows, but this deepseek_v4 model has no "
                         "compressed_sparse_attention layer; use --preset resident")
    return RowGeometry(G, cfg.head_dim, cfg.index_head_dim, cfg.index_topk, (True,) * G)


def v4_dense_bytes(cfg: V4Config, n_tokens: int, elem: int, formats: KVFormats | None = None) -> int:
    """Device bytes of one request's required (untiered) V4 state after n_tokens: `v4_bytes`
    without the CSA sources' compressed KV rows and index keys (those live in the arena)."""
    tiered = len(cfg.csa_sources) * (n_tokens // cfg.csa_rate) * sum(v4_row_bytes(cfg, elem, formats))
    return v4_bytes(cfg, n_tokens, elem, formats) - tiered


def state_owner(req: object) -> tuple[str, object]:
    """Pool owner of a request's required V4 state pages (windows, raw tails, HCA rows)."""
    return ("v4state", req)


class _V4Rows:
    """Mixin over HierarchicalKV / AdaptiveKV (which work in row units): every request also
    holds pages for its required V4 state, allocated at admission under `state_owner(req)`.
    Row passes are not one call per layer group with min(k, n) rows a request, so an all-direct
    pass is counted per call on the device (`HierContext.host_counted`).

    Keywords are the GLM stores' (`HierarchicalKV`: side_loads, hand-off backups beside the batch;
    `AdaptiveKV`: side_stream, residency copies on a side stream) plus v4, the model config."""

    host_census = False
    HOST_FIRST = False  # V4 prefixes are whole streaming states, imported by V4HierStore
    STAGING_PAPER = False  # a source's rows are read again after other sources' calls: one arena, restaged

    def __init__(self, *args, v4: V4Config, **kw) -> None:
        self.v4, self.state_need = v4, {}  # first: AdaptiveKV's default reserve counts the V4 state pages
        super().__init__(*args, **kw)

    def state_pages(self, max_rows: int) -> int:
        tokens = (max_rows + 1) * self.v4.csa_rate - 1  # the most tokens max_rows rows can stand for
        f = self.arena.formats
        return cdiv(v4_dense_bytes(self.v4, tokens, f.latent.dtype.itemsize, f), self.arena.page_nbytes)

    def required_pages(self, max_total: int) -> int:
        return super().required_pages(max_total) + self.state_pages(max_total)

    def admit(self, req: object, max_total: int, prompt_len: int | None = None) -> bool:
        if not super().admit(req, max_total, prompt_len):
            return False
        self.pool.transfer(req, state_owner(req), self.pool.alloc(req, self.state_pages(max_total)))
        self.state_need[req] = self.state_pages(max_total)
        return True

    def free(self, req: object) -> None:
        super().free(req)
        self.pool.release(state_owner(req))
        self.state_need.pop(req, None)

    def check_integrity(self) -> None:
        super().check_integrity()
        for req, n in self.state_need.items():
            assert len(self.pool.owned_by(state_owner(req))) == n, f"required V4 state pages of {req!r} are missing"


class V4HierarchicalKV(_V4Rows, HierarchicalKV):
    """`hisparse` over V4's compressed rows."""


class V4AdaptiveKV(_V4Rows, AdaptiveKV):
    """`adaptive` over V4's compressed rows."""


@dataclass
class SourceCounters:
    """reuse_reads: "reuse" consumers served from a source's latest located selection (no
    resolver call); stage_replays: staged copies re-materialized for such a consumer."""

    reuse_reads: int = 0
    stage_replays: int = 0


class V4HierStore(KVStore):
    """Engine-facing store of the hierarchical V4 presets: per-request `V4RequestState`s (window,
    streaming tails, HCA rows on device) + `kv`, the row hierarchy of the CSA sources. Speaks
    tokens; `kv` speaks rows. Its census, residency and loads are the row hierarchy's; its passes
    never replay from a step graph (no `graph_context`) and read the staging arena through their
    own row spaces (no `staging_rows`). Prefixes: whole states (module docstring)."""

    def __init__(self, cfg: V4Config, kv: HierarchicalKV, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg, self.kv, self.pool, self.m = cfg, kv, kv.pool, cfg.csa_rate
        self.device, self.page_size = device, kv.page_size  # rows of every CSA source per page
        self.group = {layer: g for g, layer in enumerate(cfg.csa_sources)}
        dense = DenseRowStore({"kv": cfg.head_dim, "index": cfg.index_head_dim}, device, dtype, kv.arena.formats)
        self.cache = V4Cache(cfg, device, dtype, store=TieredRows(set(self.group), dense))
        self.states: dict[object, object] = {}
        self.counters = SourceCounters()
        self._restaged: torch.Tensor | None = None  # bytes of deferred staging replays not yet counted

    @property
    def census(self):
        return self.kv.census

    @property
    def res(self):
        return self.kv.residency()

    @property
    def hot_cache_rows(self) -> int:
        return self.kv.B

    def host_usage(self):
        return self.kv.host_usage()

    def resolver_census(self):
        return self.kv.census

    def residency(self):
        return self.kv.residency()

    def rows(self, n_tokens: int | None) -> int | None:
        return None if n_tokens is None else n_tokens // self.m

    def pages_for(self, max_total: int, prompt_len: int | None = None) -> int:
        return self.kv.pages_for(self.rows(max_total), self.rows(prompt_len))

    def admit(self, req: object, max_total: int, prompt_len: int | None = None) -> bool:
        if not self.kv.admit(req, self.rows(max_total), self.rows(prompt_len)):
            return False
        self.states[req] = self.cache.new_request(req, auto_commit=False)
        return True

    def never_fits(self, max_total: int, prompt_len: int | None = None) -> str | None:
        return self.kv.never_fits(self.rows(max_total), self.rows(prompt_len))

    def loading(self, req: object) -> bool:
        """Whether req waits for a background load of its rows (the row hierarchy's hand-off
        backup under `--load-stream side`, kv/memory/loads.py): the scheduler skips it meanwhile."""
        return self.kv.loading(req)

    def free(self, req: object) -> None:
        st = self.states.pop(req, None)
        if st is not None:
            st.release()
        self.kv.free(req)

    def context(self, batch: ForwardBatch, reqs: list[object]):
        """Roll back uncommitted positions (rejected drafts), then open the row hierarchy's pass
        over the compressed rows this token pass can emit."""
        states = [self.states[r] for r in reqs]
        chunks = []
        for i, st in enumerate(states):
            a, b = batch.query_start[i], batch.query_start[i + 1]
            start = int(batch.positions[a]) if b > a else st.length
            if st.length > start:
                st.rollback(start)
            n0, n1 = start // self.m, (start + b - a) // self.m
            chunks.append((list(range(n0, n1)), n0))
        row_batch = ForwardBatch.build(chunks, batch.input_ids.device)
        return V4HierPass(batch, states, self.cache.store, self.kv.context(row_batch, reqs), self)

    def before_sync(self) -> None:
        self.kv.before_sync()

    def idle(self) -> None:
        self.kv.idle()

    def after_step(self, computed: dict[object, tuple[int, bool]]) -> None:
        """Commit tokens < n (streaming state trimmed); rows < n // m become history of the row
        hierarchy (handoff of a finished prompt, host backup of completed tail pages)."""
        rows = {}
        for req, (n, done) in computed.items():
            st = self.states.get(req)
            if st is not None:
                n = min(n, st.length)
                st.commit(n)
                rows[req] = (n // self.m, done)
        self.kv.after_step(rows)
        if self._restaged is not None:  # staging replays happen in verification passes, read after their sync
            self.kv.census.bytes_moved += int(self._restaged)
            self._restaged = None

    def count_restaged(self, nbytes: "int | torch.Tensor") -> None:
        """Bytes a pass's staging replay copied (`V4HierPass.reuse`): an int is counted now; a
        device tensor (a deferred plan's replay, no sync) accumulates until `after_step`."""
        if isinstance(nbytes, int):
            self.kv.census.bytes_moved += nbytes
        else:
            self._restaged = nbytes if self._restaged is None else self._restaged + nbytes

    def usage(self) -> PoolUsage:
        return self.kv.usage()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        assert set(self.states) == set(self.kv.reqs), "V4 states and row-hierarchy requests disagree"

    # -- prefixes (kv/v4/prefix.py; module docstring) ----------------------------------------------
    def export_prefix(self, req: object, token_ids: list[int], features: dict, pin: bool) -> V4Prefix:
        """req's state after its prompt: tails, HCA rows and its workspace's CSA rows (row units)."""
        st, n = self.states[req], len(token_ids)
        if st.length != n or self.kv.reqs[req].decoding:
            raise ValueError(f"request {req!r} is not at its prompt's end ({st.length} of {n} tokens)")
        latent, index = self.kv.read_rows(req, n // self.m)  # stored rows of the workspace
        tiered = StoredPrefix(row_token_ids(token_ids, self.m), host(latent, pin), host(index, pin))
        tiered.paged(*self.kv.prefix_layout())  # its page layout now, not on the first import
        rows = export_rows(st, self.cache.store.dense, set(self.group), pin)
        return V4Prefix(tuple(token_ids), export_tails(st, pin), rows, tiered, {l: f.cpu() for l, f in features.items()})

    def import_len(self, item, n: int) -> int:
        """Whole prefixes only (kv/v4/prefix.py `import_len`)."""
        return import_len(item, n)

    def import_prefix(self, req: object, item: V4Prefix, n: int) -> None:
        """req's fresh state <- the item's tails and HCA rows; its R = n // m CSA rows of every
        source -> the row hierarchy (workspace pages; complete pages borrow shared host pages)."""
        if n != len(item.token_ids) or item.tiered is None:
            raise ValueError(f"a hierarchical V4 state imports a whole hierarchical prefix ({len(item.token_ids)} "
                             f"tokens), not {n} positions{' of a resident one' if item.tiered is None else ''}")
        st, R, rows = self.states[req], n // self.m, self.cache.store
        for layer in self.group:  # the tiered rows' counts (TieredRows counts what the hierarchy holds)
            for kind in KINDS:
                rows.set_count(req, layer, kind, R)
        put_rows(rows.dense, req, item.rows)
        adopt_tails(st, item, self.device)
        if R:
            self.kv.import_prefix(req, item.tiered, R)

    def set_prefix_match(self, match: PrefixMatch) -> None:
        """The row hierarchy's admission reserves no host page for the complete row pages a
        request will borrow: it gets a matcher in rows (the tiered part, under `import_len`)."""
        self.kv.set_prefix_match(row_matcher(match, self.m))

    def write_rows(self, req: object, latent, index, start: int = 0) -> None:
        raise ValueError("deepseek_v4 prefixes are whole streaming states (import_prefix), not rows by position")

    def read_rows(self, req: object, n: int, pin: bool = False):
        raise ValueError("deepseek_v4 prefixes are whole streaming states (export_prefix), not rows by position")
