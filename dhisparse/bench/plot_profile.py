"""Fig. 10 from `bench/step_profile.py` results: where a decode step goes.

For every profiled run (preset, graph mode), one horizontal bar of the profiled step split into
each kernel family's time while it runs alone, "several families at once" (overlap, e.g. cache
copies under the model's kernels) and "no kernel running" (the GPU waits for the host); the step
measured without the profiler is marked on the bar. Input: a result {kind: "step_profile", runs:
[{preset, cuda_graphs, C, wall_ms_median, kernels: {profiled_wall_ms_per_step, busy_ms, alone_ms
{family: ms}, overlap_ms}}]}; runs without kernel data (CPU) are skipped.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dhisparse.bench.plots import save_figure  # noqa: E402

FAMILY_COLORS = {"gemm": "tab:blue", "attention": "tab:orange", "indexer": "tab:purple", "elementwise": "tab:olive",
                 "cache copy": "tab:red", "resolver": "tab:brown", "moe": "tab:cyan", "fp8 quant": "tab:gray",
                 "other": "tab:pink"}
OVERLAP, IDLE = "several families at once", "no kernel running"


class StepBar:
    """One run's step split into segments [(label, ms)] and its unprofiled step time (ms)."""

    def __init__(self, label: str, segments: list[tuple[str, float]], wall_ms: float) -> None:
        self.label, self.segments, self.wall_ms = label, segments, wall_ms


def step_bars(result: dict) -> list[StepBar]:
    """The profiled runs of a step_profile result as bars (alone families largest first)."""
    bars = []
    for r in result.get("runs", []):
        k = r.get("kernels") or {}
        if not k.get("busy_ms"):
            continue
        alone = sorted(k.get("alone_ms", {}).items(), key=lambda kv: -kv[1])
        idle = max(0.0, k["profiled_wall_ms_per_step"] - k["busy_ms"])
        label = f"{r['preset']} C{r.get('C', '?')}" + (f" [{r['cuda_graphs']}]" if r.get("cuda_graphs") else "")
        bars.append(StepBar(label, alone + [(OVERLAP, k.get("overlap_ms", 0.0)), (IDLE, idle)], r["wall_ms_median"]))
    return bars


def plot_profile(result: dict, out: str | Path, title: str | None = None) -> Path:
    """Stacked bars (ms per step, profiled) per run; a black tick marks the unprofiled step."""
    bars = step_bars(result)
    if not bars:
        raise ValueError("the step_profile result has no kernel data (profiled on CPU?); nothing to plot")
    fig, ax = plt.subplots(figsize=(12, max(3.0, 1.4 + 0.55 * len(bars))), constrained_layout=True)  # legend fits
    seen = set()
    for y, bar in enumerate(bars):
        left = 0.0
        for name, ms in bar.segments:
            color = FAMILY_COLORS.get(name, "0.55" if name == OVERLAP else "0.88" if name == IDLE else "tab:cyan")
            ax.barh(y, ms, left=left, color=color, edgecolor="white", label=None if name in seen else name)
            seen.add(name)
            left += ms
        ax.plot([bar.wall_ms] * 2, [y - 0.42, y + 0.42], color="black", lw=2)
    ax.set_yticks(range(len(bars)), [b.label for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("ms per decode step (profiled; black tick: step without the profiler)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or f"Where a decode step goes: {result.get('config', {}).get('model', '')}")
    return save_figure(fig, out)
