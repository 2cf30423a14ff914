"""Figures and tables of issue 31 drawn from result JSONs: Fig. 7 (verification widths against eq. 13's
online policy) and Fig. 9 at several loads with repeats (`dhisparse plot`), Table 2 (`dhisparse table`).

Breakages tried (each fails here): width arms keyed by preset only (every arm one bar: the point's
runs mix widths, its spread is wrong); the online arm's width shares not averaged over its runs
(shares sum past 100%); the budget sweep's points taken from their first run only (the mean and
spread checks fail); Table 2's ratio taken over the baseline's first run instead of its mean (the 1.5x check
fails)."""

from __future__ import annotations

import json

import pytest

from dhisparse.bench.plots import Spread, plot_results
from dhisparse.cli import main

pytest.importorskip("matplotlib")


def _png(path) -> None:
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _files(tmp_path, results: list[dict]) -> list[str]:
    """The results written as JSON files, as `dhisparse plot` / `table` read them."""
    for k, r in enumerate(results):
        (tmp_path / f"r{k}.json").write_text(json.dumps(r))
    return [str(tmp_path / f"r{k}.json") for k in range(len(results))]


def _arm(policy: str, k: int) -> str:
    return f"adaptive+spec@speculative_policy={policy},speculative_num_draft_tokens={k},speculative_oracle_tokens_per_round=3"


def _width_result(c: int, scale: float) -> dict:
    runs = []
    for policy, k, tpr, out in (("fixed", 4, 2.9, 500), ("fixed", 6, 3.5, 480), ("fixed", 8, 3.9, 450),
                                ("online", 8, 3.6, 505)):
        steps = {"spec_steps_width4": 30, "spec_steps_width8": 10} if policy == "online" else {f"spec_steps_width{k}": 40}
        runs.append({"preset": _arm(policy, k), "concurrency": c, "metrics": {"output_tok_s": out * scale * c / 64},
                     "engine": {"spec_tokens_per_round": tpr * scale, **steps}})
    return {"kind": "bench", "runs": runs, "config": {"engine": {"model": "m"}, "workload": {"input_len": 8, "output_len": 8}}}


def test_width_arms_plot_as_fig7_with_spread_and_the_online_widths(tmp_path):
    from dhisparse.bench.plot_widths import is_width_sweep, width_label, width_points

    assert width_label(_arm("fixed", 6)) == "block 6" and width_label(_arm("online", 8)) == "online (K_max 8)"
    assert width_label("adaptive+spec") is None and width_label("adaptive+spec@staging_mode=paper") is None
    results = [_width_result(c, s) for c in (64, 128) for s in (0.9, 1.1)]  # two runs a point
    assert is_width_sweep(results)
    assert not is_width_sweep([{"kind": "bench", "runs": [{"preset": "hisparse", "concurrency": 4, "metrics": {}}]}])
    pts = width_points(results)
    assert [(p.label, p.concurrency) for p in pts][:3] == [("block 4", 64), ("block 4", 128), ("block 6", 64)]
    b6 = next(p for p in pts if p.label == "block 6" and p.concurrency == 128)
    assert b6.runs == 2 and b6.tok_s == Spread(960.0, 864.0, 1056.0)
    assert b6.tokens_per_round.lo == pytest.approx(3.15) and b6.width_share == {6: 1.0}
    online = next(p for p in pts if p.label.startswith("online"))
    assert online.width_share == {4: 0.75, 8: 0.25}
    written = plot_results(results, tmp_path)
    assert written[0].name == "widths.png"
    _png(written[0])


def _budget_result(B: int, c: int, scale: float) -> dict:
    runs = [{"preset": p, "concurrency": c, "metrics": {"output_tok_s": (900 - B / 10 + 50 * k) * scale, "active": c,
                                                         "counters": {"host_fetched_share": 64 / B}}}
            for k, p in enumerate(("hisparse", "adaptive"))]
    return {"kind": "bench", "runs": runs, "config": {"sizing": {"hot_cache_rows": B}}}


def test_budget_sweep_at_two_loads_with_repeats(tmp_path):
    from dhisparse.bench.plot_budget import budget_points, is_budget_sweep

    results = [_budget_result(B, c, s) for B in (2048, 4096, 8192) for c in (16, 128) for s in (0.95, 1.05)]
    assert is_budget_sweep(results)
    lines = budget_points(results)
    assert sorted(lines) == ["adaptive C128", "adaptive C16", "hisparse C128", "hisparse C16"]
    b, tok_s, share, active = lines["hisparse C16"][1]
    assert b == 4096 and tok_s.mean == pytest.approx(490.4) and tok_s.lo == pytest.approx(0.95 * 490.4)
    assert share == Spread(pytest.approx(1.5625), pytest.approx(1.5625), pytest.approx(1.5625)) and active == 16
    assert main(["plot", *_files(tmp_path, results), "--out", str(tmp_path / "fig")]) == 0
    _png(tmp_path / "fig" / "budget.png")


def _served(preset: str, c: int, tok_s: float, active: float, slots: int) -> dict:
    return {"preset": preset, "concurrency": c, "metrics": {
        "output_tok_s": tok_s, "ttft_mean_ms": 4e3, "post_wave_ttft_mean_ms": 2e3, "post_wave_ttft_p99_ms": 9e3,
        "tpot_mean_ms": 40.0, "active": active, "slots": slots}, "requests": []}


def test_table2_gives_the_ratio_to_hisparse_at_each_load_with_the_spread(tmp_path):
    from dhisparse.bench.tables import table2_rows

    res = {"kind": "bench", "config": {"engine": {"model": "m"}, "workload": {"input_len": 100, "output_len": 8}},
           "runs": [_served("adaptive+spec", 128, 780.0, 124.0, 140), _served("hisparse", 128, 500.0, 120.0, 208),
                    _served("hisparse", 128, 540.0, 122.0, 208), _served("adaptive+spec", 128, 780.0, 125.0, 140),
                    _served("adaptive", 256, 800.0, 200.0, 208)]}
    rows = table2_rows([res])
    assert [(r["C"], r["preset"]) for r in rows] == [(128, "hisparse"), (128, "adaptive+spec"), (256, "adaptive")]
    h, spec, a = rows
    assert (h["output_tok_s"], h["output_min"], h["output_max"], h["runs"], h["vs_baseline"]) == (520.0, 500.0, 540.0, 2, 1.0)
    assert spec["vs_baseline"] == pytest.approx(1.5) and (spec["active"], spec["slots"]) == (124.5, 140)
    assert a["vs_baseline"] is None  # no hisparse run at C256
    assert main(["table", *_files(tmp_path, [res]), "--out", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["table_2"][1]["vs_baseline"] == pytest.approx(1.5)
