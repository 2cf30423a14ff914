"""What a run records (per request, per step, per interval) and the docs/design.md §7 summary.

Times are seconds from the run's start. `summarize` turns a `RunTrace` into `RunMetrics`:
output tok/s, TTFT mean / p99, post-wave TTFT (requests after the first C), TPOT mean / p99,
active (mean requests decoding over the central half of the run), slots (most requests running),
central output tok/s (tokens returned over that central half: the steady rate, without the
window's admission ramp and its tail) and the engine counters the build reports (None when absent;
tables print "-").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

# engine counters (EngineStats.as_dict keys) that summaries pick out when present
COUNTERS = ("host_fetched_share", "coverage", "resolver_direct_share", "resolver_hot_share", "resolver_host_share",
            "acceptance", "tokens_per_round", "allocation_wait", "handoff", "slots")
# the ones bench tables show as columns (host_fetched_share always, "-" when absent)
TABLE_COUNTERS = ("host_fetched_share", "coverage", "acceptance", "tokens_per_round")


class RequestRecord(NamedTuple):
    """One request: submit / first-token / finish times (s from run start; None if not reached)."""

    index: int
    client: int
    submit: float
    first: float | None
    finish: float | None
    output_len: int
    prompt_len: int
    finish_reason: str | None
    queue: float | None = None  # allocation wait reported by the engine (in-process only)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.submit

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first is None or self.output_len < 2:
            return None
        return (self.finish - self.first) / (self.output_len - 1)


class StepSample(NamedTuple):
    """Per engine step (in-process) or per poll (HTTP): requests decoding and running, and the
    tokens the step returned (in-process only)."""

    t: float
    decoding: int
    running: int
    tokens: int = 0


@dataclass(frozen=True)
class RunTrace:
    """Everything one closed-loop run observed."""

    duration_s: float
    output_tokens: int
    requests: tuple[RequestRecord, ...]
    steps: tuple[StepSample, ...]
    series: tuple[dict, ...]
    engine: dict


@dataclass(frozen=True)
class RunMetrics:
    """docs/design.md §7 metrics of one run; latencies in ms; None where undefined."""

    concurrency: int
    duration_s: float
    requests_submitted: int
    requests_completed: int
    output_tokens: int
    output_tok_s: float
    ttft_mean_ms: float | None
    ttft_p99_ms: float | None
    post_wave_ttft_mean_ms: float | None
    post_wave_ttft_p99_ms: float | None
    tpot_mean_ms: float | None
    tpot_p99_ms: float | None
    active: float | None
    slots: int
    queue_mean_ms: float | None
    counters: dict
    central_output_tok_s: float | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def central_active(steps: tuple[StepSample, ...], duration_s: float) -> float | None:
    """Mean of per-step decoding counts over the central half [T/4, 3T/4] of the run."""
    mid = [s.decoding for s in steps if duration_s / 4 <= s.t <= 3 * duration_s / 4]
    return mean(mid) if mid else mean([s.decoding for s in steps])


def central_tok_s(steps: tuple[StepSample, ...], duration_s: float) -> float | None:
    """Tokens returned per second over the central half (T/4, 3T/4] of a run of T s (each step's
    tokens counted at its end time). None when no step carries a token count (HTTP runs)."""
    if duration_s <= 0 or not any(s.tokens for s in steps):
        return None
    lo, hi = duration_s / 4, 3 * duration_s / 4
    return sum(s.tokens for s in steps if lo < s.t <= hi) / (hi - lo)


def series_central_tok_s(series: list[dict], duration_s: float) -> float | None:
    """`central_tok_s` from a result's interval series (rows {t, generated_tokens}: the engine's
    cumulative count), for results written before the metric: the count interpolated linearly at
    T/4 and 3T/4 (clamped to the first and last rows). None without two rows of the counter."""
    rows = [(r["t"], r["generated_tokens"]) for r in series if isinstance(r.get("generated_tokens"), (int, float))]
    if duration_s <= 0 or len(rows) < 2:
        return None

    def at(t: float) -> float:
        if t <= rows[0][0]:
            return rows[0][1]
        for (t0, g0), (t1, g1) in zip(rows, rows[1:]):
            if t <= t1:
                return g0 + (g1 - g0) * (t - t0) / (t1 - t0) if t1 > t0 else g1
        return rows[-1][1]

    lo, hi = duration_s / 4, 3 * duration_s / 4
    return (at(hi) - at(lo)) / (hi - lo)


def central_of(run: dict) -> float | None:
    """A result run's central output tok/s: its metric, or for results written before it, from its series."""
    m = run["metrics"]
    if m.get("central_output_tok_s") is not None:
        return m["central_output_tok_s"]
    return series_central_tok_s(run.get("series") or [], m.get("duration_s") or 0.0)


def counters_of(stats: dict) -> dict:
    """The COUNTERS present in an engine stats dict."""
    return {k: stats[k] for k in COUNTERS if isinstance(stats.get(k), (int, float))}


def summarize(trace: RunTrace, concurrency: int) -> RunMetrics:
    reqs = sorted(trace.requests, key=lambda r: r.index)
    ttfts = [r.ttft for r in reqs if r.ttft is not None]
    post = [r.ttft for r in reqs[concurrency:] if r.ttft is not None]
    done = [r for r in reqs if r.finish is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    queues = [r.queue for r in done if r.queue is not None]
    slots = max([s.running for s in trace.steps], default=0)
    return RunMetrics(
        concurrency=concurrency,
        duration_s=trace.duration_s,
        requests_submitted=len(reqs),
        requests_completed=len(done),
        output_tokens=trace.output_tokens,
        output_tok_s=trace.output_tokens / trace.duration_s if trace.duration_s > 0 else 0.0,
        ttft_mean_ms=_ms(mean(ttfts)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        post_wave_ttft_mean_ms=_ms(mean(post)),
        post_wave_ttft_p99_ms=_ms(percentile(post, 99)),
        tpot_mean_ms=_ms(mean(tpots)),
        tpot_p99_ms=_ms(percentile(tpots, 99)),
        active=central_active(trace.steps, trace.duration_s),
        slots=slots,
        queue_mean_ms=_ms(mean(queues)),
        counters=counters_of(trace.engine),
        central_output_tok_s=central_tok_s(trace.steps, trace.duration_s),
    )
