"""DSpark's sequential head (spec/dspark_head.py): drafts follow the head's formula over the DFlash
backbone's rows (a head that is not applied, or reads the wrong predecessor, fails); sampled drafts
follow the returned q (chi-square); its confidences come from the confidence head; checkpoints
with a head round-trip, and dspark / dflash2 refuse checkpoints without their parts."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from dhisparse.core.params import SamplingParams
from dhisparse.core.sampling import processed_probs
from dhisparse.models.tiny import build_tiny
from dhisparse.spec.config import SpecConfig, SpecConfigError
from dhisparse.spec.dflash import DFlashDrafter
from dhisparse.spec.drafter import DraftRequest
from dhisparse.spec.factory import build_drafter, random_dflash_config
import dhisparse.spec.dspark_head as head_mod


@pytest.fixture(scope="module")
def target():
    return build_tiny(0)


@pytest.fixture(scope="module")
def drafter(target):
    d = DFlashDrafter.random(random_dflash_config(target, 6, kind="dspark"), target, seed=3)
    with torch.no_grad():  # a strong transition bias, so a head that is not applied changes the drafts
        d.model.sequential_head.markov_head.w2.weight.mul_(8.0)
    return d


def prepared(drafter, n: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = drafter.cfg.hidden_size
    reqs = []
    for r in range(rows):
        rid = f"q{r}-{seed}"
        drafter.release(rid)
        drafter.observe(rid, {l: torch.randn(n, hidden, generator=g) for l in drafter.cfg.target_layer_ids}, 0)
        reqs.append(DraftRequest(rid, list(range(n)), 5 + 11 * r, 6))
    return reqs


@torch.inference_mode()
def expected_greedy(drafter, reqs):
    """The head's formula written out: e = W1[prev], g = sigmoid(G h), x = argmax(U + (e*g) W2^T)."""
    states = [drafter._prepare(r) for r in reqs]
    hidden, logits, _ = drafter._draft_logits(reqs, states)
    mh = drafter.model.sequential_head.markov_head
    out, confs = [], []
    for r, req in enumerate(reqs):
        prev, toks, cs = req.anchor, [], []
        for i in range(5):
            h = hidden[r, i]
            e = mh.w1.weight[prev]
            code = e * torch.sigmoid(mh.gate.weight @ h)
            toks.append(prev := int((logits[r, i] + code @ mh.w2.weight.T).argmax()))
            ch = drafter.model.sequential_head.confidence_head
            cs.append(float(torch.sigmoid(ch.weight[0] @ torch.cat([h, e]) + ch.bias[0])))
        out.append(toks), confs.append(cs)
    return out, confs


def test_greedy_drafts_follow_the_head(drafter):
    reqs = prepared(drafter, 9, 3)
    want, confs = expected_greedy(drafter, reqs)
    props = drafter.propose(reqs)
    assert [p.tokens for p in props] == want
    assert torch.allclose(torch.tensor([p.confidences for p in props]), torch.tensor(confs), atol=1e-5)
    assert all(p.probs is None for p in props)


def test_breakages_fail(drafter, monkeypatch):
    reqs = prepared(drafter, 9, 3, seed=1)
    want, _ = expected_greedy(drafter, reqs)
    monkeypatch.setattr(head_mod.MarkovHead, "bias", lambda self, code: torch.zeros(code.shape[0], 1))
    assert [p.tokens for p in drafter.propose(reqs)] != want, "head not applied"
    monkeypatch.undo()
    real = head_mod.MarkovHead.code
    monkeypatch.setattr(head_mod.MarkovHead, "code", lambda self, prev, h: real(self, prev * 0 + 3, h))
    assert [p.tokens for p in drafter.propose(reqs)] != want, "wrong predecessor"


@torch.inference_mode()
def test_sampled_drafts_follow_q(drafter):
    """Many rows with the same inputs: the first draft's frequencies against q_1 (chi-square), and
    q_2 is the head's distribution given the sampled x_1."""
    mh_head = drafter.model.sequential_head
    rows, vocab = 4000, drafter.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 2, drafter.cfg.hidden_size, generator=g).expand(rows, -1, -1)
    logits = torch.randn(1, 2, vocab, generator=g).expand(rows, -1, -1) * 2
    params = [SamplingParams(temperature=0.8, top_k=20, seed=1)] * rows
    gen = torch.Generator().manual_seed(7)
    out = mh_head.draft(hidden, logits, torch.full((rows,), 9), params, [gen] * rows)
    q1 = out.q[0][0]
    counts = torch.bincount(out.tokens[:, 0], minlength=vocab).double()
    keep = q1 > 0
    exp = q1.double() * rows
    stat = float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    assert counts[~keep].sum() == 0 and chi2.sf(stat, int(keep.sum()) - 1) > 1e-4
    r = 17
    code = mh_head.markov_head.code(out.tokens[r : r + 1, 0], hidden[r : r + 1, 1])
    q2 = processed_probs(logits[r : r + 1, 1] + mh_head.markov_head.bias(code), params[:1])[0]
    assert torch.allclose(out.q[r][1], q2, atol=1e-6)


def test_checkpoint_round_trip_and_refusals(drafter, target, tmp_path):
    drafter.save(tmp_path / "dspark")
    back = DFlashDrafter.load(tmp_path / "dspark", target)
    assert back.cfg.is_dspark and back.cfg.dspark_markov_gated
    reqs = prepared(drafter, 7, 2, seed=2)
    assert [p.tokens for p in back.propose(prepared(back, 7, 2, seed=2))] == [p.tokens for p in drafter.propose(reqs)]
    plain = DFlashDrafter.random(random_dflash_config(target, 6), target)
    plain.save(tmp_path / "plain")
    for algorithm in ("dspark", "dflash2"):
        with pytest.raises(SpecConfigError, match=f"--speculative-algorithm {algorithm}"):
            build_drafter(SpecConfig(algorithm=algorithm, draft_model_path=str(tmp_path / "plain")), target)
