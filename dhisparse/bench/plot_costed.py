"""The costed sweep (issue 31): what speculation returns over the baseline once its drafter is paid for,
against the tokens a round it emits.

Input: bench results of one plain preset and arms of a speculative one at set acceptance
(`bench/gpu_serving.py --presets hisparse,adaptive+spec --arms 'speculative_oracle_tokens_per_round=2.88;...'
--arm-presets adaptive+spec --charge-spec-memory`, e.g. `bench/gpu_session.sh costedsweep31`): a run's preset
reads `hisparse` or `adaptive+spec@speculative_oracle_tokens_per_round=2.88`. The oracle drafter proposes the
reference's tokens at a set acceptance: a measurement tool; costed, a drafter network runs every round and holds
its memory, its drafts discarded. Per (setup, arm, offered load), over the arm's repeated runs (mean, min-max);
a setup is one file, or the files of separate calls that repeat one setup at one commit (`setup_of`), pooled:

  (a) output tok/s over the baseline's (the mean of the baseline's runs at that load in the run's own file) against
      the tokens a round measured (`spec_tokens_per_round`), and the same for the central half's output
      (`central_output_tok_s`; from the series for results written before it); the paper's 1.45x at 2.88
      tokens a round (GLM-5, 4 GPUs) and the issue's 1.6x marked, and eq. 13's prediction from the same runs'
      slots and TPOTs (dotted, x; bench/eq13.py)
  (b) milliseconds: the baseline's TPOT (a band, min-max) beside each arm's round, its step
      (`spec_cost_ms_width{K}`, the median of the last decode-only rounds at the arm's width, less the drafter's
      call where `spec_cost_with_draft` says the round was timed with it: session 42 on; before, the engine timed
      a step after the drafter proposed) with the drafter's call (`spec_draft_ms_per_call`) stacked on it, and the
      arm's TPOT; without those counters, the arm's TPOT alone
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dhisparse.bench.eq13 import predicted_ratio  # noqa: E402
from dhisparse.bench.plot_widths import arm_of  # noqa: E402
from dhisparse.bench.plots import Spread, save_figure, setup_of  # noqa: E402
from dhisparse.bench.records import central_of  # noqa: E402

TPR = "speculative_oracle_tokens_per_round"
PAPER = (2.88, 1.45)  # the paper's speculation over HiSparse at its high-load point: GLM-5, C128 on 4 GPUs, 2.88 tokens a round
TARGET = 1.6  # issue 31's aim


def set_tokens_per_round(preset: str) -> float | None:
    """The tokens a round an arm's label sets the oracle to; None when the run is not such an arm."""
    try:
        return float(arm_of(preset)[TPR])
    except (KeyError, ValueError):
        return None


def _is_baseline(preset: str) -> bool:
    return "@" not in preset and "spec" not in preset


def _rest(preset: str) -> tuple[str, tuple]:
    """An arm without its tokens a round: its preset and its other settings."""
    return preset.partition("@")[0], tuple((n, v) for n, v in arm_of(preset).items() if n != TPR)


def is_costed_sweep(results: list[dict]) -> bool:
    """Every run is a plain non-speculative preset (the baseline, one a file) or an arm that sets
    `speculative_oracle_tokens_per_round`, at least one of each; a file's arms differ in that alone (a width
    sweep's do not), and every arm's load has a baseline run in its file."""
    n_base = n_arm = 0
    for res in results:
        runs = res["runs"]
        base = [r for r in runs if _is_baseline(r["preset"])]
        arms = [r for r in runs if set_tokens_per_round(r["preset"]) is not None]
        if len(base) + len(arms) != len(runs) or len({r["preset"] for r in base}) > 1 \
                or len({_rest(r["preset"]) for r in arms}) > 1 \
                or not {r["concurrency"] for r in arms} <= {r["concurrency"] for r in base}:
            return False
        n_base, n_arm = n_base + len(base), n_arm + len(arms)
    return n_base > 0 and n_arm > 0


@dataclass(frozen=True)
class CostedPoint:
    """One (setup, arm, C) point: the arm's runs against the baseline runs at that load. A setup is one file,
    or the files that repeat one setup at one commit (`setup_of`: separate calls of one repeat each, the preset
    order rotated between them), pooled. `source`: the setup's label where several setups hold arms ("" otherwise);
    `line`: the arm without its tokens a round, the source in brackets; `ratio`: each run's output over the mean
    output of the baseline runs in its own file (paired: a call's windows share a machine start and a model build;
    central: the same of the central halves); `step_ms`: the round's step without the drafter, `draft_ms`: the
    drafter's call, `round_ms`: their sum, run by run; `files`: how many files the point pools."""

    source: str
    line: str
    set_tokens_per_round: float
    concurrency: int
    runs: int
    baseline: str
    baseline_runs: int
    tokens_per_round: Spread | None
    tok_s: Spread
    ratio: Spread
    central_ratio: Spread | None
    baseline_tok_s: Spread
    baseline_tpot_ms: Spread | None
    tpot_ms: Spread | None
    step_ms: Spread | None
    draft_ms: Spread | None
    round_ms: Spread | None
    files: int = 1
    eq13: Spread | None = None  # eq. 13's prediction, run by run against its own file's baseline (bench/eq13.py)


