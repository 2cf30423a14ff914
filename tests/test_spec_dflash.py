"""DFlash-style block drafter: shapes, checkpoint roundtrip, start-up errors, ring == dense window."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from spec_loop import FakeTarget, one_thread, speculative_greedy  # noqa: F401

from dhisparse.core.params import SamplingParams
from dhisparse.models.tiny import build_tiny
from dhisparse.spec.dflash import DFlashDrafter
from dhisparse.spec.dflash_config import DFlashConfigError, default_target_layer_ids
from dhisparse.spec.drafter import DraftRequest, Drafter
from dhisparse.spec.dspark import DSparkDrafter, VerifyCost
from dhisparse.spec.factory import random_dflash_config

HIDDEN = 64  # the tiny target's hidden size


@pytest.fixture(scope="module")
def target():
    return build_tiny(seed=0)


@pytest.fixture(scope="module")
def cfg(target):
    return random_dflash_config(target, block_size=8, num_layers=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def feats(layers, rows: int, seed: int, start: int = 0) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + start)
    return {l: torch.randn(rows, HIDDEN, generator=gen) for l in layers}


def req(rid: str, n: int, width: int, layers, params=SamplingParams(), new: int | None = None, seed: int = 0):
    ids = [(7 * i + 3) % 250 for i in range(n)]
    f = feats(layers, n if new is None else new, seed, 0 if new is None else n - new)
    return DraftRequest(rid, ids, anchor=(n * 5) % 250, max_width=width, params=params, num_prompt_tokens=n, new_features=f)


def test_random_drafter_block_shapes(target, cfg):
    d = DFlashDrafter.random(cfg, target, seed=1, window=32, page=8, max_requests=4)
    assert isinstance(d, Drafter) and d.capture_layers == (1, 3)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=4)
    props = d.propose([req("g", 20, 8, d.capture_layers), req("s", 12, 5, d.capture_layers, sampled),
                       req("w", 9, 1, d.capture_layers)])
    g, s, w = props
    assert len(g.tokens) == 7 and g.probs is None and all(0 < c <= 1 for c in g.confidences)
    assert len(s.tokens) == 4 and s.probs.shape == (4, 320)
    assert torch.allclose(s.probs.sum(-1), torch.ones(4))
    assert all(s.probs[i, t] > 0 for i, t in enumerate(s.tokens))
    assert w.tokens == []
    assert d.state_bytes_per_request() == 2 * 2 * d.ring_rows * cfg.num_kv_heads * cfg.head_dim * 4
    with pytest.raises(ValueError, match="features for 20"):
        d.propose([DraftRequest("g", list(range(21)), 1, 4)])  # position 20 never committed


def test_checkpoint_roundtrip_gives_identical_proposals(target, cfg, tmp_path):
    d = DFlashDrafter.random(cfg, target, seed=2, window=32, page=8)
    d.save(tmp_path / "drafter")
    keys = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert keys["dflash_config"]["target_layer_ids"] == [1, 3] and keys["dflash_config"]["block_size"] == 8
    loaded = DFlashDrafter.load(tmp_path / "drafter", target, window=32, page=8, seed=2)  # same draft streams
    assert loaded.cfg == d.cfg
    sampled = SamplingParams(temperature=1.0, seed=9)
    for make in (lambda: [req("a", 15, 8, d.capture_layers)], lambda: [req("b", 11, 6, d.capture_layers, sampled)]):
        a, b = d.propose(make())[0], loaded.propose(make())[0]
        assert a.tokens == b.tokens and a.confidences == b.confidences
        assert (a.probs is None and b.probs is None) or torch.equal(a.probs, b.probs)


def test_checkpoint_with_model_prefix_and_extra_tensors(target, cfg, tmp_path):
    from safetensors.torch import load_file, save_file
    d = DFlashDrafter.random(cfg, target, seed=3, window=16, page=4)
    folder = d.save(tmp_path / "ckpt")
    tensors = {"model." + k: v for k, v in load_file(str(folder / "model.safetensors")).items()}
    tensors["model.candidate_selector.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match="strict=False"):
        DFlashDrafter.load(folder, target, window=16, page=4)
    loaded = DFlashDrafter.load(folder, target, strict=False, window=16, page=4)
    r = lambda: [req("x", 10, 8, cfg.target_layer_ids)]  # noqa: E731
    assert loaded.propose(r())[0].tokens == d.propose(r())[0].tokens


def test_startup_errors_name_the_mismatch(target, cfg, tmp_path):
    with pytest.raises(DFlashConfigError, match="vocab_size 321 does not match the target's 320"):
        DFlashDrafter.random(replace(cfg, vocab_size=321), target)
    with pytest.raises(DFlashConfigError, match="hidden_size 32 does not match the target's 64"):
        DFlashDrafter.random(replace(cfg, hidden_size=32), target)
    with pytest.raises(DFlashConfigError, match=r"target_layer_ids .* out of range .* 6 layers"):
        DFlashDrafter.random(replace(cfg, target_layer_ids=(1, 6)), target)
    with pytest.raises(DFlashConfigError, match="--speculative-draft-window-size 4 is smaller"):
        DFlashDrafter.random(cfg, target, window=4)
    bad = DFlashDrafter.random(cfg, target)
    bad.cfg = replace(cfg, vocab_size=321)
    bad.save(tmp_path / "bad")
    with pytest.raises(DFlashConfigError, match="vocab_size"):
        DFlashDrafter.load(tmp_path / "bad", target)


def test_default_target_layer_ids():
    assert default_target_layer_ids(78, 6) == (1, 16, 31, 45, 60, 75)
    assert default_target_layer_ids(6, 1) == (3,)
    assert default_target_layer_ids(2, 3) == (1, 1, 1)


def run_rounds(d: DFlashDrafter, rounds: int, seed: int) -> list[list[int]]:
    """Two requests, variable accepted counts; returns every proposal's tokens."""
    rng = torch.Generator().manual_seed(seed)
    n = {"a": 5, "b": 9}
    for rid in n:
        d.propose([req(rid, n[rid], 1, d.capture_layers, seed=seed)])  # prefill features
    out = []
    for step in range(rounds):
        reqs = [DraftRequest(r, [(7 * i + 3) % 250 for i in range(n[r])], (n[r] * 5) % 250, 4) for r in n]
        props = d.propose(reqs)
        out.append([t for p in props for t in p.tokens] + [round(c, 6) for p in props for c in p.confidences])
        for r, p in zip(n, props):
            acc = int(torch.randint(0, len(p.tokens) + 1, (1,), generator=rng))
            d.commit(r, acc, feats(d.capture_layers, acc + 1, seed, n[r]))
            n[r] += acc + 1
    return out


