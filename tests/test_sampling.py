"""SamplingParams validation, processed_probs and Sampler behaviour."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse.core.params import SamplingParams
from dhisparse.core.sampling import Sampler, make_generator, processed_probs

V = 32


def _logits(n: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# --- params -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": ("ok", "")}, "stop"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
    ],
)
def test_invalid_params_raise_naming_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_normalisation():
    assert SamplingParams(max_tokens=1).max_tokens == 1
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop="</s>").stop == ("</s>",)
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(3, 4)))
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    msg = "max_tokens must be >= 1, got 0"
    with pytest.raises(ValueError, match=msg):
        SamplingParams(max_tokens=0)


# --- greedy equivalences ----------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_id_ties():
    logits = _logits(6)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1.0  # tie: id 5 must win
    out = Sampler().sample(logits, [SamplingParams()] * 6, [None] * 6)
    assert out.probs is None
    assert out.tokens.dtype == torch.int64
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert out.tokens[0].item() == 5


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"top_p": 1e-6}])
def test_restrictive_sampling_equals_greedy(extra):
    logits = _logits(8, seed=1)
    logits[2, 3] = logits[2, 7] = logits[2].max() + 1.0
    params = [SamplingParams(temperature=1.3, seed=i, **extra) for i in range(8)]
    gens = [make_generator(p.seed) for p in params]
    out = Sampler().sample(logits, params, gens)
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert torch.equal(out.probs, processed_probs(logits, [SamplingParams()] * 8))


def test_mixed_batch_greedy_rows_one_hot():
    logits = _logits(3, seed=2)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    out = Sampler().sample(logits, params, [None, make_generator(1), None])
    for i in (0, 2):
        assert out.tokens[i] == logits[i].argmax()
        assert out.probs[i, out.tokens[i]] == 1.0 and out.probs[i].sum() == 1.0
    assert out.probs[1, out.tokens[1]] > 0


# --- processed_probs --------------------------------------------------------------------------


def test_processed_probs_temperature_only_is_softmax():
    logits = _logits(4, seed=3)
    probs = processed_probs(logits, [SamplingParams(temperature=0.7)] * 4)
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, -1))


def test_processed_probs_top_k_support():
    logits = _logits(5, seed=4)
    probs = processed_probs(logits, [SamplingParams(temperature=1.0, top_k=4)] * 5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    top4 = logits.topk(4, dim=-1).indices
    for i in range(5):
        support = set(probs[i].nonzero().flatten().tolist())
        assert support == set(top4[i].tolist())


def test_processed_probs_top_p_support_is_minimal_nucleus():
    logits = _logits(5, seed=5)
    p = 0.6
    probs = processed_probs(logits, [SamplingParams(temperature=1.0, top_p=p)] * 5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    full = torch.softmax(logits, -1)
    for i in range(5):
        ranked = full[i].argsort(descending=True)
        mass = full[i][ranked].cumsum(0)
        n_keep = int((mass < p).sum()) + 1  # smallest prefix whose mass >= p
        assert set(probs[i].nonzero().flatten().tolist()) == set(ranked[:n_keep].tolist())
        kept = full[i][ranked[:n_keep]]
        torch.testing.assert_close(probs[i][ranked[:n_keep]], kept / kept.sum())


def test_top_p_one_keeps_tiny_tail():
    logits = torch.tensor([[30.0, 0.0, -5.0, 1.0]])
    probs = processed_probs(logits, [SamplingParams(temperature=1.0)])
    assert (probs > 0).all()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    vocab=st.integers(1, 50),
    temperature=st.sampled_from([0.0, 0.05, 0.5, 1.0, 2.0, 10.0]),
    top_k=st.integers(-1, 60),
    top_p=st.floats(1e-6, 1.0),
    scale=st.sampled_from([0.1, 1.0, 20.0]),
)
def test_processed_probs_is_valid_distribution(seed, vocab, temperature, top_k, top_p, scale):
    logits = _logits(3, vocab, seed) * scale
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * 3
    probs = processed_probs(logits, params)
    assert probs.shape == logits.shape
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert (probs[torch.arange(3), logits.argmax(-1)] > 0).all()
    if top_k > 0:
        assert ((probs > 0).sum(-1) <= top_k).all()


# --- seeded sampling --------------------------------------------------------------------------


def test_seeded_sampling_reproducible():
    logits = _logits(4, seed=6)
    params = [SamplingParams(temperature=1.5, seed=10 + i) for i in range(4)]
    runs = []
    for _ in range(2):
        gens = [make_generator(p.seed) for p in params]
        runs.append(torch.stack([Sampler().sample(logits, params, gens).tokens for _ in range(20)]))
    assert torch.equal(runs[0], runs[1])
    assert len(set(runs[0][:, 0].tolist())) > 1  # actually random, not collapsed to greedy


def test_seeded_sampling_independent_of_batch():
    target = SamplingParams(temperature=1.2, top_k=20, top_p=0.95, seed=1234)
    steps = [_logits(1, seed=100 + s) for s in range(15)]
    gen = make_generator(target.seed)
    alone = [Sampler().sample(lg, [target], [gen]).tokens[0].item() for lg in steps]

    others = [SamplingParams(temperature=0.8 + 0.1 * i, seed=i) for i in range(7)]
    params = others[:3] + [target] + others[3:]
    gens = [make_generator(p.seed) for p in params]
    batched = []
    for s, lg in enumerate(steps):
        batch = _logits(8, seed=500 + s)
        batch[3] = lg[0]
        batched.append(Sampler().sample(batch, params, gens).tokens[3].item())
    assert alone == batched


def test_unseeded_generators_differ():
    a, b = make_generator(None), make_generator(None)
    assert a.initial_seed() != b.initial_seed()


def test_temperature_sampling_matches_softmax_frequencies():
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0])
    temp, n = 0.8, 4000
    params = [SamplingParams(temperature=temp, seed=s) for s in range(n)]
    gens = [make_generator(p.seed) for p in params]
    tokens = Sampler().sample(logits.expand(n, 5).clone(), params, gens).tokens
    counts = torch.bincount(tokens, minlength=5).double()
    expected = torch.softmax(logits / temp, -1).double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts.tolist(), expected.tolist())  # df=4, p ~= 4e-4
    assert not math.isnan(chi2)


def test_batch_mismatch_errors():
    with pytest.raises(ValueError, match="params"):
        processed_probs(_logits(2), [SamplingParams()])
    with pytest.raises(ValueError, match="generators"):
        Sampler().sample(_logits(2), [SamplingParams(temperature=1.0)] * 2, [None])


# --- numerically extreme temperatures (issue 24, item 1) ---------------------------------------

EXTREME_TEMPERATURES = [5e-324, 1e-300, 1e-39, 1e-38, 1e-37, 1e-6, 1e-5, 1.5e-5, 1e-3, 1e10, 1e300]


@pytest.mark.parametrize("temperature", EXTREME_TEMPERATURES)
def test_any_accepted_temperature_samples_a_valid_token(temperature):
    """Every finite temperature SamplingParams accepts gives a finite distribution and a token:
    before the fix, T = 1e-39 made logits / T overflow to inf, softmax NaN, and multinomial raised
    (which killed the serving engine)."""
    logits = _logits(3, 40, seed=2) * 20.0
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(3)]
    probs = processed_probs(logits, params)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    out = Sampler().sample(logits, params, [make_generator(p.seed) for p in params])
    assert ((out.tokens >= 0) & (out.tokens < 40)).all()
    if temperature < 1e-3:  # the limit T -> 0 is the argmax (tiny T rows are greedy or near-one-hot)
        assert out.tokens.tolist() == logits.argmax(-1).tolist()


def test_temperatures_below_eps_are_greedy():
    from dhisparse.core.params import GREEDY_EPS

    assert SamplingParams(temperature=GREEDY_EPS / 2).greedy
    assert not SamplingParams(temperature=GREEDY_EPS).greedy


# ---- logit processors (penalties, logit_bias, min_tokens, grammar masks: core/logits.py) ----------
def test_processors_feed_processed_probs_and_greedy_argmax():
    from dhisparse.core.logits import History

    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    h = History(prompt=[3], output=[0, 0], eos=(2,))
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=2.0, logit_bias=((3, 0.25),))
    # token 0: 2.0 / 2 (repetition) - 0.5 * 2 - 0.2 = -0.2; token 3: 0.5 / 2 + 0.25 = 0.5 -> argmax 1
    ref = torch.tensor([[-0.2, 1.9, -1.0, 0.5]])
    out = Sampler().sample(logits, [sp], [None], [h])
    assert out.tokens.tolist() == [1]
    hot = SamplingParams(temperature=1.0, **{k: getattr(sp, k) for k in ("frequency_penalty", "presence_penalty",
                                                                            "repetition_penalty", "logit_bias")})
    assert torch.allclose(processed_probs(logits, [hot], [h]), torch.softmax(ref, -1), atol=1e-6)
    assert torch.allclose(processed_probs(logits, [hot]), torch.softmax(logits, -1), atol=1e-6)  # no history: raw
    masked = processed_probs(logits, [SamplingParams(temperature=1.0, min_tokens=3)], [h])
    assert masked[0, 2] == 0 and masked.sum() == pytest.approx(1.0)
    grammar = History([], [], (), torch.tensor([False, False, True, True]))
    assert Sampler().sample(logits, [SamplingParams()], [None], [grammar]).tokens.tolist() == [3]


def test_greedy_verification_with_penalties_accepts_what_greedy_decoding_emits():
    """A round over a fixed next-token table: verify_batch with history must accept exactly the
    prefix that one-token-at-a-time penalised greedy decoding produces, and emit its next token."""
    from dhisparse.core.logits import History, apply_processors
    from dhisparse.spec.verify import verify_batch

    V = 8
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(3))
    sp = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5)
    hist = History([1, 2], [4])
    seq, out = [4], [4]
    for _ in range(4):  # plain greedy decoding with penalties
        row = apply_processors(table[seq[-1]].unsqueeze(0), [sp], [History([1, 2], out)])
        seq.append(int(row.argmax()))
        out = out + [seq[-1]]
    drafts = seq[1:4] + []  # the right drafts: all accepted, bonus = greedy's 4th token
    rows = table[torch.tensor([4] + drafts)]
    acc = verify_batch(rows, [0, 4], [drafts], [None], [sp], [None], history=[hist])[0]
    assert acc.accepted == 3 and acc.emitted == seq[1:5]
    wrong = [seq[1], (seq[2] + 1) % V, seq[3]]
    rows = table[torch.tensor([4] + wrong)]
    acc = verify_batch(rows, [0, 4], [wrong], [None], [sp], [None], history=[hist])[0]
    assert acc.accepted == 1 and acc.emitted == seq[1:3]
