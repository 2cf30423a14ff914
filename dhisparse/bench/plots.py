"""PNG figures in the paper's form (matplotlib, Agg backend).

* `plot_serving`: Fig. 1/4 - (a) output tok/s against offered concurrency, (b) mean TTFT
  (log axis) and (c) mean TPOT against output tok/s; one line per preset. Repeated runs of a
  (preset, C) point are one point at their mean with min-max bars (`serving_points`).
* `plot_loadstep`: Fig. 6 - (a) request slots, (b) coverage, (c) host-fetched share against
  time, one line per arm, phases shaded.
* `plot_resolver` (`plot_resolver.py`): Fig. 8a - resolver time against unique host-miss bytes per
  case (linear axes), min-max error bars, and the least-squares line with its bandwidth.
* `plot_budget` (`plot_budget.py`): Fig. 9 - output and host-fetched share against the
  hot-cache budget B, from bench results of one concurrency at different B.
* `plot_context` (`plot_context.py`): output against context length and over resident's, with
  the context where the hierarchy overtakes resident (section 4.2, Fig. 5's question).
* `plot_profile` (`plot_profile.py`): Fig. 10 - where a decode step goes, by kernel family.
* `plot_cache_work` (`plot_cachework.py`): Fig. 10a - the cache's kernel time per step (resolver and
  follower-layer copies), in all and per session, against the hot-cache budget B.
* `plot_widths` (`plot_widths.py`): Fig. 7 - tokens per round and output of static verification
  widths and eq. 13's online policy at each load, and the widths the policy chose.
* `plot_costed` (`plot_costed.py`): the costed sweep - speculation's output over the baseline against
  tokens a round (the costed oracle: acceptance set, drafter network run), and a round's time split.
* `plot_series` (`plot_series.py`): a serving run over time - output tok/s and requests decoding
  per interval, one line per preset (admission waves against steady decoding).
* `plot_fig8bc` (`plot_resolver.py`): Fig. 8b - no-miss resolver time against hot-cache size B, one
  line per batch, the direct path dotted; Fig. 8c - bars at B_ref with and without host misses.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator  # noqa: E402

from dhisparse.engine.series import column  # noqa: E402

STYLE = {"resident": "tab:gray", "hisparse": "tab:blue", "adaptive": "tab:green",
         "resident+spec": "tab:purple", "adaptive+spec": "tab:red"}


OTHER_COLORS = ("tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")  # none of STYLE's


def color_of(name: str, i: int, style: dict[str, str] = STYLE) -> str:
    """The color of line i named `name` ("preset [...]"): its preset's in `style`; any other line (an arm such as
    `adaptive+spec@...`, an unknown preset) one of OTHER_COLORS by its index, so it never takes a preset's color.
    Every figure's lines take their colors here."""
    return style.get(name.split(" ")[0], OTHER_COLORS[i % len(OTHER_COLORS)])


SETUP_KEYS = ("engine", "model", "workload", "drafter", "oracle", "gpu")  # config sections two repeat calls share


def setup_of(res: dict) -> str | None:
    """What makes two result files repeats of one point: the same commit and the same engine, model, workload,
    drafter, oracle and GPU sections of their config (arms, order and wall times may differ). None for a
    file without a commit: it pools with no other."""
    commit = res.get("commit")
    if not commit:
        return None
    cfg = res.get("config") or {}
    return json.dumps([commit] + [cfg.get(k) for k in SETUP_KEYS], sort_keys=True, default=str)


def _one_curve(results: list[dict]) -> bool:
    """Whether several result files are pieces of one sweep: same model and workload (the window
    may differ), and either no (preset, concurrency) point measured twice or every file a repeat
    call of one setup (`setup_of`: one commit, one configuration). Their runs then join into one
    line per preset, repeats of a point pooled (`serving_points`)."""
    keys = {(res.get("config", {}).get("engine", {}).get("model"),
             tuple(sorted((k, v) for k, v in res.get("config", {}).get("workload", {}).items()
                          if k != "duration_s"))) for res in results}
    points = [(r["preset"], r["concurrency"]) for res in results for r in res["runs"]]
    setups = {setup_of(res) for res in results}
    return len(keys) == 1 and (len(points) == len(set(points)) or (len(setups) == 1 and None not in setups))


