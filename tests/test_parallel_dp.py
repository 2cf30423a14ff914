"""Data parallelism on torch.distributed (gloo, CPU processes): the layout and its refusals, the
router, merged stats, and DP2 worlds whose greedy tokens equal the single-process engine's with
the row checker (I2) on every rank; a follower's abort frees its pages; a killed follower is a
RankLost within the deadline, never a hang, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from dhisparse import LLM
from dhisparse.core.parallel import ParallelConfig, ParallelConfigError, RankLost
from dhisparse.core.params import SamplingParams
from dhisparse.engine.config import ConfigValueError, EngineConfig
from dhisparse.engine.distributed import Load, Router, merge_stats
from dhisparse.engine.engine import Engine
from dhisparse.engine.stats import EngineStats
from dist_hooks import generate_on, one_process_tokens, world_presets

PROMPTS = [[5 + (3 * i + j) % 90 for j in range(12 + 11 * i)] for i in range(8)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
DP = dict(dtype="float64", device="cpu", dp_size=2, dist_timeout_s=20.0, kv_pool_bytes=8 << 20, host_pool_bytes=16 << 20)


def test_a_rank_past_the_nodes_gpus_is_refused_by_name(monkeypatch):
    """Two ranks on a one-GPU node: rank 1 would be cuda:1; refused before any CUDA call fails."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    pc = ParallelConfig(dp_size=2)
    assert pc.device_of(0, "cuda") == "cuda:0" and pc.device_of(1, "cpu") == "cpu"
    with pytest.raises(ValueError, match="2 ranks .* 1 GPU"):
        pc.device_of(1, "auto")


def test_layout_and_refusals_name_the_flag():
    pc = ParallelConfig()
    assert pc.world_size == 1 and not pc.distributed and list(pc.local_ranks()) == [0]
    two = ParallelConfig(dp_size=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert two.world_size == 4 and list(two.local_ranks()) == [2, 3] and two.device_of(3, "cpu") == "cpu"
    for kw, flag in [(dict(tp_size=2, dp_size=2), "--tp-size"), (dict(ep_size=2), "--ep-size"),
                     (dict(enable_dp_attention=True, dp_size=2), "--enable-dp-attention"), (dict(dp_size=0), "--dp-size"),
                     (dict(dp_size=2, nnodes=2), "--dist-init-addr"), (dict(node_rank=1), "--node-rank"),
                     (dict(dp_size=3, nnodes=2, dist_init_addr="h:1"), "--nnodes"),
                     (dict(dist_init_addr="nohostport"), "--dist-init-addr"), (dict(timeout_s=0), "--dist-timeout")]:
        with pytest.raises(ParallelConfigError, match=flag):
            ParallelConfig(**kw)
    with pytest.raises(ConfigValueError, match="--tp-size"):
        EngineConfig(tp_size=2, dp_size=2)


def test_router_fewest_sessions_then_free_pages_then_lowest_rank():
    r = Router(3)
    r.update([Load(2, 100), Load(1, 10), Load(1, 50)])
    assert r.pick() == 2  # fewest sessions (1), then more free pages (50 > 10)
    assert r.pick() == 1  # rank 2 now holds 2 with the one just placed
    assert r.pick() == 0  # all at 2 sessions: the most free pages, rank 0
    r.update([Load(0, 7, 3), Load(0, 7, 9), Load(0, 7, 9)])
    assert [r.pick() for _ in range(3)] == [1, 2, 0]  # host pages break the tie, then the lowest rank


def test_merged_stats_sum_counts_and_average_shares():
    a = EngineStats(2, 1, 100, 40, 50, 64, 7, 30, 200, counters={"host_fetched_share": 0.2, "resolver_calls": 5, "preset": "x"})
    b = EngineStats(1, 0, 100, 10, 20, 64, 7, 12, 100, counters={"host_fetched_share": 0.4, "resolver_calls": 3, "preset": "x"})
    m = merge_stats([a, b])
    assert (m.running, m.waiting, m.kv_pages_total, m.kv_pages_used, m.steps, m.generated_tokens) == (3, 1, 200, 50, 7, 42)
    assert m.counters["resolver_calls"] == 8 and m.counters["host_fetched_share"] == pytest.approx(0.3)
    assert m.counters["dp_size"] == 2 and m.counters["preset"] == "x"


def test_world_size_one_touches_no_distributed_code(monkeypatch):
    import torch.distributed as dist

    def boom(*a, **k):
        raise AssertionError("torch.distributed used at world size 1")

    monkeypatch.setattr(dist, "init_process_group", boom)
    monkeypatch.setattr(dist, "broadcast_object_list", boom)
    llm = LLM("tiny", max_running_requests=4)
    assert type(llm.engine) is Engine and not dist.is_initialized()
    assert len(llm.generate(PROMPTS[:2], GREEDY)[0].token_ids) == 12


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    return one_process_tokens(PROMPTS, GREEDY)


@pytest.mark.parametrize("preset", world_presets())
def test_dp2_tokens_equal_one_process_with_the_row_checker_on_every_rank(preset, references):
    from dhisparse.engine.launch import build

    engine = build(EngineConfig(model="tiny", preset=preset, **DP), on_engine="dist_hooks:row_checker")
    try:
        assert generate_on(engine, PROMPTS, GREEDY) == references[preset]
        per_rank = engine.rank_stats()
        assert all(s.admitted >= 2 for s in per_rank), [s.admitted for s in per_rank]  # both ranks served
        assert engine.stats().admitted == len(PROMPTS) and engine.stats().counters["dp_size"] == 2
        if preset == "hisparse":
            assert all(s.counters["host_selected_rows"] > 0 for s in per_rank)  # each rank's own hierarchy fetched
    finally:
        engine.close()
    assert not torch.distributed.is_initialized() and all(not p.is_alive() for p in engine.procs)


def test_a_broken_follower_store_is_caught_by_its_row_checker():
    """The breakage the per-rank checker exists for: rank 1 returns its neighbours' rows; its
    checker fails, the follower exits, and rank 0 reports the rank lost instead of wrong tokens."""
    from dhisparse.engine.launch import build

    engine = build(EngineConfig(model="tiny", preset="hisparse", **DP),
                   on_engine="dist_hooks:stale_rows_on_rank1")
    try:
        with pytest.raises(RankLost):
            generate_on(engine, PROMPTS, GREEDY)
    finally:
        engine.close()


def test_dp2_prefix_on_every_rank_and_a_followers_abort_frees_its_pages():
    llm = LLM("tiny", preset="adaptive", **DP)
    eng = llm.engine
    try:
        prefix = [7 + (5 * j) % 80 for j in range(40)]
        eng.prepare_prefix(prefix)
        prompts = [prefix + [11 + i] for i in range(4)]
        ref = [o.token_ids for o in LLM("tiny", preset="adaptive", dtype="float64", device="cpu").generate(prompts, GREEDY)]
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == ref and all(o.metrics.imported_len == 40 for o in outs)
        rids = [eng.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True)) for p in PROMPTS[:4]]
        far = next(r for r in rids if eng.owner[r] == 1)
        for _ in range(3):
            eng.step()
        assert eng.abort(far) and not eng.abort(far)
        for r in rids:
            if r != far:
                eng.abort(r)
        for _ in range(3):
            assert all(o.request_id != far for o in eng.step())
        assert not eng.has_unfinished()
        assert [s.kv_pages_used for s in eng.rank_stats()] == [0, 0]  # rank 1 freed the aborted request's pages
    finally:
        llm.close()


