"""The central-half output rate (issue 31's steady-state measurement): a window's tokens over
(T/4, 3T/4], without the admission ramp at its start; from the steps, from a result's series (results
written before the metric), in Table 2 and in bench/gpu_serving's spread and ratios."""

from __future__ import annotations

import importlib.util
import pathlib
import types

import pytest

from dhisparse.bench.records import (RequestRecord, RunTrace, StepSample, central_of, central_tok_s,
                                     series_central_tok_s, summarize)
from dhisparse.bench.tables import table2_rows


def _ramp_steps(T: float = 20.0, dt: float = 0.5, ramp_s: float = 4.0, rate: float = 100.0) -> tuple:
    """Steps every dt s: nothing returned during the first ramp_s, then `rate` tokens a second."""
    n = int(T / dt)
    return tuple(StepSample((i + 1) * dt, 1, 1, 0 if (i + 1) * dt <= ramp_s else int(rate * dt)) for i in range(n))


def test_central_rate_leaves_the_ramp_out():
    steps = _ramp_steps()
    # (5, 15]: 20 steps of 50 tokens; the whole window: (20 - 4) s at 100 tok/s over 20 s
    assert central_tok_s(steps, 20.0) == pytest.approx(100.0)
    assert sum(s.tokens for s in steps) / 20.0 == pytest.approx(80.0)
    # the edges: a step at exactly T/4 belongs to the first quarter, one at 3T/4 to the central half
    edge = (StepSample(5.0, 1, 1, 1000), StepSample(15.0, 1, 1, 7), StepSample(15.01, 1, 1, 1000))
    assert central_tok_s(edge, 20.0) == pytest.approx(7 / 10.0)


def test_central_rate_none_without_token_counts():
    assert central_tok_s(tuple(StepSample(t, 1, 1) for t in (1.0, 2.0)), 4.0) is None  # HTTP runs
    assert central_tok_s(_ramp_steps(), 0.0) is None
    assert series_central_tok_s([{"t": 1.0}], 10.0) is None


def test_summarize_records_the_central_rate():
    reqs = (RequestRecord(0, 0, 0.0, 1.0, 2.0, 10, 100, "length"),)
    m = summarize(RunTrace(20.0, 1600, reqs, _ramp_steps(), (), {}), concurrency=1)
    assert m.output_tok_s == pytest.approx(80.0) and m.central_output_tok_s == pytest.approx(100.0)


def test_series_rate_interpolates_the_cumulative_count():
    # generated_tokens is the engine's cumulative count (warm-up tokens included: an offset of 500)
    series = [{"t": t, "generated_tokens": 500 + (0 if t <= 4 else 100 * (t - 4))} for t in range(1, 21)]
    assert series_central_tok_s(series, 20.0) == pytest.approx(100.0)
    # rows every 2 s: 5 and 15 fall between rows, interpolated
    assert series_central_tok_s(series[1::2], 20.0) == pytest.approx(100.0)
    # rows on either side of T/4 and 3T/4 at uneven rates: 100 at 5 s and 1,200 at 15 s, read off the lines
    uneven = [{"t": t, "generated_tokens": g} for t, g in ((4.0, 0), (6.0, 200), (14.0, 1000), (16.0, 1400))]
    assert series_central_tok_s(uneven, 20.0) == pytest.approx(110.0)
    # before the first row and after the last: clamped
    assert series_central_tok_s([{"t": 8.0, "generated_tokens": 0}, {"t": 12.0, "generated_tokens": 40}], 20.0) \
        == pytest.approx(4.0)
    run = {"metrics": {"duration_s": 20.0}, "series": series}
    assert central_of(run) == pytest.approx(100.0)
    run["metrics"]["central_output_tok_s"] = 7.0  # the recorded metric wins
    assert central_of(run) == 7.0


def _run(preset: str, out: float, central: float | None) -> dict:
    return {"preset": preset, "concurrency": 4, "metrics": {"output_tok_s": out, "central_output_tok_s": central,
                                                            "duration_s": 20.0}, "requests": []}


def test_table2_central_columns():
    res = [{"kind": "bench", "config": {}, "runs": [_run("hisparse", 10.0, 20.0), _run("adaptive+spec", 12.0, 26.0),
                                                     _run("adaptive+spec", 14.0, 30.0)]}]
    rows = {r["preset"]: r for r in table2_rows(res)}
    spec = rows["adaptive+spec"]
    assert spec["vs_baseline"] == pytest.approx(1.3) and spec["central_vs_baseline"] == pytest.approx(1.4)
    assert (spec["central_tok_s"], spec["central_min"], spec["central_max"]) == (28.0, 26.0, 30.0)
    res[0]["runs"][0]["metrics"]["central_output_tok_s"] = None  # a baseline without the rate: no ratio
    assert {r["preset"]: r for r in table2_rows(res)}["adaptive+spec"]["central_vs_baseline"] is None


def test_gpu_serving_central_ratios():
    spec = importlib.util.spec_from_file_location("gpu_serving", pathlib.Path(__file__).parents[1] / "bench" / "gpu_serving.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    runs = [types.SimpleNamespace(preset=lab, concurrency=4, engine={}, metrics=types.SimpleNamespace(
        **{k: None for k in gs.METRICS}, counters={}) ) for lab in ("hisparse", "adaptive+spec", "adaptive+spec")]
    for r, (out, cen) in zip(runs, ((10.0, 20.0), (12.0, 26.0), (14.0, 30.0))):
        r.metrics.output_tok_s, r.metrics.central_output_tok_s = out, cen
    rows, ratios, spread = gs.summarize(runs, [4])
    assert ratios["adaptive+spec/hisparse@C4"] == pytest.approx(1.3)
    assert ratios["central:adaptive+spec/hisparse@C4"] == pytest.approx(1.4)
    sp = {d["preset"]: d for d in spread}["adaptive+spec"]
    assert (sp["central_mean_tok_s"], sp["central_min_tok_s"], sp["central_max_tok_s"]) == (28.0, 26.0, 30.0)
    assert rows[1]["central_output_tok_s"] == 26.0


def test_gpu_serving_ratios_cover_every_preset_of_fig4():
    """Fig. 4's five presets at one load: each against hisparse, and adaptive and resident+spec against resident."""
    spec = importlib.util.spec_from_file_location("gpu_serving", pathlib.Path(__file__).parents[1] / "bench" / "gpu_serving.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    by = {("hisparse", 4): 10.0, ("adaptive", 4): 11.0, ("adaptive+spec", 4): 15.0, ("resident", 4): 5.0,
          ("resident+spec", 4): 6.0}
    r = gs._ratios(by, [4], [""])
    assert r == pytest.approx({"adaptive/hisparse@C4": 1.1, "adaptive+spec/hisparse@C4": 1.5, "resident/hisparse@C4": 0.5,
                               "resident+spec/hisparse@C4": 0.6, "adaptive/resident@C4": 2.2,
                               "resident+spec/resident@C4": 1.2})