def _step_ms(engine: dict) -> float | None:
    """The round's measured cost less its drafter, at the width the arm ran most (`spec_steps_width{K}`),
    else its only one. Results flagged `spec_cost_with_draft` (session 42 on) time the round from before
    the drafter's proposal, so its call comes off; earlier ones timed the step after it."""
    costs = {int(k.rsplit("width", 1)[1]): v for k, v in engine.items() if k.startswith("spec_cost_ms_width")}
    if not costs:
        return None
    cost = costs[max(costs, key=lambda w: (engine.get(f"spec_steps_width{w}") or 0, w))]
    return cost - (engine.get("spec_draft_ms_per_call") or 0.0) if engine.get("spec_cost_with_draft") else cost


def _over(values: list, base: Spread | None) -> list:
    """Each value over the base's mean (None where a value, or the base, is missing)."""
    ok = base is not None and base.mean
    return [v / base.mean if ok and v is not None else None for v in values]


def _sum(a: list, b: list) -> list:
    return [x + y if x is not None and y is not None else None for x, y in zip(a, b)]


def _setups(results: list[dict]) -> list[tuple[str, list[dict]]]:
    """The files grouped into setups (`setup_of`), in first-seen order, each with its label: the first
    file's label (or index), "+N" when it pools N more."""
    groups: dict = {}
    for k, res in enumerate(results):
        groups.setdefault(setup_of(res) or ("file", k), []).append((k, res))
    out = []
    for members in groups.values():
        k, first = members[0]
        label = str(first.get("label") or k) + (f" +{len(members) - 1}" if len(members) > 1 else "")
        out.append((label, [res for _, res in members]))
    return out


def _paired(files: list[dict]) -> tuple[dict, dict]:
    """Per C, the baseline runs of every file; per (C, arm preset), (run, its file's baseline runs) pairs."""
    base: dict[int, list[dict]] = defaultdict(list)
    arms: dict[tuple[int, str], list[tuple[dict, list[dict]]]] = defaultdict(list)
    for res in files:
        own: dict[int, list[dict]] = defaultdict(list)
        for r in res["runs"]:
            if _is_baseline(r["preset"]):
                own[r["concurrency"]].append(r)
        for c, rs in own.items():
            base[c] += rs
        for r in res["runs"]:
            if set_tokens_per_round(r["preset"]) is not None:
                arms[r["concurrency"], r["preset"]].append((r, own[r["concurrency"]]))
    return base, arms


def costed_points(results: list[dict]) -> list[CostedPoint]:
    """Every (setup, arm, C) point, by setup, load and set tokens a round."""
    setups = _setups(results)
    with_arms = sum(1 for _, files in setups if any(not _is_baseline(r["preset"]) for res in files for r in res["runs"]))
    out = []
    for label, files in setups:
        base, arms = _paired(files)
        for (c, preset), pairs in sorted(arms.items(), key=lambda kv: (kv[0][0], set_tokens_per_round(kv[0][1]))):
            runs, b = [r for r, _ in pairs], base[c]
            eng = [r.get("engine") or {} for r in runs]
            ratio, central, eq13 = [], [], []
            for r, own in pairs:
                ratio += _over([r["metrics"]["output_tok_s"]], Spread.of([x["metrics"]["output_tok_s"] for x in own]))
                central += _over([central_of(r)], Spread.of([central_of(x) for x in own]))
                eq13.append(_eq13(c, r, own))
            name, rest = _rest(preset)
            source = label if with_arms > 1 else ""
            line = name + (f" ({', '.join(f'{n}={v}' for n, v in rest)})" if rest else "") + (f" [{source}]" if source else "")
            step, draft = [_step_ms(e) for e in eng], [e.get("spec_draft_ms_per_call") for e in eng]
            out.append(CostedPoint(
                source, line, set_tokens_per_round(preset), c, len(runs), b[0]["preset"], len(b),
                Spread.of([e.get("spec_tokens_per_round") for e in eng]),
                Spread.of([r["metrics"]["output_tok_s"] for r in runs]), Spread.of(ratio), Spread.of(central),
                Spread.of([r["metrics"]["output_tok_s"] for r in b]), Spread.of([r["metrics"].get("tpot_mean_ms") for r in b]),
                Spread.of([r["metrics"].get("tpot_mean_ms") for r in runs]), Spread.of(step), Spread.of(draft),
                Spread.of(_sum(step, draft)), len({id(own) for _, own in pairs}), Spread.of(eq13)))
    return out


