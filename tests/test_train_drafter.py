"""The DFlash2 drafter stage (dhisparse/train/drafter.py) in its CPU smoke mode: a tiny trained
target, its greedy data, a few dozen drafter steps. The loss falls and training is deterministic;
the training forward computes exactly what the engine's DFlashDrafter computes for the same
context / block (and a one-position slip would not); training on shifted labels does worse; the
saved checkpoint serves in the engine as a dflash2 drafter token-identically to no speculation,
with more accepted drafts than its untrained init; the sub-command writes a checkpoint + record."""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.spec.dflash import DFlashDrafter
from dhisparse.spec.dflash_io import load_dflash, save_dflash
from dhisparse.spec.drafter import DraftRequest
from dhisparse.train import drafter as D
from dhisparse.train import dsa
from dhisparse.train.corpus import Corpus
from dhisparse.train.tokenizer import save_tokenizer, train_tokenizer
from tie_rule import tie_rule

SMALL = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, kv_lora_rank=32,
             q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_head_dim=16,
             index_topk=8, indexer_types=["full", "full", "shared", "full"], first_k_dense_replace=2,
             max_position_embeddings=256)
BLOCK, PROMPT, GEN, STEPS = 4, 16, 32, 100
LAYER_IDS = (1, 3)  # 3 = the last layer: its feature is the pre-norm output, not hidden_states[-1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    corpus = Corpus.build(max_files=12, share=0.2)
    tok = train_tokenizer([f.text for f in corpus.train], 400)
    train = torch.tensor(tok.encode(Corpus.text(corpus.train)).ids[:20000])
    held = torch.tensor(tok.encode(Corpus.text(corpus.heldout)).ids[:5000])
    target = dsa.build_model(dsa.small_config(tok.get_vocab_size(), **SMALL), seed=0)
    dsa.train_stage(target, "dense", train, 150, seq_len=64, batch=8, log_every=50)  # varied greedy text
    dsa.set_topk(target, SMALL["index_topk"])  # the dense stage left every indexer keeping all positions
    tie_rule(target)  # the engine's top-k tie rule, so transformers' greedy tokens / features are the engine's
    folder = tmp_path_factory.mktemp("target")
    target.save_pretrained(folder)
    save_tokenizer(tok, folder)
    target.eval()
    cfg = D.drafter_config(target.config, BLOCK, 2, target_layer_ids=LAYER_IDS)
    data = D.make_data(target, train, cfg, 32, PROMPT, GEN, seed=0)
    held_data = D.make_data(target, held, cfg, 24, PROMPT, GEN, seed=1)
    model = D.new_drafter(cfg, seed=0)
    result = D.train_drafter(target, model, cfg, data, STEPS, batch=16, lr=3e-3, seed=0, log_every=10)
    return SimpleNamespace(folder=folder, target=target, cfg=cfg, data=data, held=held_data, model=model,
                           result=result, init=D.new_drafter(cfg, seed=0), held_tokens=held)


def test_loss_falls_and_acceptance_beats_the_untrained_drafter(setup):
    r = setup.result
    assert r.draft_loss[-1] < r.draft_loss[0] - 2.0, r.draft_loss
    # the selector's loss is 0 while no label is among the untrained drafter's candidates (it was at
    # step 0 on the H200's interpreter, whose standard library is another corpus): compare against
    # the first logged loss that had a target
    first = next(x for x in r.selector_loss if x > 0)
    assert r.selector_loss[-1] < first, r.selector_loss
    trained = D.eval_acceptance(setup.model, setup.target, setup.held)
    untrained = D.eval_acceptance(setup.init, setup.target, setup.held)
    # drafts accepted a round: > 1 more here; 0.79 against 0.009 on the H200 (s19), whose interpreter's
    # standard library (the corpus) is another one: a margin of half a draft holds on both
    assert trained > untrained + 0.5, (trained, untrained)
    # the trained selector is no worse than a randomly initialised one on the same drafter
    random_sel = copy.deepcopy(setup.model)
    random_sel.candidate_selector.load_state_dict(setup.init.candidate_selector.state_dict())
    assert trained >= D.eval_acceptance(random_sel, setup.target, setup.held), trained


