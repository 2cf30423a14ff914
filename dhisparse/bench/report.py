"""Rich tables of bench and load-step results (missing values print as "-")."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from dhisparse.bench.records import TABLE_COUNTERS
from dhisparse.engine.memory import format_bytes

DASH = "-"
SHARES = ("host_fetched_share", "coverage", "acceptance")


def console() -> Console:
    """A console that does not squeeze wide tables into 80 columns when output is redirected."""
    c = Console()
    return c if c.is_terminal else Console(width=200)


def fmt(v, digits: int = 1) -> str:
    """A number with `digits` decimals, a share as a percentage when digits < 0, "-" for None."""
    if v is None:
        return DASH
    if digits < 0:
        return f"{100 * v:.1f}%"
    return f"{v:.{digits}f}"


def pair(a, b, digits: int = 1) -> str:
    return f"{fmt(a, digits)} / {fmt(b, digits)}"


def _counter_columns(runs: list[dict]) -> list[str]:
    """host_fetched_share always (the paper's headline counter), the other table counters when present."""
    present = {k for r in runs for k in (r["metrics"].get("counters") or {})}
    return ["host_fetched_share"] + [k for k in TABLE_COUNTERS[1:] if k in present]


def bench_table(result: dict, title: str | None = None) -> Table:
    """One row per run: throughput, latencies (mean / p99), active, slots, engine counters."""
    runs = result["runs"]
    extra = _counter_columns(runs)
    t = Table(title=title or "dhisparse bench (closed loop; latencies in ms, mean / p99)")
    cols = ["preset", "C", "done", "out tok/s", "TTFT", "post-wave TTFT", "TPOT", "active", "slots"]
    for c in cols + [k.replace("_", " ") for k in extra]:
        t.add_column(c, justify="left" if c == "preset" else "right")
    for r in runs:
        m, counters = r["metrics"], r["metrics"].get("counters") or {}
        row = [r["preset"], str(r["concurrency"]), str(m["requests_completed"]), fmt(m["output_tok_s"]),
               pair(m["ttft_mean_ms"], m["ttft_p99_ms"]), pair(m["post_wave_ttft_mean_ms"], m["post_wave_ttft_p99_ms"]),
               pair(m["tpot_mean_ms"], m["tpot_p99_ms"], 2), fmt(m["active"]), str(m["slots"])]
        row += [fmt(counters.get(k), -1 if k in SHARES else 2) for k in extra]
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
                  fmt(m["ttft_mean_ms"]), fmt(m["tpot_mean_ms"], 2),
                  fmt((m.get("counters") or {}).get("host_fetched_share"), -1), used)
    return t


def phase_table(result: dict, title: str | None = None) -> Table:
    """Load step: one row per (arm, phase); requests that start and finish inside the phase."""
    t = Table(title=title or "dhisparse loadstep: per phase (requests that start and finish inside it)")
    cols = ["arm", "phase", "C", "requests", "out tok/s", "TTFT mean ms", "TPOT mean ms", "tok/s per session",
            "alloc wait ms", "slots max", "coverage", "host-fetched"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("arm", "phase") else "right")
    for r in result["runs"]:
        for p in r["phases"]:
            t.add_row(r["preset"], p["name"], str(p["concurrency"]), str(p["requests"]), fmt(p["output_tok_s"]),
                      fmt(p["ttft_mean_ms"]), fmt(p["tpot_mean_ms"], 2), fmt(p["tok_s_per_session"], 1),
                      fmt(p.get("queue_mean_ms"), 1), fmt(p["slots_max"], 0), fmt(p.get("coverage"), -1),
                      fmt(p.get("host_fetched_share"), -1))
    return t