def _eq13(c: int, run: dict, base: list[dict]) -> float | None:
    """Eq. 13's Q_s / Q_0 for one run against its file's baseline runs at load c: slots from the engines'
    `slots_total`, TPOTs the run's and the baselines' mean; None where one is missing."""
    b_s, b_0 = (run.get("engine") or {}).get("slots_total"), (base[0].get("engine") or {}).get("slots_total")
    tpot_s, tpot_0 = run["metrics"].get("tpot_mean_ms"), Spread.of([x["metrics"].get("tpot_mean_ms") for x in base])
    if not (b_s and b_0 and tpot_s and tpot_0):
        return None
    return predicted_ratio(c, b_s, b_0, tpot_0.mean, tpot_s)


def plot_costed(results: list[dict], path: str | Path) -> Path:
    """The costed sweep (see the module docstring): (a) output over the baseline against tokens a round,
    (b) a round's milliseconds against the baseline's TPOT."""
    pts = costed_points(results)
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(14, 5.4), constrained_layout=True)
    _ratio_panel(ax_a, pts, results)
    _round_panel(ax_b, pts)
    fig.suptitle(_title(results, pts), fontsize=10.5)
    return save_figure(fig, path)


def _ratio_panel(ax, pts: list[CostedPoint], results: list[dict]) -> None:
    """(a) one line a (arm, load), the central half dashed beside it; the baseline's own spread at 1."""
    lines = list(dict.fromkeys((p.line, p.concurrency) for p in pts))
    several = len({p.concurrency for p in pts}) > 1
    metric = all(r["metrics"].get("central_output_tok_s") is not None for res in results for r in res["runs"])
    for i, (line, c) in enumerate(lines):
        mine = sorted((p for p in pts if (p.line, p.concurrency) == (line, c)), key=lambda p: p.set_tokens_per_round)
        xs = [p.tokens_per_round or Spread(*[p.set_tokens_per_round] * 3) for p in mine]
        name, color = line + (f" C{c}" if several else ""), f"C{(3 + i) % 10}"
        for key, ls, mk, fill, what in (("ratio", "-", "o", None, "whole window"),
                                        ("central_ratio", "--", "s", "none",
                                         "central half" + ("" if metric else " (from the series)"))):
            have = [(x, getattr(p, key)) for x, p in zip(xs, mine) if getattr(p, key) is not None]
            if not have:
                continue
            ax.errorbar([x.mean for x, _ in have], [y.mean for _, y in have],
                        xerr=[[x.bar()[j] for x, _ in have] for j in (0, 1)], yerr=[[y.bar()[j] for _, y in have] for j in (0, 1)],
                        color=color, ls=ls, marker=mk, mfc=fill, capsize=3, label=f"{name}: {what}")
            for x, y in have:
                ax.annotate(f"{y.mean:.3f}x", (x.mean, y.mean), textcoords="offset points", fontsize=8, color=color,
                            xytext=(8, -10) if key == "ratio" else (-8, 4), ha="left" if key == "ratio" else "right")
        pred = [(x, p.eq13) for x, p in zip(xs, mine) if p.eq13 is not None]
        if pred:
            ax.errorbar([x.mean for x, _ in pred], [y.mean for _, y in pred],
                        yerr=[[y.bar()[j] for _, y in pred] for j in (0, 1)], color=color, ls=":", marker="x", ms=8,
                        capsize=3, label=f"{name}: eq. 13 predicted (slots, TPOT)")
        b = mine[0].baseline_tok_s
        ax.errorbar([1.0], [1.0], yerr=[[b.bar()[j] / b.mean] for j in (0, 1)], color="0.4", marker="D", capsize=3,
                    label=f"{mine[0].baseline}: {mine[0].baseline_runs} runs over their mean" if i == 0 else None)
    ax.axhline(1.0, ls="--", color="0.45", lw=1)
    ax.plot(*PAPER, ls="none", marker="*", ms=15, color="k", label="paper, high load (GLM-5 C128, 4 GPUs): 1.45x at 2.88")
    ax.axhline(TARGET, ls=":", color="tab:purple", lw=1.5, label=f"issue's target {TARGET}x")
    ax.set(xlabel="tokens a round (measured, `spec_tokens_per_round`; bars min-max)", ylabel="output over the baseline's mean",
           title="(a) speculation's output over the baseline (same load, each run over its own file's)")
    ax.set_xlim(0.8, max([3.05] + [p.tokens_per_round.hi for p in pts if p.tokens_per_round]) + 0.15)
    ax.set_ylim(min([0.8] + [p.ratio.lo - 0.05 for p in pts]), max([TARGET + 0.25] + [p.ratio.hi + 0.1 for p in pts]))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left")


