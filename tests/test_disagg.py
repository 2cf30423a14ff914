"""Prefill/decode disaggregation on torch.distributed (gloo, CPU processes, fp64, the tiny model):
the layout and its refusals, 1 prefill + 1 decode worlds whose greedy tokens equal the
single-process engine's under every preset with the row checker on every rank and each arrived
prompt's rows checked where the decode store says it placed them (resident-first while the decode
pool is spare, host-first when it is busy), FP8 rows moved as stored, seeded sampling and logprobs
across the hand-over, the prefill router over two prefill ranks, SGLang's per-role processes
(`--disaggregation-mode decode --nnodes 2 --node-rank 1`; DeepSeek-V4: tests/test_disagg_v4.py), aborts in every
state (also mid-transfer) freeing pages on both ranks, and a killed prefill or decode rank as
RankLost / HTTP 503 within the deadline, no process left.

Breakages tried by hand, and the test that caught each:
  - a layer's rows not sent (`disagg_wire.tensors_of` sends layer 0's latent rows as every layer's),
    or sent for the wrong layer (the latent rows rolled by one layer): test_tokens_equal_one_process,
    every preset (tokens differ)
  - the first token dropped (the decode rank continues from the prompt's last token instead of the
    one the prefill rank sampled): test_tokens_equal_one_process (tokens differ); recomputed (the
    decode rank imports n - 1 rows and prefills the last prompt token again, sampling it anew):
    test_tokens_equal_one_process (the decode rank's prefill_tokens is 8, not 0; tokens equal)
  - index keys not transferred (`tensors_of` sends zeros for them): test_tokens_equal_one_process
    (tokens differ: index_topk 16 < the prompt lengths)
  - rows placed host-first while claiming resident (kv/hier/arrival.py taking the host-first branch
    for every arrival, the admission's claim left resident): test_tokens_equal_one_process[adaptive],
    [adaptive+spec] and test_host_first_when_the_decode_pool_is_busy (the decode rank's placement
    checker fails, RankLost); test_host_first_while_claiming_resident_is_caught does the same by hook
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from dhisparse import LLM
from dhisparse.cli import build_parser
from dhisparse.cli.args import engine_config
from dhisparse.core.parallel import RankLost
from dhisparse.core.params import SamplingParams
from dhisparse.engine.config import ConfigValueError, EngineConfig
from dhisparse.engine.disagg import least_loaded
from dhisparse.engine.disagg_launch import build_disagg
from dhisparse.engine.disagg_round import DisaggMetrics
from dhisparse.engine.distributed import Load
from dhisparse.engine.engine import Engine
from dist_hooks import generate_on, one_process_tokens, world_presets

PROMPTS = [[5 + (3 * i + j) % 90 for j in range(12 + 11 * i)] for i in range(8)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
POOLS = dict(dtype="float64", device="cpu", kv_pool_bytes=8 << 20, host_pool_bytes=16 << 20)
PD = dict(POOLS, dist_timeout_s=20.0, disaggregation_prefill_size=1, disaggregation_decode_size=1)
CHECKER = "disagg_hooks:placement_checker"


def world(preset: str = "resident", hook: str | None = CHECKER, **kw):
    return build_disagg(EngineConfig(model="tiny", preset=preset, **(PD | kw)), on_engine=hook)


def closed(eng) -> None:
    eng.close()
    assert not torch.distributed.is_initialized() and all(not p.is_alive() for p in eng.procs)


def test_layout_flags_and_refusals_name_the_flag():
    p = build_parser()
    cfg = engine_config(p.parse_args(["serve", "--disaggregation-prefill-size", "2", "--disaggregation-decode-size", "3"]),
                        full_loader=True)
    lay = cfg.disagg_layout()
    assert cfg.disaggregated and lay.world_size == 5 and list(lay.decode_ranks) == [2, 3, 4]
    assert not cfg.parallel_config().distributed  # engine/launch.py never mistakes it for data parallelism
    node = EngineConfig(disaggregation_mode="decode", nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert node.disagg_layout().node_role == "decode" and list(node.disagg_layout().parallel_config().local_ranks()) == [1]
    for kw, flag in [(dict(disaggregation_mode="prefill"), "--disaggregation-mode"),
                     (dict(disaggregation_prefill_size=2), "--disaggregation-decode-size"),
                     (dict(disaggregation_mode="decode", nnodes=2, dist_init_addr="h:1"), "--disaggregation-mode is decode"),
                     (dict(disaggregation_prefill_size=1, disaggregation_decode_size=1, dp_size=2), "--dp-size"),
                     (dict(disaggregation_mode="prefill", nnodes=2), "--dist-init-addr"),
                     (dict(disaggregation_prefill_size=3, disaggregation_decode_size=1, nnodes=2, dist_init_addr="h:1",
                           disaggregation_mode="prefill"), "--disaggregation-prefill-size 3")]:
        with pytest.raises(ConfigValueError, match=flag):
            EngineConfig(**kw)
    loads = {0: Load(2, 100), 1: Load(1, 10), 2: Load(1, 50)}
    placed = {0: 0, 1: 0, 2: 1}
    assert least_loaded(loads, placed) == 1 and least_loaded(loads, placed, cap=2) == 1  # rank 2 holds 2 now
    assert least_loaded(loads, {0: 0, 1: 1, 2: 1}, cap=2) is None  # no decode rank with room: the KV stays held
    with pytest.raises(ValueError, match="build_disagg"):  # one Engine never silently ignores the layout
        Engine(EngineConfig(model="tiny", disaggregation_prefill_size=1, disaggregation_decode_size=1))


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    return one_process_tokens(PROMPTS, GREEDY)


def test_a_prefill_rank_takes_its_own_host_pool(references):
    """--disaggregation-prefill-host-pool-bytes: the prefill rank's host pool is a quarter of the decode
    rank's (it holds only its in-flight prompts) and the world still gives one process's tokens.
    (Breakage tried: rank_engine ignoring the setting: the page totals are equal.)"""
    eng = world("hisparse", disaggregation_prefill_host_pool_bytes=4 << 20)
    try:
        llm = LLM.__new__(LLM)
        llm.engine = eng
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == references["hisparse"]
        prefill, decode = (s.as_dict() for s in eng.rank_stats())
        assert 4 * prefill["host_pages_total"] <= decode["host_pages_total"] + 4
    finally:
        closed(eng)


@pytest.mark.parametrize("preset", world_presets())
def test_tokens_equal_one_process(preset, references):
    """Every rank checks its rows (I2); the decode rank also checks each arrived prompt's placement,
    here resident-first (its pool is spare), and computes no prompt token."""
    eng = world(preset)
    try:
        llm = LLM.__new__(LLM)
        llm.engine = eng
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == references[preset]
        prefill, decode = eng.rank_stats()
        assert (prefill.admitted, decode.admitted, decode.prefill_tokens) == (8, 8, 0)
        assert prefill.prefill_tokens == sum(map(len, PROMPTS))
        c = eng.stats().counters
        assert (c["disagg_handed_over"], c["disagg_received"], c["disagg_resident_first"], c["disagg_host_first"]) == (8, 8, 8, 0)
        assert c["disagg_sent_bytes"] == c["disagg_received_bytes"] > 0 and c["disagg_held"] == 0
        for o in outs:
            m = o.metrics
            assert isinstance(m, DisaggMetrics) and m.prompt_len == len(PROMPTS[outs.index(o)])
            assert min(m.prefill, m.handoff, m.transfer, m.alloc_wait) >= 0 and m.transfer <= m.handoff
            assert m.ttft >= m.prefill + m.handoff + m.alloc_wait - 1e-3 and m.output_len == 12
    finally:
        closed(eng)


def test_per_role_processes_form_one_world(references):
    """SGLang's per-role form on one host: `dhisparse serve --disaggregation-mode decode --nnodes 2
    --node-rank 1` in its own process runs the decode rank; node 0 (this process, mode prefill) fronts it."""
    import subprocess
    import sys

    from dhisparse.engine.launch import free_addr

    addr = free_addr()
    node = dict(nnodes=2, dist_init_addr=addr)
    flags = ["--model-path", "tiny", "--device", "cpu", "--dtype", "float64", "--kv-pool-bytes", str(8 << 20),
             "--host-pool-bytes", str(16 << 20), "--dist-timeout", "20", "--port", "0", "--skip-server-warmup"]
    decode = subprocess.Popen([sys.executable, "-m", "dhisparse", "serve", *flags, "--disaggregation-mode", "decode",
                               "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr])
    try:
        roles = dict(disaggregation_mode="prefill", disaggregation_prefill_size=0, disaggregation_decode_size=0)
        eng = build_disagg(EngineConfig(model="tiny", **(PD | node | roles)))
        try:
            assert eng.procs == [] and generate_on(eng, PROMPTS, GREEDY) == references["resident"]
        finally:
            closed(eng)
        assert decode.wait(timeout=30) == 0
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait()


def test_fp8_rows_travel_as_stored():
    """--kv-cache-dtype fp8_e4m3: the rows move as their stored FP8 bytes (core/kvformat.py) and the
    decode rank decodes the same tokens as one process."""
    fp8 = dict(POOLS, dtype="float32", kv_cache_dtype="fp8_e4m3")
    ref = [o.token_ids for o in LLM("tiny", preset="adaptive", **fp8).generate(PROMPTS, GREEDY)]
    eng = world("adaptive", **fp8)
    try:
        assert generate_on(eng, PROMPTS, GREEDY) == ref
        c = eng.stats().counters
        cfg = eng.model_config
        fp32_latent = sum(map(len, PROMPTS)) * cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
        assert 0 < c["disagg_received_bytes"] < fp32_latent  # FP8 bytes, index keys included
    finally:
        closed(eng)


def test_host_first_when_the_decode_pool_is_busy():
    """A 3 MiB pool and long prompts: early arrivals keep their prompts as optional history, so
    later ones find no spare pages and are admitted host-first; tokens still equal one process's."""
    prompts = [[7 + (5 * i + 3 * j) % 200 for j in range(150 + 7 * i)] for i in range(10)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    small = dict(kv_pool_bytes=3 << 20, max_num_batched_tokens=512)
    ref = [o.token_ids for o in LLM("tiny", preset="adaptive", **(POOLS | small)).generate(prompts, params)]
    eng = world("adaptive", **small)
    try:
        assert generate_on(eng, prompts, params) == ref
        c = eng.stats().counters
        assert c["disagg_host_first"] >= 1 and c["disagg_resident_first"] >= 1, c
        assert c["disagg_host_first"] + c["disagg_resident_first"] == len(prompts)
    finally:
        closed(eng)


def test_host_first_while_claiming_resident_is_caught():
    eng = world("adaptive", hook="disagg_hooks:hosted_as_resident_on_decode")
    try:
        with pytest.raises(RankLost):
            generate_on(eng, PROMPTS[3:5], GREEDY)
    finally:
        closed(eng)


def until(eng, pred, seen: list, limit: int = 400) -> None:
    for _ in range(limit):
        if pred():
            return
        seen += eng.step()
    raise AssertionError("the state was never reached")


def test_aborts_in_every_state_free_pages_on_both_ranks():
    """One request slot per rank (a decode rank then takes at most 2): requests aborted while
    prefilling, held on the prefill rank, moving (the transfer already scheduled: aborted on the
    decode rank right after it lands), waiting for decode pages and decoding."""
    eng = world("adaptive", max_running_requests=1, max_num_batched_tokens=16)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    seen: list = []
    try:
        r = [eng.add_request(PROMPTS[i + 2], long) for i in range(4)]
        until(eng, lambda: eng.owner.get(r[0]) == 1 and r[2] in eng.ready, seen)  # r0 decoding, r1 waits there, r2 held
        assert eng.abort(r[2]) and eng.abort(r[1])  # held on the prefill rank; waiting on the decode rank
        until(eng, lambda: any(h.request_id == r[3] for _, _, h in eng._pending.transfers), seen)
        assert eng.abort(r[3])  # moving
        assert eng.abort(r[0]) and not eng.abort(r[0])  # decoding
        late = eng.add_request(PROMPTS[6], long)
        eng.step()
        assert eng.abort(late)  # prefilling (16 tokens a step)
        aborted = set(r) | {late}
        marks = len(seen)
        for _ in range(4):
            seen += eng.step()
        assert not any(o.request_id in aborted for o in seen[marks:]) and not eng.has_unfinished()
        assert [s.kv_pages_used for s in eng.rank_stats()] == [0, 0]
        prefill, decode = eng.rank_stats()
        assert prefill.counters["disagg_held"] == 0 and decode.running == decode.waiting == 0
        assert decode.counters["disagg_received"] == 3  # r0, r1 and r3 (mid-transfer) landed, then were aborted
    finally:
        closed(eng)


def streamed(engine, params: list[SamplingParams]) -> list[tuple[list[int], list]]:
    """(token ids, logprobs of every report) of each of PROMPTS, run to completion."""
    rids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    got: dict[str, tuple[list[int], list]] = {r: ([], []) for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].extend(o.logprobs or [])
    return [got[r] for r in rids]


def test_two_prefill_ranks_sampling_state_travels_and_a_killed_prefill_rank_is_rank_lost():
    """Least-loaded placement over two prefill ranks; seeded sampling with penalties and logprobs
    equal one process's (the generator state and the first token's logprob travel); then prefill
    rank 1 is killed: RankLost within the deadline, no process left."""
    sampled = [SamplingParams(max_tokens=10, temperature=0.9, top_k=40, seed=11 + i, frequency_penalty=0.5,
                              logprobs=2, ignore_eos=True) for i in range(len(PROMPTS))]
    ref = streamed(LLM("tiny", preset="resident", **POOLS).engine, sampled)
    eng = world("resident", disaggregation_prefill_size=2)
    (prefill1, decode) = eng.procs
    try:
        got = streamed(eng, sampled)
        assert [t for t, _ in got] == [t for t, _ in ref] and all(len(t) == 10 for t, _ in got)
        for (toks, lps), (_, want) in zip(got, ref):  # the first token's logprobs come from the prefill rank
            assert [lp.token for lp in lps] == toks
            assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in want], abs=1e-9)
        assert all(s.admitted >= 3 for s in eng.rank_stats()[:2]), [s.admitted for s in eng.rank_stats()]
        for p in PROMPTS[:4]:
            eng.add_request(p, SamplingParams(max_tokens=2000, ignore_eos=True))
        eng.step()
        os.kill(prefill1.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankLost, match="lost"):
            for _ in range(2000):
                eng.step()
        assert time.monotonic() - t0 < PD["dist_timeout_s"] + 3.0
    finally:
        eng.close()
    for p in eng.procs:
        p.join(timeout=10)
    assert not torch.distributed.is_initialized() and all(not p.is_alive() for p in eng.procs)


def test_the_server_answers_503_when_the_decode_rank_dies():
    """One endpoint over 1 prefill + 1 decode: a completion decoded on rank 1; the decode rank is
    killed mid-stream: the stream ends with a 503 error chunk, /health and new completions are 503."""
    import httpx

    from dhisparse.server.app import ServerConfig
    from dhisparse.server.runner import ServerThread

    eng = world("hisparse", hook=None)
    (decode,) = eng.procs
    try:
        with ServerThread(eng, ServerConfig(drain_timeout_s=2)) as srv:
            short = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True}
            r = httpx.post(srv.url + "/v1/completions", json=short, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
            metrics = httpx.get(srv.url + "/metrics", timeout=5).text
            assert "dhisparse_handoff_seconds_count" in metrics and "dhisparse_engine_disagg_received" in metrics
            body = dict(short, max_tokens=4000, stream=True)
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as resp:
                lines = resp.iter_lines()
                chunks = [next(lines), next(lines)]  # decoding on rank 1 by now (the first token comes from there)
                os.kill(decode.pid, signal.SIGKILL)
                t0 = time.monotonic()
                chunks += list(lines)
            assert time.monotonic() - t0 < PD["dist_timeout_s"] + 3.0
            assert any("\"code\":\"rank_lost\"" in c for c in chunks), chunks[-4:]
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
            assert httpx.post(srv.url + "/v1/completions", json=short, timeout=5).status_code == 503
    finally:
        eng.close()
    decode.join(timeout=5)
    assert not decode.is_alive() and not torch.distributed.is_initialized()


def test_llm_builds_a_disaggregated_world_through_launch_build():
    """`LLM(...)` with the disaggregation sizes goes through `engine/launch.build` to a
    DisaggCoordinator (breakage caught: build() without its disaggregation branch makes the
    Engine refuse the config)."""
    llm = LLM("tiny", preset="adaptive", **PD)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == one_process_tokens(PROMPTS[:2], GREEDY)["adaptive"]
    finally:
        closed(llm.engine)
