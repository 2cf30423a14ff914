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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhisparse.kv.hier.adaptive import AdaptiveKV
from dhisparse.core.contracts import KVStore
from dhisparse.core.kvformat import KVFormats
from dhisparse.core.rows import cdiv
from dhisparse.core.batch import ForwardBatch
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from dhisparse.kv.memory.pool import PoolUsage
from dhisparse.kv.v4.hier_pass import V4HierPass
from dhisparse.kv.v4.passes import V4Cache
from dhisparse.kv.v4.rows import DenseRowStore
from dhisparse.kv.v4.store import v4_bytes
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
    row = formats.latent.nbytes + formats.index.nbytes if formats is not None else (cfg.head_dim + cfg.index_head_dim) * elem
    tiered = len(cfg.csa_sources) * (n_tokens // cfg.csa_rate) * row
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
    own row spaces (no `staging_rows`)."""

    supports_prefix = False

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

    def write_rows(self, req: object, latent, index, start: int = 0) -> None:
        raise ValueError("prefix KV import is not available for deepseek_v4 models yet; send the whole prompt")

    def read_rows(self, req: object, n: int):
        raise ValueError("prefix KV export (prepare_prefix) is not available for deepseek_v4 models yet")
