"""DFlash and DFlash2 against their public reference, the `dflash` package (0.1.0, a test-time
reference only): checkpoints written by its `save_pretrained` load into our drafter, and a round's
block hidden states, logits and greedy drafts equal the reference's within 1e-4 (fp32) over
random configs - layer counts, block sizes, target_layer_ids, sliding windows and causal layers,
attention bias, output_multiplier, softcapping, the input embedding scale, DFlash2's grouped
dynamic convolutions and candidate selector, and the trained drafter shipped with the built-in
`tiny-code` checkpoint (over tiny-code's own embedding and LM head). Each breakage named in issue 27 (a causal block,
context K/V dropped, the selector's codebooks swapped, the convolution offset off by one) makes
the comparison fail.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import dflash.model as dflash_model  # pinned: dflash==0.1.0, installed --no-deps by the test command
from transformers import Qwen3Config  # noqa: E402

import dhisparse.spec.dflash_model as ours_model  # noqa: E402
import dhisparse.spec.dflash_select as ours_select  # noqa: E402
from dhisparse.spec.dflash import DFlashDrafter  # noqa: E402
from dhisparse.spec.drafter import DraftRequest  # noqa: E402

H, V, TARGET_LAYERS = 64, 96, 6
CASES = {
    "one-layer": dict(layers=1, block=4, ids=[2], extra=dict(is_causal=False)),
    "sliding-causal": dict(layers=3, block=5, ids=[1, 3, 4], extra=dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=6,
        use_sliding_window=True, attention_bias=True), dflash=dict(output_multiplier=0.7, final_logit_softcapping=3.0,
                                                                   input_embedding_scale=1.3)),
    "sliding-bidirectional": dict(layers=2, block=6, ids=[0, 5], extra=dict(
        layer_types=["sliding_attention"] * 2, sliding_window=8, use_sliding_window=True, is_causal=False)),
    "dflash2": dict(layers=2, block=5, ids=[1, 4], two=True, extra=dict(is_causal=False),
                    dflash=dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)),
}
TRAINED = "trained-tiny-code"  # models/builtin/tiny-code/dflash2, loaded by both from its folder


def trained_case() -> dict:
    import json

    from dhisparse.models.registry import builtin_folder

    folder = builtin_folder("tiny-code") / "dflash2"
    cfg = json.loads((folder / "config.json").read_text())
    d = cfg["dflash_config"]
    return dict(folder=folder, two=True, block=d["block_size"], ids=d["target_layer_ids"], H=cfg["hidden_size"], V=cfg["vocab_size"],
                mask=d["mask_token_id"], dflash={"input_embedding_scale": d["input_embedding_scale"]})


def trained_target():
    """tiny-code's embedding and LM head (all a drafter round reads of its target)."""
    from safetensors.torch import load_file

    from dhisparse.models.registry import builtin_folder

    w = load_file(str(builtin_folder("tiny-code") / "model.safetensors"))
    emb, head = w["model.embed_tokens.weight"].float(), w["lm_head.weight"].float()
    embed = torch.nn.Embedding(*emb.shape)
    lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    with torch.no_grad():
        embed.weight.copy_(emb), lm_head.weight.copy_(head)
    cfg = SimpleNamespace(vocab_size=emb.shape[0], hidden_size=emb.shape[1], num_layers=6)
    return SimpleNamespace(model=SimpleNamespace(embed_tokens=embed), lm_head=lm_head, config=cfg)


def reference(case: dict, seed: int = 0):
    dcfg = {"block_size": case["block"], "mask_token_id": 3, "target_layer_ids": case["ids"], **case.get("dflash", {})}
    cfg = Qwen3Config(hidden_size=H, intermediate_size=96, num_hidden_layers=case["layers"], num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=V, max_position_embeddings=512,
                      num_target_layers=TARGET_LAYERS, dflash_config=dcfg, **case.get("extra", {}))
    cls = dflash_model.DFlash2DraftModel if case.get("two") else dflash_model.DFlashDraftModel
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.25)
    return model


def fake_target(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(V, H)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(V, H, generator=g))
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
    cfg = SimpleNamespace(vocab_size=V, hidden_size=H, num_layers=TARGET_LAYERS)
    return SimpleNamespace(model=SimpleNamespace(embed_tokens=embed), lm_head=head, config=cfg)


@pytest.fixture(scope="module", params=[*sorted(CASES), TRAINED])
def pair(request, tmp_path_factory):
    if request.param == TRAINED:
        case = trained_case()
        ref = dflash_model.DFlash2DraftModel.from_pretrained(str(case["folder"]), dtype=torch.float32).eval()
        target = trained_target()
        return TRAINED, case, ref, DFlashDrafter.load(case["folder"], target, max_context=512), target
    case = CASES[request.param]
    ref = reference(case)
    folder = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(folder)
    target = fake_target()
    return request.param, case, ref, DFlashDrafter.load(folder, target, max_context=512), target


