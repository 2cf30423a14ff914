"""N-gram and oracle drafters; the greedy speculative loop is exact for every drafter."""

from __future__ import annotations

import random
from array import array

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from spec_loop import FakeTarget, one_thread, speculative_greedy  # noqa: F401

from dhisparse.spec.drafter import DraftProposal, DraftRequest, TokenIds
from dhisparse.spec.ngram import NgramDrafter, continuation, find_last_match, find_last_match_bytes
from dhisparse.spec.oracle import OracleDrafter, corrupt_rate_for_tokens_per_round, expected_tokens_per_round
from dhisparse.spec.verify import verify_greedy


pytestmark = pytest.mark.usefixtures("one_thread")


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.integers(0, 9), max_size=12), hs.lists(hs.integers(0, 9), max_size=12), hs.data())
def test_token_ids_view_equals_the_concatenation(prompt, output, data):
    """TokenIds (the engine's no-copy history for drafters) reads as prompt + output[:n - P]: len,
    indices (negative too), slices (any bounds and steps) and iteration; out of range raises."""
    n = data.draw(hs.integers(0, len(prompt) + len(output)))
    ref = (prompt + output)[:n]
    view = TokenIds(prompt, output, n)
    assert len(view) == n and list(view) == ref
    a, b = data.draw(hs.integers(-15, 15)), data.draw(hs.integers(-15, 15))
    step = data.draw(hs.sampled_from([None, 1, 2, -1]))
    assert view[a:b:step] == ref[a:b:step] and view[:b] == ref[:b] and view[a:] == ref[a:]
    for i in range(-n, n):
        assert view[i] == ref[i]
    with pytest.raises(IndexError):
        view[n]
    with pytest.raises(ValueError, match="n must be in"):
        TokenIds(prompt, output, len(prompt) + len(output) + 1)


def test_draft_request_from_parts_equals_from_history():
    prompt, output = [5, 6, 7, 8], [9, 10]
    a = DraftRequest.from_parts("r", prompt, output, 4, num_prompt_tokens=4)
    b = DraftRequest.from_history("r", prompt + output, 4, num_prompt_tokens=4)
    assert list(a.token_ids) == b.token_ids and a.anchor == b.anchor == 10 and a.num_committed == b.num_committed == 5
    assert DraftRequest.from_parts("r", [3], [], 2).anchor == 3
    with pytest.raises(ValueError, match="from_parts: no ids"):
        DraftRequest.from_parts("r", [], [], 2)
    for d in (NgramDrafter(min_n=1, max_n=3), OracleDrafter({(5, 6, 7, 8): [9, 10, 11, 12]}, vocab_size=20)):
        assert d.propose([a])[0].tokens == d.propose([b])[0].tokens


def test_ngram_proposes_the_continuation_on_repetitive_text():
    d = NgramDrafter(min_n=2, max_n=4)
    req = DraftRequest("a", [1, 2, 3, 4, 5] * 3 + [1, 2], anchor=3, max_width=6)
    prop = d.propose([req])[0]
    assert prop.tokens == [4, 5, 1, 2, 3] and prop.probs is None and len(prop.confidences) == 5
    assert d.propose([DraftRequest("a", [9, 9], 9, max_width=4)])[0].tokens == [9, 9, 9]  # period 1
    assert d.propose([DraftRequest("a", [1, 2], 3, max_width=1)])[0] == DraftProposal.empty()


def test_ngram_prefers_the_longest_and_latest_match():
    hist = torch.tensor([7, 1, 2, 8, 0, 1, 2, 9, 5, 0, 1, 2])
    assert find_last_match(hist, 2) == 5 and find_last_match(hist, 3) == 4 and find_last_match(hist, 4) == -1
    assert continuation([1, 2, 3], 1, 4) == [2, 3, 2, 3]


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.integers(0, 300), max_size=40), hs.integers(0, 5))
def test_ngram_byte_search_matches_the_window_reference(hist, n):
    """The drafter's int32-bytes search finds the same latest match as the window comparison,
    including ids whose bytes could line up across an id boundary (0..300 spans two bytes)."""
    buf = array("i", hist).tobytes()
    assert find_last_match_bytes(buf, n) == find_last_match(torch.tensor(hist, dtype=torch.int64), n)


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.integers(0, 300), min_size=1, max_size=40), hs.integers(0, 5))
def test_ngram_byte_search_with_a_trailing_id_not_copied_in(hist, n):
    """The history's last id passed apart (`last`, the drafter's anchor) finds what the joined
    buffer finds."""
    buf, last = array("i", hist[:-1]).tobytes(), array("i", hist[-1:]).tobytes()
    assert find_last_match_bytes(buf, n, last) == find_last_match(torch.tensor(hist, dtype=torch.int64), n)


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.integers(0, 6), min_size=1, max_size=40), hs.integers(1, 6))
def test_ngram_proposals_equal_the_joined_history_reference(ids, width):
    """Proposals (match length, continuation reading into the anchor and into the proposal
    itself) equal a plain search over history + anchor."""
    hist, anchor = ids[:-1], ids[-1]
    full = torch.tensor(ids, dtype=torch.int64)
    want = []
    for n in range(min(4, len(ids) - 1), 1, -1):
        j = find_last_match(full, n)
        if j >= 0:
            want = continuation(ids, j + n, width - 1)
            break
    got = NgramDrafter(2, 4).propose([DraftRequest("r", hist, anchor, max_width=width)])[0]
    assert got.tokens == want


