"""Fig. 7: what a wider verification block returns - static widths against eq. 13's online policy.

Input: bench results whose runs are arms of one speculative preset (`bench/gpu_serving.py --arms`, e.g.
`bench/gpu_session.sh specpolicy`): a run's preset reads `adaptive+spec@speculative_policy=fixed,
speculative_num_draft_tokens=6,...`. Per (arm, offered load), over its repeated runs (mean, min-max):

  (a) emitted tokens per speculative round   (the engine's `spec_tokens_per_round`)
  (b) output tok/s
  (c) the online arms only: the share of rounds run at each width (`spec_steps_width{K}`), which is
      what eq. 13 chose at that load

The paper's Fig. 7 is (a) and (b) for static blocks of 4, 6 and 8 at C64 / C128 / C256; the online
policy is ours (its panel (c) shows where it sits).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dhisparse.bench.plots import Spread, save_figure  # noqa: E402

_WIDTH_STEPS = re.compile(r"spec_steps_width(\d+)$")


def arm_of(preset: str) -> dict[str, str]:
    """The engine settings of an arm's run label ("preset@name=value,name=value"), {} for a plain preset."""
    _, sep, pairs = preset.partition("@")
    return dict(p.split("=", 1) for p in pairs.split(",") if "=" in p) if sep else {}


def width_label(preset: str) -> str | None:
    """"block K" for a fixed width, "online (K_max K)" for eq. 13's policy; None when the run is not a
    width arm."""
    arm = arm_of(preset)
    k = arm.get("speculative_num_draft_tokens")
    if k is None:
        return None
    return f"online (K_max {k})" if arm.get("speculative_policy") == "online" else f"block {k}"


def is_width_sweep(results: list[dict]) -> bool:
    """Every run is a width arm, and there are at least two arms."""
    labels = [width_label(r["preset"]) for res in results for r in res["runs"]]
    return bool(labels) and None not in labels and len(set(labels)) >= 2


@dataclass(frozen=True)
class WidthPoint:
    """One (arm, C) point: its runs' tokens per round and output (mean, min-max), and the mean share of
    rounds at each width (online arms; a fixed arm runs its one width)."""

    label: str
    concurrency: int
    runs: int
    tokens_per_round: Spread | None
    tok_s: Spread
    width_share: dict[int, float]


def _shares(engine: dict) -> dict[int, float]:
    steps = {int(m.group(1)): v for k, v in engine.items() if (m := _WIDTH_STEPS.match(k)) and v}
    total = sum(steps.values())
    return {w: n / total for w, n in sorted(steps.items())} if total else {}


def width_points(results: list[dict]) -> list[WidthPoint]:
    """Every (arm, C) point of the results, arms in label order, loads ascending."""
    by: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for res in results:
        for r in res["runs"]:
            by[width_label(r["preset"]), r["concurrency"]].append(r)
    out = []
    for (label, c), runs in sorted(by.items(), key=lambda kv: (_order(kv[0][0]), kv[0][1])):
        share: dict[int, float] = defaultdict(float)
        for r in runs:
            for w, v in _shares(r.get("engine") or {}).items():
                share[w] += v / len(runs)
        out.append(WidthPoint(label, c, len(runs), Spread.of([(r.get("engine") or {}).get("spec_tokens_per_round")
                                                              for r in runs]),
                              Spread.of([r["metrics"]["output_tok_s"] for r in runs]), dict(share)))
    return out


def _order(label: str) -> tuple[int, int]:
    """Fixed blocks by width, then the online arms."""
    k = int(re.search(r"(\d+)\)?$", label).group(1))
    return (label.startswith("online"), k)


def plot_widths(results: list[dict], out: str | Path) -> Path:
    """Fig. 7 (see the module docstring): grouped bars per offered load, min-max bars over repeats."""
    pts = width_points(results)
    loads = sorted({p.concurrency for p in pts})
    labels = list(dict.fromkeys(p.label for p in pts))
    online = [p for p in pts if p.label.startswith("online") and p.width_share]
    fig, axes = plt.subplots(1, 3 if online else 2, figsize=(15 if online else 10.5, 4.3), constrained_layout=True)
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        mine = {p.concurrency: p for p in pts if p.label == label}
        xs = [loads.index(c) + (i - (len(labels) - 1) / 2) * width for c in mine]
        for ax, key in ((axes[0], "tokens_per_round"), (axes[1], "tok_s")):
            have = [(x, getattr(p, key)) for x, p in zip(xs, mine.values()) if getattr(p, key) is not None]
            if have:
                ax.bar([x for x, _ in have], [s.mean for _, s in have], width, color=f"C{i}", label=label,
                       yerr=[[s.bar()[j] for _, s in have] for j in (0, 1)], capsize=2)
    for ax, ylabel, title in ((axes[0], "emitted tokens per round", "(a) tokens per speculative round"),
                              (axes[1], "output tok/s", "(b) output throughput")):
        ax.set_xticks(range(len(loads)), [f"C{c}" for c in loads])
        ax.set(xlabel="offered concurrency", ylabel=ylabel, title=title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
        ax.legend(fontsize=8, ncols=2, loc="upper left")
    if online:
        _online_panel(axes[2], online, loads)
    runs = max(p.runs for p in pts)
    fig.suptitle("Verification width: static blocks vs eq. 13's online policy (Fig. 7)"
                 + (f", mean of up to {runs} runs, bars min-max" if runs > 1 else ""))
    return save_figure(fig, out)


def _online_panel(ax, online: list[WidthPoint], loads: list[int]) -> None:
    """(c) stacked share of rounds at each width, one bar per (online arm, load)."""
    widths = sorted({w for p in online for w in p.width_share})
    names = list(dict.fromkeys(p.label for p in online))
    xs = [loads.index(p.concurrency) + (names.index(p.label) - (len(names) - 1) / 2) * 0.35 for p in online]
    bottom = [0.0] * len(online)
    for j, w in enumerate(widths):
        h = [100 * p.width_share.get(w, 0.0) for p in online]
        ax.bar(xs, h, 0.3, bottom=bottom, color=f"C{(j + 4) % 10}", label=f"width {w}")
        bottom = [b + x for b, x in zip(bottom, h)]
    ax.set_xticks(range(len(loads)), [f"C{c}" for c in loads])
    ax.set(xlabel="offered concurrency", ylabel="rounds (%)", ylim=(0, 100),
           title="(c) widths eq. 13 chose" + (f" ({', '.join(names)})" if len(names) > 1 else f": {names[0]}"))
    ax.legend(fontsize=8)
