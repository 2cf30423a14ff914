"""The costed oracle (issue 31 item 3a; spec/oracle.py `CostedOracle`): a network drafter runs every
round and holds its memory while the oracle's tokens replace its drafts. It must give the plain
oracle's tokens and rounds (same seed), run the drafter's network once per drafting call, and be
charged the drafter's weights and ring. Breakage tried: returning the inner drafter's proposals
(the rounds and acceptance change: the first test fails)."""

from __future__ import annotations

import pytest

from dhisparse import SamplingParams
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.llm import LLM
from dhisparse.spec.config import SpecConfig, SpecConfigError
from dhisparse.spec.oracle import CostedOracle

GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)
PROMPTS = [[3 + (7 * i + 5 * j) % 250 for j in range(20 + 23 * i)] for i in range(3)]


def _reference(model: str) -> tuple[list[list[int]], dict]:
    ps = PROMPTS if model == "tiny" else [[5 + (11 * i + j) % 3000 for j in range(40)] for i in range(2)]
    return ps, {tuple(p): o.token_ids for p, o in zip(ps, LLM(model).generate(ps, GREEDY))}


def _llm(model: str, reference: dict, **kw) -> LLM:
    llm = LLM.__new__(LLM)
    llm.engine = Engine(EngineConfig(model=model, speculative_algorithm="oracle", speculative_num_draft_tokens=4,
                                     speculative_oracle_tokens_per_round=2.5, **kw), oracle_reference=reference)
    return llm


@pytest.mark.parametrize("network,preset,model", [("dflash2", "adaptive", "tiny"), ("dflash", "resident", "tiny"),
                                                  ("mtp", "hisparse", "tiny-code")])
def test_costed_oracle_gives_the_oracles_rounds_and_runs_the_network(network, preset, model, monkeypatch):
    prompts, reference = _reference(model)
    plain = _llm(model, reference, preset=preset)
    costed = _llm(model, reference, preset=preset, speculative_oracle_drafter=network)
    d = costed.engine.spec.drafter
    assert isinstance(d, CostedOracle) and d.capture_layers == d.inner.capture_layers
    calls = []
    orig = d.inner.propose
    monkeypatch.setattr(d.inner, "propose", lambda reqs: calls.append(len(reqs)) or orig(reqs))
    for llm in (plain, costed):
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [reference[tuple(p)] for p in prompts]
    b = costed.engine.stats().as_dict()
    # the oracle's acceptance (calibrated to 2.5 tokens a round at width 4; ~30 rounds), not the random
    # drafter's (about 1.0)
    assert b["spec_tokens_per_round"] > 1.5, b["spec_tokens_per_round"]
    assert len(calls) == b["spec_draft_calls"] > 0  # the network ran in every drafting call
    assert d.device_bytes().weights > 0 or network == "mtp"  # its weights are charged (MTP's are the target's)
    assert d.device_bytes() == d.inner.device_bytes()
    assert plain.engine.spec.drafter.device_bytes().weights == 0


def test_costed_oracle_proposes_the_oracles_tokens():
    """Over the same requests, the costed oracle's proposals are the plain oracle's (same seed)."""
    from dhisparse.spec.drafter import DraftRequest, DraftProposal
    from dhisparse.spec.oracle import OracleDrafter

    ref = {(1, 2, 3): [7, 8, 9, 10, 11, 12]}

    class Network:  # a drafter whose own drafts are always wrong
        capture_layers, feature_window, proposed = (0,), 4, 0

        def propose(self, reqs):
            self.proposed += 1
            return [DraftProposal([0] * (r.max_width - 1), None, [1.0] * (r.max_width - 1)) for r in reqs]

    net = Network()
    costed = CostedOracle(net, OracleDrafter(ref, 50, 0.3, seed=1))
    plain = OracleDrafter(ref, 50, 0.3, seed=1)
    for n in range(3):
        req = DraftRequest.from_history("a", [1, 2, 3] + [7, 8, 9][:n] + [5], 4, num_prompt_tokens=3)
        assert costed.propose([req])[0].tokens == plain.propose([req])[0].tokens
    assert net.proposed == 3


def test_costed_oracle_settings_are_checked():
    with pytest.raises(SpecConfigError, match="speculative-oracle-drafter"):
        SpecConfig(algorithm="dflash", oracle_drafter="dflash2")
    with pytest.raises(SpecConfigError, match="speculative-oracle-drafter"):
        SpecConfig(algorithm="oracle", oracle_drafter="ngram")
    assert SpecConfig(algorithm="oracle", oracle_drafter="dspark").oracle_drafter == "dspark"
