"""Drafter cost is visible (issue 27 item 5): the time of every propose call and the device bytes
of the drafter's weights and state are engine stats and /metrics gauges, with the exact values
the drafter holds; feature-less drafters report zero bytes."""

from __future__ import annotations

import httpx

from dhisparse.core.params import SamplingParams
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.server import ServerConfig, ServerThread

BASE = dict(device="cpu", max_model_len=256, kv_pool_bytes=16 << 20, hot_cache_rows=16, max_running_requests=4)


def run(eng: Engine) -> dict:
    for i in range(2):
        eng.add_request([5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=12, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return eng.stats().as_dict()


def test_dflash_cost_counters_equal_what_it_holds():
    eng = Engine(EngineConfig(preset="adaptive+spec", speculative_algorithm="dflash", **BASE))
    st = run(eng)
    drafter = eng.spec.drafter
    weights = sum(p.numel() * p.element_size() for p in drafter.model.parameters())
    ring = sum(t.numel() * t.element_size() for t in drafter.kv.k + drafter.kv.v) + drafter.kv.tags.numel() * 8
    ig = drafter.ingest_graphs  # CUDA: the context projection's graphs hold their static inputs
    fixed = 0 if ig is None else sum(t.numel() * t.element_size() for t in (ig._feat, ig._pos))
    assert st["drafter_weight_bytes"] == weights > 0 and st["drafter_state_bytes"] == ring + fixed > 0
    assert st["spec_draft_calls"] > 0 and st["spec_draft_seconds"] > 0
    assert st["spec_draft_ms_per_call"] == 1e3 * st["spec_draft_seconds"] / st["spec_draft_calls"]
    with ServerThread(eng, ServerConfig(drain_timeout_s=5)) as srv:
        text = httpx.get(srv.url + "/metrics").text
    line = next(l for l in text.splitlines() if l.startswith("dhisparse_drafter_weight_bytes{"))
    assert float(line.split()[-1]) == weights
    assert "dhisparse_spec_draft_ms_per_call{" in text and "dhisparse_drafter_state_bytes{" in text


def test_ngram_holds_nothing_but_is_timed():
    st = run(Engine(EngineConfig(preset="resident+spec", speculative_algorithm="ngram", **BASE)))
    assert st["drafter_weight_bytes"] == 0 and st["drafter_state_bytes"] == 0 and st["spec_draft_calls"] > 0
