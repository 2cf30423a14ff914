"""Reference replay (engine/replay.py, `EngineConfig.replay_reference`), a benchmark measurement tool:
requests emit the reference's tokens, the model runs on them (its KV history is the reference's), and
the oracle's rounds are judged against them, so its acceptance is the one set even where the target's
own greedy output would leave the reference.

Breakages tried (each fails here): the sampled token not replaced (`sampled` returns the model's);
the round judged against the target (`verified` returns `own`); agreement judged at the next position;
a finished request's entry kept (`forget` a no-op)."""

from __future__ import annotations

import pytest

from dhisparse import SamplingParams
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.llm import LLM
from dhisparse.engine.replay import ReferenceReplay
from dhisparse.spec.verify import Acceptance

N = 10
GREEDY = SamplingParams(max_tokens=N, ignore_eos=True)
PROMPTS = [[3 + (7 * i + 5 * j) % 250 for j in range(20 + 23 * i)] for i in range(2)]


@pytest.fixture(scope="module")
def own() -> list[list[int]]:
    """The tiny model's own greedy outputs."""
    return [o.token_ids for o in LLM("tiny").generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def forced(own) -> dict:
    """A reference that is not the model's output: its own with every third token moved, so the model's
    agreement with it is neither all nor nothing."""
    return {tuple(p): [(t + 1) % 256 if j % 3 == 1 else t for j, t in enumerate(o)] for p, o in zip(PROMPTS, own)}


def _engine(reference, **kw) -> Engine:
    return Engine(EngineConfig(hot_cache_rows=16, debug_checks=True, replay_reference=True, **kw), oracle_reference=reference)


def _generate(engine: Engine, prompts) -> list[list[int]]:
    llm = LLM.__new__(LLM)
    llm.engine = engine
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def _own_agreement(forced: dict) -> int:
    """Positions j where the model's own greedy token after prompt + ref[:j] is ref[j]: what a replay
    whose model ran on the reference's tokens must count as agreed."""
    llm = LLM("tiny")
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    prompts = [list(p) + ref[:j] for p, ref in forced.items() for j in range(N)]
    wanted = [ref[j] for ref in forced.values() for j in range(N)]
    return sum(o.token_ids[0] == w for o, w in zip(llm.generate(prompts, one), wanted))


@pytest.mark.parametrize("preset", ["resident", "hisparse"])
def test_sampled_steps_emit_the_reference_and_run_on_it(forced, preset):
    engine = _engine(forced, preset=preset)
    assert _generate(engine, PROMPTS) == [forced[tuple(p)] for p in PROMPTS]
    st = engine.stats().as_dict()
    assert st["replay_forced_tokens"] == st["replay_judged"] == N * len(PROMPTS)
    agreed = round(st["replay_agreement"] * st["replay_judged"])
    assert agreed == _own_agreement(forced)  # the model's own token after the reference's history
    assert 0 < agreed < N * len(PROMPTS) and st["replay_missing_requests"] == 0
    assert not engine.replay._refs  # finished requests are forgotten


def test_oracle_rounds_keep_their_set_acceptance_on_a_reference_the_model_leaves(forced, monkeypatch):
    """Without replay the model leaves this reference at its second token, so the oracle's drafts stop
    matching; replayed, the rounds are judged against the reference and emit it. The oracle's draws are
    seeded by request id, which a process-wide counter hands out, so the ids start from 0 here: with
    whatever ran before in the worker, one suite run drew 2.0 tokens a round (the bound was 2.5) for these
    few rounds."""
    import itertools

    import dhisparse.engine.request as request_module

    monkeypatch.setattr(request_module, "_ids", itertools.count())
    spec = dict(preset="hisparse", speculative_algorithm="oracle", speculative_num_draft_tokens=4,
                speculative_oracle_tokens_per_round=3.5)
    plain = Engine(EngineConfig(hot_cache_rows=16, debug_checks=True, **spec), oracle_reference=forced)
    _generate(plain, PROMPTS)
    off = plain.stats().as_dict()
    assert off["oracle_off_reference_share"] > 0.5
    engine = _engine(forced, **spec)
    assert _generate(engine, PROMPTS) == [forced[tuple(p)] for p in PROMPTS]
    st = engine.stats().as_dict()
    # these few rounds drew 2.25-3.0 tokens a round over ten id offsets (set: 3.5)
    assert st["oracle_off_reference_share"] == 0.0 and st["spec_tokens_per_round"] > 2.0
    assert st["spec_tokens_per_round"] > off["spec_tokens_per_round"] + 0.5, (st["spec_tokens_per_round"], off["spec_tokens_per_round"])
    assert st["replay_forced_tokens"] == N * len(PROMPTS) and 0 < st["replay_judged"] < N * len(PROMPTS)


def test_replay_needs_the_reference():
    with pytest.raises(ValueError, match="replay_reference"):
        Engine(EngineConfig(replay_reference=True))


def test_without_a_reference_or_past_its_end_the_model_decides():
    rp = ReferenceReplay({(1, 2): [7, 8]})
    assert rp.sampled("a", [5], 0, 9) == 9 and rp.stats()["replay_missing_requests"] == 1
    assert rp.sampled("b", [1, 2], 1, 9) == 8 and rp.sampled("b", [1, 2], 2, 9) == 9
    own = Acceptance(0, [4], 1)
    assert rp.verified("b", [1, 2], 0, [7, 8], own) is own  # the round reaches past the reference
    assert rp.verified("b", [1, 2], 0, [7], own) == Acceptance(1, [7, 8], 2)
    assert rp.stats() == {"replay_forced_tokens": 3, "replay_judged": 2, "replay_agreement": 0.0,
                          "replay_missing_requests": 1}
    rp.forget("b")
    assert "b" not in rp._refs

    def file_reference(prompt):  # a callable reference that refuses a prompt it lacks
        if prompt != [1, 2]:
            raise KeyError(tuple(prompt))
        return [7, 8]

    rf = ReferenceReplay(file_reference)
    assert rf.sampled("c", [5], 0, 9) == 9 and rf.sampled("d", [1, 2], 0, 9) == 7 and rf.missing == 1
