"""`dhisparse bench --url`: the closed loop over HTTP against a live server (tiny, CPU)."""

from __future__ import annotations

import json

from dhisparse.bench.http_client import parse_engine_metrics
from dhisparse.cli import main
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.server import ServerThread


def test_bench_over_http_measures_client_side(tmp_path):
    engine = Engine(EngineConfig(device="cpu", max_model_len=256, kv_pool_bytes=32 << 20))
    out = tmp_path / "http.json"
    with ServerThread(engine) as srv:
        rc = main(["bench", "--url", srv.url, "--concurrency", "2", "--num-requests", "4", "--input-len", "40",
                   "--output-len", "5", "--sample-interval", "0.2", "--no-progress", "--out", str(out)])
        assert rc == 0
        imported = engine.stats().prefill_tokens
    run = json.loads(out.read_text())["runs"][0]
    m = run["metrics"]
    assert run["target"] == srv.url and run["preset"] == engine.config.preset
    assert m["requests_completed"] == 4 and m["ttft_mean_ms"] > 0 and m["tpot_mean_ms"] > 0
    assert all(r["output_len"] == 5 and r["prompt_len"] > 40 for r in run["requests"])
    assert m["output_tokens"] >= 20 and m["slots"] <= 2  # slots come from /metrics polls, which may miss a busy moment
    # the prefix was prefilled once (plus warm-up); requests imported it and prefilled only their suffix
    assert imported < 40 + 6 * 10


def test_parse_engine_metrics():
    text = ('# HELP x\ndhisparse_engine_running{model_name="t",preset="r"} 3.0\n'
            'dhisparse_engine_host_fetched_share{model_name="t",preset="r"} 0.25\nother_metric 1\n')
    assert parse_engine_metrics(text) == {"running": 3.0, "host_fetched_share": 0.25}


def test_bench_over_http_sends_the_api_key(tmp_path, monkeypatch):
    """A server started with --api-key refuses the benchmark without it (a one-line error naming
    --api-key) and serves it with the flag or DHISPARSE_API_KEY."""
    import pytest

    from dhisparse.bench.http import HttpBenchError, HttpTarget
    from dhisparse.server import ServerConfig

    engine = Engine(EngineConfig(device="cpu", max_model_len=256, kv_pool_bytes=32 << 20))
    args = ["--concurrency", "1", "--num-requests", "2", "--input-len", "20", "--output-len", "3", "--no-warmup",
            "--sample-interval", "0.2", "--no-progress"]
    with ServerThread(engine, ServerConfig(api_key="sekrit")) as srv:
        with pytest.raises(HttpBenchError, match="--api-key"):
            HttpTarget.connect(srv.url)
        assert main(["bench", "--url", srv.url, "--api-key", "sekrit", *args, "--out", str(tmp_path / "a.json")]) == 0
        monkeypatch.setenv("DHISPARSE_API_KEY", "sekrit")
        assert main(["bench", "--url", srv.url, *args, "--out", str(tmp_path / "b.json")]) == 0
    for name in ("a.json", "b.json"):
        assert json.loads((tmp_path / name).read_text())["runs"][0]["metrics"]["requests_completed"] == 2


def test_bench_over_http_staggers_the_first_requests(tmp_path):
    """--stagger over HTTP: each client's first request asks for its share of --output-len."""
    engine = Engine(EngineConfig(device="cpu", max_model_len=256, kv_pool_bytes=32 << 20))
    out = tmp_path / "http.json"
    with ServerThread(engine) as srv:
        assert main(["bench", "--url", srv.url, "--concurrency", "2", "--num-requests", "4", "--input-len", "40",
                     "--output-len", "6", "--stagger", "--no-warmup", "--no-progress", "--out", str(out)]) == 0
    reqs = json.loads(out.read_text())["runs"][0]["requests"]
    firsts = {}
    for r in sorted(reqs, key=lambda r: r["index"]):
        firsts.setdefault(r["client"], r["output_len"])
    assert sorted(firsts.values()) == [3, 6] and sorted(r["output_len"] for r in reqs) == [3, 6, 6, 6]
