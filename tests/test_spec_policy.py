"""DSpark width choice, VerifyCost, static / online width policy (eq. 13) and SpecConfig checks."""

from __future__ import annotations

import random

import pytest

from dhisparse.spec.config import SpecConfig, SpecConfigError
from dhisparse.spec.drafter import DraftProposal, DraftRequest, StatelessDrafter
from dhisparse.spec.dspark import DSparkDrafter, VerifyCost, choose_width, expected_emitted
from dhisparse.spec.factory import build_drafter, static_schedule
from dhisparse.spec.ngram import NgramDrafter
from dhisparse.spec.policy import (
    MemoryModel, OnlineWidthPolicy, StaticWidthSchedule, output_ratio, speculation_pays,
)


def test_expected_emitted_is_one_plus_cumulative_products():
    assert expected_emitted([0.5, 0.5, 0.5], 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_emitted([0.9], 1) == 1.0 and expected_emitted([], 8) == 1.0


def test_dspark_picks_wide_for_confident_and_narrow_for_unconfident_drafts():
    cost = VerifyCost.linear(base=1.0, per_query=0.08)
    assert choose_width([0.95] * 7, cost, k_max=8) == 8
    assert choose_width([0.05] * 7, cost, k_max=8) == 1
    assert choose_width([0.9, 0.9, 0.1, 0.9, 0.9, 0.9, 0.9], cost, k_max=8) == 3
    assert choose_width([0.95] * 7, cost, k_max=4) == 4  # bounded by K_max
    assert choose_width([0.95] * 2, cost, k_max=8) == 3  # bounded by the drafts available


class FixedDrafter(StatelessDrafter):
    def __init__(self, confidences):
        self.confidences = confidences

    def propose(self, requests):
        return [DraftProposal(list(range(r.max_drafts)), None, self.confidences[: r.max_drafts]) for r in requests]


def test_dspark_drafter_truncates_each_proposal():
    cost = VerifyCost.linear(1.0, 0.08)
    sure, unsure = DSparkDrafter(FixedDrafter([0.95] * 7), cost), DSparkDrafter(FixedDrafter([0.05] * 7), cost)
    r = DraftRequest("a", [1, 2], 3, max_width=8)
    assert sure.propose([r])[0].tokens == list(range(7)) and unsure.propose([r])[0].tokens == []
    assert unsure.last_widths == [1]


def test_verify_cost_median_and_interpolation():
    cost = VerifyCost({1: 1.0, 4: 2.2, 8: 4.0})
    assert cost.cost(4) == 2.2 and cost.cost(2) == pytest.approx(1.4) and cost.cost(6) == pytest.approx(3.1)
    assert cost.cost(10) == pytest.approx(4.9)  # extrapolated from the last two points
    cost.update(4, 3.2)
    assert cost.cost(4) == pytest.approx(2.7)  # the median of its two samples
    cost.update(4, 2.4)
    assert cost.cost(4) == pytest.approx(2.4)
    one = VerifyCost({4: 2.0})
    assert one.cost(4) == 2.0 and one.cost(1) == pytest.approx(2.0 * 1.0 / 1.3)  # prior's shape
    timed = VerifyCost.measure(lambda w: None, [1, 2], repeats=2)
    assert set(timed.measured) == {1, 2}


def test_static_schedule_by_load():
    s = StaticWidthSchedule()
    assert [s.width(c) for c in (1, 8, 32, 33, 64, 127, 128, 256)] == [8, 8, 8, 6, 6, 6, 4, 4]
    assert s.width(8, k_max=6) == 6
    assert static_schedule(SpecConfig(static_schedule=((16, 8),), static_default_width=2)).width(17) == 2


def test_eq13_matches_the_paper_and_turns_speculation_off():
    assert output_ratio(0.99, 1.0, 0.77, 1.0) == pytest.approx(1.286, abs=1e-3)  # C128: 1.29x
    assert output_ratio(140, 208, 0.71, 1.0) == pytest.approx(0.948, abs=1e-3)  # C256: ~0.96x
    assert speculation_pays(0.99, 1.0, 0.77, 1.0) and not speculation_pays(140, 208, 0.71, 1.0)


def paper_like_policy() -> OnlineWidthPolicy:
    """Round of 4 queries costs 2.2 non-speculative steps; 208 vs 140 sessions fit in memory."""
    cost = VerifyCost({1: 1.0, 4: 2.2, 6: 2.8, 8: 3.6})
    memory = MemoryModel(capacity_bytes=20_800, session_bytes=100, spec_session_bytes=48)
    policy = OnlineWidthPolicy(k_max=8, cost=cost, memory=memory, widths=(4, 6, 8), ema=0.02, prior=0.5)
    rng = random.Random(0)
    for _ in range(6000):  # drafts accepted independently with probability 0.784 (2.88 tokens at width 4)
        a = 0
        while a < 7 and rng.random() < 0.784:
            a += 1
        policy.observe(8, a)
    return policy


def test_online_policy_from_acceptance_cost_and_memory():
    policy = paper_like_policy()
    assert policy.tokens_per_round(4) == pytest.approx(2.88, abs=0.1)
    assert policy.memory.sessions(256, True) == 140 and policy.memory.sessions(256, False) == 208
    on = policy.decide(concurrency=128)
    assert on.speculate and on.ratio > 1.2 and on.sessions == 128
    off = policy.decide(concurrency=256)
    assert not off.speculate and off.width == 1  # eq. 13: 140/208 sessions at ~0.77 TPOT does not pay
    assert policy.decide(concurrency=256, capacity_bytes=10**9).speculate  # plenty of memory -> on again


def test_online_policy_turns_off_for_a_useless_drafter():
    policy = OnlineWidthPolicy(k_max=4, cost=VerifyCost({1: 1.0, 4: 1.6}), ema=0.1)
    for _ in range(200):
        policy.observe(4, 0)
    assert policy.acceptance[0] < 0.01 and policy.decide(8).width == 1
    with pytest.raises(ValueError, match="accepted"):
        policy.observe(4, 4)


def test_spec_config_validation():
    cfg = SpecConfig()
    assert cfg.ring_rows == 2176 and cfg.block == 8
    with pytest.raises(SpecConfigError, match="--speculative-draft-window-size 4 is smaller than the draft block"):
        SpecConfig(draft_window_size=4)
    with pytest.raises(SpecConfigError, match="--speculative-draft-window-size 8 is smaller"):
        SpecConfig(draft_window_size=8, block_size=16)
    with pytest.raises(SpecConfigError, match="larger than K_max"):
        SpecConfig(num_draft_tokens=4, fixed_width=6)
    assert SpecConfig(num_draft_tokens=6).num_draft_tokens == 6  # schedule widths are capped at K_max
    with pytest.raises(SpecConfigError, match="--speculative-num-draft-tokens must be >= 2"):
        SpecConfig(num_draft_tokens=1, static_schedule=(), static_default_width=1)
    with pytest.raises(SpecConfigError, match="--speculative-algorithm"):
        SpecConfig(algorithm="eagle")
    with pytest.raises(SpecConfigError, match="not both"):
        SpecConfig(oracle_corrupt_rate=0.1, oracle_tokens_per_round=2.0)
    with pytest.raises(SpecConfigError, match="draft block"):
        SpecConfig(draft_window_size=2048).check_block(4096)
    SpecConfig().check_block(4096)  # no window given: the drafter's own, checked when it is built


def test_factory_builds_each_algorithm():
    from dhisparse.models.tiny import build_tiny
    target = build_tiny(0)
    assert isinstance(build_drafter(SpecConfig(algorithm="ngram"), target), NgramDrafter)
    oracle = build_drafter(SpecConfig(algorithm="oracle", oracle_tokens_per_round=2.88, fixed_width=4), target,
                           reference={(1,): [2, 3]})
    assert oracle.corrupt_rate == pytest.approx(0.216, abs=1e-3)
    with pytest.raises(SpecConfigError, match="reference run"):
        build_drafter(SpecConfig(algorithm="oracle"), target)
    dspark = build_drafter(SpecConfig(algorithm="dspark", draft_window_size=16, page_size=4), target, max_requests=2)
    assert isinstance(dspark, DSparkDrafter) and dspark.capture_layers == (1, 3)
    assert dspark.inner.window == 16 and dspark.inner.ring_rows == 28  # ceil((16 + 3 + 8) / 4) * 4


def scripted(policy: OnlineWidthPolicy, rounds: int, accepted, t1: float, tw: float) -> list[int]:
    """A scripted load at C8: each decision runs; a speculative round of width w accepts
    accepted(w) drafts and costs tw, a width-1 step costs t1 (what the engine feeds back)."""
    widths = []
    for _ in range(rounds):
        d = policy.decide(8)
        widths.append(d.width)
        if d.width > 1:
            policy.observe(d.width, accepted(d.width))
            policy.observe_cost(d.width, tw)
        else:
            policy.observe_cost(1, t1)
    return widths


@pytest.mark.parametrize("probe_every", [8, 0])
def test_probes_turn_a_drafter_that_became_useful_back_on(probe_every):
    policy = OnlineWidthPolicy(k_max=4, cost=VerifyCost({1: 1.0, 4: 1.6}), widths=(4,), ema=0.2, probe_every=probe_every)
    first = scripted(policy, 100, lambda w: 0, 1.0, 1.6)  # a useless drafter: speculation off
    assert first[-1] == 1 and policy.best(8)[0].width == 1
    frozen = policy.acceptance[0]
    later = scripted(policy, 200, lambda w: w - 1, 1.0, 1.6)  # every draft accepted from now on
    if probe_every:  # on again: every round wide but one narrow probe in nine
        assert policy.best(8)[0].width == 4 and later[-27:].count(4) == 24 and policy.acceptance[0] > 0.9
    else:  # no probes: no round is ever verified again, the estimate stays frozen and speculation off
        assert set(later) == {1} and policy.acceptance[0] == frozen


@pytest.mark.parametrize("probe_every", [8, 0])
def test_narrow_probes_measure_tpot0_instead_of_a_prior(probe_every):
    # only width 4 measured: cost(1) comes from the prior's shape (1.6 / 1.3), so speculation looks
    # worth it; the true plain step costs 0.3, and 2.5 tokens a round at 1.6 s lose to it
    policy = OnlineWidthPolicy(k_max=4, cost=VerifyCost({4: 1.6}), widths=(4,), ema=0.2, probe_every=probe_every)
    for _ in range(100):
        policy.observe(4, 1 if _ % 2 else 2)
    assert policy.best(8)[0].width == 4
    widths = scripted(policy, 60, lambda w: 1 if len(policy.cost._table) % 2 else 2, 0.3, 1.6)
    if probe_every:
        assert policy.cost.cost(1) == pytest.approx(0.3) and widths[-10:].count(1) >= 9  # off, measured
    else:
        assert set(widths) == {4} and policy.cost.cost(1) > 1.0  # never measured: on, on a prior


def test_unjudged_positions_are_priced_by_the_nearest_judged_one():
    """A policy that ran width 3 has judged positions 1-2 only; wider widths are priced with
    position 2's estimate, not the prior (with the prior, 0.6 against a measured ~0.7-0.85, eq. 13
    picks width 7 over 8 at this cost; on the H200 in session 20 the online policy ran ~2.3 tokens a
    round at C2 where width 8 gave 4.0)."""
    policy = OnlineWidthPolicy(k_max=8, cost=VerifyCost({1: 1.0, 8: 1.2}), ema=0.05, prior=0.6, probe_every=0)
    rng = random.Random(0)
    for _ in range(2000):  # conditional acceptance 0.8 at every position
        acc = next((i for i in range(2) if rng.random() > 0.8), 2)
        policy.observe(3, acc)
    assert policy.judged[:2] != [0, 0] and policy.judged[2:] == [0] * 5
    est = policy.estimates()
    assert est[0] == pytest.approx(0.8, abs=0.1) and est[2:] == [est[1]] * 5
    assert policy.acceptance[2:] == [0.6] * 5  # the raw EMA of unjudged positions is untouched
    assert policy.best(8)[0].width == 8


def test_on_probes_alternate_width_one_and_the_widest_width():
    """While speculating at a narrow width, every `probe_every`+1-th decision is a probe: width 1
    (TPOT_0), then the widest width (its positions and cost stay measured), alternately."""
    policy = OnlineWidthPolicy(k_max=6, cost=VerifyCost({1: 1.0, 2: 1.1, 6: 3.0}), ema=0.2, probe_every=4)
    for _ in range(50):
        policy.observe(6, 1)  # position 1 always accepted, position 2 never: width 2 pays
    decisions = [policy.decide(8) for _ in range(20)]
    probes = [d.width for d in decisions if d.probe]
    assert {d.width for d in decisions if not d.probe} == {2}
    assert probes == [1, 6, 1, 6]


def test_verify_cost_caps_one_outlier_sample():
    """A step that compiled or captured (seconds, not milliseconds) is outvoted by the window's
    median; a width's first sample is capped against its neighbours' estimate; a too-low first
    sample is not held down (breakages caught: the window's mean instead of its median; the
    session-22 EMA; every sample capped against the width's own estimate)."""
    cost = VerifyCost({1: 0.010, 8: 0.012}, clip=2.0)
    cost.update(8, 5.0)
    assert cost.cost(8) == pytest.approx((0.012 + 5.0) / 2)  # the median of two
    cost.update(8, 0.012)
    assert cost.cost(8) == pytest.approx(0.012)  # outvoted
    cost.update(4, 5.0)  # a width's first sample is capped against its interpolated estimate
    assert cost.cost(4) == pytest.approx(2 * (0.010 + (0.012 - 0.010) * 3 / 7))
    fresh = VerifyCost(window=5)
    fresh.update(8, 5.0)  # nothing measured yet: nothing to cap against
    assert fresh.cost(8) == pytest.approx(5.0)
    for _ in range(2):
        fresh.update(8, 0.03)
    assert fresh.cost(8) == pytest.approx(0.03)  # three samples outvote the first
    for _ in range(5):
        fresh.update(8, 0.06)
    assert fresh.cost(8) == pytest.approx(0.06)  # the window follows a real change within `window` samples
    fresh.update(1, 1e-6)  # a too-low first sample (capped against nothing higher)
    for _ in range(2):
        fresh.update(1, 0.02)
    assert fresh.cost(1) == pytest.approx(0.02)
    fresh.clear()
    assert fresh.measured == {} and VerifyCost({4: 2.0}).measured == {4: 2.0}
    seeded = VerifyCost({4: 2.0})
    seeded.update(4, 3.0)
    seeded.clear()
    assert seeded.measured == {4: 2.0}  # back to the constructor's table
    with pytest.raises(ValueError, match="clip"):
        VerifyCost(clip=1.0)
    with pytest.raises(ValueError, match="window"):
        VerifyCost(window=0)


def test_a_slow_first_round_does_not_lock_the_online_policy_narrow():
    """Session 23 on the H200 at C2: the first width-8 round compiled (seconds); with an EMA cost
    the policy then ran widths 2-4 for seconds where every width costs about the same and 8
    emits the most. Scripted: flat cost, 0.77 acceptance per position, one 2-s first round
    (breakage caught: the EMA cost, whose mean non-probe width here was 3.0)."""
    import random
    rng = random.Random(0)
    policy = OnlineWidthPolicy(k_max=8, cost=VerifyCost(), widths=(2, 4, 8))
    chosen = []
    for step in range(200):
        d = policy.decide(2)
        for _ in range(2):
            accepted = 0
            while d.width > 1 and accepted < d.width - 1 and rng.random() < 0.77:
                accepted += 1
            if d.width > 1:
                policy.observe(d.width, accepted)
        policy.observe_cost(d.width, 2.0 if step == 0 else 0.030 * (1 + 0.1 * rng.random()))
        if step >= 16 and not d.probe:
            chosen.append(d.width)
    assert chosen.count(8) >= 0.95 * len(chosen)


def test_round_widths_are_what_the_policy_can_choose():
    """Online: 1, the powers of two below K_max and K_max (breakage caught: 1..K_max again, the
    112 graphs / 166 s of H200 start-up at K_max 8), or the given online_widths."""
    assert SpecConfig(num_draft_tokens=4, policy="online").round_widths() == (1, 2, 4)
    assert SpecConfig(num_draft_tokens=8, policy="online").round_widths() == (1, 2, 4, 8)
    assert SpecConfig(num_draft_tokens=6, policy="online").round_widths() == (1, 2, 4, 6)
    assert SpecConfig(num_draft_tokens=8, policy="online", online_widths=(6, 3, 6)).round_widths() == (1, 3, 6)
    with pytest.raises(SpecConfigError, match="online_widths"):
        SpecConfig(num_draft_tokens=4, policy="online", online_widths=(5,))
    assert SpecConfig(num_draft_tokens=8, policy="fixed").round_widths() == (1, 8)
    assert SpecConfig(num_draft_tokens=8, policy="fixed", fixed_width=3).round_widths() == (1, 3)
    assert SpecConfig(num_draft_tokens=6, policy="static").round_widths() == (1, 4, 6)  # 8 capped at K_max


def test_only_decode_only_steps_feed_the_cost_model():
    """A step that also prefilled is not a round's cost at its width (engine.step passes
    decode_only), nor one that cut a request's width to its remaining max_tokens (an eager
    width); the tiny engine's online run feeds every other pure-decode step (breakage caught:
    clipped steps fed)."""
    from dhisparse import LLM
    from dhisparse.core.params import SamplingParams

    llm = LLM("tiny", preset="adaptive", speculative_algorithm="ngram", speculative_num_draft_tokens=4,
              speculative_policy="online", max_num_batched_tokens=32)
    spec = llm.engine.spec
    fed, calls = [], []
    update, observe = spec.cost.update, spec.observe_step
    spec.cost.update = lambda w, s: (fed.append(w), update(w, s))[1]
    spec.observe_step = lambda seconds, decode_only=True: (calls.append((spec._step_width, decode_only, spec._clipped)),
                                                           observe(seconds, decode_only))[1]
    prompts = [[3 + (5 * j + i) % 200 for j in range(40 + 30 * i)] for i in range(3)]
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    mixed = [w for w, only, _ in calls if w and not only]
    assert mixed, "the scripted load has steps that verify while another request prefills"
    assert any(cut for w, only, cut in calls if w and only), "and steps that cut a width to max_tokens"
    assert len(fed) == sum(1 for w, only, cut in calls if w and only and not cut)


def test_the_online_runtime_prices_only_its_candidate_widths():
    """SpecRuntime hands the policy `online_candidates()`: with widths 3..5 cheap per token, the
    policy still chooses among 2, 4 and 8 (breakage caught: the policy built over 2..K_max)."""
    from dhisparse.engine.speculative import SpecRuntime

    cfg = SpecConfig(algorithm="ngram", num_draft_tokens=8, policy="online")
    rt = SpecRuntime(cfg, target=None, max_requests=4)
    assert rt.online.widths == [2, 4, 8]
    for w in (1, 2, 4, 8):
        rt.online.observe_cost(w, 0.01 * w)
    assert rt.online.decide(1).width in (1, 2, 4, 8)


@pytest.mark.parametrize("fresh_start", [True, False])
def test_a_cold_policy_measures_before_pricing_speculation_out(fresh_start):
    """A prior (0.6) below the drafter's true acceptance (0.8) prices every width out at these
    costs; eq. 13 with the true rate speculates (width 8, 4 close behind). The start-up warm-up (the widest width until
    position 1 is judged `warmup` times) and the prior counted as `prior_weight` observations
    get the policy speculating within 60 rounds at C2. Without them (the s21 policy) the first 32 rounds
    run speculation off (on the H200: ~1 token a round for 4-5 s at C2)."""
    cost = VerifyCost({1: 1.0, 2: 1.7, 4: 2.3, 8: 3.2})
    kw = {} if fresh_start else dict(prior_weight=0.0, warmup=0)
    policy = OnlineWidthPolicy(k_max=8, cost=cost, widths=(2, 4, 8), ema=0.05, prior=0.6, **kw)
    assert not OnlineWidthPolicy(k_max=8, cost=cost, widths=(2, 4, 8), ema=0.05, prior=0.6, warmup=0).best(8)[0].speculate
    rng = random.Random(0)

    def accepted(w: int) -> int:
        return next((i for i in range(w - 1) if rng.random() > 0.8), w - 1)

    widths = []
    for _ in range(60):
        d = policy.decide(2)
        widths.append(d.width)
        for _ in range(2 if d.width > 1 else 0):  # C2: both requests' rounds are judged
            policy.observe(d.width, accepted(d.width))
    if fresh_start:  # 16 rounds at width 8 judge position 1 32 times; then eq. 13 speculates (4 or 8)
        assert widths[:16] == [8] * 16 and widths[-20:].count(1) <= 1
        assert policy.estimates()[0] == pytest.approx(0.8, abs=0.1)
    else:  # priced out from the first round until the first probe
        assert widths[:32] == [1] * 32
