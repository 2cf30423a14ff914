"""DeepSeek-V4 MTP drafter: a tiny V4 checkpoint's `mtp.0.*` block loads and drafts, every preset
stays token-identical to non-speculative `resident`, the ring equals a dense windowed reference
(the sliding-window MTP layer is exact), sampled drafts follow the returned q, and a mis-wired
block (e_proj / h_proj swapped) drafts differently."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dhisparse import SamplingParams
from dhisparse.models.registry import load_model
from dhisparse.models.v4_loader import read_v4_config
from dhisparse.spec.config import SpecConfig, SpecConfigError
from dhisparse.spec.drafter import DraftRequest, Drafter
from dhisparse.spec.factory import build_drafter
from dhisparse.spec.mtp import MtpDrafter
from dhisparse.spec.mtp_v4 import MtpV4Parts
from dhisparse.spec.mtp_v4_model import MtpV4Module, SequenceWindow
from test_spec_mtp import chi2_ok
from v4_engine_util import engine, generate, loaded_v41
from v4_fixtures import _UP, one_thread as _one_thread, prompt_ids, save_v4_checkpoint, v4_config

pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPTS = [prompt_ids(n, seed=n) for n in (9, 22)] + [[5, 6, 7, 8, 9] * 6]
one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)
OWN_UP = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm.weight",
          "hnorm.weight": "hnorm.weight", "norm.weight": "norm.weight", "hc_head.hc_fn": "hc_head_fn",
          "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}  # hand-written, not the loader's


def upstream_mtp(module: MtpV4Module) -> dict[str, torch.Tensor]:
    """The block under DeepSeek's names (`mtp.0.*`, per-expert w1 / w3 / w2), via the fixtures' table."""
    I, out = module.tcfg.moe_intermediate_size, {}
    for name, t in module.state_dict().items():
        t = t.detach().clone()
        if name in OWN_UP:
            out["mtp.0." + OWN_UP[name]] = t
        elif name == "block.mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                out[f"mtp.0.ffn.experts.{e}.w1.weight"], out[f"mtp.0.ffn.experts.{e}.w3.weight"] = t[e, :I], t[e, I:]
        elif name == "block.mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"mtp.0.ffn.experts.{e}.w2.weight"] = t[e]
        else:
            out["mtp.0." + _UP[name.removeprefix("block.")]] = t
    return out


def write_checkpoint(folder, mtp: dict | None, nextn: int = 1):
    """Rewrite a saved tiny V4 checkpoint with `mtp` tensors added and num_nextn_predict_layers."""
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        state = {n: f.get_tensor(n) for n in f.keys() if not n.startswith("mtp.")}
    save_file({k: v.contiguous() for k, v in (state | (mtp or {})).items()}, str(path))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": nextn}))
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = save_v4_checkpoint(v4_config(num_nextn_predict_layers=1), tmp_path_factory.mktemp("v4mtp") / "hf", seed=3)
    module = MtpV4Module.random(read_v4_config(folder), seed=11)
    mtp = upstream_mtp(module)
    return write_checkpoint(folder, mtp), mtp


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint[0])


@pytest.fixture(scope="module")
def reference(loaded) -> list[list[int]]:
    return generate(engine(loaded), PROMPTS, GREEDY)


def test_checkpoint_block_loads_with_the_right_tensors(loaded, checkpoint):
    lm, cfg = loaded.model, loaded.config
    assert set(lm.mtp_weights) == set(checkpoint[1])
    d = build_drafter(SpecConfig(algorithm="mtp", num_draft_tokens=4, page_size=4), lm)
    assert isinstance(d, MtpDrafter) and isinstance(d, Drafter) and isinstance(d.parts, MtpV4Parts)
    assert d.capture_layers == (cfg.num_layers,) and d.window == cfg.sliding_window == 8  # exact window
    assert d.embed is lm.model.embed_tokens and d.head is lm.lm_head  # shared, as upstream
    m, want = d.module, checkpoint[1]
    assert torch.equal(m.e_proj.weight, want["mtp.0.e_proj.weight"]) and torch.equal(m.h_proj.weight, want["mtp.0.h_proj.weight"])
    assert torch.equal(m.hc_head.hc_fn, want["mtp.0.hc_head_fn"]) and torch.equal(m.norm.weight, want["mtp.0.norm.weight"])
    assert torch.equal(m.block.attn_hc.fn, want["mtp.0.hc_attn_fn"])
    assert torch.equal(m.block.self_attn.q_a_proj.weight, want["mtp.0.attn.wq_a.weight"])
    assert torch.equal(m.block.mlp.experts.down_proj[1], want["mtp.0.ffn.experts.1.w2.weight"])
    assert m.block.self_attn.kind == "sliding_attention" and not m.block.mlp.gate.hashed
    bf16 = build_drafter(SpecConfig(algorithm="mtp"), load_model(checkpoint[0], dtype="bfloat16").model).module
    assert bf16.e_proj.weight.dtype == torch.bfloat16  # hyper-connections, sinks, norms stay fp32 like the target's
    assert {bf16.block.attn_hc.fn.dtype, bf16.hc_head.hc_fn.dtype, bf16.block.self_attn.sinks.dtype} == {torch.float32}


@pytest.mark.parametrize("preset", ["resident", "hisparse", "adaptive"])
def test_every_preset_is_token_identical(loaded, reference, preset):
    eng = engine(loaded, preset=preset, hot_cache_rows=4, speculative_algorithm="mtp", speculative_num_draft_tokens=4)
    assert isinstance(eng.spec.drafter.parts, MtpV4Parts)
    assert generate(eng, PROMPTS, GREEDY) == reference
    st = eng.stats().as_dict()
    assert st["spec_rounds"] > 0


def test_startup_errors(tmp_path, checkpoint):
    folder = save_v4_checkpoint(v4_config(), tmp_path / "none", seed=3)
    with pytest.raises(SpecConfigError, match=r"num_nextn_predict_layers=0") as e:
        build_drafter(SpecConfig(algorithm="mtp"), load_model(write_checkpoint(folder, None, 0)).model)
    assert "\n" not in str(e.value)
    with pytest.raises(SpecConfigError, match=r"lacks MTP tensors \['mtp.0.e_proj.weight'"):
        build_drafter(SpecConfig(algorithm="mtp"), load_model(write_checkpoint(folder, None, 1)).model)
    part = {n: t for n, t in checkpoint[1].items() if "experts.3." not in n}
    with pytest.raises(SpecConfigError, match="experts are incomplete"):
        build_drafter(SpecConfig(algorithm="mtp"), load_model(write_checkpoint(folder, part, 1)).model)
    lm = loaded_v41().model  # a built-in random V4 model: seeded random MTP weights, like GLM's
    assert isinstance(build_drafter(SpecConfig(algorithm="mtp"), lm).parts, MtpV4Parts)
    with pytest.raises(SpecConfigError, match="sliding window of 8"):
        build_drafter(SpecConfig(algorithm="mtp", draft_window_size=16), lm)


# -- the ring is the dense windowed reference (exact sliding-window attention) ------------------------
def reference_drafts(d: MtpDrafter, ids: list[int], g: torch.Tensor, k: int) -> list[int]:
    """Greedy chain re-running `forward_sequence` over the whole history each step. ids: tokens
    0..n (anchor last); g [n, N * D]: the target streams of positions 0..n-1."""
    m, out = d.module, []
    tok, G = torch.tensor(ids[1:]), g
    for _ in range(k):
        s = m.forward_sequence(d.embed(tok), G, torch.arange(tok.shape[0]), tok, d.window)[-1:]
        nxt = int(d.head(m.head_input(s)).argmax())
        out.append(nxt)
        tok, G = torch.cat([tok, torch.tensor([nxt])]), torch.cat([G, s.flatten(1)])
    return out


@pytest.fixture(scope="module")
def target():
    return loaded_v41().model


@torch.inference_mode()
def test_ring_wraparound_matches_the_dense_reference(target):
    d = MtpDrafter.random(target, seed=3, page=4, k_max=4, max_requests=2)
    L, F = target.config.num_layers, target.config.hc_mult * target.config.hidden_size
    assert d.ring_rows == 16 and d.capture_layers == (L,) and d.feature_window == 8
    gen = torch.Generator().manual_seed(0)
    ids = {"a": [(7 * i + 3) % 120 for i in range(6)], "b": [(5 * i + 1) % 120 for i in range(3)]}
    raw = {r: torch.randn(len(v) - 1, F, generator=gen) for r, v in ids.items()}
    d.observe("a", {L: raw["a"][:2]}, 0)
    d.observe("a", {L: raw["a"][2:]}, 2)
    for step in range(12):  # up to ~40 positions: past W = 8, the 16-row slots wrap
        reqs = [DraftRequest(r, v[:-1], v[-1], 4, new_features={L: raw[r]} if step == 0 and r == "b" else None)
                for r, v in ids.items()]
        for r, prop in zip(ids, d.propose(reqs)):
            assert prop.probs is None and len(prop.tokens) == 3
            assert prop.tokens == reference_drafts(d, ids[r], raw[r], 3)
            acc = int(torch.randint(0, 4, (1,), generator=gen))
            new = torch.randn(acc + 1, F, generator=gen)
            d.commit(r, acc, {L: new})
            raw[r] = torch.cat([raw[r], new])
            ids[r] = ids[r] + prop.tokens[:acc] + [int(torch.randint(3, 120, (1,), generator=gen))]
    assert len(ids["a"]) > 3 * d.window


@torch.inference_mode()
def test_kv_rows_are_the_rows_the_layer_attends(target):
    m = MtpV4Module.random(target.config, seed=2)
    T, F = 7, target.config.hc_mult * target.config.hidden_size
    ids, pos = torch.arange(3, 3 + T), torch.arange(T)
    s = m.fuse(target.model.embed_tokens(ids), torch.randn(T, F, generator=torch.Generator().manual_seed(0)), pos)
    ctx = SequenceWindow(pos, 8)
    m.run_block(s, pos, ids, ctx)
    torch.testing.assert_close(m.kv_rows(s, pos), ctx.kv, rtol=0, atol=0)


# -- sampled drafts follow the returned q --------------------------------------------------------------
@torch.inference_mode()
def test_sampled_drafts_follow_the_returned_q(target):
    d = MtpDrafter.random(target, seed=4, page=4, k_max=3)
    L, V = target.config.num_layers, target.config.vocab_size
    d.observe("s", {L: torch.randn(12, target.config.hc_mult * target.config.hidden_size,
                                   generator=torch.Generator().manual_seed(1))}, 0)
    ids, params, n = [(3 * i + 7) % 120 for i in range(12)], SamplingParams(temperature=2.0, top_k=6, seed=5), 1500
    counts, sums = torch.zeros(2, V), torch.zeros(2, V)
    for _ in range(n):  # no commit: the request's state stays, its generator advances
        p = d.propose([DraftRequest("s", ids, 9, 3, params=params)])[0]
        assert torch.allclose(p.probs.sum(-1), torch.ones(2)) and all(p.probs[i, t] > 0 for i, t in enumerate(p.tokens))
        for i in range(2):
            counts[i, p.tokens[i]] += 1
            sums[i] += p.probs[i]
    assert int((sums[0] > 0).sum()) == 6  # top-k 6: q1 is the same every call
    for i in range(2):  # E[count] = sum of the q each draw used
        ok, stat = chi2_ok(counts[i], sums[i])
        assert ok, stat


# -- a mis-wired block drafts differently --------------------------------------------------------------
class SwappedV4(MtpV4Module):
    """Mutation: e_proj applied to the target streams and h_proj to the token embedding."""

    def fuse(self, embeds, hidden, positions):
        embeds = embeds.to(self.weight.dtype).masked_fill((positions == 0)[:, None], 0.0)
        h = self.hnorm(hidden.to(embeds.dtype).view(hidden.shape[0], self.tcfg.hc_mult, self.tcfg.hidden_size))
        return self.e_proj(h) + self.h_proj(self.enorm(embeds)).unsqueeze(1)


@torch.inference_mode()
def test_a_miswired_block_drafts_differently(target):
    good = MtpV4Module.random(target.config, seed=6)
    bad = SwappedV4(good.cfg, good.tcfg)
    bad.load_state_dict(good.state_dict())
    bad.to_target(torch.float32, "cpu").eval()
    L, F = target.config.num_layers, target.config.hc_mult * target.config.hidden_size
    drafts = {}
    for name, module in (("good", good), ("bad", bad)):
        d = MtpDrafter(module, target, page=4, k_max=4, max_requests=8)
        reqs = []
        for r in range(8):
            g = torch.Generator().manual_seed(100 + r)
            n = 5 + 3 * r
            d.observe(str(r), {L: torch.randn(n, F, generator=g)}, 0)
            reqs.append(DraftRequest(str(r), torch.randint(3, 120, (n,), generator=g).tolist(), 40 + r, 4))
        drafts[name] = [p.tokens for p in d.propose(reqs)]
    differ = sum(a != b for x, y in zip(drafts["good"], drafts["bad"]) for a, b in zip(x, y))
    assert differ >= 16, (differ, drafts)  # of 24 drafts: random tokens agree ~1 / 128 of the time
