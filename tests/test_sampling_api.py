"""The sampling API in the engine: logprobs (raw-logit log-softmax), prompt logprobs, penalties and
logit_bias (against a plain-PyTorch reference, greedy and under speculation), min_tokens, and the
speculative rejection sampler's exactness with penalties (chi-square)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from dhisparse.core.logits import History
from dhisparse.core.params import SamplingParams
from dhisparse.core.sampling import processed_probs
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.llm import LLM
from dhisparse.spec.verify import verify_batch

PROMPT = [5, 6, 7, 8, 9] * 8
PEN = dict(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3, logit_bias=((40, 3.0), (41, -100.0)))


def engine(**kw) -> Engine:
    return Engine(EngineConfig(device="cpu", max_model_len=256, kv_pool_bytes=16 << 20, **kw))


@pytest.fixture(scope="module")
def plain():
    return engine()


def capture_logits(eng: Engine) -> list[torch.Tensor]:
    """Every logits tensor the model returns, in order (the engine's `model.logits` is wrapped)."""
    seen, inner = [], eng.model.logits

    def logits(hidden):
        out = inner(hidden)
        seen.append(out.detach().clone())
        return out

    eng.model.logits = logits
    return seen


def run(eng: Engine, prompt, sp: SamplingParams):
    rid = eng.add_request(prompt, sp)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def reference_penalised(logits: torch.Tensor, prompt, out, p: SamplingParams) -> torch.Tensor:
    """Plain PyTorch, written from the definitions (OpenAI / HF), independent of core/logits.py."""
    l = logits.clone()
    for t in set(prompt) | set(out):
        l[t] = l[t] / p.repetition_penalty if l[t] > 0 else l[t] * p.repetition_penalty
    for t in set(out):
        l[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t, b in p.logit_bias:
        l[t] += b
    return l


def test_logprobs_are_log_softmax_of_the_engines_logits(plain):
    seen = capture_logits(plain)
    try:
        outs = run(plain, PROMPT, SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=3, ignore_eos=True))
    finally:
        del plain.model.logits
    lps = [lp for o in outs for lp in o.logprobs]
    toks = [t for o in outs for t in o.new_token_ids]
    assert len(lps) == len(toks) == 6 and len(seen) == 6
    for lp, tok, logits in zip(lps, toks, seen):
        ref = torch.log_softmax(logits[0].float(), -1)
        assert lp.token == tok and lp.logprob == pytest.approx(float(ref[tok]), abs=1e-5)
        top = torch.topk(ref, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_prompt_logprobs_cover_every_prompt_token(plain):
    seen = capture_logits(plain)
    try:
        outs = run(plain, PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))
    finally:
        del plain.model.logits
    plp = outs[-1].prompt_logprobs
    assert len(plp) == len(PROMPT) and plp[0] is None
    full = torch.log_softmax(seen[0].float(), -1)  # one prefill chunk: rows predict positions 1..P-1
    for pos in range(1, len(PROMPT)):
        assert plp[pos].token == PROMPT[pos]
        assert plp[pos].logprob == pytest.approx(float(full[pos - 1, PROMPT[pos]]), abs=1e-5)


def test_penalties_change_greedy_output_and_match_a_plain_reference(plain):
    sp = SamplingParams(max_tokens=16, ignore_eos=True, **PEN)
    base = run(plain, PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))[-1].token_ids
    seen = capture_logits(plain)
    try:
        got = run(plain, PROMPT, sp)[-1].token_ids
    finally:
        del plain.model.logits
    assert got != base
    assert 41 not in got
    for i, tok in enumerate(got):
        row = seen[i][-1]  # the step's (single) sampled row
        assert tok == int(reference_penalised(row, PROMPT, got[:i], sp).argmax())


def test_min_tokens_masks_eos():
    eng = engine()
    eos = eng.tokenizer.eos_token_ids or eng.model_config.eos_token_ids
    e = eos[0]
    forced = SamplingParams(max_tokens=12, logit_bias=((e, 100.0),))
    assert run(eng, PROMPT, forced)[-1].token_ids == [e]  # EOS at once without min_tokens
    out = run(eng, PROMPT, SamplingParams(max_tokens=12, min_tokens=5, logit_bias=((e, 100.0),)))[-1]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == e and e not in out.token_ids[:5]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("sp", [SamplingParams(max_tokens=20, ignore_eos=True, **PEN),
                                SamplingParams(max_tokens=20, ignore_eos=True, frequency_penalty=-0.5,
                                               presence_penalty=-0.3, min_tokens=8)])
def test_speculative_greedy_with_penalties_is_exact(plain, sp):
    ref = run(plain, PROMPT, sp)[-1].token_ids
    spec = Engine(EngineConfig(preset="adaptive+spec", speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                               device="cpu", max_model_len=256, kv_pool_bytes=16 << 20, hot_cache_rows=16))
    outs = run(spec, PROMPT, sp)
    assert outs[-1].token_ids == ref
    assert spec.stats().as_dict()["spec_rounds"] > 0


def test_speculative_logprobs_match_non_speculative(plain):
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    ref = [lp for o in run(plain, PROMPT, sp) for lp in o.logprobs]
    spec = Engine(EngineConfig(preset="adaptive+spec", speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                               device="cpu", max_model_len=256, kv_pool_bytes=16 << 20, hot_cache_rows=16))
    got = [lp for o in run(spec, PROMPT, sp) for lp in o.logprobs]
    assert [l.token for l in got] == [l.token for l in ref]
    assert [l.logprob for l in got] == pytest.approx([l.logprob for l in ref], abs=1e-4)


# ---- sampled verification with penalties: chi-square on a small vocabulary ----------------------
V = 6
W = torch.randn(V, V, generator=torch.Generator().manual_seed(11)) * 1.5
SP = SamplingParams(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.5,
                    logit_bias=((3, 1.0),))
HIST = History([1, 2], [0])


def test_rejection_sampling_with_penalties_keeps_the_penalised_distribution():
    """Two-token rounds from anchor 0: the first emitted token ~ processed_probs(row 0, history);
    the second, given the first x, ~ processed_probs(row of x, history + [x])."""
    q = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(100)) * 2, -1)
    gen, dgen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    counts, counts_first = torch.zeros(V, V), torch.zeros(V)
    for _ in range(6000):
        d = [int(torch.multinomial(q[i], 1, generator=dgen)) for i in range(2)]
        logits = W[torch.tensor([0] + d)]
        acc = verify_batch(logits, [0, 3], [d], [q], [SP], [gen], history=[HIST])[0]
        counts_first[acc.emitted[0]] += 1
        if len(acc.emitted) >= 2:  # the first draft accepted: row 1 judged the second
            counts[acc.emitted[0], acc.emitted[1]] += 1
    p0 = processed_probs(W[0:1], [SP], [HIST])[0]
    assert chi_p(counts_first, p0) > 1e-3
    for x in range(V):
        if counts[x].sum() >= 300:
            px = processed_probs(W[x : x + 1], [SP], [HIST.extended([x])])[0]
            assert chi_p(counts[x], px) > 1e-3, x
    wrong = processed_probs(W[0:1], [SP])[0]  # the unpenalised distribution must fail the same test
    assert chi_p(counts_first, wrong) < 1e-6


def chi_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return 0.0
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))
