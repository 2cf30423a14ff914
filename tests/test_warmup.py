"""Engine warm-up (`dhisparse.engine.warmup`): what it runs, that it leaves no state behind (pages
free again, later outputs unchanged), the deadline, and `dhisparse serve`'s flags."""

from __future__ import annotations

import pytest

from dhisparse import SamplingParams
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.warmup import WARMUP_TOKENS, server_prompt, warm_up, warm_up_server

PROMPT = [3 + (11 * j) % 250 for j in range(70)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def run(engine: Engine, prompt=PROMPT) -> list[int]:
    rid = engine.add_request(prompt, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return list(out.token_ids)
    raise AssertionError("request did not finish")


@pytest.mark.parametrize("preset", ["resident", "hisparse", "adaptive"])
def test_warm_up_leaves_no_state_and_outputs_unchanged(preset):
    cold = run(Engine(EngineConfig(preset=preset, hot_cache_rows=16, debug_checks=True)))
    eng = Engine(EngineConfig(preset=preset, hot_cache_rows=16, debug_checks=True))
    free = eng.store.pool.num_free
    rep = warm_up_server(eng, batch=3)
    assert (rep.requests, rep.tokens, rep.drafted) == (3, 3 * WARMUP_TOKENS[0], None)
    assert not eng.has_unfinished() and eng.store.pool.num_free == free
    eng.store.pool.check_integrity()
    assert run(eng) == cold


@pytest.mark.parametrize("algorithm", ["dflash", "ngram"])
def test_speculative_warm_up_runs_until_a_round_verified_drafts(algorithm):
    eng = Engine(EngineConfig(preset="adaptive", hot_cache_rows=16, speculative_algorithm=algorithm,
                              speculative_num_draft_tokens=4, debug_checks=True))
    rep = warm_up_server(eng)
    assert not eng.has_unfinished()
    if algorithm == "dflash":  # drafts a whole block every round: one warm-up round is enough
        assert rep.drafted is True and rep.requests == 1
    else:  # n-gram drafts only when the output repeats: longer rounds until it does, or all of them
        assert rep.drafted or rep.requests == len(WARMUP_TOKENS)


def test_speculation_forgets_what_the_warm_up_taught_it():
    """The online policy's acceptance and the measured round costs go back to their priors after
    a warm-up (session 23 on the H200: its 4-token rounds left a ~0-ms width-1 cost and eager
    widths at 10x a round's cost in the table, which turned speculation off for seconds).
    Breakage caught: warm_up without forget_learning."""
    eng = Engine(EngineConfig(preset="adaptive", hot_cache_rows=16, speculative_algorithm="dflash",
                              speculative_num_draft_tokens=4, speculative_policy="online"))
    policy = eng.spec.online
    warm_up_server(eng, batch=2)
    assert eng.spec.counters.rounds > 0  # the warm-up did verify rounds ...
    assert policy.judged == [0] * 3 and policy.acceptance == [policy.prior] * 3  # ... and taught nothing
    assert eng.spec.cost.measured == {} and policy.decide(2).probe  # start-up measuring again


def test_every_rank_of_a_world_forgets_with_the_next_round():
    """Control(forget=True) reaches every rank's engine before its share of the round (DP / TP
    and prefill / decode worlds)."""
    from types import SimpleNamespace

    from dhisparse.engine import disagg_round, distributed

    class Rank:
        forgot = 0

        def forget_learning(self):
            self.forgot += 1

    eng = Rank()
    distributed.apply(eng, 1, distributed.Control(forget=True))
    distributed.apply(eng, 1, distributed.Control())
    assert eng.forgot == 1
    side = SimpleNamespace(engine=Rank(), rank=1, transferred=lambda *a: None, load=lambda: None,
                           collect=lambda outs: ([], []), stats=lambda: None, exported=lambda: [],
                           outgoing=lambda: [])
    wire = SimpleNamespace(run=lambda transfers, outgoing: [])
    disagg_round.serve_round(side, wire, disagg_round.DControl(forget=True, beat=True))
    assert side.engine.forgot == 1


def test_deadline_aborts_what_is_left():
    eng = Engine(EngineConfig(preset="hisparse", hot_cache_rows=16))
    free = eng.store.pool.num_free
    rep = warm_up(eng, lambda i: PROMPT, batch=2, timeout_s=1e-9)
    assert rep.requests == 2 and rep.tokens == 0
    assert not eng.has_unfinished() and eng.store.pool.num_free == free


def test_bad_batch_and_short_max_model_len():
    eng = Engine(EngineConfig(max_model_len=20))
    with pytest.raises(ValueError, match="batch"):
        warm_up(eng, lambda i: PROMPT, batch=0)
    ids = server_prompt(eng, 5, max_tokens=19)
    assert len(ids) == 1  # what max_model_len leaves
    rep = warm_up_server(eng)
    assert rep.requests == 1 and rep.tokens == WARMUP_TOKENS[0] and not eng.has_unfinished()


def test_serve_flags(monkeypatch, capsys):
    from dhisparse.cli import main
    import dhisparse.server.runner as runner

    served = []
    monkeypatch.setattr(runner, "serve", lambda engine, config, **kw: served.append(engine))
    assert main(["serve", "--warmup-timeout", "0"]) == 2
    assert "--warmup-timeout" in capsys.readouterr().err and not served
    assert main(["serve"]) == 0 and len(served) == 1
    assert "warm-up ran 1 requests" in capsys.readouterr().out
    assert main(["serve", "--skip-server-warmup"]) == 0 and len(served) == 2
    assert "warm-up" not in capsys.readouterr().out
