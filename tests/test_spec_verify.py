"""Acceptance (eq. 7), commit rows (eq. 8) and distribution preservation of rejection sampling (I7)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2
from spec_loop import one_thread  # noqa: F401

from dhisparse.core.params import SamplingParams
from dhisparse.core.sampling import processed_probs
from dhisparse.spec.verify import commit_rows, verify_batch, verify_greedy, verify_request, verify_sampled


pytestmark = pytest.mark.usefixtures("one_thread")


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
    with pytest.raises(ValueError, match=r"request 0's target_logits .*K_r.*got \(3,\)"):  # 3 rows for 1 draft
        verify_batch(logits, [0, 3, 5], [[3], [1]], [None, None], params, gens)


# ---- distribution preservation: chi-square on V = 6 ---------------------------------------------
V = 6
PARAMS = SamplingParams(temperature=0.9, top_k=5)
W_LAST = torch.randn(V, V, generator=torch.Generator().manual_seed(11)) * 1.5
# p(. | prev): the target's processed next-token distribution depends on the previous token
P_TABLE = processed_probs(W_LAST, [PARAMS] * V)
# arbitrary draft distributions per draft position, independent of the target
Q_TABLE = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(100)) * 2, -1)


def draft_stream(trials: int, seed: int):
    """Pre-drawn drafts: x_i ~ Q_TABLE[i], independent of everything else (a separate stream)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    cols = [torch.multinomial(Q_TABLE[i], 2 * trials, replacement=True, generator=gen).tolist() for i in range(2)]
    return iter(list(zip(*cols)))


def spec_round(anchor: int, drafts: list[int], gen: torch.Generator, always_accept: bool = False) -> list[int]:
    """One width-3 round: drafts x_1, x_2 ~ q, target rows p(.|x_0), p(.|x_1), p(.|x_2)."""
    if always_accept:
        return drafts
    rows = P_TABLE[torch.tensor([anchor] + drafts)]
    return verify_sampled(rows, drafts, Q_TABLE, gen).emitted


def two_tokens(gen: torch.Generator, drafts, always_accept: bool = False) -> tuple[int, int]:
    """First two generated tokens; a second round supplies token 2 when round 1 emitted one."""
    out = spec_round(0, list(next(drafts)), gen, always_accept)
    if len(out) < 2:
        out += spec_round(out[-1], list(next(drafts)), gen, always_accept)
    return out[0], out[1]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def collect(trials: int, seed: int, always_accept: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    drafts = draft_stream(trials, seed)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        a, b = two_tokens(gen, drafts, always_accept)
        counts[a, b] += 1
    return counts


def test_rejection_sampling_preserves_target_distribution():
    counts = collect(12000, seed=1)
    p = P_TABLE
    assert chi_square_p(counts.sum(1), p[0]) > 1e-3  # first token ~ p(. | anchor)
    for a in range(V):  # second token ~ p(. | first token), whichever round produced it
        if counts[a].sum() >= 200:
            assert chi_square_p(counts[a], p[a]) > 1e-3, f"second position given first = {a}"


def test_chi_square_has_power_against_a_wrong_verifier():
    """Emitting the drafts unverified (first token ~ q) must fail the same test."""
    first = collect(3000, seed=2, always_accept=True).sum(1)
    p = P_TABLE[0]
    assert first[p == 0].sum() > 0 or chi_square_p(first, p) < 1e-6


def test_point_mass_drafts_and_seeded_determinism():
    logits = W_LAST[torch.tensor([0, 1, 2])]
    runs = [verify_request(logits, [1, 2], None, PARAMS, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert runs[0] == runs[1] and 0 <= runs[0].accepted <= 2
    direct = verify_sampled(P_TABLE[torch.tensor([0, 1, 2])], [1, 2], None, torch.Generator().manual_seed(5))
    assert direct == runs[0]  # verify_request = processed_probs + rejection sampling
