"""Closed-loop bench, load step and plots at CI size (built-in tiny model on CPU)."""

from __future__ import annotations

import json
import time
import types

import matplotlib.image as mpimg
import pytest
import torch

from dhisparse.bench.loadstep import default_arms, unavailable_arms
from dhisparse.bench.plot_resolver import fit_bandwidth, plot_resolver
from dhisparse.bench.plots import plot_loadstep, plot_results, plot_serving
from dhisparse.bench.records import RequestRecord, RunTrace, StepSample, percentile, summarize
from dhisparse.engine.series import SeriesRecorder
from dhisparse.bench.workload import Phase, Phases, Workload
from dhisparse.cli import main
from dhisparse.engine.config import AVAILABLE_PRESETS, PRESETS

METRICS = ("output_tok_s", "ttft_mean_ms", "ttft_p99_ms", "post_wave_ttft_mean_ms", "post_wave_ttft_p99_ms",
           "tpot_mean_ms", "tpot_p99_ms", "active", "slots", "counters")
SMALL = ["--device", "cpu", "--input-len", "48", "--output-len", "6", "--no-progress", "--kv-pool-bytes", str(32 << 20)]


def assert_png(path) -> None:
    img = mpimg.imread(path)
    assert img.shape[0] > 300 and img.shape[1] > 500
    assert img[..., :3].std() > 0.05  # not blank