def test_a_killed_follower_is_rank_lost_within_the_deadline_and_no_process_remains():
    llm = LLM("tiny", preset="hisparse", **DP)
    eng = llm.engine
    (proc,) = eng.procs
    rids = [eng.add_request(p, SamplingParams(max_tokens=500, ignore_eos=True)) for p in PROMPTS[:4]]
    eng.step()
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankLost, match="lost"):
        for _ in range(1000):
            eng.step()
    assert time.monotonic() - t0 < DP["dist_timeout_s"] + 3.0  # a killed peer resets its connection at once
    with pytest.raises(RankLost):  # every later call says so too
        eng.has_unfinished()
    llm.close()
    proc.join(timeout=5)
    assert not proc.is_alive() and not torch.distributed.is_initialized() and rids


def test_the_server_answers_503_when_a_rank_dies():
    """A DP2 server; a follower is killed mid-stream. Within the deadline /health is 503, a new
    completion is 503 with the lost rank named, and the stream in flight ends with a 503 error
    chunk; closing the world leaves no process."""
    import httpx

    from dhisparse.server.app import ServerConfig
    from dhisparse.server.runner import ServerThread

    llm = LLM("tiny", preset="hisparse", **DP)
    eng = llm.engine
    (proc,) = eng.procs
    try:
        with ServerThread(eng, ServerConfig(drain_timeout_s=2)) as srv:
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "stream": True}
            chunks = []
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                chunks.append(next(lines))
                while eng.owner and all(v == 0 for v in eng.owner.values()):  # the stream may sit on rank 0
                    rid = eng.add_request([9, 9, 9], SamplingParams(max_tokens=4000, ignore_eos=True))
                    if eng.owner[rid] == 1:
                        break
                os.kill(proc.pid, signal.SIGKILL)
                t0 = time.monotonic()
                chunks += list(lines)
            assert time.monotonic() - t0 < DP["dist_timeout_s"] + 3.0
            assert any("\"code\":\"rank_lost\"" in c for c in chunks), chunks[-6:]  # the 503 error chunk
            health = httpx.get(srv.url + "/health", timeout=5)
            assert health.status_code == 503 and "lost" in health.json()["error"]
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=5)
            assert r.status_code == 503 and "lost" in r.text
    finally:
        llm.close()
    proc.join(timeout=5)
    assert not proc.is_alive() and not torch.distributed.is_initialized()


def test_the_servers_prefix_endpoint_prepares_the_prefix_on_every_rank():
    """POST /v1/dhisparse/prefix over DP2 returns once every rank holds the prefix (exports emit
    no output: each rank reports its finished exports); completions on both ranks then import it."""
    import httpx

    from dhisparse.server.app import ServerConfig
    from dhisparse.server.runner import ServerThread

    llm = LLM("tiny", preset="adaptive", **DP)
    eng = llm.engine
    prefix = [7 + (5 * j) % 80 for j in range(40)]
    try:
        with ServerThread(eng, ServerConfig(drain_timeout_s=2)) as srv:
            r = httpx.post(srv.url + "/v1/dhisparse/prefix", json={"model": "tiny", "prompt": prefix}, timeout=30)
            assert r.status_code == 200 and r.json()["prefix_tokens"] == 40
            bodies = [{"model": "tiny", "prompt": prefix + [11 + i], "max_tokens": 4} for i in range(4)]
            assert all(httpx.post(srv.url + "/v1/completions", json=b, timeout=30).status_code == 200 for b in bodies)
        assert not eng.owner and not eng._prefix_left
        per_rank = eng.rank_stats()
        assert all(s.admitted >= 2 for s in per_rank)
        # each rank prefilled the prefix once (40) and each request only its last token (imported 40)
        assert sum(s.prefill_tokens for s in per_rank) == 2 * 40 + 4
    finally:
        llm.close()