def _lines(results: list[dict]) -> dict[str, list[dict]]:
    """Runs of every bench result grouped by line label, sorted by concurrency. Files that are
    pieces of one sweep (`_one_curve`) share labels; otherwise each file's label is appended."""
    multi = len(results) > 1 and not _one_curve(results)
    lines: dict[str, list[dict]] = defaultdict(list)
    for k, res in enumerate(results):
        for r in res["runs"]:
            label = r["preset"] + (f" [{res.get('label') or k}]" if multi and res.get("label") else "")
            lines[label].append(r)
    return {k: sorted(v, key=lambda r: r["concurrency"]) for k, v in lines.items()}


@dataclass(frozen=True)
class Spread:
    """Mean and min-max of one metric over a point's runs (None: no run reported it)."""

    mean: float
    lo: float
    hi: float

    @staticmethod
    def of(values: list) -> "Spread | None":
        v = [x for x in values if x is not None]
        return Spread(sum(v) / len(v), min(v), max(v)) if v else None

    def bar(self) -> tuple[float, float]:
        """(below, above) the mean, for errorbar's yerr / xerr."""
        return self.mean - self.lo, self.hi - self.mean


@dataclass(frozen=True)
class ServingPoint:
    """One (line, C) point of Fig. 1/4: the runs measured there, summarized."""

    concurrency: int
    runs: int
    tok_s: Spread
    ttft_ms: Spread | None
    tpot_ms: Spread | None


def serving_points(runs: list[dict]) -> list[ServingPoint]:
    """A line's runs grouped by offered concurrency (repeats of a point: mean, min, max), by C."""
    by: dict[int, list[dict]] = defaultdict(list)
    for r in runs:
        by[r["concurrency"]].append(r["metrics"])
    return [ServingPoint(c, len(ms), Spread.of([m["output_tok_s"] for m in ms]), Spread.of([m["ttft_mean_ms"] for m in ms]),
                         Spread.of([m["tpot_mean_ms"] for m in ms])) for c, ms in sorted(by.items())]


def errorbar_points(ax, xs: list[Spread | float], ys: list[Spread], **kw) -> None:
    """Points at their means joined by a line, with min-max bars where a point has a spread."""
    xm = [x.mean if isinstance(x, Spread) else x for x in xs]
    xerr = [[x.bar()[i] for x in xs] for i in (0, 1)] if all(isinstance(x, Spread) for x in xs) else None
    ax.errorbar(xm, [y.mean for y in ys], yerr=[[y.bar()[i] for y in ys] for i in (0, 1)], xerr=xerr, capsize=2, **kw)


