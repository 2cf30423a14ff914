"""Prometheus metrics for `/metrics`.

Engine state is read from the worker's latest stats snapshot (`EngineWorker.stats`: the engine's
`stats().as_dict()`, refreshed after every step and every abort) at scrape time by a custom
collector: named gauges that are always present (0 until the engine reports them) - running /
waiting requests, request slots, device (KV pool) pages, host pages, optional pages - plus every
numeric engine stat as `dhisparse_engine_<name>`, so counters that later presets add (host-fetched
share, coverage, acceptance, ...) appear without code changes here. Per-step gauges (`decoding`)
read 0 while the engine is idle instead of keeping the last busy step's value. Request latencies
are histograms observed when a request finishes (under prefill/decode disaggregation also TTFT's
split: hand-off and allocation wait, `DisaggMetrics`); aborted requests are counted by reason
(client_disconnect - streamed or not -, stall, timeout, shutdown).
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dhisparse.engine.disagg_round import DisaggMetrics
from dhisparse.engine.request import RequestOutput

PREFIX = "dhisparse"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5)
# named series: metric name -> (stats key or a rule, help); always exported
NAMED_GAUGES = {
    "num_requests_running": ("running", "requests decoding or prefilling"),
    "num_requests_waiting": ("waiting", "requests queued for admission"),
    "kv_pages_used": ("kv_pages_used", "KV pool (device) pages in use"),
    "kv_pages_total": ("kv_pages_total", "KV pool (device) pages in total"),
    "kv_pool_usage": ("=pool_usage", "share of KV pool pages in use (0..1)"),
    "device_pages_used": ("kv_pages_used", "device KV pages in use (same as kv_pages_used)"),
    "device_pages_total": ("kv_pages_total", "device KV pages in total (same as kv_pages_total)"),
    "host_pages_used": ("host_pages_used", "host backing pages in use (hierarchical presets; else 0)"),
    "host_pages_total": ("host_pages_total", "host backing pages in total (hierarchical presets; else 0)"),
    "optional_pages": ("optional_pages", "device pages holding optional (re-fetchable) history (adaptive; else 0)"),
    "slots": ("=slots_used", "request slots in use (running requests)"),
    "request_slots_used": ("=slots_used", "request slots in use (running requests)"),
    "request_slots_total": ("=slots_total", "request slots (--max-running-requests)"),
}
# present once the engine reports them (hierarchical / adaptive / speculative presets)
OPTIONAL_GAUGES = {
    "host_fetched_share": ("host_fetched_share", "selected rows copied from host / all selected rows"),
    "coverage": ("coverage", "ready optional history / eligible history"),
    "acceptance": ("acceptance", "speculative acceptance rate"),
    "spec_draft_ms_per_call": ("spec_draft_ms_per_call", "drafter time per step that drafts, milliseconds"),
    "drafter_weight_bytes": ("drafter_weight_bytes", "device bytes of the drafter's own weights"),
    "drafter_state_bytes": ("drafter_state_bytes", "device bytes of the drafter's state (draft KV ring, every slot; graph static inputs)"),
}
PER_STEP_KEYS = ("decoding",)  # what the last step did: 0 while nothing runs or waits
ABORT_REASONS = ("client_disconnect", "stall", "timeout", "shutdown")


def metric_name(key: str) -> str:
    """A stats key -> a valid Prometheus name fragment."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class EngineCollector(Collector):
    """Yields gauges from `snapshot()` (a dict of engine stats) at every scrape."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str, preset: str, slots_total: int = 0) -> None:
        self.snapshot, self.model_name, self.preset, self.slots_total = snapshot, model_name, preset, slots_total

    def _gauge(self, name: str, help_: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"{PREFIX}_{name}", help_, labels=["model_name", "preset"])
        g.add_metric([self.model_name, self.preset], value)
        return g

    def _value(self, stats: dict, key: str) -> float:
        if key == "=pool_usage":
            total = stats.get("kv_pages_total") or 0
            return (stats.get("kv_pages_used", 0) / total) if total else 0.0
        if key == "=slots_used":
            return float(stats.get("slots_used", stats.get("running", 0)))
        if key == "=slots_total":
            return float(stats.get("slots_total", self.slots_total))
        return float(stats.get(key, 0) or 0)

    def collect(self) -> Iterator:
        stats = dict(self.snapshot())
        if not stats.get("running") and not stats.get("waiting"):
            stats.update({k: 0 for k in PER_STEP_KEYS if k in stats})
        for name, (key, help_) in NAMED_GAUGES.items():
            yield self._gauge(name, help_, self._value(stats, key))
        for name, (key, help_) in OPTIONAL_GAUGES.items():
            if key in stats:
                yield self._gauge(name, help_, float(stats[key]))
        if "generated_tokens" in stats:
            c = CounterMetricFamily(f"{PREFIX}_generation_tokens", "tokens generated since start",
                                    labels=["model_name", "preset"])
            c.add_metric([self.model_name, self.preset], float(stats["generated_tokens"]))
            yield c
        for key, value in numeric_items(stats):
            yield self._gauge(f"engine_{metric_name(key)}", f"engine stat '{key}' (EngineStats.as_dict)", value)


def numeric_items(stats: dict) -> list[tuple[str, float]]:
    """(key, float) for every finite int/float/bool value of a stats dict."""
    out = []
    for k, v in stats.items():
        if isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v)):
            out.append((k, float(v)))
    return out


class ServerMetrics:
    """A private registry (so several servers can live in one process, e.g. in tests)."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str, preset: str, slots_total: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(snapshot, model_name, preset, slots_total))
        labels = ["model_name", "preset"]
        self._labels = (model_name, preset)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "time to first token",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds", "mean time per output token after the first",
                              labels, buckets=TPOT_BUCKETS, registry=self.registry)
        # prefill/decode disaggregation (engine/disagg.py): TTFT's split, observed for requests decoded elsewhere
        self.handoff = Histogram(f"{PREFIX}_handoff_seconds", "first token on the prefill rank -> KV on the decode rank",
                                 labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.alloc_wait = Histogram(f"{PREFIX}_allocation_wait_seconds", "KV received -> admitted on the decode rank",
                                    labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.finished = Counter(f"{PREFIX}_requests_finished", "finished requests by finish reason",
                                labels + ["finish_reason"], registry=self.registry)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "requests answered with an HTTP error",
                                labels + ["status"], registry=self.registry)
        self.aborted = Counter(f"{PREFIX}_requests_aborted", "requests aborted before they finished, by reason",
                               labels + ["reason"], registry=self.registry)
        for reason in ABORT_REASONS:
            self.aborted.labels(*self._labels, reason)

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m.ttft is not None:
            self.ttft.labels(*self._labels).observe(m.ttft)
        if m.tpot is not None:
            self.tpot.labels(*self._labels).observe(m.tpot)
        if isinstance(m, DisaggMetrics) and m.handoff is not None:
            self.handoff.labels(*self._labels).observe(m.handoff)
            self.alloc_wait.labels(*self._labels).observe(m.alloc_wait or 0.0)
        self.finished.labels(*self._labels, out.finish_reason or "unknown").inc()

    def observe_rejected(self, status: int) -> None:
        self.rejected.labels(*self._labels, str(status)).inc()

    def observe_aborted(self, reason: str) -> None:
        self.aborted.labels(*self._labels, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
