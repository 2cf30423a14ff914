"""The costed sweep's figure (`dhisparse plot` -> costed.png): speculation's output over the baseline's mean at
the same load in the same file, against tokens a round, with the arm's spread, and a round's time split.

Breakages tried (each fails here): the ratio over the baseline's max instead of its mean; over the baseline's
first run; the baseline taken from every file instead of the arm's own (the two-file check fails); from every
load instead of the arm's (the two-load check fails); the round as the step alone, without the drafter's call;
`is_costed_sweep` taking arms that differ in more than their tokens a round (a width sweep with a baseline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dhisparse.bench.plots import Spread, plot_results
from dhisparse.cli import main

pytest.importorskip("matplotlib")

S36 = Path(__file__).resolve().parents[1] / "bench" / "results" / "costed_sweep_faithful_100k_k2048_c20_s36_h200.json"


def _arm(tpr: float, extra: str = "") -> str:
    return f"adaptive+spec@speculative_oracle_tokens_per_round={tpr}{extra}"


def _run(preset: str, out: float, tpot: float, central: float | None = None, c: int = 20, engine: dict | None = None) -> dict:
    m = {"output_tok_s": out, "ttft_mean_ms": 1e3, "tpot_mean_ms": tpot, "duration_s": 30.0}
    if central is not None:
        m["central_output_tok_s"] = central
    return {"preset": preset, "concurrency": c, "metrics": m, "engine": engine or {}}


def _spec(tpr: float, step: float, draft: float) -> dict:
    return {"spec_tokens_per_round": tpr, "spec_steps_width4": 100, "spec_cost_ms_width4": step,
            "spec_draft_ms_per_call": draft}


def _costed(scale: float = 1.0, central: bool = True) -> dict:
    """hisparse 200 / 240 (mean 220), the 2.88 arm 264 / 286 (1.2x / 1.3x), the 2.2 arm 198 (0.9x), at C20;
    central halves 1.1x the window's but the baseline's second run (250)."""
    cen = (lambda v: v * 1.1) if central else (lambda v: None)
    runs = [_run("hisparse", 200 * scale, 90.0, cen(200 * scale)),
            _run(_arm(2.88), 264 * scale, 80.0, cen(264 * scale), engine=_spec(2.8, 170.0, 12.0)),
            _run(_arm(2.2), 198 * scale, 100.0, cen(198 * scale), engine=_spec(2.2, 180.0, 14.0)),
            _run(_arm(2.88), 286 * scale, 84.0, cen(286 * scale), engine=_spec(3.0, 174.0, 14.0)),
            _run("hisparse", 240 * scale, 94.0, 250 * scale if central else None)]
    return {"kind": "bench", "runs": runs,
            "config": {"engine": {"model": "m", "speculative_oracle_drafter": "dflash2"},
                       "workload": {"input_len": 102400, "output_len": 1024}}}


def _width_sweep(with_baseline: bool) -> dict:
    runs = [_run(f"adaptive+spec@speculative_policy=fixed,speculative_num_draft_tokens={k},"
                 "speculative_oracle_tokens_per_round=3", 500.0 - k, 40.0, engine={"spec_tokens_per_round": 2.9})
            for k in (4, 6, 8)]
    return {"kind": "bench", "runs": runs + ([_run("hisparse", 400.0, 50.0)] if with_baseline else [])}


def test_a_costed_sweep_is_a_baseline_and_arms_of_set_tokens_a_round():
    from dhisparse.bench.plot_costed import is_costed_sweep, set_tokens_per_round
    from dhisparse.bench.plot_widths import is_width_sweep

    assert set_tokens_per_round(_arm(2.88)) == 2.88 and set_tokens_per_round("hisparse") is None
    assert set_tokens_per_round("adaptive+spec@speculative_num_draft_tokens=6") is None
    assert is_costed_sweep([_costed()]) and not is_width_sweep([_costed()])
    assert is_costed_sweep([_costed(), {"kind": "bench", "runs": [_run("hisparse", 1.0, 1.0)]}])  # a baseline-only file
    assert not is_costed_sweep([_width_sweep(False)]) and is_width_sweep([_width_sweep(False)])
    only = _costed()
    base, arms = ({**only, "runs": [r for r in only["runs"] if keep(r["preset"])]}
                  for keep in (lambda p: "@" not in p, lambda p: "@" in p))
    assert not is_costed_sweep([base]) and not is_costed_sweep([arms])  # one of each
    assert not is_costed_sweep([])
    plain = {"kind": "bench", "runs": [_run("hisparse", 200.0, 90.0), _run("adaptive+spec", 190.0, 90.0)]}
    assert not is_costed_sweep([plain])  # s30b's shape: the tokens a round set for the whole call, not an arm
    other_load = _costed()
    other_load["runs"].append(_run(_arm(2.5), 230.0, 85.0, c=40))
    assert not is_costed_sweep([other_load])  # no baseline at C40
    two_bases = _costed()
    two_bases["runs"].append(_run("adaptive", 230.0, 85.0))
    assert not is_costed_sweep([two_bases])
    assert not is_costed_sweep([_width_sweep(True)])  # a width sweep with a baseline is neither; serving.png


def test_costed_points_divide_each_run_by_the_baselines_mean_at_its_load():
    from dhisparse.bench.plot_costed import costed_points

    pts = costed_points([_costed()])
    assert [(p.line, p.set_tokens_per_round, p.runs) for p in pts] == [("adaptive+spec", 2.2, 1), ("adaptive+spec", 2.88, 2)]
    low, high = pts
    assert high.baseline == "hisparse" and high.baseline_runs == 2 and high.baseline_tok_s == Spread(220.0, 200.0, 240.0)
    assert high.ratio.mean == pytest.approx(1.25, abs=1e-12)
    assert (high.ratio.lo, high.ratio.hi) == (pytest.approx(1.2, abs=1e-12), pytest.approx(1.3, abs=1e-12))
    assert high.ratio.mean == pytest.approx(high.tok_s.mean / high.baseline_tok_s.mean, abs=1e-12)
    assert low.ratio == Spread(pytest.approx(0.9, abs=1e-12), pytest.approx(0.9, abs=1e-12), pytest.approx(0.9, abs=1e-12))
    # central halves: the arm's 1.1 x (264, 286) over the baseline's (1.1 x 200 + 250) / 2 = 235
    assert high.central_ratio.lo == pytest.approx(290.4 / 235) and high.central_ratio.hi == pytest.approx(314.6 / 235)
    assert high.tokens_per_round == Spread(pytest.approx(2.9), 2.8, 3.0)
    assert high.step_ms == Spread(172.0, 170.0, 174.0) and high.draft_ms == Spread(13.0, 12.0, 14.0)
    assert high.round_ms == Spread(185.0, 182.0, 188.0)  # step + drafter, run by run
    assert high.tpot_ms == Spread(82.0, 80.0, 84.0) and high.baseline_tpot_ms == Spread(92.0, 90.0, 94.0)
    assert high.eq13 is None  # no slots in these runs: no prediction
    no_central = costed_points([_costed(central=False)])
    assert no_central[1].ratio == high.ratio and no_central[1].central_ratio is None


def test_a_round_timed_with_its_drafter_is_not_charged_it_twice():
    """Since session 42 the engine's round cost includes the drafter's proposal (`spec_cost_with_draft`):
    the step is the cost less the call, and the round is the cost itself."""
    from dhisparse.bench.plot_costed import costed_points

    res = _costed()
    for r in res["runs"]:
        if r["engine"]:
            r["engine"] = r["engine"] | {"spec_cost_ms_width4": r["engine"]["spec_cost_ms_width4"] + r["engine"]["spec_draft_ms_per_call"],
                                         "spec_cost_with_draft": 1}
    high = costed_points([res])[1]
    assert high.step_ms == Spread(172.0, 170.0, 174.0) and high.round_ms == Spread(185.0, 182.0, 188.0)


def test_each_file_is_divided_by_its_own_baseline(tmp_path):
    from dhisparse.bench.plot_costed import costed_points

    a, b = _costed(), _costed(scale=0.5)
    a["label"], b["label"] = "a", "b"
    pts = costed_points([a, b])
    assert [(p.source, p.line) for p in pts] == [("a", "adaptive+spec [a]")] * 2 + [("b", "adaptive+spec [b]")] * 2
    assert [p.ratio.mean for p in pts] == pytest.approx([0.9, 1.25, 0.9, 1.25])
    assert pts[3].baseline_tok_s == Spread(110.0, 100.0, 120.0)


def test_each_load_is_divided_by_the_baseline_at_that_load():
    from dhisparse.bench.plot_costed import costed_points, is_costed_sweep

    res = _costed()
    res["runs"] += [_run("hisparse", 400.0, 120.0, c=40), _run(_arm(2.88), 500.0, 100.0, c=40)]
    assert is_costed_sweep([res])
    pts = costed_points([res])
    assert [(p.concurrency, p.set_tokens_per_round) for p in pts] == [(20, 2.2), (20, 2.88), (40, 2.88)]
    assert pts[1].ratio.mean == pytest.approx(1.25) and pts[2].ratio.mean == pytest.approx(1.25)
    assert pts[2].baseline_runs == 1 and pts[2].baseline_tpot_ms == Spread(120.0, 120.0, 120.0)


def test_costed_sweep_plots_as_costed_png(tmp_path):
    written = plot_results([_costed()], tmp_path / "a")
    assert [p.name for p in written] == ["costed.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bare = _costed(central=False)
    for r in bare["runs"]:
        r["engine"] = {}  # no round counters: panel (b) falls back to TPOT bars
    assert [p.name for p in plot_results([bare], tmp_path / "b")] == ["costed.png"]
    assert [p.name for p in plot_results([_width_sweep(False)], tmp_path / "c")] == ["widths.png"]
    (tmp_path / "r.json").write_text(json.dumps(_costed()))
    assert main(["plot", str(tmp_path / "r.json"), "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "costed.png").exists()


@pytest.mark.skipif(not S36.exists(), reason="session 36's costed sweep is not in this checkout")
def test_session_36s_costed_sweep_gives_the_benchs_own_ratio(tmp_path):
    from dhisparse.bench.plot_costed import costed_points, is_costed_sweep
    from dhisparse.bench.plot_widths import is_width_sweep

    res = json.loads(S36.read_text())
    assert is_costed_sweep([res]) and not is_width_sweep([res])
    ratios = res["config"]["ratios"]
    for p in costed_points([res]):
        key = f"{_arm(p.set_tokens_per_round)}/hisparse@C20"
        assert p.runs == 2 and p.ratio.mean == pytest.approx(ratios[key], rel=1e-12)
        assert p.central_ratio is not None and p.round_ms.mean > p.step_ms.mean
    assert [p.name for p in plot_results([res], tmp_path)] == ["costed.png", "series.png"]


def test_the_title_names_every_measurement_tool_and_a_non_result():
    """The oracle (costed or not), reference replay and a result marked not to be cited show in the title."""
    from dhisparse.bench.plot_costed import _title, costed_points

    res = _costed()
    plain = _title([res], costed_points([res]))
    assert "costed oracle" in plain and "measurement tool" in plain and "REPLAYED" not in plain and "NOT A" not in plain
    res["config"]["engine"]["replay_reference"] = True
    res["not_a_result"] = "left its reference"
    marked = _title([res], costed_points([res]))
    assert "REPLAYED" in marked and "[NOT A RESULT]" in marked
    res["config"] |= {"gpu": "NVIDIA H100 80GB HBM3", "model": {"name": "m", "overrides": {"n_routed_experts": 12}}}
    stand_in = _title([res], costed_points([res]))
    assert "m (n_routed_experts 12), NVIDIA H100 80GB HBM3" in stand_in  # an H100 stand-in says so


def test_repeat_calls_of_one_setup_pool_each_run_over_its_own_calls_baseline():
    """Separate calls that repeat one setup at one commit (the preset order rotated between them) pool into one
    point a arm; each run is still divided by its own file's baseline. Another commit, or no commit, stays apart.
    Breakages tried (each fails here): dividing by the pooled baselines' mean (165: the 2.88 arm's spread would
    become 0.8-1.73x instead of 1.2-1.3x), pooling files of different commits, pooling files without a commit."""
    from dhisparse.bench.plot_costed import costed_points, setup_of

    a, b = _costed(), _costed(scale=0.5)
    a["commit"] = b["commit"] = "abc"
    assert setup_of(a) == setup_of(b) and setup_of(_costed()) is None
    pts = costed_points([a, b])
    assert [(p.source, p.set_tokens_per_round, p.runs, p.files) for p in pts] == [("", 2.2, 2, 2), ("", 2.88, 4, 2)]
    high = pts[1]
    assert high.ratio.mean == pytest.approx(1.25) and (high.ratio.lo, high.ratio.hi) == (pytest.approx(1.2), pytest.approx(1.3))
    assert high.baseline_runs == 4 and high.baseline_tok_s == Spread(165.0, 100.0, 240.0)
    b["commit"] = "def"
    assert [(p.source, p.files) for p in costed_points([a, b])] == [("0", 1)] * 2 + [("1", 1)] * 2
    c = _costed()
    c["commit"], c["config"]["workload"]["input_len"] = "abc", 32768
    assert len(costed_points([a, c])) == 4  # another workload: another setup


def test_eq13_is_predicted_run_by_run_from_the_slots_and_tpots():
    """With the engines' slots, each arm run's eq. 13 prediction is min(C, b_s) / min(C, b_0) x the baseline's
    mean TPOT over the run's own (below the slot bound at C20 with 21 / 30 slots: the TPOT ratio)."""
    from dhisparse.bench.plot_costed import costed_points

    res = _costed()
    for r in res["runs"]:
        r["engine"] = {**r["engine"], "slots_total": 30 if r["preset"] == "hisparse" else 21}
    high = costed_points([res])[1]
    assert high.eq13.lo == pytest.approx(92.0 / 84.0) and high.eq13.hi == pytest.approx(92.0 / 80.0)
    for r in res["runs"]:
        r["concurrency"] = 40  # above both slot counts: the memory term 21 / 30 enters
    high = costed_points([res])[1]
    assert high.eq13.hi == pytest.approx(0.7 * 92.0 / 80.0)