def test_training_is_deterministic(setup):
    def run(seed):
        m = D.new_drafter(setup.cfg, seed)
        D.train_drafter(setup.target, m, setup.cfg, setup.data, 8, batch=8, lr=3e-3, seed=seed)
        return m.state_dict()

    flags = [p.requires_grad for p in setup.target.parameters()]
    a, b, c = run(3), run(3), run(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert [p.requires_grad for p in setup.target.parameters()] == flags  # the target's flags are restored


def _engine_drafter(cfg, model, target) -> DFlashDrafter:
    """The inference drafter over the transformers target (num_layers as the engine's config names it)."""
    shim = SimpleNamespace(model=target, config=SimpleNamespace(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                                                num_layers=target.config.num_hidden_layers))
    return DFlashDrafter(cfg, copy.deepcopy(model), shim, context="dense")


def _features(cfg, feats: torch.Tensor) -> dict[int, torch.Tensor]:
    """[n, F*H] -> {layer: [n, H]} (the engine's per-layer capture)."""
    h = cfg.hidden_size
    return {l: feats[:, j * h:(j + 1) * h] for j, l in enumerate(cfg.target_layer_ids)}


@pytest.mark.parametrize("window", [None, 8])
def test_training_forward_equals_the_inference_drafter(setup, window):
    """Same context (positions max(0, n - W)..n - 1), block [anchor, mask...], positions, rows -> tokens;
    window 8 (< the context) checks the window convention; a one-position slip is detected."""
    cfg = setup.cfg if window is None else replace(setup.cfg, sliding_window=window)
    model = setup.model if window is None else D.new_drafter(cfg, seed=5)
    seqs, feats = setup.held.seqs, setup.held.feats
    cases = [(s, n) for s in range(3) for n in (PROMPT, PROMPT + 7, seqs.shape[1] - 2)]
    rows, starts = (torch.tensor(c) for c in zip(*cases))
    anchors = seqs[rows].gather(1, starts[:, None])[:, 0]
    with torch.no_grad():
        hidden, logits = D.block_forward(model, setup.target, feats[rows], anchors, starts)
        slipped = D.block_forward(model, setup.target, feats[rows], anchors, starts + 1)[1]
    tokens = D.draft_tokens(model, setup.target, feats[rows], anchors, starts)
    d = _engine_drafter(cfg, model, setup.target)
    reqs = []
    for i, (s, n) in enumerate(cases):
        rid = f"r{i}"
        d.observe(rid, _features(cfg, feats[s, :n]), 0)
        reqs.append(DraftRequest(rid, seqs[s, :n].tolist(), int(seqs[s, n]), BLOCK))
    ref_hidden, ref_logits, _ = d._draft_logits(reqs, [d._states[r.request_id] for r in reqs])
    assert torch.allclose(hidden, ref_hidden, atol=1e-5) and torch.allclose(logits, ref_logits, atol=1e-4)
    assert [p.tokens for p in d.propose(reqs)] == tokens.tolist()
    assert (slipped - ref_logits).abs().max() > 1e-2  # one position off (context through the anchor) is caught


def test_shifted_labels_do_not_beat_correct_training(setup, monkeypatch):
    """Mutation: block row i trained on the greedy token at n + i + 1 instead of n + i."""
    right = D.block_labels
    monkeypatch.setattr(D, "block_labels", lambda seqs, starts, block: right(seqs, starts + 1, block))
    shifted = D.new_drafter(setup.cfg, seed=0)
    D.train_drafter(setup.target, shifted, setup.cfg, setup.data, STEPS, batch=16, lr=3e-3, seed=0)
    monkeypatch.setattr(D, "block_labels", right)
    correct = D.eval_acceptance(setup.model, setup.target, setup.held)
    assert D.eval_acceptance(shifted, setup.target, setup.held) < correct - 0.2


def test_engine_serves_the_trained_drafter_exactly(setup, tmp_path):
    save_dflash(tmp_path / "trained", setup.cfg, setup.model)
    save_dflash(tmp_path / "init", setup.cfg, setup.init)
    prompts = [setup.held.seqs[i, :PROMPT].tolist() for i in range(8)]  # held-out prompts
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = [o.token_ids for o in LLM(str(setup.folder), device="cpu").generate(prompts, greedy)]
    per_round = {}
    for name in ("trained", "init"):
        llm = LLM(str(setup.folder), device="cpu", preset="resident", speculative_algorithm="dflash2",
                  speculative_draft_model_path=str(tmp_path / name), speculative_num_draft_tokens=BLOCK)
        drafter, seen = llm.engine.spec.drafter, {}
        observe = drafter.observe
        drafter.observe = lambda rid, f, start: (seen.setdefault(rid, f), observe(rid, f, start))
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == plain
        per_round[name] = llm.engine.stats().as_dict()["spec_tokens_per_round"]
        # the engine's prefill features are the ones the stage trains on (hooked layer outputs)
        mine = D.target_features(setup.target, torch.tensor(prompts), LAYER_IDS)
        assert len(seen) == len(prompts)
        for theirs, feats in zip(seen.values(), mine):
            assert all(torch.allclose(theirs[l], _features(setup.cfg, feats)[l], atol=1e-5) for l in LAYER_IDS)
    assert per_round["trained"] > per_round["init"] + 0.5, per_round


def test_the_drafter_stage_writes_a_checkpoint_and_a_record(setup, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    D.add_parser(parser.add_subparsers(dest="stage"))
    argv = ["drafter", "--target", str(setup.folder), "--out", str(tmp_path / "d"), "--steps", "30", "--batch", "8",
            "--lr", "3e-3", "--block-size", "4", "--seqs", "16", "--eval-seqs", "4", "--prompt-len", "16",
            "--gen-len", "16", "--max-files", "12", "--heldout", "0.2"]
    ns = parser.parse_args(argv)
    assert ns.func(ns, argv) == 0
    record = json.loads((tmp_path / "d" / "drafter_record.json").read_text())
    assert record["steps"] == 30 and record["corpus"]["train"]["files"] > 0 and record["device"] == "cpu"
    assert record["draft_loss"][-1] < record["draft_loss"][0], record["draft_loss"]
    acc = record["heldout_acceptance"]
    assert acc["trained"] > acc["untrained"], acc
    cfg, _ = load_dflash(tmp_path / "d")
    assert cfg.is_dflash2 and cfg.block_size == 4 and cfg.num_target_layers == 4
    bad = parser.parse_args(["drafter", "--target", str(tmp_path / "absent"), "--out", str(tmp_path / "x")])
    assert D.drafter_stage(bad, []) == 2
    assert "no config.json there" in capsys.readouterr().err
    short = parser.parse_args(argv[:-4] + ["--gen-len", "2"])
    assert D.drafter_stage(short, []) == 2 and "--gen-len 2 is shorter than --block-size 4" in capsys.readouterr().err
