"""The paper's Table 2 and appendix tables from bench results (serving runs with per-request records).

* `table2_rows` — Table 2: at every (C, preset) the output (mean and min-max over repeats), its
  ratio to the baseline preset's mean output at the same C (hisparse: "against HiSparse"), the same
  two for the central half of each window (`records.central_of`: the steady rate, without the
  admission ramp), TTFT mean, post-wave mean and post-wave p99, mean TPOT, and active / slots.
* `ttft_split` — Table A2: mean first-token time split into allocation wait (submit -> a slot:
  the engine's per-request `queue`) and hand-off (the slot -> the first token: prefill or the
  prepared prefix's import, and the KV transport), over all requests and after the first wave
  (the first C submitted requests left out). The paper's small "other" column is inside our
  hand-off.
* `latency_rows` — Table A3: TTFT mean / p99, post-wave TTFT mean / p99, TPOT mean / p99 at every
  (preset, C), each the mean of the point's repeated runs, with the run count.
* `capacity` — the highest C each preset sustains under a post-wave p99 TTFT bound and a mean
  TPOT bound (the paper: 10 s and 40 ms), and its output there; `scaled_bounds` scales the paper's
  bounds to another setup's step times (its baseline's latency at its lowest load against the
  paper's HiSparse at C4).

Runs are grouped by (source, preset label, C), the source being the model and workload of the
file (`source`): files of one sweep share a source, others stay apart. A point's value is the
mean over its runs of each run's statistic (None where no run had one).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from dhisparse.bench.records import central_of, mean

LATENCY_KEYS = ("ttft_mean_ms", "ttft_p99_ms", "post_wave_ttft_mean_ms", "post_wave_ttft_p99_ms", "tpot_mean_ms",
                "tpot_p99_ms", "output_tok_s")


@dataclass(frozen=True)
class TtftSplit:
    """Mean seconds of a run's first tokens: allocation wait + hand-off = TTFT (n requests)."""

    allocation_s: float | None
    handoff_s: float | None
    ttft_s: float | None
    n: int


def _split(reqs: list[dict]) -> TtftSplit:
    have = [r for r in reqs if r.get("ttft") is not None and r.get("queue") is not None]
    return TtftSplit(mean([r["queue"] for r in have]), mean([r["ttft"] - r["queue"] for r in have]),
                     mean([r["ttft"] for r in have]), len(have))


def ttft_split(run: dict) -> dict[str, TtftSplit]:
    """Table A2 for one run: {"all": ..., "post_wave": ...} (post-wave: submitted after the first C)."""
    reqs = sorted(run.get("requests") or [], key=lambda r: r["index"])
    return {"all": _split(reqs), "post_wave": _split(reqs[run["concurrency"]:])}


def source(result: dict) -> str:
    """'model input/output' of a bench result (its engine model and workload lengths)."""
    cfg = result.get("config") or {}
    w = cfg.get("workload") or {}
    return f"{(cfg.get('engine') or {}).get('model', '?')} {w.get('input_len', '?')}/{w.get('output_len', '?')}"


def source_notes(results: list[dict]) -> list[dict]:
    """What each result's runs are, for the tables' caption: its notes (the measurement tools it used and
    what they leave out: the oracle drafter, a costed network, reference replay), and whether it is not a
    result or was superseded. One {"source", "notes"} a result that has any, each once (repeat calls of one
    setup carry the same notes)."""
    out = []
    for res in results:
        notes = list(res.get("notes") or [])
        if res.get("not_a_result"):
            notes.insert(0, f"NOT A RESULT: {res['not_a_result']}")
        if res.get("superseded_by"):
            notes.insert(0, f"SUPERSEDED by {res['superseded_by']}")
        entry = {"source": source(res), "notes": notes}
        if notes and entry not in out:
            out.append(entry)
    return out


def _points(results: list[dict]) -> dict[tuple[str, str, int], list[dict]]:
    by: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for res in results:
        for r in res.get("runs", []):
            by[(source(res), r["preset"], r["concurrency"])].append(r)
    return dict(sorted(by.items()))


def latency_rows(results: list[dict]) -> list[dict]:
    """Table A3: one row per (preset, C) with the mean of each LATENCY_KEYS metric over its runs."""
    rows = []
    for (src, preset, c), runs in _points(results).items():
        row = {"source": src, "preset": preset, "C": c, "runs": len(runs)}
        for k in LATENCY_KEYS:
            row[k] = mean([r["metrics"].get(k) for r in runs if r["metrics"].get(k) is not None])
        rows.append(row)
    return rows


TABLE2_KEYS = ("ttft_mean_ms", "post_wave_ttft_mean_ms", "post_wave_ttft_p99_ms", "tpot_mean_ms", "active", "slots")


def table2_rows(results: list[dict], baseline: str = "hisparse") -> list[dict]:
    """Table 2: one row per (source, C, preset), loads ascending, the baseline first at each load:
    output mean / min / max over the point's runs, `vs_baseline` = its mean over the baseline's mean
    at the same (source, C) (None without a baseline run there), and the means of TABLE2_KEYS."""
    points = _points(results)
    rows = []
    for (src, preset, c), runs in sorted(points.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1] != baseline,
                                                                          kv[0][1])):
        out = [r["metrics"]["output_tok_s"] for r in runs]
        base = points.get((src, baseline, c))
        base_mean = mean([r["metrics"]["output_tok_s"] for r in base]) if base else None
        row = {"source": src, "C": c, "preset": preset, "runs": len(runs), "output_tok_s": mean(out),
               "output_min": min(out), "output_max": max(out),
               "vs_baseline": mean(out) / base_mean if base_mean else None, "baseline": baseline}
        row |= _central(runs, base)
        for k in TABLE2_KEYS:
            row[k] = mean([r["metrics"].get(k) for r in runs if r["metrics"].get(k) is not None])
        rows.append(row)
    return rows