def inputs(case: dict, n: int, requests: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    h, v = case.get("H", H), case.get("V", V)
    feats = torch.randn(requests, n, len(case["ids"]) * h, generator=g)
    anchors = torch.randint(4, v, (requests,), generator=g)
    return feats, anchors


def run_reference(ref, case, target, feats, anchors):
    """The reference's round: its forward over [context ; block] with the target's embedding and
    head, as dflash_generate calls it -> (hidden rows 1.., logits rows 1.., greedy drafts)."""
    n, b = feats.shape[1], case["block"]
    ids = torch.full((feats.shape[0], b), case.get("mask", 3))
    ids[:, 0] = anchors
    scale = float(case.get("dflash", {}).get("input_embedding_scale", 1.0))
    with torch.no_grad():
        noise = torch.nn.functional.embedding(ids, target.model.embed_tokens.weight) * scale
        pos = torch.arange(n + b)[None].expand(feats.shape[0], -1)
        hidden = ref(target_hidden=feats, noise_embedding=noise, position_ids=pos)[:, 1:]
        if case.get("two"):
            tokens = ref.propose(hidden, anchors, target.lm_head, 0.0)[0]
        else:
            tokens = ref.compute_logits(hidden, target.lm_head).argmax(-1)
        return hidden, ref.compute_logits(hidden, target.lm_head), tokens


def run_ours(drafter: DFlashDrafter, case, feats, anchors):
    n = feats.shape[1]
    reqs, states = [], []
    for r in range(feats.shape[0]):
        rid = f"r{r}-{id(feats)}"
        h = case.get("H", H)
        split = {l: feats[r, :, i * h:(i + 1) * h] for i, l in enumerate(case["ids"])}
        drafter.observe(rid, split, 0)
        req = DraftRequest(rid, list(range(n)), int(anchors[r]), case["block"])
        reqs.append(req), states.append(drafter._prepare(req))
    hidden, logits, _ = drafter._draft_logits(reqs, states)
    tokens = torch.tensor([p.tokens for p in drafter.propose(reqs)])
    for req in reqs:
        drafter.release(req.request_id)
    return hidden, logits, tokens


def close(a, b, tol=1e-4) -> bool:
    return bool(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) < tol)


@pytest.mark.parametrize("n", [1, 12])
def test_block_hidden_logits_and_drafts_match_the_reference(pair, n):
    name, case, ref, drafter, target = pair
    feats, anchors = inputs(case, n, requests=4)
    rh, rl, rt = run_reference(ref, case, target, feats, anchors)
    oh, ol, ot = run_ours(drafter, case, feats, anchors)
    assert close(oh, rh) and close(ol, rl), (name, (oh - rh).abs().max(), (ol - rl).abs().max())
    assert torch.equal(ot, rt), name


def test_the_checkpoints_settings_are_read(pair):
    name, case, _, drafter, _ = pair
    cfg = drafter.cfg
    assert cfg.is_dflash2 == bool(case.get("two")) and cfg.target_layer_ids == tuple(case["ids"])
    if name == "sliding-causal":
        assert [cfg.layer_window(i) for i in range(3)] == [6, None, 6] and cfg.layer_causal(0) and not cfg.layer_causal(1)
        assert drafter.window == 512 and cfg.output_multiplier == 0.7 and cfg.final_logit_softcapping == 3.0
    if name == "sliding-bidirectional":
        assert drafter.window == 8 and not cfg.layer_causal(0)  # the ring holds the checkpoint's window


def mismatch(pair, n: int = 12) -> bool:
    _, case, ref, drafter, target = pair
    feats, anchors = inputs(case, n, requests=8)
    rh, rl, rt = run_reference(ref, case, target, feats, anchors)
    oh, ol, ot = run_ours(drafter, case, feats, anchors)
    return not (close(oh, rh) and close(ol, rl) and torch.equal(ot, rt))


def test_breakages_fail(pair, monkeypatch):
    name, case, _, drafter, _ = pair
    real = ours_model.attention_mask
    monkeypatch.setattr(ours_model, "attention_mask", lambda q, k, valid, w, c: real(q, k, valid, w, True))
    assert mismatch(pair) or all(drafter.cfg.layer_causal(i) for i in range(drafter.cfg.num_layers)), "causal block"
    monkeypatch.setattr(ours_model, "attention_mask",
                        lambda q, k, valid, w, c: real(q, k, torch.cat([valid[:, :-q.shape[1]] & False,
                                                                        valid[:, -q.shape[1]:]], 1), w, c))
    assert mismatch(pair), "context K/V dropped"
    monkeypatch.undo()
    if case.get("two"):
        sel = drafter.model.candidate_selector
        with torch.no_grad():
            a, b = sel.predecessor_codebook.weight.clone(), sel.successor_codebook.weight.clone()
            sel.predecessor_codebook.weight.copy_(b), sel.successor_codebook.weight.copy_(a)
        try:
            assert mismatch(pair), "codebooks swapped"
        finally:
            with torch.no_grad():
                sel.predecessor_codebook.weight.copy_(a), sel.successor_codebook.weight.copy_(b)
        real_conv = ours_select.grouped_dynamic_conv

        def off_by_one(x, dynamic, base, group):
            return real_conv(torch.nn.functional.pad(x[:, :-1], (0, 0, 1, 0)), dynamic, base, group)

        monkeypatch.setattr(ours_select, "grouped_dynamic_conv", off_by_one)
        assert mismatch(pair), "convolution offset off by one"
        monkeypatch.undo()
    assert not mismatch(pair), name  # and with everything restored it matches again