def test_ring_wraparound_matches_an_unbounded_window_store(target, cfg):
    small = replace(cfg, block_size=4)
    ring = DFlashDrafter.random(small, target, seed=5, window=8, page=4, k_max=4, max_requests=2)
    dense = DFlashDrafter.random(small, target, seed=5, window=8, page=4, k_max=4, context="dense")
    assert ring.ring_rows == 16
    a, b = run_rounds(ring, 30, seed=1), run_rounds(dense, 30, seed=1)
    assert a == b  # ring rows wrapped many times (>= 30 rounds x 1..4 positions past 16 rows)
    wide = DFlashDrafter.random(small, target, seed=5, window=64, page=4, k_max=4, context="dense")
    assert run_rounds(wide, 30, seed=1) != a  # the window really bounds what the drafter sees


def test_dflash_and_dspark_in_the_greedy_loop_are_exact(target, cfg):
    fake = FakeTarget(vocab=13, hidden=HIDDEN, layers=(1, 3))
    prompt = [3, 1, 4, 1, 5]
    for drafter in (DFlashDrafter.random(cfg, target, seed=6, window=16, page=4),
                    DSparkDrafter(DFlashDrafter.random(cfg, target, seed=6, window=16, page=4), VerifyCost())):
        out, _ = speculative_greedy(fake, drafter, prompt, steps=40, width=6)
        assert out == fake.greedy(prompt, 40)


def test_observe_chunks_and_window_suffix_match_full_prefill(target, cfg):
    make = lambda: DFlashDrafter.random(cfg, target, seed=8, window=16, page=4)  # noqa: E731
    full, chunked, suffix = make(), make(), make()
    f = feats(cfg.target_layer_ids, 40, seed=3)
    ids = [(7 * i + 3) % 250 for i in range(40)]
    chunked.observe("r", {l: v[:25] for l, v in f.items()}, 0)
    chunked.observe("r", {l: v[25:] for l, v in f.items()}, 25)
    suffix.observe("r", {l: v[24:] for l, v in f.items()}, 24)  # only the last W = 16 positions
    r = DraftRequest("r", ids, 9, 8)
    expect = full.propose([replace(r, new_features=f)])[0].tokens
    assert chunked.propose([r])[0].tokens == expect and suffix.propose([r])[0].tokens == expect
    gap = make()
    gap.observe("r", {l: v[30:] for l, v in f.items()}, 30)  # positions 24..29 are inside the window
    with pytest.raises(ValueError, match="skipped positions before 30"):
        gap.propose([r])
    with pytest.raises(ValueError, match="rewinds"):
        gap.observe("r", f, 0)