def plot_serving(results: list[dict], out: str | Path, title: str | None = None) -> Path:
    """Fig. 1/4 from one or more bench results (repeats: means with min-max bars)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), constrained_layout=True)
    cs = sorted({r["concurrency"] for res in results for r in res["runs"]})
    lines = {label: serving_points(runs) for label, runs in _lines(results).items()}
    widest = max(lines, key=lambda k: max(p.tok_s.mean for p in lines[k]), default=None)
    repeats = max((p.runs for pts in lines.values() for p in pts), default=1)
    for i, (label, pts) in enumerate(lines.items()):
        kw = dict(color=color_of(label, i), marker="o", label=label)
        errorbar_points(axes[0], [p.concurrency for p in pts], [p.tok_s for p in pts], **kw)
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
            have = [p for p in pts if getattr(p, key) is not None]
            if have:
                errorbar_points(ax, [p.tok_s for p in have], [getattr(p, key) for p in have], **kw)
            if label == widest:
                _label_points(ax, [(p.tok_s.mean, getattr(p, key).mean, p.concurrency) for p in have])
    _decorate_serving(axes, cs)
    _serving_legend(fig, axes, len(lines))
    note = f" (mean of up to {repeats} runs a point, bars min-max)" if repeats > 1 else ""
    fig.suptitle((title or _serving_title(results)) + note)
    return save_figure(fig, out)


def _label_points(ax, pts: list[tuple[float, float, int]]) -> None:
    """Mark offered concurrency next to points of one line, skipping points too close to the last label."""
    span = max((p[0] for p in pts), default=1.0) or 1.0
    last = None
    for px, py, c in pts:
        if last is None or px - last > 0.06 * span:
            ax.annotate(f"C{c}", (px, py), textcoords="offset points", xytext=(5, -10), fontsize=7, color="0.35")
            last = px


def _decorate_serving(axes, cs: list[int]) -> None:
    a, b, c = axes
    for ax in axes:
        ax.margins(x=0.08, y=0.12)
        ax.grid(True, which="major", alpha=0.3)
    a.set_xscale("log", base=2)
    a.xaxis.set_major_locator(FixedLocator(cs))
    a.xaxis.set_minor_locator(NullLocator())
    a.set_xticklabels([str(v) for v in cs])
    a.set(xlabel="offered concurrency C", ylabel="output tok/s", title="(a) output vs offered concurrency")
    b.set(xlabel="output tok/s", ylabel="mean TTFT (ms, log)", title="(b) TTFT vs output")
    c.set(xlabel="output tok/s", ylabel="mean TPOT (ms)", title="(c) TPOT vs output")
    for ax in (a, c):
        ax.set_ylim(0, ax.get_ylim()[1])
    _plain_log_y(b)


LEGEND_IN_PANELS = 6  # lines a panel's own legend holds; more (files that are not one sweep) share one below


def _serving_legend(fig, axes, n_lines: int) -> None:
    """A legend in each panel for a few lines; for more, one legend under the three panels (the same handles
    in every panel), so the labels do not cover the data."""
    if n_lines <= LEGEND_IN_PANELS:
        for ax in axes:
            ax.legend(fontsize=8)
        return
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=2 if n_lines <= 24 else 3, fontsize=7)


def _plain_log_y(ax) -> None:
    """Log y axis labelled with plain numbers; minor ticks get labels too when the data span
    less than a decade (otherwise a narrow range would show a single label)."""
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    lo, hi = ax.get_ylim()
    if lo > 0 and hi / lo < 10:
        ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)))
        ax.yaxis.set_minor_formatter(plain)
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def _serving_title(results: list[dict]) -> str:
    res = results[0]
    w = (res.get("config") or {}).get("workload") or {}
    eng = (res.get("config") or {}).get("engine") or {}
    over = ((res.get("config") or {}).get("model") or {}).get("overrides")
    model = (eng.get("model") or eng.get("url") or "?") + (f" ({', '.join(f'{k} {v}' for k, v in over.items())})"
                                                           if over else "")
    gpu = (res.get("config") or {}).get("gpu")
    return (f"closed loop: {model}{', ' + gpu if gpu else ''}, input {w.get('input_len', '?')}, "
            f"output cap {w.get('output_len', '?')}")


def _phase_spans(run: dict) -> list[tuple[float, float, str]]:
    return [(p["start_s"], p["end_s"], f"{p['name']}") for p in run.get("phases", [])]


LOADSTEP_PANELS = (("slots", ("slots", "running"), "(a) request slots", "requests"),
                   ("coverage", ("coverage",), "(b) coverage: ready optional / eligible history", "share"),
                   ("host_fetched_share", ("host_fetched_share",), "(c) selected rows fetched from host", "share"))


def plot_loadstep(result: dict, out: str | Path, title: str | None = None) -> Path:
    """Fig. 6 from a loadstep result: slots, coverage, host-fetched share against time."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True, constrained_layout=True)
    runs = result["runs"]
    for ax, (_, keys, name, ylabel) in zip(axes, LOADSTEP_PANELS):
        _loadstep_panel(ax, runs, keys, share=ylabel == "share")
        ax.set(title=name, ylabel=ylabel)
        ax.grid(True, alpha=0.3)
    _shade_phases(axes, runs[0] if runs else {})
    axes[-1].set_xlabel("time (s)")
    unavailable = (result.get("config") or {}).get("unavailable_arms") or []
    sub = f" (unavailable arms: {', '.join(unavailable)})" if unavailable else ""
    fig.suptitle((title or "load step: residency under changing load\n"
                  + _serving_title([result]).removeprefix("closed loop: ")) + sub)
    return save_figure(fig, out)


