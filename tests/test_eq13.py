"""Eq. 13's prediction beside the measured ratio (dhisparse/bench/eq13.py, bench/gpu_serving.py's `eq13`).

Breakages tried (each fails here): the memory term without min(C, b) (below the slot bound it would scale the
prediction by b_s / b_0), TPOT_s / TPOT_0 inverted, the baseline taken from another load, a non-speculative
preset given a row."""

from __future__ import annotations

import importlib.util
import pathlib
from types import SimpleNamespace

import pytest

from dhisparse.bench.eq13 import Series, eq13_dicts, eq13_rows, predicted_ratio


def test_below_the_slot_bound_only_the_tpots_decide():
    # C18 with 21 speculative and 30 plain slots: the memory term is 1
    assert predicted_ratio(18, 21, 30, tpot_0=72.7, tpot_s=54.4) == pytest.approx(72.7 / 54.4)


def test_at_the_slot_bound_the_memory_term_enters():
    # C30: 21 of 30 requests decode with speculation
    assert predicted_ratio(30, 21, 30, tpot_0=80.0, tpot_s=60.0) == pytest.approx(0.7 * 80 / 60)
    # between the two bounds: min(C, b) on each side
    assert predicted_ratio(25, 21, 30, tpot_0=80.0, tpot_s=60.0) == pytest.approx(21 / 25 * 80 / 60)


def test_rows_pair_each_speculative_series_with_the_baseline_at_its_load():
    series = [Series("hisparse", 18, 250.0, 72.0, 30), Series("hisparse", 30, 300.0, 90.0, 30),
              Series("adaptive+spec@speculative_oracle_tokens_per_round=2.88", 18, 360.0, 54.0, 21),
              Series("adaptive+spec@speculative_oracle_tokens_per_round=2.88", 30, 290.0, 60.0, 21),
              Series("adaptive", 18, 255.0, 71.0, 30),  # not speculative: no row
              Series("resident+spec", 9, 100.0, 50.0, 9)]  # no baseline at C9: no row
    rows = eq13_rows(series)
    assert [(r.concurrency, r.slots_spec, r.slots_base) for r in rows] == [(18, 21, 30), (30, 21, 30)]
    low, high = rows
    assert low.predicted == pytest.approx(72 / 54) and low.measured == pytest.approx(360 / 250)
    assert high.predicted == pytest.approx(0.7 * 90 / 60) and high.measured == pytest.approx(290 / 300)
    assert eq13_dicts(series)[1]["baseline"] == "hisparse"


def test_a_series_without_tpot_or_slots_gets_no_row():
    series = [Series("hisparse", 18, 250.0, 72.0, None), Series("adaptive+spec", 18, 360.0, 54.0, 21)]
    assert eq13_rows(series) == []
    series = [Series("hisparse", 18, 250.0, 72.0, 30), Series("adaptive+spec", 18, 360.0, None, 21)]
    assert eq13_rows(series) == []


def test_gpu_serving_averages_each_series_before_predicting():
    spec = importlib.util.spec_from_file_location("gpu_serving", pathlib.Path(__file__).parents[1] / "bench" / "gpu_serving.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)

    def run(preset, tok, tpot, slots):
        return SimpleNamespace(preset=preset, concurrency=30, metrics=SimpleNamespace(output_tok_s=tok, tpot_mean_ms=tpot),
                               engine={"slots_total": slots})

    runs = [run("hisparse", 300.0, 90.0, 30), run("hisparse", 320.0, 94.0, 30),
            run("adaptive+spec", 280.0, 60.0, 21), run("adaptive+spec", 300.0, 64.0, 21)]
    (row,) = gs.eq13(runs)
    assert row["tpot_base_ms"] == pytest.approx(92.0) and row["tpot_spec_ms"] == pytest.approx(62.0)
    assert row["predicted"] == pytest.approx(0.7 * 92 / 62) and row["measured"] == pytest.approx(290 / 310)
