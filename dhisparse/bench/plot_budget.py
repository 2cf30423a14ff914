"""Fig. 9: output and host-fetched share against the hot-cache budget B, one line per preset.

Input: bench results of one concurrency that differ in the hot-cache size (`config.sizing.
hot_cache_rows`, e.g. `bench/gpu_session.sh budget`: one file per B)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dhisparse.bench.plots import save_figure  # noqa: E402


def budget_of(result: dict) -> int | None:
    """The run's hot-cache rows B (None: not recorded)."""
    return ((result.get("config") or {}).get("sizing") or {}).get("hot_cache_rows")


def is_budget_sweep(results: list[dict]) -> bool:
    """Two or more bench results at different B, every run at one concurrency."""
    bs = {budget_of(r) for r in results}
    cs = {run["concurrency"] for r in results for run in r["runs"]}
    return len(results) >= 2 and None not in bs and len(bs) == len(results) and len(cs) == 1


def plot_budget(results: list[dict], out: str | Path, colors: dict[str, str]) -> Path:
    """(a) output tok/s and (b) host-fetched share against B (log2 axis), one line per preset;
    each point is labelled with the requests the run held (`active`)."""
    points: dict[str, list[tuple[int, float, float, float]]] = defaultdict(list)
    for res in results:
        for run in res["runs"]:
            m = run["metrics"]
            share = (m.get("counters") or {}).get("host_fetched_share", 0.0)
            points[run["preset"]].append((budget_of(res), m["output_tok_s"], 100 * share, m.get("active") or 0))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), constrained_layout=True)
    for i, (preset, pts) in enumerate(sorted(points.items())):
        pts.sort()
        kw = dict(color=colors.get(preset, f"C{i}"), marker="o", label=preset)
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], **kw)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], **kw)
        for b, y, _, active in pts:
            axes[0].annotate(f"{active:.0f}", (b, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    bs = sorted({p[0] for pts in points.values() for p in pts})
    for ax, ylabel in ((axes[0], "output tok/s (labels: active requests)"), (axes[1], "host-fetched share (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("hot-cache rows B")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend()
    c = results[0]["runs"][0]["concurrency"]
    fig.suptitle(f"Hot-cache budget sweep at C{c} (Fig. 9)")
    return save_figure(fig, out)