def _loadstep_panel(ax, runs: list[dict], keys: tuple[str, ...], share: bool) -> None:
    top = 0.0
    for i, r in enumerate(runs):
        key = next((k for k in keys if column(r["series"], k)[0]), None)
        if key is None:
            continue
        t, v = column(r["series"], key)
        ax.step(t, v, where="post", color=color_of(r["preset"], i), ls=("-", "--", ":", "-.")[i % 4],
                lw=2.2 - 0.4 * (i % 3), label=f"{r['preset']} ({key})")
        top = max(top, max(v))
    if top == 0.0 and not ax.lines:
        ax.text(0.5, 0.5, "not reported by this build's presets", ha="center", va="center",
                transform=ax.transAxes, color="0.4")
        ax.set_yticks([])
        return
    ax.legend(fontsize=8, loc="lower right")
    if share:
        ax.set_ylim(0, min(1.0, max(top * 1.15, 0.01)) if top < 0.8 else 1.02)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:.0f}%"))
    else:
        ax.set_ylim(0, max(top * 1.15, 1))


def _shade_phases(axes, run: dict) -> None:
    """Alternate phases shaded; phase names along the top of the first panel."""
    for k, (start, end, name) in enumerate(_phase_spans(run)):
        for ax in axes:
            if k % 2:
                ax.axvspan(start, end, color="0.92", zorder=0)
        axes[0].text((start + end) / 2, 0.96, name, transform=axes[0].get_xaxis_transform(), ha="center",
                     va="top", fontsize=8, color="0.3")


def save_figure(fig, out: str | Path) -> Path:
    """Write `fig` to `out` (folders made, 120 dpi) and close it; every figure module saves here."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_results(results: list[dict], out_dir: str | Path) -> list[Path]:
    """Every figure the given result files support: serving curves from all bench results
    together (or, for bench results of one concurrency at different hot-cache sizes, the budget
    sweep; at different context lengths with resident among the presets, the context crossover; arms of
    verification widths, Fig. 7; a baseline and arms of set tokens a round, the costed sweep), one over-time
    figure per bench result with per-interval series, one load-step figure per loadstep result, one step-profile figure (Fig. 10) per step_profile result with kernel
    data (and, over step profiles at two or more hot-cache budgets, Fig. 10a's cache_work.png), one resolver figure
    per resolver file."""
    from dhisparse.bench.plot_budget import is_budget_sweep, plot_budget
    from dhisparse.bench.plot_cachework import is_cache_work_sweep, plot_cache_work
    from dhisparse.bench.plot_context import is_context_sweep, plot_context
    from dhisparse.bench.plot_costed import is_costed_sweep, plot_costed
    from dhisparse.bench.plot_profile import plot_profile, step_bars
    from dhisparse.bench.plot_resolver import plot_fig8bc, plot_resolver
    from dhisparse.bench.plot_series import has_series, plot_series
    from dhisparse.bench.plot_widths import is_width_sweep, plot_widths

    out_dir = Path(out_dir)
    written = []
    bench = [r for r in results if r.get("kind") == "bench"]
    if bench and is_budget_sweep(bench):
        written.append(plot_budget(bench, out_dir / "budget.png", STYLE))
    elif bench and is_context_sweep(bench):
        written.append(plot_context(bench, out_dir / "context.png", STYLE))
    elif bench and is_width_sweep(bench):
        written.append(plot_widths(bench, out_dir / "widths.png"))
    elif bench and is_costed_sweep(bench):
        written.append(plot_costed(bench, out_dir / "costed.png"))
    elif bench:
        written.append(plot_serving(bench, out_dir / "serving.png"))
    for k, r in enumerate(x for x in bench if has_series(x)):
        written.append(plot_series(r, out_dir / f"series{'' if k == 0 else k}.png", STYLE))
    for k, r in enumerate(x for x in results if x.get("kind") == "loadstep"):
        written.append(plot_loadstep(r, out_dir / f"loadstep{'' if k == 0 else k}.png"))
    for k, r in enumerate(x for x in results if x.get("kind") == "step_profile" and step_bars(x)):
        written.append(plot_profile(r, out_dir / f"step_profile{'' if k == 0 else k}.png"))
    if is_cache_work_sweep(results):
        written.append(plot_cache_work(results, out_dir / "cache_work.png", STYLE))
    for k, r in enumerate(x for x in results if "records" in x):
        if r["records"]:
            written.append(plot_resolver(r["records"], out_dir / f"resolver{'' if k == 0 else k}.png"))
        if "fig8" in (r.get("summary") or {}):
            written.append(plot_fig8bc(r["summary"]["fig8"], out_dir / f"resolver_fig8bc{'' if k == 0 else k}.png"))
    return written
