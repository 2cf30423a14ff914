"""`EngineStats`: a snapshot of engine state and counters (what /metrics, the benchmark harness and
the per-second series read). Counters from the KV store (resolver census, residency) and the
speculative runtime are merged into `as_dict()` when those parts exist."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dhisparse.models.graphs import graph_counters

if TYPE_CHECKING:
    from dhisparse.engine.engine import Engine


@dataclass(frozen=True)
class EngineStats:
    """Snapshot of engine state: requests, KV pool pages and bytes, totals since start."""

    running: int
    waiting: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_peak: int
    kv_page_bytes: int
    steps: int
    generated_tokens: int
    prefill_tokens: int
    decoding: int = 0
    admitted: int = 0
    alloc_wait_s: float = 0.0
    counters: dict = field(default_factory=dict)

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_pages_total * self.kv_page_bytes

    @property
    def kv_peak_bytes(self) -> int:
        return self.kv_pages_peak * self.kv_page_bytes

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "counters"}
        d.update(kv_pool_bytes=self.kv_pool_bytes, kv_peak_bytes=self.kv_peak_bytes, **self.counters)
        return d


def engine_stats(eng: Engine) -> EngineStats:
    """`Engine.stats`: the engine's requests, its pool net of the pages it holds for good
    (`Engine._fixed_pages`), its totals, and the counters of its store, speculation, pool and graphs."""
    u, fixed = eng.store.usage(), eng._fixed_pages
    return EngineStats(len(eng.scheduler.running), len(eng.scheduler.waiting), u.total - fixed, u.used - fixed,
                       eng._peak, eng.page_bytes, eng._steps, eng._generated, eng._prefilled,
                       eng._decoding, eng._admitted, eng._alloc_wait,
                       store_counters(eng.store, eng.spec.stats() if eng.spec else {})
                       | (eng.spec_memory.counters() if eng.spec_memory is not None else {})
                       | pool_counters(eng.store, len(eng.scheduler.running), eng.config.max_running_requests)
                       | graph_counters(eng.model.graphs)
                       | (eng.step_graphs.counters() if eng.step_graphs is not None else {})
                       | (eng.replay.stats() if eng.replay is not None else {}))


def store_counters(store, spec_counters: dict) -> dict:
    """Resolver census, residency and speculative counters of an engine's store."""
    census = store.resolver_census()
    if census is None:
        return dict(spec_counters)
    sel = max(census.selected, 1)
    rows = max(census.direct + census.hot + census.host, 1)
    return residency_counters(store) | spec_counters | {
        "selected_rows": census.selected,
        "host_selected_rows": census.host_selected,
        "host_fetched_share": census.host_selected / sel,
        "resolver_direct_share": census.direct / rows,
        "resolver_hot_share": census.hot / rows,
        "resolver_host_share": census.host / rows,
        "resolver_calls": census.calls,
        "resolver_direct_calls": census.direct_calls,
        "resolver_bytes_moved": census.bytes_moved,
        "resolver_overflow": census.overflow,
        "staging_promoted_rows": census.promoted,
        "staging_copyback_bytes": census.copyback_bytes,
        "host_selections_per_row": census.host_selected / census.host if census.host else 0.0,
    }


def pool_counters(store, running: int, slots: int) -> dict:
    """Request slots and host backing pages (0 / 0 for stores without a host pool)."""
    host = store.host_usage()
    return {"slots_used": running, "slots_total": slots,
            "host_pages_used": host.used if host is not None else 0, "host_pages_total": host.total if host is not None else 0}


def residency_counters(store) -> dict:
    res = store.residency()
    if res is None:
        return {}
    ready, eligible = res.coverage()
    return {"coverage": ready / eligible if eligible else 0.0, "optional_pages": res.optional_pages(),
            "reclaimed_pages": res.reclaimed, "repopulated_pages": res.repopulated}
