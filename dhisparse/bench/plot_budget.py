"""Fig. 9: output and host-fetched share against the hot-cache budget B, one line per preset (and load).

Input: bench results that differ in the hot-cache size (`config.sizing.hot_cache_rows`, e.g.
`bench/gpu_session.sh budget`: one file per B), at one load or several (the paper sweeps B at a low
and a high load: a line per (preset, C), a preset's color with one line style per load); repeats of a point are one point
at their mean with min-max bars."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dhisparse.bench.plots import Spread, color_of, errorbar_points, save_figure  # noqa: E402


def budget_of(result: dict) -> int | None:
    """The run's hot-cache rows B (None: not recorded)."""
    return ((result.get("config") or {}).get("sizing") or {}).get("hot_cache_rows")


def is_budget_sweep(results: list[dict]) -> bool:
    """Bench results at two or more hot-cache sizes B (every file records its B); repeats of a B and
    several loads (the paper's low and high) are allowed."""
    bs = [budget_of(r) for r in results]
    return len(results) >= 2 and None not in bs and len(set(bs)) >= 2


def budget_points(results: list[dict]) -> dict[str, list[tuple[int, Spread, Spread, float]]]:
    """Line label ("preset", or "preset C{c}" when the results hold several loads) -> its points
    (B, output tok/s, host-fetched share in %, mean active requests) by B, each a mean with min-max
    over the runs at that (preset, C, B)."""
    loads = {run["concurrency"] for r in results for run in r["runs"]}
    by: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for res in results:
        for run in res["runs"]:
            label = run["preset"] + (f" C{run['concurrency']}" if len(loads) > 1 else "")
            by[label, budget_of(res)].append(run["metrics"])
    lines: dict[str, list[tuple[int, Spread, Spread, float]]] = defaultdict(list)
    for (label, b), ms in sorted(by.items()):
        share = Spread.of([100 * (m.get("counters") or {}).get("host_fetched_share", 0.0) for m in ms])
        active = sum(m.get("active") or 0 for m in ms) / len(ms)
        lines[label].append((b, Spread.of([m["output_tok_s"] for m in ms]), share, active))
    return dict(lines)


def plot_budget(results: list[dict], out: str | Path, colors: dict[str, str]) -> Path:
    """(a) output tok/s and (b) host-fetched share against B (log2 axis), one line per preset (and
    load); repeats are a point at their mean with min-max bars, labelled with the requests held."""
    lines = budget_points(results)
    loads = sorted({run["concurrency"] for r in results for run in r["runs"]})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), constrained_layout=True)
    for i, (label, pts) in enumerate(lines.items()):
        load = loads.index(int(label.rsplit(" C", 1)[1])) if len(loads) > 1 else 0
        kw = dict(color=color_of(label, i, colors), marker="o", label=label,
                  ls=("-", "--", ":", "-.")[load % 4])  # a preset's color, a line style per load
        errorbar_points(axes[0], [p[0] for p in pts], [p[1] for p in pts], **kw)
        errorbar_points(axes[1], [p[0] for p in pts], [p[2] for p in pts], **kw)
        for b, y, _, active in pts:
            axes[0].annotate(f"{active:.0f}", (b, y.mean), textcoords="offset points", xytext=(4, 4), fontsize=7)
    bs = sorted({p[0] for pts in lines.values() for p in pts})
    for ax, ylabel in ((axes[0], "output tok/s (labels: active requests)"), (axes[1], "host-fetched share (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("hot-cache rows B")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Hot-cache budget sweep at {', '.join(f'C{c}' for c in loads)} (Fig. 9)"
                 + (", mean with min-max over repeats" if _repeated(results) else ""))
    return save_figure(fig, out)


def _repeated(results: list[dict]) -> bool:
    seen = set()
    for r in results:
        for run in r["runs"]:
            key = (run["preset"], run["concurrency"], budget_of(r))
            if key in seen:
                return True
            seen.add(key)
    return False
