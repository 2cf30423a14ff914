"""The load-step experiment (paper §4.3.1, Fig. 6, Table A1): offered concurrency
C_low -> C_high -> C_low, closed loop, with optional residency on (`adaptive`) and off
(`hisparse`); in-flight requests drain when the load falls.

Arms are preset names. Until those presets land, the available subset of them runs (else
`resident`) and the result records which arms were unavailable.
"""

from __future__ import annotations

import dataclasses

from dhisparse.bench.records import COUNTERS, RunTrace, mean
from dhisparse.bench.results import RunResult, run_result
from dhisparse.engine.series import interval_shares
from dhisparse.bench.sweep import ProgressBar, is_world, load_shared_model, on_fresh_engine
from dhisparse.bench.inproc import run_inprocess
from dhisparse.bench.workload import Phase, Phases, Workload
from dhisparse.engine.config import AVAILABLE_PRESETS, EngineConfig

RESIDENCY_ARMS = ("adaptive", "hisparse")  # residency on, off
FALLBACK_ARM = "resident"


def default_arms() -> list[str]:
    arms = [a for a in RESIDENCY_ARMS if a in AVAILABLE_PRESETS]
    return arms or [FALLBACK_ARM]


def unavailable_arms() -> list[str]:
    return [a for a in RESIDENCY_ARMS if a not in AVAILABLE_PRESETS]


def step_phases(c_low: int, c_high: int, low_s: float, high_s: float, after_s: float | None = None) -> Phases:
    return Phases((Phase(c_low, low_s, f"C{c_low} before"), Phase(c_high, high_s, f"C{c_high}"),
                   Phase(c_low, low_s if after_s is None else after_s, f"C{c_low} after")))


def _phase_counters(rows: list[dict], start: float, end: float) -> dict:
    """Each engine counter over the series rows inside (start, end]: a DELTA_SHARES share from
    its raw counters when exported (counted over the phase, as in Table A1), else the mean."""
    inside = [r for r in rows if start < r["t"] <= end]
    before = [r for r in rows if r["t"] <= start]
    out = {k: mean([r[k] for r in inside if r.get(k) is not None]) for k in COUNTERS}
    if inside and before:
        for share, value in interval_shares(before[-1], inside[-1]).items():
            out[share] = value
    return out


def phase_summary(trace: RunTrace, phases: Phases) -> list[dict]:
    """Per phase: requests that start and finish inside it (count, TTFT, TPOT, tok/s per session,
    allocation wait), output tok/s and most requests running over the phase, counter means."""
    out = []
    for p, (start, end) in zip(phases.phases, phases.bounds()):
        reqs = [r for r in trace.requests if start <= r.submit and r.finish is not None and r.finish < end]
        tpot = mean([r.tpot for r in reqs if r.tpot is not None])
        steps = [s for s in trace.steps if start <= s.t < end]
        span = min(end, trace.duration_s) - start
        row = {"name": p.name, "concurrency": p.concurrency, "start_s": start, "end_s": end, "requests": len(reqs),
               "output_tok_s": sum(s.tokens for s in steps) / span if span > 0 else None,
               "ttft_mean_ms": _ms(mean([r.ttft for r in reqs if r.ttft is not None])),
               "tpot_mean_ms": _ms(tpot), "tok_s_per_session": (1.0 / tpot) if tpot else None,
               "queue_mean_ms": _ms(mean([r.queue for r in reqs if r.queue is not None])),
               "slots_max": max((s.running for s in steps), default=None)}
        row.update({k: v for k, v in _phase_counters(list(trace.series), start, end).items() if k != "slots"})
        out.append(row)
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def run_loadstep(base: EngineConfig, arms: list[str], phases: Phases, workload: Workload, bar: ProgressBar,
                 sample_interval_s: float = 1.0) -> list[RunResult]:
    """One in-process run per arm over the same phases and model."""
    loaded = None if is_world(base) else load_shared_model(base)  # a world's ranks load their own
    runs = []
    for arm in arms:
        cfg = dataclasses.replace(base, preset=arm)
        tick = bar.task(f"{arm} load step", workload, phases)
        trace = on_fresh_engine(cfg, loaded, lambda e: run_inprocess(e, workload, phases, tick, sample_interval_s))
        runs.append(run_result(arm, phases.max_concurrency, "in-process", trace, phase_summary(trace, phases)))
    return runs
