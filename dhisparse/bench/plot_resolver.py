"""Fig. 8 in the paper's form, from the resolver bench's files (`bench/resolver_bench.py`, `bench/resolver_fig8.py`).

* `plot_resolver`: Fig. 8a - resolver time against unique host-miss bytes per case (linear axes), min-max error
  bars, and the least-squares line with its bandwidth (`fit_bandwidth`).
* `plot_fig8bc`: Fig. 8b - no-miss resolver time against hot-cache size B, one line per batch, the direct path
  dotted; Fig. 8c - bars at B_ref with and without host misses; p10-p90 error bars.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402

from dhisparse.bench.plots import save_figure  # noqa: E402

__all__ = ["fit_bandwidth", "plot_resolver", "plot_fig8bc"]


def fit_bandwidth(xs: list[float], ys_ms: list[float]) -> tuple[float, float, float]:
    """Least squares time_ms = a + b * bytes -> (a_ms, GB/s = 1 / b, R^2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys_ms) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys_ms))
    b = sxy / sxx if sxx else 0.0
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys_ms)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys_ms))
    r2 = 1 - ss_res / ss_tot if ss_tot else 1.0
    gbps = (1e-9 / (b * 1e-3)) if b > 0 else float("inf")
    return a, gbps, r2


def plot_resolver(records: list[dict], out: str | Path, title: str | None = None) -> Path:
    """Fig. 8a from records {miss_bytes, time_ms, case[, row_bytes, min_ms, max_ms]}: one panel per
    row size; resolver calls as points with min-max bars and a least-squares fit over them;
    gather ceilings (cases named ceiling_*) as dashed reference lines, not fitted."""
    if not records:
        raise ValueError("resolver plot: no records; expected a list of {miss_bytes, time_ms, case}")
    sizes = sorted({r.get("row_bytes") for r in records}, key=lambda x: (x is None, x))
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.4 * len(sizes), 4.8), constrained_layout=True, squeeze=False)
    for ax, size in zip(axes[0], sizes):
        _resolver_panel(ax, [r for r in records if r.get("row_bytes") == size], size)
    fig.suptitle(title or "resolver time vs unique host-miss bytes")
    return save_figure(fig, out)


def _resolver_panel(ax, records: list[dict], size) -> None:
    calls = [r for r in records if not str(r.get("case", "")).startswith("ceiling")]
    for i, case in enumerate(sorted({str(r.get("case", "all")) for r in calls})):
        pts = sorted(((float(r["miss_bytes"]), r) for r in calls if str(r.get("case", "all")) == case), key=lambda p: p[0])
        x, y = [b / 1e6 for b, _ in pts], [float(r["time_ms"]) for _, r in pts]
        lo = [t - float(r.get("min_ms", t)) for t, (_, r) in zip(y, pts)]
        hi = [float(r.get("max_ms", t)) - t for t, (_, r) in zip(y, pts)]
        ax.errorbar(x, y, yerr=[lo, hi], fmt="o", ms=4, color=f"C{i % 10}", capsize=2, label=case)
    if len(calls) >= 2:
        a, gbps, r2 = fit_bandwidth([float(r["miss_bytes"]) for r in calls], [float(r["time_ms"]) for r in calls])
        xs = [0.0, max(float(r["miss_bytes"]) for r in calls)]
        ax.plot([b / 1e6 for b in xs], [a + b * 1e-6 / gbps for b in xs], "k-", lw=1, label=f"fit {gbps:.1f} GB/s (R² {r2:.3f})")
    for j, case in enumerate(sorted({str(r["case"]) for r in records} - {str(r.get("case")) for r in calls})):
        pts = sorted((float(r["miss_bytes"]), float(r["time_ms"])) for r in records if r["case"] == case)
        ax.plot([b / 1e6 for b, _ in pts], [t for _, t in pts], ls="--", color="0.4" if j == 0 else "0.7", label=case)
    ax.set(xlabel="unique host-miss payload per call (MB)", ylabel="resolver time (ms)",
           title=f"{size}-B rows" if size else None)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def _us(entry: dict) -> tuple[float, float, float]:
    """(median, median - p10, p90 - median) in microseconds of one summary entry."""
    t, lo, hi = (1e3 * entry[k] for k in ("time_ms", "p10_ms", "p90_ms"))
    return t, t - lo, hi - t


def plot_fig8bc(fig8: dict, out: str | Path, title: str | None = None) -> Path:
    """Fig. 8 (b) and (c) from the resolver bench's summary["fig8"] (see bench/resolver_bench.py)."""
    sh = fig8["shapes"]
    fig, (ax_b, ax_c) = plt.subplots(1, 2, figsize=(12.5, 4.6), constrained_layout=True)
    for i, (name, b) in enumerate(fig8["b"].items()):
        for path, ls, mk in (("scan", "-", "o"), ("direct", ":", "s")):
            pts = [_us(e) for e in b[path]]
            ax_b.errorbar(b["B"], [p[0] for p in pts], yerr=[[p[1] for p in pts], [p[2] for p in pts]], ls=ls,
                          marker=mk, ms=4, capsize=2, color=f"C{i}",
                          label=f"{name.replace('batch', 'batch ')}" + (", direct path" if path == "direct" else ""))
    ax_b.set_xscale("log", base=2)
    ax_b.xaxis.set_major_locator(FixedLocator(list(sh["Bs"])))
    ax_b.xaxis.set_minor_locator(NullLocator())
    ax_b.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v):,}"))
    ax_b.set(xlabel="hot-cache size B (rows)", ylabel="resolver time (µs per call)",
             title=f"(b) no host miss, K=1, k={sh['k']}")
    ax_b.set_ylim(bottom=0)
    _fig8c(ax_c, fig8["c"], sh)
    for ax in (ax_b, ax_c):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    glm = " ".join(f"GLM {k}: direct {v['direct']['time_ms'] * 1e3:.1f} µs vs scan {v['scan']['time_ms'] * 1e3:.1f} µs;"
                   for k, v in fig8.get("glm", {}).items())
    fig.suptitle(title or f"resolver cost (median, p10-p90).  {glm}".rstrip(";"), fontsize=10)
    return save_figure(fig, out)


def _fig8c(ax, c: dict, sh: dict) -> None:
    """Grouped bars: per batch, no miss and `miss` misses per request, labelled with the median (µs)."""
    miss = f"miss{sh['miss']}"
    width = 0.38
    for j, (key, label) in enumerate((("no_miss", "no host miss"), (miss, f"{sh['miss']} host misses"))):
        xs, ts, lo, hi = [], [], [], []
        for i, entry in enumerate(c.values()):
            t, a, b = _us(entry[key])
            xs.append(i + (j - 0.5) * width)
            ts.append(t), lo.append(a), hi.append(b)
        bars = ax.bar(xs, ts, width, yerr=[lo, hi], capsize=3, color=f"C{j + 2}", label=label)
        extra = [f"\n+{e['added_us_per_request']:.2f}/req" if j else "" for e in c.values()]
        ax.bar_label(bars, labels=[f"{t:.1f}{x}" for t, x in zip(ts, extra)], padding=2, fontsize=8)
    ax.set_xticks(range(len(c)), [k.replace("batch", "batch ") for k in c])
    ax.set(ylabel="resolver time (µs per call)", title=f"(c) B = {sh['B_ref']:,}")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