def _round_panel(ax, pts: list[CostedPoint]) -> None:
    """(b) the baseline's TPOT band; per arm a stacked bar (step, drafter) and its TPOT beside it, or, without
    round counters, its TPOT as the bar."""
    bands = dict.fromkeys((p.source, p.concurrency, p.baseline, p.baseline_tpot_ms) for p in pts if p.baseline_tpot_ms)
    for j, (src, c, name, tpot) in enumerate(bands):
        ax.axhspan(tpot.lo, tpot.hi, color="0.8", zorder=0)
        ax.axhline(tpot.mean, color="0.35", lw=1, ls=("-", "-.", ":")[j % 3],
                   label=f"{name}{f' [{src}]' if src else ''} TPOT, C{c}: {tpot.mean:.1f} ms (band min-max)")
    idx = [i for i, p in enumerate(pts) if p.round_ms is not None]
    rounds = [pts[i] for i in idx]
    if rounds:
        ax.bar(idx, [p.step_ms.mean for p in rounds], 0.5, color="C0", label="round's step (`spec_cost_ms_width{K}`)")
        ax.bar(idx, [p.draft_ms.mean for p in rounds], 0.5, bottom=[p.step_ms.mean for p in rounds], color="C1",
               yerr=[[p.round_ms.bar()[j] for p in rounds] for j in (0, 1)], capsize=3,
               label="drafter call (`spec_draft_ms_per_call`); bar: the round's min-max")
        for i, p in zip(idx, rounds):
            per = f"\n{p.round_ms.mean / p.tokens_per_round.mean:.0f} ms a token" if p.tokens_per_round else ""
            ax.annotate(f"{p.round_ms.mean:.1f} ms (drafter {p.draft_ms.mean:.1f}){per}", (i, p.round_ms.hi),
                        textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    tp = [(i + (0.38 if rounds else 0), p.tpot_ms) for i, p in enumerate(pts) if p.tpot_ms is not None]
    if tp and rounds:
        ax.errorbar([x for x, _ in tp], [s.mean for _, s in tp], yerr=[[s.bar()[j] for _, s in tp] for j in (0, 1)],
                    ls="none", marker="D", color="C3", capsize=3, label="arm's TPOT (mean, min-max)")
    elif tp:
        ax.bar([x for x, _ in tp], [s.mean for _, s in tp], 0.5, yerr=[[s.bar()[j] for _, s in tp] for j in (0, 1)],
               color="C3", capsize=3, label="arm's TPOT (mean, min-max)")
    several = len({p.concurrency for p in pts}) > 1
    ax.set_xticks(range(len(pts)), [f"set {p.set_tokens_per_round:g}" + (f" C{p.concurrency}" if several else "")
                                    + (f"\n({p.tokens_per_round.mean:.2f} measured)" if p.tokens_per_round else "")
                                    + (f"\n[{p.source}]" if p.source else "") for p in pts])
    ax.set(xlabel="arm: tokens a round", ylabel="ms",
           title="(b) a round (step + drafter) against the baseline's TPOT" if rounds else "(b) TPOT against the baseline's")
    ax.set_xlim(-0.6, len(pts) - 0.4 + (0.38 if rounds else 0))
    ax.set_ylim(0, ax.get_ylim()[1] * (1.3 + 0.08 * len(bands)))  # room for the legend
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left")


def _title(results: list[dict], pts: list[CostedPoint]) -> str:
    cfg = results[0].get("config") or {}
    eng, w = cfg.get("engine") or {}, cfg.get("workload") or {}
    ctx = w.get("input_len")
    drafter = eng.get("speculative_oracle_drafter")
    how = (f"costed oracle: acceptance set, drafter network run (measurement tool); drafter {drafter}" if drafter
           else "oracle: acceptance set, no drafter network run (measurement tool)")
    if eng.get("replay_reference"):
        how += "; REPLAYED: every preset emits the reference's tokens (measurement tool)"
    runs = max(p.runs for p in pts)
    files = max(p.files for p in pts)
    spread = (f"; mean of up to {runs} runs" + (f" from {files} calls pooled" if files > 1 else "") + ", bars min-max"
              if runs > 1 else "")
    old = " [SUPERSEDED]" if any(r.get("superseded_by") for r in results) else ""
    old += " [NOT A RESULT]" if any(r.get("not_a_result") for r in results) else ""
    over = (cfg.get("model") or {}).get("overrides")
    model = (eng.get("model") or "?") + (f" ({', '.join(f'{k} {v}' for k, v in over.items())})" if over else "")
    gpu = f", {cfg['gpu']}" if cfg.get("gpu") else ""
    return (f"Costed sweep{old}: {model}{gpu}, {f'{ctx:,}-token context' if ctx else 'context ?'}, "
            f"{', '.join(f'C{c}' for c in sorted({p.concurrency for p in pts}))}{spread}\n{how}")
