"""Per-interval (default one second) time series of engine counters during a run.

Each row: `t` (end of the interval, s from run start), `output_tok_s` over the interval,
`decoding` (mean requests decoding per step in it), then every numeric field of the latest
`stats().as_dict()` (running, waiting, kv_pages_used, and whatever later presets add:
host_fetched_share, coverage, slots, ...).

Shares the engine reports cumulatively (since start) are replaced by their value over the
interval when the engine also exports the raw counters behind them (DELTA_SHARES), so a
one-second row shows that second's share as in the paper's Fig. 6.
"""

from __future__ import annotations

import math

# share key -> (numerator counter, denominator counter), both cumulative engine stats
DELTA_SHARES = {"host_fetched_share": ("host_selected_rows", "selected_rows")}


def numeric(stats: dict) -> dict:
    """The finite int / float / bool fields of a stats dict, as numbers."""
    out = {}
    for k, v in stats.items():
        if isinstance(v, bool):
            out[k] = int(v)
        elif isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = v
    return out


class SeriesRecorder:
    """Accumulates per-step observations and closes a row every `interval_s`."""

    def __init__(self, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"sample interval must be > 0 s; got {interval_s}")
        self.interval_s = interval_s
        self.rows: list[dict] = []
        self._start = 0.0
        self._tokens = 0
        self._decoding: list[int] = []

    def observe(self, t: float, new_tokens: int, decoding: int, stats) -> None:
        """stats: a dict, or a callable returning one (only called when a row closes)."""
        self._tokens += new_tokens
        self._decoding.append(decoding)
        if t - self._start >= self.interval_s:
            self.close(t, stats() if callable(stats) else stats)

    def close(self, t: float, stats: dict) -> None:
        span = max(t - self._start, 1e-9)
        row = {"t": round(t, 4), "output_tok_s": self._tokens / span,
               "decoding": sum(self._decoding) / len(self._decoding) if self._decoding else 0.0}
        row.update(numeric(stats))
        if self.rows:
            row.update(interval_shares(self.rows[-1], row))
        self.rows.append(row)
        self._start, self._tokens, self._decoding = t, 0, []


def interval_shares(prev: dict, row: dict) -> dict:
    """For each DELTA_SHARES key whose counters both rows carry: numerator delta / denominator delta."""
    out = {}
    for share, (num, den) in DELTA_SHARES.items():
        if all(k in r for k in (num, den) for r in (prev, row)):
            d = row[den] - prev[den]
            out[share] = (row[num] - prev[num]) / d if d > 0 else None
    return out


def column(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(t, value) of the rows that carry `key`."""
    pts = [(r["t"], r[key]) for r in rows if key in r and r[key] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]
