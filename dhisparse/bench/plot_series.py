"""A serving run over time: output tok/s and requests decoding per interval, one line per preset.

Input: a bench result (`dhisparse bench`, `bench/gpu_serving.py`) whose runs carry the engine's
per-interval series (`engine/series.py`). One column of panels per offered concurrency:

  (a) output tok/s in each interval        the steady level, and the dips of admission waves
  (b) requests decoding (mean per step)    how many of the C requests decode; the rest are
                                           queued, prefilling or waiting for a hand-off

A closed loop with short outputs re-admits its requests in waves; this figure shows how much of
a window is steady decoding (docs/benchmarks.md, tenth round)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dhisparse.bench.plots import save_figure  # noqa: E402
from dhisparse.engine.series import column  # noqa: E402

PANELS = (("output_tok_s", "(a) output tok/s per interval", "tok/s"),
          ("decoding", "(b) requests decoding", "requests"))


def has_series(result: dict) -> bool:
    """Whether any run of the bench result carries a per-interval series with output rows."""
    return any(column(run.get("series") or [], "output_tok_s")[0] for run in result.get("runs", []))


def plot_series(result: dict, out: str | Path, colors: dict[str, str], title: str | None = None) -> Path:
    """The module docstring's figure for one bench result; `colors` maps presets to colours."""
    cs = sorted({run["concurrency"] for run in result["runs"]})
    if not cs:
        raise ValueError("the bench result has no runs to plot")
    fig, axes = plt.subplots(2, len(cs), figsize=(6.2 * len(cs), 6.8), sharex="col", squeeze=False,
                             constrained_layout=True)
    for j, c in enumerate(cs):
        runs = [r for r in result["runs"] if r["concurrency"] == c]
        for i, (key, name, ylabel) in enumerate(PANELS):
            ax = axes[i, j]
            for k, run in enumerate(runs):
                t, v = column(run.get("series") or [], key)
                if t:
                    ax.step(t, v, where="post", color=colors.get(run["preset"], f"C{k}"), lw=1.8,
                            label=f"{run['preset']} ({run['metrics']['output_tok_s']:.0f} tok/s)")
            if key == "decoding":
                ax.axhline(c, color="0.5", lw=0.8, ls=":")
                ax.set_ylim(0, c * 1.1)
            ax.set(title=f"C{c}: {name}", ylabel=ylabel)
            ax.grid(True, alpha=0.3)
        axes[0, j].legend(fontsize=8, loc="lower right")
        axes[-1, j].set_xlabel("time in the window (s)")
    fig.suptitle(title or _title(result))
    return save_figure(fig, out)


def _title(result: dict) -> str:
    w = (result.get("config") or {}).get("workload") or {}
    eng = (result.get("config") or {}).get("engine") or {}
    return (f"{eng.get('model', '?')}, input {w.get('input_len', '?')}, output cap {w.get('output_len', '?')}\n"
            f"(legend: output over the whole window)")