def test_bench_cli_writes_json_table_and_png(tmp_path, capsys):
    out, figs = tmp_path / "bench.json", tmp_path / "figs"
    rc = main(["bench", *SMALL, "--concurrency", "1,2", "--num-requests", "4", "--presets", AVAILABLE_PRESETS[0],
               "--out", str(out), "--plot", str(figs)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "bench" and data["schema_version"] == 1
    assert {"date", "command", "machine", "config", "runs", "unavailable_presets"} <= set(data)
    assert "bench" in data["command"] and data["machine"]["cpu_count"] >= 1
    assert [r["concurrency"] for r in data["runs"]] == [1, 2]
    for run in data["runs"]:
        m = run["metrics"]
        assert set(METRICS) <= set(m)
        assert m["requests_completed"] == 4 and m["output_tokens"] == 24 and m["output_tok_s"] > 0
        assert m["slots"] == run["concurrency"] and m["tpot_mean_ms"] > 0
        assert len(run["requests"]) == 4 and run["series"] is not None
        assert "kv_pages_total" in run["engine"]
    assert data["unavailable_presets"] == [p for p in PRESETS if p not in AVAILABLE_PRESETS]
    assert "out tok/s" in capsys.readouterr().out
    assert_png(figs / "serving.png")


def test_bench_duration_mode_counts_window_tokens(tmp_path):
    out = tmp_path / "b.json"
    assert main(["bench", *SMALL, "--concurrency", "2", "--duration", "1.0", "--sample-interval", "0.25",
                 "--presets", AVAILABLE_PRESETS[0], "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["metrics"]["duration_s"] == pytest.approx(1.0)
    assert run["metrics"]["requests_completed"] >= 2 and len(run["series"]) >= 3
    assert {"t", "output_tok_s", "running", "kv_pages_used"} <= set(run["series"][0])


def test_staggered_starts_spread_the_first_requests():
    """--stagger (issue 31 item 4): client k's first request is capped at ceil(L (k + 1) / C) tokens,
    every later one at L, so requests complete from early on instead of as one wave. (Breakage
    tried: every request staggered, not only the first: caught by the later requests' lengths.)"""
    w = Workload(input_len=8, output_len=10, duration_s=1.0, stagger=True)
    assert [w.max_tokens_for(k, True, 4) for k in range(4)] == [3, 5, 8, 10]
    assert w.max_tokens_for(0, False, 4) == 10 and Workload(input_len=8, output_len=10).max_tokens_for(0, True, 4) == 10
    import tempfile
    from pathlib import Path

    out = Path(tempfile.mkdtemp()) / "b.json"
    assert main(["bench", *SMALL, "--concurrency", "3", "--num-requests", "6", "--output-len", "9", "--stagger",
                 "--presets", AVAILABLE_PRESETS[0], "--out", str(out)]) == 0
    reqs = sorted(json.loads(out.read_text())["runs"][0]["requests"], key=lambda r: r["index"])
    assert [(r["client"], r["output_len"]) for r in reqs[:3]] == [(0, 3), (1, 6), (2, 9)]  # each client's first
    assert [r["output_len"] for r in reqs[3:]] == [9, 9, 9]


def test_loadstep_cli_phases_and_figure(tmp_path):
    out, figs = tmp_path / "ls.json", tmp_path / "figs"
    assert main(["loadstep", *SMALL, "--c-low", "1", "--c-high", "3", "--low-duration", "0.6", "--high-duration", "0.8",
                 "--sample-interval", "0.2", "--out", str(out), "--plot", str(figs)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "loadstep" and data["config"]["arms"] == default_arms()
    assert data["config"]["unavailable_arms"] == unavailable_arms()
    run = data["runs"][0]
    assert [p["concurrency"] for p in run["phases"]] == [1, 3, 1]
    assert [(p["start_s"], p["end_s"]) for p in run["phases"]] == [(0, 0.6), (0.6, 1.4), (1.4, 2.0)]
    assert {"requests", "output_tok_s", "ttft_mean_ms", "tpot_mean_ms", "slots_max", "host_fetched_share"} <= set(run["phases"][0])
    assert 1 <= max(s["running"] for s in run["series"]) <= 3 and run["metrics"]["requests_submitted"] >= 1
    assert_png(figs / "loadstep.png")


def test_unavailable_preset_is_a_clear_error(capsys):
    missing = [p for p in PRESETS if p not in AVAILABLE_PRESETS]
    if not missing:
        pytest.skip("every preset is available")
    assert main(["bench", *SMALL, "--presets", missing[0], "--num-requests", "1"]) == 2
    assert "not available" in capsys.readouterr().err


def _trace(ttfts: list[float]) -> RunTrace:
    reqs = tuple(RequestRecord(i, i % 2, float(i), i + t, i + t + 0.9, 10, 100, "length") for i, t in enumerate(ttfts))
    steps = tuple(StepSample(t / 10, 2 if 2.5 <= t / 10 <= 7.5 else 0, 2) for t in range(100))
    return RunTrace(10.0, 40, reqs, steps, (), {"host_fetched_share": 0.25})


def test_summarize_post_wave_active_and_percentiles():
    m = summarize(_trace([5.0, 5.0, 1.0, 1.0]), concurrency=2)
    assert m.ttft_mean_ms == pytest.approx(3000) and m.post_wave_ttft_mean_ms == pytest.approx(1000)
    assert m.tpot_mean_ms == pytest.approx(100) and m.active == pytest.approx(2.0) and m.slots == 2
    assert m.output_tok_s == pytest.approx(4.0) and m.counters == {"host_fetched_share": 0.25}
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5) and percentile([], 99) is None


def test_phases_and_workload_validation():
    ph = Phases((Phase(1, 2.0, "a"), Phase(4, 3.0, "b"), Phase(1, 2.0, "c")))
    assert [ph.target(t) for t in (0, 1.9, 2.0, 4.9, 5.0, 99)] == [1, 1, 4, 4, 1, 1]
    assert ph.total_s == 7.0 and ph.max_concurrency == 4
    with pytest.raises(ValueError, match="exactly one"):
        Workload(duration_s=None, num_requests=None)
    with pytest.raises(ValueError, match="concurrency"):
        Phases((Phase(0, 1.0),))


def _bench_result(presets: list[str]) -> dict:
    runs = []
    for k, p in enumerate(presets):
        for c in (1, 4, 16, 64):
            tput = 100 * c ** 0.8 * (1 + 0.2 * k)
            runs.append({"preset": p, "concurrency": c, "metrics": {"output_tok_s": tput, "ttft_mean_ms": 50 * c ** 1.3,
                                                                    "tpot_mean_ms": 20 + c / (1 + k)}})
    return {"kind": "bench", "runs": runs, "config": {"engine": {"model": "synthetic"},
                                                      "workload": {"input_len": 100000, "output_len": 2048}}}


def test_plots_on_synthetic_data(tmp_path):
    assert_png(plot_serving([_bench_result(["hisparse", "adaptive", "adaptive+spec"])], tmp_path / "s.png"))
    t = [0.5 * i for i in range(60)]
    series = [{"t": x, "running": 4 if 10 <= x < 20 else 1, "coverage": 0.0 if 10 <= x < 22 else 0.9,
               "host_fetched_share": 0.14 if 10 <= x < 20 else 0.014} for x in t]
    run = {"preset": "adaptive", "series": series, "phases": [
        {"name": "C1 before", "start_s": 0, "end_s": 10}, {"name": "C4", "start_s": 10, "end_s": 20},
        {"name": "C1 after", "start_s": 20, "end_s": 30}]}
    off = dict(run, preset="hisparse", series=[dict(r, coverage=0.0) for r in series])
    assert_png(plot_loadstep({"kind": "loadstep", "runs": [run, off]}, tmp_path / "l.png"))


def test_many_lines_share_one_legend_below_the_panels(tmp_path, monkeypatch):
    """Up to LEGEND_IN_PANELS lines: a legend in each panel; more (files that are not one sweep, labelled per file):
    one figure legend with every line, and none in the panels."""
    from dhisparse.bench import plots

    seen = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, out: seen.append(fig) or out)
    plot_serving([_bench_result(["hisparse", "adaptive", "adaptive+spec"])], tmp_path / "few.png")
    many = [dict(_bench_result([f"p{i}" for i in range(4)]), label=f"file{j}", commit=f"c{j}") for j in range(3)]
    plot_serving(many, tmp_path / "many.png")
    few, lots = seen
    assert all(ax.get_legend() is not None for ax in few.axes) and not few.legends
    assert all(ax.get_legend() is None for ax in lots.axes)
    (leg,) = lots.legends
    assert len(leg.get_texts()) == 12 and {t.get_text() for t in leg.get_texts()} >= {"p0 [file0]", "p3 [file2]"}
    # a line that is no preset (an arm) never takes a preset's color, whatever its index
    assert {plots.color_of(f"adaptive+spec@w=4 [f{i}]", i) for i in range(12)}.isdisjoint(plots.STYLE.values())
    assert plots.color_of("hisparse [f3]", 7) == plots.STYLE["hisparse"]


def test_repeated_runs_of_a_point_plot_as_their_mean_and_spread(tmp_path):
    """Three rotated runs a (preset, C) point: one point at the mean, bars from min to max; a run
    without a TTFT (nothing finished in its window) is left out of that metric only."""
    from dhisparse.bench.plots import Spread, serving_points

    res = _bench_result(["hisparse", "adaptive+spec"])
    runs = []
    for k, scale in enumerate((0.9, 1.0, 1.2)):
        for r in res["runs"]:
            m = dict(r["metrics"], output_tok_s=r["metrics"]["output_tok_s"] * scale)
            if k == 2 and r["concurrency"] == 64:
                m["ttft_mean_ms"] = None
            runs.append(dict(r, metrics=m))
    pts = serving_points([r for r in runs if r["preset"] == "hisparse"])
    assert [(p.concurrency, p.runs) for p in pts] == [(1, 3), (4, 3), (16, 3), (64, 3)]
    want = 100 * 16 ** 0.8
    assert pts[2].tok_s.mean == pytest.approx(want * 3.1 / 3) and pts[2].tok_s.bar() == pytest.approx(
        (want * (3.1 / 3 - 0.9), want * (1.2 - 3.1 / 3)))
    assert pts[3].ttft_ms == Spread(50 * 64 ** 1.3, 50 * 64 ** 1.3, 50 * 64 ** 1.3)
    assert Spread.of([None, None]) is None
    assert_png(plot_serving([dict(res, runs=runs)], tmp_path / "r.png"))


def test_pieces_of_one_sweep_join_into_one_line_per_preset():
    from dhisparse.bench.plots import _lines

    full = _bench_result(["hisparse", "adaptive"])
    lo = dict(full, label="lo", runs=[r for r in full["runs"] if r["concurrency"] < 16])
    hi = dict(full, label="hi", runs=[r for r in full["runs"] if r["concurrency"] >= 16])
    hi["config"] = dict(full["config"], workload=dict(full["config"]["workload"], duration_s=20.0))
    joined = _lines([lo, hi])
    assert sorted(joined) == ["adaptive", "hisparse"]
    assert [r["concurrency"] for r in joined["hisparse"]] == [1, 4, 16, 64]
    # the same point twice, or another workload: one line per file
    assert len(_lines([full, dict(full, label="again")])) == 4
    other = dict(hi, config=dict(full["config"], workload={"input_len": 32768, "output_len": 2048}))
    assert "hisparse [hi]" in _lines([lo, other])


def test_repeat_calls_of_one_setup_pool_into_one_line_with_spread():
    """Files of separate calls that repeat one setup at one commit (`setup_of`) join: a point measured in each
    is one point of their runs (mean, min-max). Another commit, or a file without one, keeps its own line."""
    from dhisparse.bench.plots import _lines, serving_points

    full = dict(_bench_result(["hisparse", "adaptive"]), commit="abc1234")
    again = dict(full, label="again", runs=[dict(r, metrics=dict(r["metrics"], output_tok_s=2 * r["metrics"]["output_tok_s"]))
                                            for r in full["runs"]])
    pooled = _lines([full, again])
    assert sorted(pooled) == ["adaptive", "hisparse"]
    pt = serving_points(pooled["hisparse"])[0]
    first = min(r["metrics"]["output_tok_s"] for r in full["runs"] if r["preset"] == "hisparse" and r["concurrency"] == pt.concurrency)
    assert pt.runs == 2 * sum(1 for r in full["runs"] if r["preset"] == "hisparse" and r["concurrency"] == pt.concurrency)
    assert pt.tok_s.lo == pytest.approx(first) and pt.tok_s.hi > pt.tok_s.mean > pt.tok_s.lo
    assert len(_lines([full, dict(again, commit="def5678")])) == 4
    assert len(_lines([full, dict(again, commit=None)])) == 4
    assert len(_lines([dict(full, commit=None), dict(again, commit=None)])) == 4  # no commit: no setup to share


def test_the_serving_title_names_the_model_overrides_and_the_gpu():
    from dhisparse.bench.plots import _serving_title

    res = _bench_result(["hisparse"])
    res["config"] = dict(res["config"], model={"overrides": {"n_routed_experts": 12}}, gpu="NVIDIA H100 80GB HBM3")
    t = _serving_title([res])
    assert "(n_routed_experts 12)" in t and "NVIDIA H100 80GB HBM3" in t


def test_series_plot_needs_a_series_and_draws_one_column_per_concurrency(tmp_path):
    from dhisparse.bench.plot_series import has_series, plot_series

    res = _bench_result(["hisparse", "adaptive+spec"])
    assert not has_series(res)  # the synthetic runs carry no per-interval rows
    for run in res["runs"]:
        c = run["concurrency"]
        run["series"] = [{"t": float(t), "output_tok_s": 50.0 * c if t > 3 else 0.0,
                          "decoding": c if t > 3 else t} for t in range(1, 12)]
    assert has_series(res)
    assert_png(plot_series(res, tmp_path / "series.png", {"hisparse": "tab:blue"}))
    written = plot_results([res], tmp_path / "all")  # the CLI's entry point draws it beside serving.png
    assert [p.name for p in written] == ["serving.png", "series.png"]
    with pytest.raises(ValueError, match="no runs"):
        plot_series({"runs": []}, tmp_path / "none.png", {})


def test_resolver_plot_and_bandwidth_fit(tmp_path):
    gbps, base_ms = 50.0, 0.2
    recs = [{"case": case, "miss_bytes": mb * 1e6, "time_ms": base_ms + mb * 1e6 / (gbps * 1e9) * 1e3 * (1 + 0.01 * r)}
            for case, sizes in (("shared", (4, 38)), ("partial", (75, 150)), ("disjoint", (302,)))
            for mb in sizes for r in range(-1, 2)]
    a, fit, r2 = fit_bandwidth([r["miss_bytes"] for r in recs], [r["time_ms"] for r in recs])
    assert fit == pytest.approx(gbps, rel=0.02) and a == pytest.approx(base_ms, abs=0.1) and r2 > 0.99
    assert_png(plot_resolver(recs, tmp_path / "r.png"))
    with pytest.raises(ValueError, match="no records"):
        plot_resolver([], tmp_path / "empty.png")


def test_series_interval_share_from_raw_counters():
    rec = SeriesRecorder(1.0)
    rec.observe(1.0, 5, 1, {"host_selected_rows": 10, "selected_rows": 100, "host_fetched_share": 0.1, "running": 1})
    rec.observe(1.5, 5, 1, {})
    rec.observe(2.0, 5, 2, {"host_selected_rows": 60, "selected_rows": 200, "host_fetched_share": 0.3, "running": 2})
    first, second = rec.rows
    assert first["host_fetched_share"] == 0.1 and second["host_fetched_share"] == pytest.approx(0.5)
    assert second["output_tok_s"] == pytest.approx(10.0) and second["decoding"] == pytest.approx(1.5)


def test_step_profile_plot_splits_the_step(tmp_path):
    """Fig. 10: each run's bar is its alone families + overlap + idle = the profiled step; runs
    without kernel data (CPU) are skipped, and a result with none of them is refused."""
    from dhisparse.bench.plot_profile import IDLE, OVERLAP, plot_profile, step_bars
    from dhisparse.bench.plots import plot_results

    kern = {"profiled_wall_ms_per_step": 40.0, "busy_ms": 25.0, "overlap_ms": 3.0,
            "alone_ms": {"gemm": 10.0, "cache copy": 4.0, "attention": 8.0}}
    res = {"kind": "step_profile", "config": {"model": "m"},
           "runs": [{"preset": "hisparse", "cuda_graphs": "auto", "C": 24, "wall_ms_median": 30.0, "kernels": kern},
                    {"preset": "resident", "C": 4, "wall_ms_median": 9.0, "kernels": {}}]}
    (bar,) = step_bars(res)
    assert [n for n, _ in bar.segments] == ["gemm", "attention", "cache copy", OVERLAP, IDLE]
    assert sum(ms for _, ms in bar.segments) == pytest.approx(40.0) and bar.label == "hisparse C24 [auto]"
    assert_png(plot_profile(res, tmp_path / "p.png"))
    assert [p.name for p in plot_results([res], tmp_path)] == ["step_profile.png"]
    with pytest.raises(ValueError, match="no kernel data"):
        plot_profile({"kind": "step_profile", "runs": res["runs"][1:]}, tmp_path / "none.png")


def test_blocked_clock_times_device_reads_and_restores_them():
    """step_profile's unprofiled host time = step time minus the time blocked in tolist / item."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("step_profile", pathlib.Path(__file__).parents[1] / "bench" / "step_profile.py")
    sp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sp)
    import torch

    before = torch.Tensor.tolist, torch.Tensor.item
    with sp.BlockedClock() as clock:
        assert torch.arange(3).tolist() == [0, 1, 2] and torch.tensor(4).item() == 4
    assert clock.blocked > 0
    assert (torch.Tensor.tolist, torch.Tensor.item) == before


def test_gpu_serving_engine_args_are_typed_from_the_config():
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("gpu_serving", pathlib.Path(__file__).parents[1] / "bench" / "gpu_serving.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    got = gs.engine_overrides(["backup_ahead_pages=128", "copy_stream=compute", "debug_checks=true", "hot_cache_rows=none",
                               "fp8_activations=none"])
    assert got == {"backup_ahead_pages": 128, "copy_stream": "compute", "debug_checks": True, "hot_cache_rows": None,
                   "fp8_activations": "none"}  # a string field's 'none' is its value
    with pytest.raises(SystemExit, match="backup_ahead_pages"):
        gs.engine_overrides(["backup_ahed_pages=1"])


def test_gpu_serving_arms_rotate_and_apply_their_settings():
    """--arms / --repeats: every (preset, arm) runs once a repeat, repeat r starts at arm r mod n and
    at preset r mod m, each arm's settings reach its engine config, and a bad arm fails before any
    model is built."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("gpu_serving", pathlib.Path(__file__).parents[1] / "bench" / "gpu_serving.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    ns = gs.parse(["--quick", "--presets", "hisparse,adaptive", "--arms", "staging_mode=paper;staging_mode=single",
                   "--repeats", "2"])
    order = [(p, a.split("=")[1]) for _, p, a in gs.schedule(ns)]
    assert order == [("hisparse", "paper"), ("adaptive", "paper"), ("hisparse", "single"), ("adaptive", "single"),
                     ("adaptive", "single"), ("hisparse", "single"), ("adaptive", "paper"), ("hisparse", "paper")]
    sz = gs.sizing(ns, gs.model_config(ns.model))
    assert gs.engine_config(ns, sz, "adaptive", "staging_mode=single").staging_mode == "single"
    assert gs.label("adaptive", "staging_mode=single") == "adaptive@staging_mode=single" and gs.label("adaptive", "") == "adaptive"
    with pytest.raises(SystemExit, match="staging_mod"):
        gs.parse(["--quick", "--arms", "staging_mod=paper"])
    # --arm-presets: the armed preset once per arm, the others once a round as a shared baseline; rotated
    ns = gs.parse(["--quick", "--presets", "hisparse,adaptive+spec", "--arms", "seed=1;seed=2", "--arm-presets", "adaptive+spec",
                   "--repeats", "2"])
    assert [(p, a) for _, p, a in gs.schedule(ns)] == [
        ("hisparse", ""), ("adaptive+spec", "seed=1"), ("adaptive+spec", "seed=2"),
        ("adaptive+spec", "seed=1"), ("adaptive+spec", "seed=2"), ("hisparse", "")]
    for bad in (["--arm-presets", "adaptive+spec"], ["--arms", "seed=1", "--arm-presets", "resident"]):
        with pytest.raises(SystemExit):
            gs.parse(["--quick", "--presets", "hisparse,adaptive+spec", *bad])
    runs = [types.SimpleNamespace(preset=lab, concurrency=4, metrics=types.SimpleNamespace(
        output_tok_s=v, **{k: None for k in gs.METRICS if k != "output_tok_s"}, counters={}), engine={})
        for lab, v in (("hisparse", 10.0), ("adaptive+spec@seed=1", 15.0), ("adaptive+spec@seed=2", 12.0))]
    _, ratios, _ = gs.summarize(runs, [4], ns.arm_list)
    assert ratios["adaptive+spec@seed=1/hisparse@C4"] == 1.5 and ratios["adaptive+spec@seed=2/hisparse@C4"] == 1.2


def test_gpu_serving_charges_speculation_for_its_memory():
    """--charge-spec-memory (issue 31 item 2): the +spec presets' pool + drafter weights + ring equals
    the others' pool, and their slots each also hold a staging share, so fewer fit."""
    import importlib.util
    import pathlib

    from dhisparse.bench.sweep import load_shared_model

    spec = importlib.util.spec_from_file_location("gpu_serving", pathlib.Path(__file__).parents[1] / "bench" / "gpu_serving.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    ns = gs.parse(["--quick", "--charge-spec-memory", "--engine-arg", "speculative_oracle_drafter=dflash2",
                   "--engine-arg", "speculative_draft_window_size=16"])
    ns.resident_fit, ns.admit_factor, ns.host_pool_gib = 40, 10.0, 1.0
    cfg = gs.model_config(ns.model)
    sz = gs.sizing(ns, cfg)
    loaded = load_shared_model(gs.EngineConfig(model=ns.model, device=ns.device, dtype=ns.dtype))
    ch = gs.spec_charge(ns, sz, cfg, loaded, {})
    assert ch["drafter_weight_bytes"] > 0 and ch["drafter_ring_bytes_per_slot"] > 0 and ch["staging_bytes_per_slot"] > 0
    S = ch["max_running_requests"]
    assert ch["kv_pool_bytes"] + ch["drafter_weight_bytes"] + S * ch["drafter_ring_bytes_per_slot"] == sz["kv_pool_bytes"]
    assert 1 <= S < sz["max_running_requests"]
    per_slot = sz["hierarchy_required_pages_per_request"] * sz["page_bytes"] + ch["staging_bytes_per_slot"]
    assert S * per_slot <= ch["kv_pool_bytes"]  # the charged pool holds S sessions and their staging
    sz["spec_charged"] = ch
    charged, plain = gs.engine_config(ns, sz, "adaptive+spec"), gs.engine_config(ns, sz, "adaptive")
    assert (charged.kv_pool_bytes, charged.max_running_requests) == (ch["kv_pool_bytes"], S)
    assert (plain.kv_pool_bytes, plain.max_running_requests) == (sz["kv_pool_bytes"], sz["max_running_requests"])


def test_budget_sweep_plot(tmp_path):
    """Bench results of one concurrency at different hot-cache sizes plot as Fig. 9; results of a
    concurrency sweep (or one file) stay serving curves."""
    from dhisparse.bench.plot_budget import is_budget_sweep
    from dhisparse.bench.plots import plot_results

    def at(B: int) -> dict:
        runs = [{"preset": p, "concurrency": 36, "metrics": {"output_tok_s": 900 - B / 10 + 50 * k, "active": 36,
                                                             "counters": {"host_fetched_share": 64 / B}}}
                for k, p in enumerate(("hisparse", "adaptive"))]
        return {"kind": "bench", "runs": runs, "config": {"sizing": {"hot_cache_rows": B}}}

    sweep = [at(B) for B in (512, 1024, 2048)]
    assert is_budget_sweep(sweep) and not is_budget_sweep(sweep[:1])
    assert not is_budget_sweep([_bench_result(["hisparse"]), _bench_result(["adaptive"])])  # no B recorded
    written = plot_results(sweep, tmp_path)
    assert [p.name for p in written] == ["budget.png"]
    assert_png(written[0])


def test_phase_clock_splits_a_step_and_removes_its_wrappers():
    """The step profile's host phases: every phase reported, exclusive times that add up to at
    most the step, and the engine's and torch's methods restored afterwards."""
    import importlib.util
    import pathlib
    import time

    import torch

    spec = importlib.util.spec_from_file_location("host_phases", pathlib.Path(__file__).parents[1] / "bench" / "host_phases.py")
    hp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hp)
    from dhisparse import SamplingParams
    from dhisparse.engine.llm import LLM

    eng = LLM("tiny", preset="adaptive", speculative_algorithm="ngram", speculative_num_draft_tokens=3).engine
    for i in range(3):
        eng.add_request([3 + (i + j) % 7 for j in range(20)], SamplingParams(max_tokens=12, ignore_eos=True))
    before = torch.Tensor.tolist, torch.Tensor.item
    t0 = time.perf_counter()
    ph = hp.phase_steps(eng, 4, lambda: None)
    wall_ms = (time.perf_counter() - t0) * 1e3 / 4
    assert set(hp.BEFORE + hp.OVERLAP + hp.AFTER) | {"blocked"} <= set(ph) and min(ph.values()) >= 0
    assert ph["launch"] > 0 and ph["expand"] > 0 and ph["other"] > 0
    assert ph["before_launch"] + ph["overlap"] + ph["blocked"] + ph["after_sync"] <= wall_ms * 1.01
    assert not {"_forward", "_step", "_sample"} & set(vars(eng)) and "schedule" not in vars(eng.scheduler)
    assert (torch.Tensor.tolist, torch.Tensor.item) == before


def test_bench_timing_resets_an_input_before_each_timed_call():
    """bench/kernel_bench.py's `timed` (mla_tune_bench.py, attention_replay.py, stage_overflow_bench.py): warm-up
    calls, then reps timed calls, each after `reset()`; so a call that changes its own input is timed on the same input every time."""
    from bench.kernel_bench import Timing, timed

    x, seen = torch.zeros(1), []

    def fn():
        seen.append(float(x))
        x.add_(1)

    assert timed(fn, Timing(warmup=2, reps=3, graph=0), False, reset=lambda: x.zero_()) >= 0
    assert seen == [0.0, 1.0, 0.0, 0.0, 0.0]
    seen.clear()
    x.zero_()
    timed(fn, Timing(warmup=0, reps=2, graph=0), False)  # no reset: the input runs on
    assert seen == [0.0, 1.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke test of the bench script under the Triton interpreter; on a GPU the bench itself runs")
def test_mla_tune_bench_quick_reports_ratios_against_the_default_plan(tmp_path):
    import json

    from bench import mla_tune_bench
    from dhisparse.kernels.backend import DEFAULT_SPLIT_ROWS as n

    out = tmp_path / "mla.json"
    assert mla_tune_bench.main(["--quick", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    # the shipped default plan (its split is above the quick k = 40, so unsplit) first, then the sweep
    assert [(r["tokens"], r["split_rows"]) for r in runs] == [(2, n), (2, 0), (2, 16), (3, n), (3, 0), (3, 16)]
    assert [r["vs_default"] for r in runs if r["split_rows"] == n] == [1.0, 1.0]
    assert all(r["max_abs_diff_vs_default"] < 1e-4 for r in runs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke test of the bench script under the Triton interpreter; on a GPU the bench itself runs")
def test_mla_tune_bench_sweeps_head_blocks_and_scale_paths_on_fp8_rows(tmp_path):
    """FP8 rows of the 656-B layout (at the quick shape): every head block and scale path is timed
    against the shipped plan and agrees with it (fold rounds differently, within the tolerance)."""
    import json

    from bench import mla_tune_bench

    out = tmp_path / "mla.json"
    argv = ["--quick", "--kv-cache-dtype", "fp8_e4m3", "--block-h", "4,16", "--scales", "fold", "--tokens", "3",
            "--out", str(out)]
    assert mla_tune_bench.main(argv) == 0
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert doc["config"]["row_bytes"] == 32 + 4 + 8 * 2  # 32 e4m3 values, one fp32 scale, 8 bf16 rope values
    seen = {(r["block_h"], r["split_rows"], r["scales"]) for r in runs}
    assert {(16, 0, "default"), (16, 16, "fold"), (16, 0, "fold")} <= seen and runs[0]["vs_default"] == 1.0
    assert all(r["max_abs_diff_vs_default"] < 1e-2 for r in runs)


def test_attention_replay_describes_and_varies_the_recorded_locations():
    """describe: empty / staging shares and distinct locations per request; variants keep each
    token's valid locations (sorted: same set, ascending, -1 last; one_space: staging folded into
    the first space)."""
    import torch

    from bench.attention_replay import describe, variants
    from dhisparse.core.rows import SPACE

    loc = torch.tensor([[5, 3, -1], [3, 5, SPACE + 1], [7, -1, -1], [7, 8, 9]])
    d = describe(loc, per_request=2)
    assert (d["T"], d["k"]) == (4, 3) and d["empty_share"] == 3 / 12 and d["staging_share"] == 1 / 9
    assert d["distinct_share_per_request"] == (3 + 3) / 9  # {3, 5, S+1} and {7, 8, 9}
    rows = (torch.zeros(2, 4, 8), torch.zeros(1, 4, 8))
    v = variants(None, None, rows, loc)
    assert v["sorted"][1].tolist() == [[3, 5, -1], [3, 5, SPACE + 1], [7, -1, -1], [7, 8, 9]]
    assert v["one_space"][0] is rows[0] and v["one_space"][1][1].tolist() == [3, 5, 1]
    assert v["random"][1].shape == loc.shape and int(v["random"][1].max()) < 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke test of the bench script under the Triton interpreter; on a GPU the bench itself runs")
def test_step_profile_attention_replay_on_cpu(tmp_path, monkeypatch):
    import json

    from bench import step_profile

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "sp.json"
    assert step_profile.main(["--quick", "--presets", "adaptive+spec", "--drafter", "oracle", "--cuda-graphs", "none",
                              "--attention-replay", "1", "--out", str(out)]) == 0
    (rec,) = json.loads(out.read_text())["runs"][0]["attention_replay"]
    assert rec["T"] == 4 * 4 and 0 < rec["distinct_share_per_request"] <= 1
    assert {"engine", "sorted", "one_space", "random"} <= set(rec["ms"]) and all(v > 0 for v in rec["ms"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke test of the bench script under the Triton interpreter; on a GPU the bench itself runs")
def test_step_profile_engine_args_cost_the_drafter(tmp_path, monkeypatch):
    """--engine-arg reaches the engine: with the costed oracle the round runs (and holds) the drafter
    network, so the profile prices its kernels; without it no drafter weights are held. A bad name is
    refused before anything is built."""
    import json

    from bench import step_profile

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    held = {}
    for extra in ([], ["--engine-arg", "speculative_oracle_drafter=dflash"]):
        out = tmp_path / f"sp{len(extra)}.json"
        assert step_profile.main(["--quick", "--presets", "adaptive+spec", "--drafter", "oracle", "--cuda-graphs", "none",
                                  "--steps", "2", "--warmup", "1", *extra, "--out", str(out)]) == 0
        c = json.loads(out.read_text())["runs"][0]["counters"]
        held[len(extra)] = c.get("drafter_weight_bytes", 0)
        assert c["spec_draft_calls"] > 0
    assert held[0] == 0 and held[2] > 0
    with pytest.raises(SystemExit, match="speculative_oracle_drafterr"):
        step_profile.engine_config(step_profile.parse(["--quick", "--engine-arg", "speculative_oracle_drafterr=x"]),
                                   "adaptive+spec")


def test_step_profile_keeps_the_presets_it_finished(tmp_path, monkeypatch):
    """The profile's JSON is rewritten after each preset: a call stopped during the second still has the first
    (`complete` False), and a finished call says `complete` True. (Breakage tried: writing only at the end.)"""
    import json

    from bench import step_profile

    fake = {"wall_ms_median": 1.0, "host_unprofiled_ms_median": 0.1, "host_unprofiled_share": 0.1, "host_top": [],
            "sync_sites": {}, "kernels": {}}
    calls = []

    def one(ns, loaded, prefixes, preset, graphs):
        calls.append(preset)
        if preset == "adaptive":
            raise KeyboardInterrupt("the call's limit")
        return dict(fake, preset=preset)

    monkeypatch.setattr(step_profile, "load_model", lambda ns: None)
    monkeypatch.setattr(step_profile, "one_preset", one)
    out = tmp_path / "sp.json"
    args = ["--quick", "--device", "cpu", "--cuda-graphs", "none", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        step_profile.main([*args, "--presets", "hisparse,adaptive"])
    doc = json.loads(out.read_text())
    assert [r["preset"] for r in doc["runs"]] == ["hisparse"] and doc["complete"] is False
    assert step_profile.main([*args, "--presets", "hisparse,resident"]) == 0
    doc = json.loads(out.read_text())
    assert [r["preset"] for r in doc["runs"]] == ["hisparse", "resident"] and doc["complete"] is True
    assert not (tmp_path / "sp.json.tmp").exists()


class _WarmEngine:
    """Engine stand-in for the warm-up: finishes each request in one step; its drafter drafts
    only once a request asks for at least `drafts_from` tokens (n-gram lookup needs a repeat)."""

    class _Out:
        def __init__(self, rid):
            self.request_id, self.finished, self.new_token_ids = rid, True, [0]

    def __init__(self, speculative: bool, drafts_from: int):
        from types import SimpleNamespace

        from dhisparse.engine.speculative import SpecCounters
        from dhisparse.models.tiny import tiny_config
        from dhisparse.models.tokenizer import ByteTokenizer

        self.tokenizer, self.model_config = ByteTokenizer(), tiny_config()
        self.spec = SimpleNamespace(counters=SpecCounters()) if speculative else None
        self.drafts_from, self.asked, self.pending, self.forgot = drafts_from, [], [], 0

    def forget_learning(self):
        self.forgot += 1

    def add_request(self, ids, params):
        self.asked.append(params.max_tokens)
        self.pending.append(f"r{len(self.asked)}")
        return self.pending[-1]

    def step(self):
        if self.spec is not None and self.asked[-1] >= self.drafts_from:
            self.spec.counters.drafted_at = [1]
        done, self.pending = self.pending, []
        return [self._Out(r) for r in done]


@pytest.mark.parametrize("speculative,drafts_from,batches", [(False, 1, [4]), (True, 1, [4]), (True, 16, [4, 16]),
                                                              (True, 10**6, [4, 16, 64])])
def test_warmup_runs_until_a_round_verified_drafts(speculative, drafts_from, batches):
    from dhisparse.bench.inproc import InProcessLoop

    eng = _WarmEngine(speculative, drafts_from)
    loop = InProcessLoop(eng, Workload(input_len=8, output_len=100, duration_s=1.0), Phases.constant(3, 1.0))
    loop.warmup()
    assert eng.asked == [b for b in batches for _ in range(3)]  # one request per client per batch
    assert eng.forgot == 1  # and then what it taught speculation is forgotten


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke test of the bench script under the Triton interpreter; on a GPU the bench itself runs")
def test_fp8_kernels_bench_scores_keys_where_the_engine_stores_them(tmp_path):
    """bench/fp8_kernels.py --quick: the indexer's keys live in a KVArena page slot (the engine's
    layout, so slot alignment is measured, not assumed), both formats agree on the top-k, and the
    contiguous layout of the fifteenth round stays available."""
    import json

    from bench import fp8_kernels

    for layout in ("arena", "contiguous"):
        out = tmp_path / f"fp8_{layout}.json"
        assert fp8_kernels.main(["--quick", "--key-layout", layout, "--out", str(out)]) == 0
        idx = [r for r in json.loads(out.read_text())["runs"] if r["kernel"] == "indexer_scores"]
        assert len(idx) == 2 and all(r["key_layout"] == layout and r["fp8_values_ptr_mod16"] == 0 for r in idx)
        assert all(r["topk_position_agreement"] > 0.5 for r in idx)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke test of the bench script under the Triton interpreter; on a GPU the bench itself runs")
def test_indexer_tune_bench_puts_the_shipped_launch_first_and_checks_round_against_decode(tmp_path):
    """bench/indexer_tune_bench.py --quick: the shipped configuration is first (ratio 1), every swept
    one follows once, and each round configuration's scores are checked bit for bit against the
    per-token kernel's (fp32 in the interpreter: all equal)."""
    import json

    from bench import indexer_tune_bench

    out = tmp_path / "indexer.json"
    assert indexer_tune_bench.main(["--quick", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    from dhisparse.kernels.indexer import BLOCK_S

    assert [(r["block_s"], r["num_warps"]) for r in runs] == [(BLOCK_S, 4), (16, 4), (32, 4)]
    assert runs[0]["round_over_shipped"] == runs[0]["decode_over_shipped"] == 1.0
    assert all(r["equal_to_decode"] and r["decode_equal_to_shipped"] for r in runs)


def test_dflash_attention_bench_times_both_forms_on_the_same_inputs(tmp_path):
    """bench/dflash_attention_bench.py --quick: the upcast baseline and the fused form, their ratio and
    their difference (bf16 rounding, not a wrong pairing) for each request count."""
    import json

    from bench import dflash_attention_bench

    out = tmp_path / "dfa.json"
    assert dflash_attention_bench.main(["--quick", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["runs"]
    assert row["requests"] == 2 and row["fused_over_upcast"] == row["fused_ms"] / row["upcast_ms"]
    assert 0 < row["max_abs_diff"] < 2e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke test of the bench script under the Triton interpreter; on a GPU the bench itself runs")
def test_moe_align_bench_times_both_groupings_on_the_same_ids(tmp_path):
    """bench/moe_align_bench.py --quick: per (experts, tokens) the torch form and the kernel, their ratio, and
    that both group alike."""
    import json

    from bench import moe_align_bench

    out = tmp_path / "ma.json"
    assert moe_align_bench.main(["--quick", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["experts"], r["tokens"], r["rows"]) for r in runs] == [(4, 3, 6), (4, 17, 34)]
    assert all(r["same"] and r["kernel_over_torch"] == r["kernel_us"] / r["torch_us"] for r in runs)


def test_resolver_peer_cases_phases_and_comparison():
    """bench/resolver_peer.py (issue 33): a case misses the share its level names, every phase stop
    is timed, the host split has its parts (the compiled launcher's only on CUDA), the case's full plan equals the
    reference, and a case of the issue's table is compared with the peer's figure."""
    from bench import resolver_peer as rp
    from bench.resolver_cases import Rig, check_case, index_case

    rig = Rig(quick=True)
    sh = rp.shapes(True)
    rig.fill(656)
    case = rp.build(rig, sh, 32, 2, 656, "20%")
    assert all(v for k, v in check_case(rig, case, distinct=True).items() if k not in ("case", "copies"))
    rec = rp.time_case(rig, case, rp.Flush(rig.dev, True), 1, 0, upto=(10, 45), host_n=1)
    assert rec["miss_rows"] == 2 * round(0.2 * sh["k"]) and list(rec["phases"]) == [rp.PHASES[10], rp.PHASES[45]]
    parts = {"call", "python", "launch_jit", "call_unbound", "call_reuse", "python_reuse"} | ({"launch_compiled"} if rig.cuda else set())
    assert set(rec["host_split_us"]) == parts
    cmp_ = rp.compare({**rec, "H": 4096, "batch": 8, "row_bytes": 656, "miss_level": "0.1%"})
    assert cmp_["peer_us"] == 17.7 and cmp_["ours_over_peer"] == pytest.approx(cmp_["ours_us"] / 17.7)
    assert rp.compare({**rec, "H": 32}) is None
    icase = index_case(case)  # the hot_entry lookup on the same inputs: exact, index kept, compared
    chk = check_case(rig, icase, distinct=True)
    assert chk["hot_entry"] and all(v for k, v in chk.items() if k not in ("case", "copies"))
    irec = rp.time_case(rig, icase, rp.Flush(rig.dev, True), 1, 0, host_n=1)
    cmp_ = rp.compare({**rec, "index": irec, "H": 4096, "batch": 8, "row_bytes": 656, "miss_level": "0.1%"})
    assert cmp_["ours_index_over_peer"] == pytest.approx(irec["plan_copy"]["time_ms"] * 1e3 / 17.7)
    assert "ours_index_plan_us" in cmp_
    specs = rp.precompile_specs(rp.shapes(False), phases=True)  # every worker spec parses (s35: one did not)
    assert len(specs) == 2 * 2 + 2 * len(rp.PHASES) and all(rp.parse_spec(x)[0] in (4096, 8192) for x in specs)
    assert {rp.parse_spec(x)[2] for x in specs} == {False, True}


def test_resolver_probe_times_every_variant():
    """bench/resolver_probe.py (issue 33): one level at one H times the empty-kernel floor and every
    variant (phase stops, warps, distinct) it lists, K 1 and a K 2 union."""
    from bench import resolver_peer as rp
    from bench import resolver_probe as probe
    from bench.resolver_cases import Rig

    rig = Rig(quick=True)
    sh = rp.shapes(True) | {"Hs": (32,), "batches": (2,)}
    rig.fill(656)
    recs = probe.run_cases(rig, sh, rp.Flush(rig.dev, True), 1, ("20%",), 0.0, 32)
    recs += probe.run_cases(rig, sh, rp.Flush(rig.dev, True), 1, ("20%",), 0.0, 32, 2, "partial")
    assert [r["K"] for r in recs] == [1, 2] and all(r["empty_kernel"]["n_timings"] == 1 for r in recs)
    assert [(v["UPTO"], v["D"]) for v in recs[0]["variants"]] == [(10, 0), (10, 1), (50, 0), (50, 1)]
    assert all(v["D"] == 0 for v in recs[1]["variants"])


def test_resolver_one_call_checks_and_plans():
    """bench/resolver_one_call.py (issue 33's profiling driver): the case passes its reference check."""
    from bench import resolver_one_call

    assert resolver_one_call.main(["--quick", "--warmup", "1", "--calls", "1"]) == 0
    assert resolver_one_call.main(["--quick", "--warmup", "1", "--calls", "1", "--lookup", "index"]) == 0


def test_resolver_run_case_times_the_engine_path_too():
    """bench/resolver_timing.run_case: the session-6 call and the engine's (workspace, device now)."""
    from types import SimpleNamespace

    from bench.resolver_cases import Rig
    from bench.resolver_timing import run_case

    rig = Rig(quick=True)
    rig.fill(656)
    case = rig.cases(656)[0]
    rec = run_case(rig, case, SimpleNamespace(iters=1, warmup=0))
    assert rec["plan_only"]["n_timings"] == rec["plan_only_engine_path"]["n_timings"] == 1
    assert rec["time_ms_engine_path"] > 0
    assert "plan_only_engine_path" not in run_case(rig, case, SimpleNamespace(iters=1, warmup=0), engine_path=False)


def _bench_script(name: str):
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parents[1] / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_drafter_checkpoint_takes_the_papers_ring_row(tmp_path, capsys):
    """`--shape paper-glm5` on glm5-faithful: 12,288 B a draft-ring row (the paper's six layers' twelve
    K/V allocations) and ~4.9 GiB of weights (counted on the meta device); the target's own shape is
    12x that row. Explicit flags write a checkpoint the drafter loads with its K/V heads."""
    from types import SimpleNamespace

    from dhisparse.models.registry import builtin_config
    from dhisparse.spec.dflash_model import DFlashModel
    from dhisparse.spec.factory import random_dflash_config

    dc = _bench_script("drafter_checkpoint")
    cfg = builtin_config("glm5-faithful")
    fake = SimpleNamespace(model=SimpleNamespace(embed_tokens=None), lm_head=None, config=cfg)
    own = random_dflash_config(fake, 8, num_layers=6, kind="dflash2")
    flags = dict(shape="paper-glm5", heads=None, kv_heads=None, head_dim=None, intermediate=None)
    paper = dc.shaped(own, SimpleNamespace(**flags))
    assert (dc.ring_row_bytes(paper), dc.ring_row_bytes(own)) == (12288, 12 * 12288)
    assert paper.num_heads * paper.head_dim == cfg.hidden_size
    with torch.device("meta"):
        params = sum(p.numel() for p in DFlashModel(paper).parameters())
    assert 4.7 < 2 * params / 2**30 < 5.0
    out = tmp_path / "d"
    assert dc.main(["--model", "glm52-scaled", "--layers", "2", "--heads", "8", "--kv-heads", "2", "--head-dim", "128",
                    "--intermediate", "1536", "--out", str(out)]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (rec["kv_heads"], rec["ring_row_bytes"]) == (2, 2 * 2 * 2 * 128 * 2)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2


def test_oracle_reference_is_read_back_from_its_file_and_refused_for_another_run(tmp_path, monkeypatch):
    """gpu_serving --reference-file: the first call decodes and writes the outputs, a second on the
    same code reads them (no decode) and gives the same prompt -> output map, also at another commit
    (a docs-only commit keeps the package's files); a file made for another output length or by
    other package files (`code_digest`) is refused naming the field."""
    import dhisparse.bench.reference as ref_mod
    from dhisparse.bench.reference import ReferenceMismatch, load_reference, reference_key
    from dhisparse.bench.sweep import load_shared_model
    from dhisparse.engine.config import EngineConfig
    from dhisparse.kv.memory.prefix_store import PrefixStore

    gs = _bench_script("gpu_serving")
    path = tmp_path / "ref.json"
    monkeypatch.setenv("DHISPARSE_COMMIT", "abc1234")
    ns = gs.parse(["--quick", "--presets", "adaptive+spec", "--reference-file", str(path)])
    sz = gs.sizing(ns, gs.model_config(ns.model))
    loaded = load_shared_model(EngineConfig(model=ns.model, device=ns.device, dtype=ns.dtype))
    first = gs.oracle_reference(ns, sz, loaded, PrefixStore(pin=False))
    assert len(first) == ns.distinct_suffixes and all(len(v) == ns.output_len for v in first.values())

    def no_decode(*a, **k):
        raise AssertionError("decoded although the file holds this run's reference")

    monkeypatch.setattr(gs, "decode_reference", no_decode)
    assert gs.oracle_reference(ns, sz, loaded, PrefixStore(pin=False)) == first
    assert json.loads(path.read_text())["commit"] == "abc1234"  # recorded, not matched:
    monkeypatch.setenv("DHISPARSE_COMMIT", "def5678")
    assert gs.oracle_reference(ns, sz, loaded, PrefixStore(pin=False)) == first
    key = reference_key(ns.model, ns.dtype, ns.kv_cache_dtype, ns.input_len, ns.output_len, ns.distinct_suffixes)
    with pytest.raises(ReferenceMismatch, match="output_len: file 12, run 13"):
        load_reference(path, dict(key, output_len=13))
    monkeypatch.setattr(gs, "suffix_text", lambda i: f"another prompt {i}")  # built outside the decoding code
    with pytest.raises(ReferenceMismatch, match="prompts: file '[0-9a-f]{32}', run '[0-9a-f]{32}'"):
        gs.oracle_reference(ns, sz, loaded, PrefixStore(pin=False))
    monkeypatch.undo()
    monkeypatch.setattr(ref_mod, "code_digest", lambda root=None: "other package files")
    with pytest.raises(ReferenceMismatch, match="code: file '[0-9a-f]{32}', run 'other package files'"):
        gs.oracle_reference(ns, sz, loaded, PrefixStore(pin=False))
    assert load_reference(tmp_path / "none.json", key) is None


def test_gpu_serving_load_step_writes_a_loadstep_result_with_its_phases(tmp_path):
    """gpu_serving --load-step C_LOW,C_HIGH: each preset runs once through the step's three phases (the load C_HIGH,
    the window their total); the file is a loadstep result with the phases and each run's per-phase statistics,
    which `dhisparse plot` draws as loadstep.png. Bad steps fail naming the flag."""
    from dhisparse.bench.plots import plot_results

    gs = _bench_script("gpu_serving")
    out = tmp_path / "ls.json"
    assert gs.main(["--quick", "--presets", "adaptive", "--load-step", "1,2", "--load-step-s", "0.6,1,0.6",
                    "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "loadstep" and [p["concurrency"] for p in res["config"]["phases"]] == [1, 2, 1]
    (run,) = res["runs"]
    assert run["concurrency"] == 2 and [p["name"] for p in run["phases"]] == ["C1 before", "C2", "C1 after"]
    assert run["phases"][1]["slots_max"] == 2 and run["phases"][0]["slots_max"] == 1
    assert [p.name for p in plot_results([res], tmp_path / "fig")] == ["loadstep.png"]
    assert main(["table", str(out), "--out", str(tmp_path / "a1.json")]) == 0  # Table A1: a row a phase
    a1 = json.loads((tmp_path / "a1.json").read_text())["table_a1"]
    assert [(r["arm"], r["name"]) for r in a1] == [("adaptive", "C1 before"), ("adaptive", "C2"), ("adaptive", "C1 after")]
    for bad in (["--load-step", "3,2"], ["--load-step", "2"], ["--load-step", "1,2", "--load-step-s", "1,0,1"]):
        with pytest.raises(SystemExit):
            gs.parse(["--quick", *bad])
    assert gs.parse(["--quick"]).phases is None


def test_gpu_serving_reports_device_bytes_outside_the_pool(monkeypatch):
    """A run's device memory: the peak less the target's weights, the KV pool and speculation's
    accounted bytes is what nothing charges (activations, graph pools, metadata)."""
    from types import SimpleNamespace

    gs = _bench_script("gpu_serving")
    model = torch.nn.Linear(4, 3)  # 15 fp32 parameters: 60 B
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 10_000)
    got = gs.device_memory(SimpleNamespace(model=model), {"kv_pool_bytes": 6_000, "spec_bytes": 1_000})
    assert got == {"device_peak_bytes": 10_000, "device_model_bytes": 60, "device_outside_pool_bytes": 2_940}
    assert gs.device_memory(SimpleNamespace(model=model), {"kv_pool_bytes": 6_000})["device_outside_pool_bytes"] == 3_940


def _req(i, submit, first, queue, finish=None):
    return {"index": i, "client": i, "submit": submit, "first": first, "finish": finish, "queue": queue,
            "ttft": None if first is None else first - submit}


def _served(preset, c, tok_s, ttft_p99_post, tpot, reqs):
    return {"preset": preset, "concurrency": c, "requests": reqs,
            "metrics": {"output_tok_s": tok_s, "ttft_mean_ms": 1.0, "ttft_p99_ms": 2.0, "post_wave_ttft_mean_ms": 1.0,
                        "post_wave_ttft_p99_ms": ttft_p99_post, "tpot_mean_ms": tpot, "tpot_p99_ms": tpot}}


def test_appendix_tables_split_ttft_average_repeats_and_find_the_capacity(tmp_path, capsys):
    """Table A2: allocation wait + hand-off = TTFT, post-wave leaves out the first C submitted and
    requests without a queue figure; Table A3: a point is the mean of its repeats; capacity: the
    highest C within both bounds; a file of another model stays a separate source."""
    from dhisparse.bench.tables import capacity, latency_rows, split_rows, ttft_split

    reqs = [_req(0, 0.0, 1.0, 0.25), _req(1, 0.0, 2.0, 0.75), _req(2, 3.0, 3.5, 0.1), _req(3, 4.0, 5.0, None),
            _req(4, 5.0, None, None)]
    sp = ttft_split({"concurrency": 2, "requests": reqs})
    assert (sp["all"].allocation_s, sp["all"].handoff_s, sp["all"].ttft_s, sp["all"].n) == \
        pytest.approx((1.1 / 3, 2.4 / 3, 3.5 / 3, 3))
    assert (sp["post_wave"].allocation_s, sp["post_wave"].ttft_s, sp["post_wave"].n) == pytest.approx((0.1, 0.5, 1))
    cfg = {"engine": {"model": "m"}, "workload": {"input_len": 100, "output_len": 8}}
    a = {"kind": "bench", "config": cfg, "runs": [
        _served("hisparse", 4, 100.0, 5e3, 30.0, reqs), _served("hisparse", 4, 120.0, 7e3, 34.0, reqs),
        _served("hisparse", 8, 150.0, 9e3, 45.0, reqs), _served("adaptive+spec", 8, 300.0, 9e3, 38.0, reqs),
        _served("adaptive+spec", 16, 350.0, 12e3, 39.0, reqs)]}
    other = {"kind": "bench", "config": dict(cfg, engine={"model": "n"}), "runs": [_served("hisparse", 4, 1.0, 1.0, 1.0, [])]}
    rows = latency_rows([a, other])
    h4 = next(r for r in rows if (r["source"], r["preset"], r["C"]) == ("m 100/8", "hisparse", 4))
    assert (h4["runs"], h4["output_tok_s"], h4["post_wave_ttft_p99_ms"], h4["tpot_mean_ms"]) == (2, 110.0, 6e3, 32.0)
    cap = {(c["source"], c["preset"]): (c["C"], c["output_tok_s"]) for c in capacity(rows, 10e3, 40.0)}
    assert cap[("m 100/8", "hisparse")] == (4, 110.0)  # C8's TPOT 45 ms is over the bound
    assert cap[("m 100/8", "adaptive+spec")] == (8, 300.0)  # C16's p99 TTFT 12 s is over
    assert cap[("n 100/8", "hisparse")] == (4, 1.0)
    assert capacity(rows, 1.0, 1.0)[0]["C"] is None
    (s4,) = [r for r in split_rows([a]) if (r["preset"], r["C"]) == ("hisparse", 4)]
    assert s4["all_ttft_s"] == pytest.approx(3.5 / 3) and s4["post_wave_allocation_s"] is None  # only r4 (no token)
    path = tmp_path / "a.json"
    path.write_text(json.dumps(a | {"notes": ["+spec presets use the ORACLE drafter"], "not_a_result": "left its reference"}))
    assert main(["table", str(path), "--out", str(tmp_path / "t.json")]) == 0
    saved = json.loads((tmp_path / "t.json").read_text())
    assert {"table_a2", "table_a3", "capacity", "command", "date", "commit", "machine"} <= set(saved)
    assert saved["kind"] == "tables" and "table" in saved["command"]
    assert saved["notes"] == [{"source": "m 100/8", "notes": ["NOT A RESULT: left its reference",
                                                              "+spec presets use the ORACLE drafter"]}]
    assert "[m 100/8] +spec presets use the ORACLE drafter" in capsys.readouterr().out  # the tool is named under the table
    assert main(["table", str(path), str(path), "--out", str(tmp_path / "t2.json")]) == 0  # a repeat call's file
    assert json.loads((tmp_path / "t2.json").read_text())["notes"] == saved["notes"]  # its notes once
    bad = tmp_path / "l.json"
    bad.write_text(json.dumps({"kind": "loadstep", "runs": []}))
    assert main(["table", str(bad)]) == 2


def test_an_aborted_request_keeps_its_allocation_wait():
    """The closed loop takes a request's allocation wait from its first token on, so a request cut
    at the window's end (finish None, 'abort') still counts in Table A2."""
    from types import SimpleNamespace

    from dhisparse.bench.inproc import InProcessLoop
    from dhisparse.models.tiny import tiny_config
    from dhisparse.models.tokenizer import ByteTokenizer

    class Never:  # every request gets a token a step and never finishes
        tokenizer, model_config = ByteTokenizer(), tiny_config()

        def __init__(self):
            self.ids = []

        def prepare_prefix(self, prefix):
            pass

        def add_request(self, ids, params):
            self.ids.append(f"r{len(self.ids)}")
            return self.ids[-1]

        def step(self):
            return [SimpleNamespace(request_id=r, new_token_ids=[5], finished=False, finish_reason=None,
                                    metrics=SimpleNamespace(queue=0.125)) for r in self.ids]

        def abort(self, rid):
            pass

        def stats(self):
            return SimpleNamespace(as_dict=lambda: {"running": len(self.ids)})

    w = Workload(input_len=8, output_len=4, duration_s=0.05, warmup=False)
    trace = InProcessLoop(Never(), w, Phases.constant(2, 0.05)).run()
    assert trace.requests and all(r.finish_reason == "abort" and r.queue == 0.125 for r in trace.requests)


def test_the_context_sweep_finds_where_the_hierarchy_overtakes_resident(tmp_path):
    """Bench results at 32K / 128K / 512K, one C: the ratio to resident crosses 1 between 32K and
    128K, interpolated in log context; a line that never reaches resident has no crossover; a
    single context or no resident run is not a context sweep; `dhisparse plot` draws context.png."""
    from dhisparse.bench.plot_context import context_points, crossover, is_context_sweep, ratios
    from dhisparse.bench.plots import Spread

    def res(ctx, out):
        return {"kind": "bench", "config": {"engine": {"model": "m"}, "workload": {"input_len": ctx, "output_len": 8}},
                "runs": [{"preset": p, "concurrency": 64, "metrics": {"output_tok_s": v, "ttft_mean_ms": 1.0,
                                                                     "tpot_mean_ms": 1.0}} for p, v in out.items()]}

    results = [res(32768, {"resident": 100.0, "adaptive": 90.0, "hisparse": 50.0}),
               res(131072, {"resident": 50.0, "adaptive": 60.0, "hisparse": 40.0}),
               res(524288, {"resident": 20.0, "adaptive": 40.0, "hisparse": 15.0}),
               res(524288, {"resident": 22.0, "adaptive": 44.0, "hisparse": 16.5})]  # a repeat
    assert is_context_sweep(results)
    assert not is_context_sweep(results[:1]) and not is_context_sweep(
        [dict(r, runs=[x for x in r["runs"] if x["preset"] != "resident"]) for r in results])
    pts = context_points(results)
    assert pts["adaptive"][2] == (524288, Spread(42.0, 40.0, 44.0))
    rs = ratios(pts, "adaptive")
    assert rs[:2] == [(32768, 0.9), (131072, 1.2)]
    # log2 32K = 15, 128K = 17: 0.9 -> 1.2 reaches 1 a third of the way, at 2^(15 + 2/3)
    assert crossover(rs) == pytest.approx(2 ** (15 + 2 / 3))
    assert crossover(ratios(pts, "hisparse")) is None and crossover([(1, 1.1), (2, 1.3)]) is None
    paths = []
    for k, r in enumerate(results):
        paths.append(tmp_path / f"c{k}.json")
        paths[-1].write_text(json.dumps(r))
    assert main(["plot", *map(str, paths), "--out", str(tmp_path / "fig")]) == 0
    assert_png(tmp_path / "fig" / "context.png")


def test_code_digest_follows_every_file_and_skips_caches(tmp_path):
    """The oracle reference's `code` key: any file's bytes or name under the root change it; a
    __pycache__ entry does not."""
    from dhisparse.bench.reference import code_digest

    def digest(tag):
        d = tmp_path / tag
        for name, text in files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(text)
        return code_digest(d)

    files = {"a.py": "x = 1\n", "m/b.json": "{}"}
    base = digest("base")
    files["__pycache__/a.cpython-311.pyc"] = "cache"
    assert digest("cached") == base
    del files["__pycache__/a.cpython-311.pyc"]
    files["a.py"] = "x = 2\n"
    assert digest("edited") != base
    files["a.py"], files["m/c.json"] = "x = 1\n", files.pop("m/b.json")
    assert digest("renamed") != base
    renamed = digest("renamed2")
    files["bench/p.py"] = "y"  # an explicit root skips nothing (only the package's default does)
    assert digest("bench") != renamed
    assert len(code_digest()) == 32 and code_digest() == code_digest()


def test_the_package_digest_skips_the_subpackages_no_decode_runs(tmp_path, monkeypatch):
    """The default root (the package) leaves out bench/, cli/, server/ and train/ (a plot or server change
    keeps a carried reference) and follows every other file, a top-level module named like them included."""
    import dhisparse.bench.reference as ref_mod

    def digest(files):
        monkeypatch.setattr(ref_mod, "_PACKAGE", tmp_path / str(len(list(tmp_path.iterdir()))))
        monkeypatch.setattr(ref_mod, "_DIGESTS", {})
        for name, text in files.items():
            (ref_mod._PACKAGE / name).parent.mkdir(parents=True, exist_ok=True)
            (ref_mod._PACKAGE / name).write_text(text)
        return ref_mod.code_digest()

    files = {"engine/step.py": "a", "bench/plot.py": "b", "server/app.py": "c", "bench.py": "d"}
    base = digest(files)
    for name in ("bench/plot.py", "server/app.py"):
        assert digest(files | {name: "changed"}) == base, name
    assert digest(files | {"train/new.py": "x", "cli/new.py": "y"}) == base
    for name in ("engine/step.py", "bench.py"):
        assert digest(files | {name: "changed"}) != base, name


def test_gpu_serving_run_records_its_engine_build_and_loop_time():
    """A run's wall time split (engine build, then the loop: warm-up, window, drain), kept in its
    engine dict: a first window's compiles and graph captures show where they go."""
    from dhisparse.bench.sweep import load_shared_model
    from dhisparse.engine.config import EngineConfig
    from dhisparse.kv.memory.prefix_store import PrefixStore

    gs = _bench_script("gpu_serving")
    ns = gs.parse(["--quick", "--presets", "hisparse", "--duration", "1"])
    sz = gs.sizing(ns, gs.model_config(ns.model))
    loaded = load_shared_model(EngineConfig(model=ns.model, device=ns.device, dtype=ns.dtype))
    t = time.perf_counter()
    run = gs.one_run(ns, sz, loaded, PrefixStore(pin=False), "hisparse", 2, None)
    wall = time.perf_counter() - t
    assert 0 < run.engine["engine_build_s"] and ns.duration <= run.engine["loop_s"]
    assert run.engine["engine_build_s"] + run.engine["loop_s"] <= wall


def test_gpu_serving_replays_the_reference_for_every_preset():
    """--replay-reference (a measurement tool, engine/replay.py): the reference is decoded unreplayed even
    with no +spec preset, every preset's engine gets it and emits its tokens, and the note says so."""
    from dhisparse.bench.sweep import load_shared_model
    from dhisparse.engine.config import EngineConfig
    from dhisparse.kv.memory.prefix_store import PrefixStore

    gs = _bench_script("gpu_serving")
    ns = gs.parse(["--quick", "--presets", "hisparse", "--duration", "1", "--replay-reference"])
    assert gs.uses_oracle(ns) and not gs.uses_oracle(gs.parse(["--quick", "--presets", "hisparse"]))
    sz = gs.sizing(ns, gs.model_config(ns.model))
    loaded = load_shared_model(EngineConfig(model=ns.model, device=ns.device, dtype=ns.dtype))
    reference = gs.oracle_reference(ns, sz, loaded, PrefixStore(pin=False))
    run = gs.one_run(ns, sz, loaded, PrefixStore(pin=False), "hisparse", 2, reference)
    assert run.engine["replay_forced_tokens"] > 0 and run.engine["replay_judged"] > 0
    assert run.engine["replay_agreement"] > 0.5  # the same model on the CPU: its own tokens are the reference's
    assert "REPLAYED" in gs.spec_note(ns) and "REPLAYED" not in gs.spec_note(gs.parse(["--quick"]))
    assert "ORACLE" not in gs.spec_note(ns)  # no +spec preset ran: no drafting to describe
    assert gs.spec_note(gs.parse(["--quick", "--presets", "resident,hisparse"])) is None  # nothing to label
    assert "ORACLE" in gs.spec_note(gs.parse(["--quick", "--presets", "hisparse,adaptive+spec"]))


def test_gpu_serving_warns_when_a_measurement_tool_misleads():
    """A run whose oracle went off its reference, or whose replayed target disagrees with the reference, is
    flagged as it ends (session 42's off-reference run showed it only in the JSON afterwards)."""
    gs = _bench_script("gpu_serving")
    assert gs.run_warnings({"oracle_proposals": 100, "oracle_off_reference_share": 0.0, "replay_judged": 50,
                            "replay_agreement": 0.97}) == []
    (off,) = gs.run_warnings({"oracle_proposals": 2245, "oracle_off_reference_share": 0.947, "spec_tokens_per_round": 1.08})
    assert "94.7%" in off and "1.08 tokens" in off
    (agree,) = gs.run_warnings({"replay_judged": 50, "replay_agreement": 0.02})
    assert "2.0%" in agree and "KV path" in agree
    assert gs.run_warnings({}) == [] and gs.run_warnings({"replay_judged": 0, "replay_agreement": 0.0}) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke test of the bench script; on a GPU the bench itself runs")
def test_step_profile_builds_glm5_faithful_at_overrides(tmp_path):
    """--layers / --overrides build glm5-faithful at another geometry (fewer routed experts fit an H100); each run
    records what --fp8-activations resolved to (auto: the faithful models' "dynamic"; an --engine-arg wins).
    Another model's --overrides is refused by name."""
    import json

    from bench import step_profile
    from dhisparse.models.faithful import SMALL_OVERRIDES

    base = ["--model", "glm5-faithful", "--layers", "4", "--overrides", json.dumps(SMALL_OVERRIDES), "--device", "cpu",
            "--dtype", "float32", "--input-len", "160", "--concurrency", "2", "--steps", "2", "--warmup", "1",
            "--kv-pool-gib", "0.05", "--host-pool-gib", "0.05", "--page-size", "16", "--max-batched-tokens", "1024",
            "--presets", "hisparse", "--cuda-graphs", "none"]
    for extra, want in (([], "dynamic"), (["--engine-arg", "fp8_activations=none"], "none")):
        out = tmp_path / f"sp_{want}.json"
        assert step_profile.main([*base, *extra, "--out", str(out)]) == 0
        (run,) = json.loads(out.read_text())["runs"]
        assert run["fp8_activations"] == want and run["admitted"] >= 1
    with pytest.raises(SystemExit):
        step_profile.parse(["--model", "glm52-scaled-k512", "--overrides", "{\"n_routed_experts\": 4}"])


def test_mla_split_pick_rule():
    """bench/mla_split_pick.py: the geometric mean over pass sizes decides, a split must beat the
    default by the margin, and a split not measured at every T is not a candidate."""
    from bench.mla_split_pick import pick

    def runs(rows):
        return [{"tokens": t, "split_rows": n, "vs_default": v} for t, n, v in rows]

    sweep = runs([(20, 128, 1.0), (20, 512, 1.2), (20, 256, 0.95), (90, 128, 1.0), (90, 512, 0.5), (90, 256, 0.99),
                  (90, 64, 0.1)])
    n, means = pick(sweep, 128, 0.97)
    assert n == 512 and 64 not in means and abs(means[512] - (1.2 * 0.5) ** 0.5) < 1e-12
    assert pick(runs([(20, 128, 1.0), (20, 256, 0.98), (90, 128, 1.0), (90, 256, 0.98)]), 128, 0.97)[0] == 128


def test_ptx_fingerprint_drops_only_what_does_not_reach_the_gpu():
    """bench/ptx_fingerprint.py's normalization: debug sections, .loc / .file lines, comments and the
    inlining labels go; every instruction and branch label stays."""
    from bench.ptx_fingerprint import normalized

    ptx = ("\t.file\t1 \"a.py\"\n$L__tmp3:\n\t.loc\t1 20 4\n\tadd.s32 \t%r1, %r2, %r3;\n// a comment\n"
           "$L__BB0_2:\n\tbra.uni \t$L__BB0_2;\n\t.section\t.debug_info\n\t{ .b8 1 }\n")
    assert normalized(ptx).split("\n") == ["\tadd.s32 \t%r1, %r2, %r3;", "$L__BB0_2:", "\tbra.uni \t$L__BB0_2;"]
    moved = ptx.replace("\tadd.s32 \t%r1, %r2, %r3;\n", "").replace("\t.section", "\tadd.s32 \t%r1, %r2, %r3;\n\t.section")
    assert normalized(moved) != normalized(ptx)  # an instruction that moves changes the hash's input


def test_capacity_bounds_scale_to_each_sources_low_load_latency(tmp_path, capsys):
    """--scale-bounds-to: each source's bounds are the paper's times its baseline's post-wave p99 TTFT and mean TPOT
    at that source's lowest load over the paper's HiSparse at C4 (0.95 s, 19.4 ms), so a slower setup is held to
    proportionally looser bounds; a source without the baseline is refused by name. Breakages caught: the highest
    load as the anchor, the per-source bounds ignored, the TPOT ratio inverted."""
    from dhisparse.bench.tables import PAPER_ANCHOR, Bounds, capacity, latency_rows, scaled_bounds

    cfg = {"engine": {"model": "m"}, "workload": {"input_len": 100, "output_len": 8}}
    a = {"kind": "bench", "config": cfg, "runs": [  # this setup's steps are 2x the paper's at its lowest load
        _served("hisparse", 8, 150.0, 2 * 950.0, 45.0, []), _served("hisparse", 2, 40.0, 2 * 950.0, 2 * 19.4, []),
        _served("hisparse", 16, 200.0, 3e3, 90.0, []), _served("adaptive+spec", 16, 400.0, 21e3, 60.0, []),
        _served("adaptive+spec", 8, 300.0, 19e3, 50.0, [])]}
    other = {"kind": "bench", "config": dict(cfg, engine={"model": "n"}), "runs": [_served("hisparse", 4, 1.0, 950.0, 19.4, [])]}
    rows = latency_rows([a, other])
    got = scaled_bounds(rows, "hisparse", Bounds(10e3, 40.0))
    assert got["m 100/8"] == Bounds(pytest.approx(20e3), pytest.approx(80.0), "hisparse@C2")  # the lowest load, not C8
    assert got["n 100/8"] == Bounds(pytest.approx(10e3), pytest.approx(40.0), "hisparse@C4")  # the paper's own steps
    assert PAPER_ANCHOR == {"post_wave_ttft_p99_ms": 950.0, "tpot_mean_ms": 19.4}
    cap = {(c["source"], c["preset"]): c for c in capacity(rows, 10e3, 40.0, got)}
    assert cap[("m 100/8", "hisparse")]["C"] == 8  # C16's 90 ms is over 80
    assert cap[("m 100/8", "adaptive+spec")]["C"] == 8  # C16's 21 s is over 20
    assert cap[("m 100/8", "hisparse")]["bounds"]["scaled_from"] == "hisparse@C2"
    plain = {(c["source"], c["preset"]): c for c in capacity(rows, 10e3, 40.0)}
    assert plain[("m 100/8", "hisparse")]["C"] == 2 and "scaled_from" not in plain[("m 100/8", "hisparse")]["bounds"]
    with pytest.raises(ValueError, match="'m 100/8' has no adaptive run"):
        scaled_bounds(rows, "adaptive", Bounds(10e3, 40.0))
    path = tmp_path / "a.json"
    path.write_text(json.dumps(a))
    assert main(["table", str(path), "--scale-bounds-to", "hisparse", "--out", str(tmp_path / "t.json")]) == 0
    (h,) = [c for c in json.loads((tmp_path / "t.json").read_text())["capacity"] if c["preset"] == "hisparse"]
    assert h["C"] == 8 and h["bounds"]["tpot_mean_ms"] == pytest.approx(80.0)
    assert "scaled to hisparse" in capsys.readouterr().out
