"""Where the hierarchy overtakes resident serving: output against context length (the paper's
"context length sets the crossover", section 4.2 with Fig. 5).

Input: bench results of one concurrency that differ in the input length (`config.workload.
input_len`: one file, or one run set, per context). (a) output tok/s against context (log2 axis),
one line per preset, repeats as means with min-max bars; (b) each preset's output over
`resident`'s at the same context, with the crossover (`crossover`: where the ratio passes 1,
interpolated in log context) marked and written in the legend.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dhisparse.bench.plots import Spread, color_of, errorbar_points, save_figure  # noqa: E402

BASE = "resident"


def context_of(result: dict) -> int | None:
    """The result's input length (None: not recorded)."""
    return ((result.get("config") or {}).get("workload") or {}).get("input_len")


def is_context_sweep(results: list[dict]) -> bool:
    """Two or more contexts, one concurrency, and a `resident` run to compare against."""
    ctx = {context_of(r) for r in results}
    cs = {run["concurrency"] for r in results for run in r["runs"]}
    presets = {run["preset"] for r in results for run in r["runs"]}
    return None not in ctx and len(ctx) >= 2 and len(cs) == 1 and BASE in presets and len(presets) >= 2


def context_points(results: list[dict]) -> dict[str, list[tuple[int, Spread]]]:
    """preset -> [(context, output tok/s over its runs)] by context (repeats folded)."""
    raw: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for res in results:
        for run in res["runs"]:
            raw[run["preset"]][context_of(res)].append(run["metrics"]["output_tok_s"])
    return {p: [(c, Spread.of(v)) for c, v in sorted(by.items())] for p, by in sorted(raw.items())}


def ratios(points: dict[str, list[tuple[int, Spread]]], preset: str) -> list[tuple[int, float]]:
    """[(context, preset's mean output / resident's)] at the contexts both have."""
    base = {c: s.mean for c, s in points.get(BASE, [])}
    return [(c, s.mean / base[c]) for c, s in points.get(preset, []) if base.get(c)]


def crossover(pts: list[tuple[int, float]]) -> float | None:
    """The first context where the ratio reaches 1 from below, interpolated linearly in log2(context)
    between the two measured contexts around it; None if it never does (or starts at or above 1)."""
    for (c0, r0), (c1, r1) in zip(pts, pts[1:]):
        if r0 < 1.0 <= r1:
            x0, x1 = math.log2(c0), math.log2(c1)
            return 2 ** (x0 + (1.0 - r0) * (x1 - x0) / (r1 - r0))
    return None


def plot_context(results: list[dict], out: str | Path, colors: dict[str, str]) -> Path:
    """(a) output against context per preset, (b) output over resident's, crossovers marked."""
    points = context_points(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for i, (preset, pts) in enumerate(points.items()):
        color = color_of(preset, i, colors)
        errorbar_points(axes[0], [c for c, _ in pts], [sp for _, sp in pts], color=color, marker="o", label=preset)
        if preset == BASE:
            continue
        rs = ratios(points, preset)
        x = crossover(rs)
        label = preset + (f" (overtakes at ~{x / 1024:.0f}K)" if x else "")
        axes[1].plot([r[0] for r in rs], [r[1] for r in rs], color=color, marker="o", label=label)
        if x:
            axes[1].axvline(x, color=color, ls=":", lw=1)
    axes[1].axhline(1.0, color="0.5", lw=1)
    ctx = sorted({c for pts in points.values() for c, _ in pts})
    for ax, ylabel in ((axes[0], "output tok/s"), (axes[1], f"output / {BASE}'s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [f"{c / 1024:g}K" for c in ctx])
        ax.set_xlabel("context (input tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylim(bottom=0)
    c = results[0]["runs"][0]["concurrency"]
    fig.suptitle(f"Output against context at C{c}: where the hierarchy overtakes {BASE}")
    return save_figure(fig, out)
