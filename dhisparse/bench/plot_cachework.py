"""Fig. 10a: what the cache costs inside a step as the hot-cache budget B varies.

Input: `bench/step_profile.py` results (kernel data: a GPU run) that differ in the hot-cache size
(`config.hot_cache_rows`, one file per B; e.g. `bench/gpu_session.sh fig10_31`). For every (preset, C) line
and budget: the summed kernel time of the cache families per profiled step -- the fused resolver and the
row copies into the follower layers (`FAMILY_COLORS`' "resolver" and "cache copy") -- in all and per
session (requests the step holds), as the paper's panel (a). Repeats of a point are one point at their
mean with min-max bars. Panel (b) of the paper, the step's share by kernel family at one budget, is
`plot_profile`'s figure of that budget's file.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dhisparse.bench.plots import Spread, color_of, errorbar_points, save_figure  # noqa: E402

CACHE_FAMILIES = ("resolver", "cache copy")  # bench/step_profile.py's kernel families of the cache


def profile_budget(result: dict) -> int | None:
    """The profiled run's hot-cache rows B (None: the default, not recorded as a number)."""
    return (result.get("config") or {}).get("hot_cache_rows")


def _profiled(result: dict) -> bool:
    return result.get("kind") == "step_profile" and any((r.get("kernels") or {}).get("busy_ms") for r in result["runs"])


def is_cache_work_sweep(results: list[dict]) -> bool:
    """Two or more step-profile results with kernel data at two or more recorded budgets."""
    prof = [r for r in results if _profiled(r)]
    bs = [profile_budget(r) for r in prof]
    return len(prof) >= 2 and None not in bs and len(set(bs)) >= 2


@dataclass(frozen=True)
class CachePoint:
    """One (line, B) point: ms per profiled step of the resolver and of the copies, their sum per session, and
    the sessions the step held (means with min-max over repeats)."""

    budget: int
    resolver_ms: Spread
    copy_ms: Spread
    total_ms: Spread
    per_session_ms: Spread
    sessions: float


def cache_points(results: list[dict]) -> dict[str, list[CachePoint]]:
    """Line label "preset C{c}" -> its points by B, from every profiled run of the step-profile results."""
    by: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for res in results:
        if not _profiled(res):
            continue
        for run in res["runs"]:
            if (run.get("kernels") or {}).get("busy_ms"):
                by[f"{run['preset']} C{run.get('C', '?')}", profile_budget(res)].append(run)
    lines: dict[str, list[CachePoint]] = defaultdict(list)
    for (label, b), runs in sorted(by.items()):
        fam = [run["kernels"].get("family_ms") or {} for run in runs]
        res_ms = [f.get("resolver", 0.0) for f in fam]
        cp_ms = [f.get("cache copy", 0.0) for f in fam]
        held = [run.get("admitted") or run.get("C") or 1 for run in runs]
        total = [a + c for a, c in zip(res_ms, cp_ms)]
        lines[label].append(CachePoint(b, Spread.of(res_ms), Spread.of(cp_ms), Spread.of(total),
                                       Spread.of([t / n for t, n in zip(total, held)]), sum(held) / len(held)))
    return dict(lines)


def plot_cache_work(results: list[dict], out: str | Path, colors: dict[str, str]) -> Path:
    """(a) cache kernel ms per step against B (log2 axis): resolver + copies (solid, labelled with the sessions
    held) and the copies alone (dashed); (b) the same sum per session."""
    lines = cache_points(results)
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.2), constrained_layout=True)
    for i, (label, pts) in enumerate(lines.items()):
        color = color_of(label, i, colors)
        bs = [p.budget for p in pts]
        errorbar_points(axes[0], bs, [p.total_ms for p in pts], color=color, marker="o", label=f"{label}: resolver + copies")
        errorbar_points(axes[0], bs, [p.copy_ms for p in pts], color=color, marker="x", ls="--", label=f"{label}: copies")
        errorbar_points(axes[1], bs, [p.per_session_ms for p in pts], color=color, marker="o", label=label)
        for p in pts:
            axes[0].annotate(f"{p.sessions:.0f}", (p.budget, p.total_ms.mean), textcoords="offset points",
                             xytext=(4, 4), fontsize=7)
    bs = sorted({p.budget for pts in lines.values() for p in pts})
    for ax, ylabel in ((axes[0], "cache kernel ms per step (labels: sessions held)"),
                       (axes[1], "cache kernel ms per step and session")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set(xlabel="hot-cache rows B", ylabel=ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    model = (results[0].get("config") or {}).get("model", "")
    fig.suptitle(f"What the cache costs inside a step (Fig. 10a): {model}, kernel time of the resolver and the "
                 "follower-layer copies, profiled")
    return save_figure(fig, out)
