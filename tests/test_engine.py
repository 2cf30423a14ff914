"""Resident engine on the built-in tiny model: batching invariance, chunked prefill, prefix
import, waiting under a small pool, aborts, and bad input."""

from __future__ import annotations

import pytest

from dhisparse import SamplingParams
from dhisparse.engine.config import ConfigValueError, EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.llm import LLM

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    return [[3 + (7 * i + 5 * j) % 250 for j in range(5 + 9 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", debug_checks=True)


def test_alone_equals_in_batch_of_8(llm):
    ps = prompts(8)
    batch = [o.token_ids for o in llm.generate(ps, GREEDY)]
    for p, tokens in zip(ps, batch):
        assert llm.generate([p], GREEDY)[0].token_ids == tokens
    assert len({tuple(t) for t in batch}) > 1


def test_chunked_prefill_matches_one_pass(llm):
    ps = prompts(3)
    ref = [o.token_ids for o in llm.generate(ps, GREEDY)]
    chunked = LLM("tiny", max_num_batched_tokens=7, debug_checks=True)
    assert [o.token_ids for o in chunked.generate(ps, GREEDY)] == ref


def test_prefix_import_matches_full_prefill():
    base = LLM("tiny", debug_checks=True)
    prefix = prompts(6)[5]
    full = [prefix + [40 + i, 41 + i] for i in range(3)]
    ref = [o.token_ids for o in base.generate(full, GREEDY)]
    fresh = LLM("tiny", debug_checks=True)
    assert fresh.prepare_prefix(prefix) == len(prefix)
    outs = fresh.generate(full, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert all(o.metrics.imported_len == len(prefix) for o in outs)
    # a prompt equal to the prefix imports all but its last token
    again = fresh.generate([prefix], GREEDY)[0]
    assert again.metrics.imported_len == len(prefix) - 1
    # preparing it again keeps the stored prefix: no second prefill
    item, steps = fresh.engine.prefixes.get(prefix), fresh.engine.stats().steps
    assert fresh.prepare_prefix(prefix) == len(prefix)
    assert fresh.engine.prefixes.get(prefix) is item and fresh.engine.stats().steps == steps


def test_requests_wait_when_pool_is_small():
    eng = LLM("tiny", kv_pool_bytes=8 * 6 * 16 * 40 * 4, page_size=16, debug_checks=True).engine
    assert eng.store.pool.num_pages == 8
    ids = [eng.add_request(p, GREEDY) for p in prompts(5)]
    seen_waiting = False
    done: set[str] = set()
    while eng.has_unfinished():
        seen_waiting |= eng.stats().waiting > 0
        done |= {o.request_id for o in eng.step() if o.finished}
    assert done == set(ids) and seen_waiting
    assert eng.stats().kv_pages_used == 0


def test_abort_frees_pages():
    eng = Engine(EngineConfig(debug_checks=True))
    a = eng.add_request(prompts(2)[1], SamplingParams(max_tokens=50))
    eng.add_request(prompts(1)[0], SamplingParams(max_tokens=3))
    eng.step()
    assert eng.stats().kv_pages_used > 0
    assert eng.abort(a) and not eng.abort(a)
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().kv_pages_used == 0
    eng.store.check_integrity()


def test_stop_token_and_eos():
    llm = LLM("tiny")
    out = llm.generate([prompts(1)[0]], GREEDY)[0]
    stop_id = out.token_ids[5]
    first = out.token_ids.index(stop_id)
    stopped = llm.generate([prompts(1)[0]], SamplingParams(max_tokens=24, stop_token_ids=(stop_id,)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == out.token_ids[: first + 1]


def test_seeded_sampling_is_reproducible(llm):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    a = llm.generate([prompts(1)[0]], sp)[0].token_ids
    b = llm.generate(prompts(4), [sp] + [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(3)])[0].token_ids
    assert a == b


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([5] * 9000, SamplingParams(max_tokens=4), "max_model_len"),
        ([5, 999999], SamplingParams(max_tokens=4), "vocabulary"),
    ],
)
def test_bad_requests(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params)


def test_empty_prompt_uses_bos(llm):
    out = llm.generate([""], SamplingParams(max_tokens=3))[0]
    assert out.metrics.prompt_len == 1


def test_bad_settings():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigValueError, match="preset must be one of"):
        EngineConfig(preset="hisparse+magic")
    with pytest.raises(ConfigValueError, match="unknown engine setting"):
        EngineConfig.from_kwargs(pagesize=4)
    with pytest.raises(ValueError, match="model"):
        LLM("/no/such/folder")


def test_ids_from_equals_a_slice_of_all_ids():
    """The scheduler's decode chunks read ids_from(start) instead of slicing all_ids."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as hs

    from dhisparse.engine.request import Request

    @settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a busy GPU host generates slowly
    @given(hs.lists(hs.integers(0, 9), min_size=1, max_size=6), hs.lists(hs.integers(0, 9), max_size=6), hs.integers(0, 14))
    def check(prompt, output, start):
        req = Request("r", prompt, SamplingParams())
        req.output_ids = list(output)
        assert req.ids_from(start) == req.all_ids[start:]

    check()


def test_step_graph_warmup_flag():
    """--step-graph-warmup turns on start-up capture of the step graphs (off by default)."""
    import argparse

    from dhisparse.cli.args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args(["--step-graph-warmup"])).step_graph_warmup is True
    assert engine_config(p.parse_args([])).step_graph_warmup is False