def _central(runs: list[dict], base: list[dict] | None) -> dict:
    """Table 2's central-half columns of a point: mean, min, max over its runs and the ratio of its
    mean to the baseline's (None where a run has no central rate)."""
    cen = [central_of(r) for r in runs]
    if None in cen:
        return dict.fromkeys(("central_tok_s", "central_min", "central_max", "central_vs_baseline"))
    bcen = [central_of(r) for r in base or ()]
    ratio = mean(cen) / mean(bcen) if bcen and None not in bcen and mean(bcen) else None
    return {"central_tok_s": mean(cen), "central_min": min(cen), "central_max": max(cen), "central_vs_baseline": ratio}


def split_rows(results: list[dict]) -> list[dict]:
    """Table A2: one row per (preset, C): mean allocation / hand-off / TTFT seconds over its runs,
    all requests and post-wave."""
    rows = []
    for (src, preset, c), runs in _points(results).items():
        row = {"source": src, "preset": preset, "C": c, "runs": len(runs)}
        for part in ("all", "post_wave"):
            splits = [ttft_split(r)[part] for r in runs]
            for f in ("allocation_s", "handoff_s", "ttft_s"):
                row[f"{part}_{f}"] = mean([getattr(s, f) for s in splits if getattr(s, f) is not None])
        rows.append(row)
    return rows


# The paper's Table A3 at its lowest load (HiSparse, C4, GLM-5.3 at 100K): what its bounds (10 s post-wave p99 TTFT,
# 40 ms mean TPOT) are set against
PAPER_ANCHOR = {"post_wave_ttft_p99_ms": 950.0, "tpot_mean_ms": 19.4}


@dataclass(frozen=True)
class Bounds:
    """Capacity bounds of one source: post-wave p99 TTFT and mean TPOT, ms; `anchor` names the run they were
    scaled from ("preset@C"), None when they are given as they are."""

    post_wave_ttft_p99_ms: float
    tpot_mean_ms: float
    anchor: str | None = None


def scaled_bounds(rows: list[dict], preset: str, bounds: Bounds) -> dict[str, Bounds]:
    """Per source of Table A3's rows, `bounds` (the paper's) scaled to that source's step times: each bound times
    the ratio of `preset`'s latency at the source's lowest load (its post-wave p99 TTFT, its mean TPOT) to the
    paper's HiSparse at C4 (`PAPER_ANCHOR`). So a bound sits as far above the setup's own low-load latency as the
    paper's sits above its HiSparse's: 40 ms is 2.06x 19.4 ms. Raises ValueError naming a source where `preset`
    has no run with both metrics."""
    out = {}
    for src in sorted({r["source"] for r in rows}):
        have = [r for r in rows if (r["source"], r["preset"]) == (src, preset)
                and r["post_wave_ttft_p99_ms"] is not None and r["tpot_mean_ms"] is not None]
        if not have:
            raise ValueError(f"bounds scaled to {preset!r}: source {src!r} has no {preset} run with a post-wave p99 "
                             "TTFT and a mean TPOT")
        low = min(have, key=lambda r: r["C"])
        out[src] = Bounds(bounds.post_wave_ttft_p99_ms * low["post_wave_ttft_p99_ms"] / PAPER_ANCHOR["post_wave_ttft_p99_ms"],
                          bounds.tpot_mean_ms * low["tpot_mean_ms"] / PAPER_ANCHOR["tpot_mean_ms"], f"{preset}@C{low['C']}")
    return out


def capacity(rows: list[dict], post_wave_ttft_p99_ms: float, tpot_mean_ms: float,
             per_source: dict[str, Bounds] | None = None) -> list[dict]:
    """Per (source, preset), the highest C whose post-wave p99 TTFT and mean TPOT are within the
    bounds (a point without either metric does not qualify), with its output; C None if none does.
    per_source (`scaled_bounds`) replaces the two bounds for the sources it names."""
    out = []
    for src, preset in sorted({(r["source"], r["preset"]) for r in rows}):
        b = (per_source or {}).get(src) or Bounds(post_wave_ttft_p99_ms, tpot_mean_ms)
        ok = [r for r in rows if (r["source"], r["preset"]) == (src, preset) and r["post_wave_ttft_p99_ms"] is not None
              and r["tpot_mean_ms"] is not None and r["post_wave_ttft_p99_ms"] <= b.post_wave_ttft_p99_ms
              and r["tpot_mean_ms"] <= b.tpot_mean_ms]
        best = max(ok, key=lambda r: r["C"], default=None)
        out.append({"source": src, "preset": preset, "C": best["C"] if best else None,
                    "output_tok_s": best["output_tok_s"] if best else None,
                    "bounds": {"post_wave_ttft_p99_ms": b.post_wave_ttft_p99_ms, "tpot_mean_ms": b.tpot_mean_ms,
                               **({"scaled_from": b.anchor} if b.anchor else {})}})
    return out
