"""Rich tables of bench and load-step results (missing values print as "-")."""

from __future__ import annotations

from rich.table import Table

from dhisparse.bench.records import COUNTERS
from dhisparse.engine.memory import format_bytes

DASH = "-"


def fmt(v, digits: int = 1) -> str:
    """A number with `digits` decimals, a share as a percentage when digits < 0, "-" for None."""
    if v is None:
        return DASH
    if digits < 0:
        return f"{100 * v:.1f}%"
    return f"{v:.{digits}f}"


def _counter_columns(runs: list[dict]) -> list[str]:
    """host_fetched_share always (the paper's headline counter), the other COUNTERS when present."""
    present = {k for r in runs for k in (r["metrics"].get("counters") or {})}
    return ["host_fetched_share"] + [k for k in COUNTERS if k in present and k not in ("host_fetched_share", "slots")]


def bench_table(result: dict, title: str | None = None) -> Table:
    """One row per run: throughput, latencies, active, slots, engine counters."""
    runs = result["runs"]
    extra = _counter_columns(runs)
    t = Table(title=title or "dhisparse bench (closed loop)")
    cols = ["preset", "C", "done", "out tok/s", "TTFT mean ms", "TTFT p99 ms", "post-wave TTFT ms",
            "post-wave p99 ms", "TPOT mean ms", "TPOT p99 ms", "active", "slots"] + [k.replace("_", " ") for k in extra]
    for c in cols:
        t.add_column(c, justify="left" if c == "preset" else "right")
    for r in runs:
        m, counters = r["metrics"], r["metrics"].get("counters") or {}
        row = [r["preset"], str(r["concurrency"]), str(m["requests_completed"]), fmt(m["output_tok_s"]),
               fmt(m["ttft_mean_ms"]), fmt(m["ttft_p99_ms"]), fmt(m["post_wave_ttft_mean_ms"]),
               fmt(m["post_wave_ttft_p99_ms"]), fmt(m["tpot_mean_ms"], 2), fmt(m["tpot_p99_ms"], 2),
               fmt(m["active"]), str(m["slots"])]
        row += [fmt(counters.get(k), -1 if k.endswith("share") or k == "coverage" else 2) for k in extra]
        t.add_row(*row)
    return t


def demo_table(result: dict, title: str) -> Table:
    """The demo's comparison: one row per preset."""
    t = Table(title=title)
    for c in ("preset", "C", "requests", "out tok/s", "TTFT mean ms", "TPOT mean ms", "host-fetched", "KV pool used (peak)"):
        t.add_column(c, justify="left" if c == "preset" else "right")
    for r in result["runs"]:
        m, e = r["metrics"], r["engine"]
        peak = e.get("kv_peak_bytes")
        used = f"{format_bytes(peak)} of {format_bytes(e['kv_pool_bytes'])}" if peak is not None and "kv_pool_bytes" in e else DASH
        t.add_row(r["preset"], str(r["concurrency"]), str(m["requests_completed"]), fmt(m["output_tok_s"]),
                  fmt(m["ttft_mean_ms"]), fmt(m["tpot_mean_ms"], 2), fmt((m.get("counters") or {}).get("host_fetched_share"), -1), used)
    return t


def phase_table(result: dict, title: str | None = None) -> Table:
    """Load step: one row per (arm, phase)."""
    t = Table(title=title or "dhisparse loadstep: per phase")
    cols = ["arm", "phase", "C", "requests", "out tok/s", "TTFT mean ms", "TPOT mean ms", "tok/s per session",
            "slots max", "coverage", "host-fetched"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("arm", "phase") else "right")
    for r in result["runs"]:
        for p in r["phases"]:
            t.add_row(r["preset"], p["name"], str(p["concurrency"]), str(p["requests"]), fmt(p["output_tok_s"]),
                      fmt(p["ttft_mean_ms"]), fmt(p["tpot_mean_ms"], 2), fmt(p["tok_s_per_session"], 2),
                      fmt(p["slots_max"], 0), fmt(p.get("coverage"), -1), fmt(p.get("host_fetched_share"), -1))
    return t
