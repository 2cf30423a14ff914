"""Every feature-conditioned drafter (dflash, dflash2, dspark) and ngram, over every preset
(resident, hisparse, adaptive), is token-identical to non-speculative `resident` under greedy
decoding on a DeepSeek-V3.2 and a DeepSeek-V4 tiny checkpoint (GLM-5's built-in tiny model is
tests/test_spec_engine.py; MTP is tests/test_spec_mtp.py). And the sampled proposals of DFlash and of
DFlash2's selector follow the q they return (chi-square; DSpark's: tests/test_dspark_head.py)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from dhisparse import SamplingParams
from dhisparse.models.registry import load_model
from dhisparse.models.tiny import build_tiny
from dhisparse.spec.dflash import DFlashDrafter
from dhisparse.spec.factory import random_dflash_config
from hf_fixtures import save_hf_checkpoint, v32_config
from v4_engine_util import engine, generate
from v4_fixtures import prompt_ids, save_v4_checkpoint, v4_config

GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
PROMPTS = [prompt_ids(n, seed=n) for n in (9, 26)] + [[5, 6, 7, 8, 9] * 5]
DRAFTERS = ["dflash", "dflash2", "dspark", "ngram"]
PRESETS = ["resident", "hisparse", "adaptive"]


@pytest.fixture(scope="module", params=["deepseek_v32", "deepseek_v4"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "deepseek_v32":
        path = save_hf_checkpoint(v32_config(), folder / "hf", seed=2)
    else:
        path = save_v4_checkpoint(v4_config(), folder / "hf", seed=3)
    loaded = load_model(path)
    return request.param, loaded, generate(engine(loaded), PROMPTS, GREEDY)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("algorithm", DRAFTERS)
def test_drafter_and_preset_match_resident(model, preset, algorithm):
    name, loaded, reference = model
    eng = engine(loaded, preset=preset, hot_cache_rows=4, speculative_algorithm=algorithm,
                 speculative_num_draft_tokens=4)
    assert generate(eng, PROMPTS, GREEDY) == reference, (name, preset, algorithm)
    assert eng.stats().as_dict()["spec_rounds"] > 0


@torch.inference_mode()
def test_dflash2_sampled_drafts_follow_q():
    target = build_tiny(0)
    drafter = DFlashDrafter.random(random_dflash_config(target, 4, kind="dflash2"), target, seed=1)
    sel = drafter.model.candidate_selector
    rows, vocab = 4000, drafter.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 2, drafter.cfg.hidden_size, generator=g).expand(rows, -1, -1)
    logits = (torch.randn(1, 2, vocab, generator=g) * 3).expand(rows, -1, -1)
    gen = torch.Generator().manual_seed(5)
    out = sel.select(hidden, logits, torch.full((rows,), 7), [0.9] * rows, [gen] * rows)
    q1 = out.dense_q(0, 1, vocab)[0]
    counts = torch.bincount(out.tokens[:, 0], minlength=vocab).double()
    keep = q1 > 0
    assert int(keep.sum()) == sel.top_k and counts[~keep].sum() == 0
    exp = q1.double() * rows
    assert chi2.sf(float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1) > 1e-4
    greedy = sel.select(hidden[:2], logits[:2], torch.full((2,), 7), [0.0, 0.0], [None, None])
    assert torch.equal(greedy.q.sum(-1), torch.ones(2, 2))  # one-hot at the greedy pick


@torch.inference_mode()
def test_dflash_sampled_drafts_follow_q():
    """DFlash's sampled drafts: each request draws from q = processed_probs(its rows) with its own
    stream; over many requests the first draft's frequencies match q (chi-square), and the q it
    returns is that distribution."""
    from dhisparse.core.sampling import processed_probs
    from dhisparse.spec.dflash import _State
    from dhisparse.spec.dflash_pick import pick_each
    from dhisparse.spec.drafter import DraftRequest

    target = build_tiny(0)
    drafter = DFlashDrafter.random(random_dflash_config(target, 4), target, seed=2)
    vocab = drafter.cfg.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 2
    params = SamplingParams(temperature=0.7, top_p=0.9)
    want = processed_probs(logits, [params] * 3)
    counts = torch.zeros(vocab, dtype=torch.float64)
    rows = 3000
    for r in range(rows):
        req = DraftRequest(f"s{r}", [1, 2], 5, 4, params=params)
        prop = pick_each([req], [drafter._generator(req, _State(0), logits.device)], logits[None])[0]
        counts[prop.tokens[0]] += 1
        if r == 0:
            assert torch.allclose(prop.probs, want)
    keep = want[0] > 0
    exp = want[0].double() * rows
    assert counts[~keep].sum() == 0
    assert chi2.sf(float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1) > 1e-4