def test_ngram_on_random_text_proposes_nothing_useful():
    rng = random.Random(0)
    text = [rng.randrange(1000) for _ in range(600)]
    d = NgramDrafter(min_n=2, max_n=4)
    proposed = accepted = 0
    for n in range(100, 599):
        prop = d.propose([DraftRequest("r", text[:n], text[n], max_width=4)])[0]
        proposed += bool(prop.tokens)
        accepted += int(bool(prop.tokens) and prop.tokens[0] == text[n + 1])
    assert proposed <= 0.05 * 499 and accepted == 0


def test_ngram_gets_real_acceptance_and_stays_exact():
    target = FakeTarget(vocab=13)
    prompt = [1, 1, 2, 3]
    out, rounds = speculative_greedy(target, NgramDrafter(2, 4), prompt, steps=300, width=4)
    assert out == target.greedy(prompt, 300)
    assert 300 / rounds > 2.8  # Fibonacci mod 13 has period 28: after one period every draft is accepted


def test_corrupt_rate_solves_tokens_per_round():
    c = corrupt_rate_for_tokens_per_round(2.88, 4)
    assert expected_tokens_per_round(1 - c, 4) == pytest.approx(2.88, abs=1e-9)
    assert c == pytest.approx(0.2161, abs=1e-3)
    assert corrupt_rate_for_tokens_per_round(4, 4) == pytest.approx(0.0, abs=1e-9)
    assert corrupt_rate_for_tokens_per_round(1, 4) == pytest.approx(1.0, abs=1e-9)
    with pytest.raises(ValueError, match="target_tokens_per_round"):
        corrupt_rate_for_tokens_per_round(4.5, 4)


def test_oracle_calibration_over_a_long_run():
    ref_rng = random.Random(1)
    prompt = (5, 6, 7)
    ref = [ref_rng.randrange(50) for _ in range(12000)]
    oracle = OracleDrafter.for_tokens_per_round({prompt: ref}, vocab_size=50, tokens_per_round=2.88, width=4, seed=3)
    out, rounds = [ref[0]], 0
    while len(out) < 9000:
        req = DraftRequest("r", list(prompt) + out[:-1], out[-1], 4, num_prompt_tokens=3)
        prop = oracle.propose([req])[0]
        k = len(out)  # target row i predicts ref[k + i]
        logits = torch.nn.functional.one_hot(torch.tensor(ref[k: k + len(prop.tokens) + 1]), 50).float()
        out += verify_greedy(logits, prop.tokens).emitted
        rounds += 1
    assert out[:9000] == ref[:9000]
    assert len(out) / rounds == pytest.approx(2.88, abs=0.06)


def test_oracle_exact_replay_and_missing_reference():
    oracle = OracleDrafter({(1, 2): [3, 4, 5, 6, 7]}, vocab_size=10)
    prop = oracle.propose([DraftRequest("a", [1, 2, 3], 4, max_width=4, num_prompt_tokens=2)])[0]
    assert prop.tokens == [5, 6, 7] and prop.confidences == [1.0] * 3
    with pytest.raises(KeyError, match="no reference run"):
        oracle.propose([DraftRequest("b", [9, 9], 4, max_width=4, num_prompt_tokens=2)])


def test_oracle_in_the_loop_is_exact():
    target = FakeTarget(vocab=13)
    prompt = [2, 5, 1]
    ref = target.greedy(prompt, 200)
    oracle = OracleDrafter(lambda p: target.greedy(p, 200), vocab_size=13, corrupt_rate=0.3, seed=1)
    out, rounds = speculative_greedy(target, oracle, prompt, steps=150, width=6)
    assert out == ref[:150] and 150 / rounds > 1.5


def test_oracle_counts_proposals_made_off_the_reference():
    """A request whose output follows its reference is on it; once an emitted token differs (a
    batch that rounded differently, or sampling) every later proposal is counted off, and the
    request once. (Breakage tried: comparing only token_ids, not the anchor, misses a flip in the
    newest token: caught by the second request's first off count.)"""
    prompt, ref = [5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17]
    o = OracleDrafter({tuple(prompt): ref}, vocab_size=50)

    def ask(rid, out):  # out: the output so far, its last token the anchor
        return o.propose([DraftRequest.from_parts(rid, prompt, out, 4, num_prompt_tokens=len(prompt))])[0]

    assert ask("a", [10]).tokens == [11, 12, 13]
    assert ask("a", [10, 11, 12]).tokens == [13, 14, 15]
    assert o.stats() == {"oracle_proposals": 2, "oracle_off_reference_share": 0.0, "oracle_requests_off_reference": 0}
    ask("b", [10])
    ask("b", [10, 99])  # the newest emitted token (the anchor) left the reference
    assert o.stats()["oracle_requests_off_reference"] == 1
    ask("b", [10, 99, 12, 13])
    s = o.stats()
    assert s["oracle_proposals"] == 5 and s["oracle_requests_off_reference"] == 1
    assert s["oracle_off_reference_share"] == pytest.approx(2 / 5)
    o.release("b")
    ask("b", [10])  # a new request with that id starts on its reference
    assert o.stats()["oracle_requests_off_reference"] == 1 and o.stats()["oracle_proposals"] == 6
