"""MTP ("next-n predict") drafter: checkpoint MTP layers load and draft, the ring equals a dense
reference, every preset stays token-identical, sampled drafts follow the returned q, and a trained
MTP block is accepted far more often than a random or mis-wired one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chi2

from dhisparse import SamplingParams
from dhisparse.core.batch import ForwardBatch
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.llm import LLM
from dhisparse.kv.resident.dense import DenseKV
from dhisparse.layers import rope as rope_module
from dhisparse.models.loader import read_config
from dhisparse.models.tiny import build_tiny
from dhisparse.spec.config import SpecConfig, SpecConfigError
from dhisparse.spec.drafter import DraftRequest, Drafter
from dhisparse.spec.factory import build_drafter
from dhisparse.spec.mtp import MtpDrafter
from dhisparse.spec.mtp_io import checkpoint_tensors
from dhisparse.spec.mtp_model import MtpConfig, MtpModule
from hf_fixtures import checkpoint_state, save_single
from spec_loop import one_thread  # noqa: F401
from v4_engine_util import loaded_v41

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPTS = [[3 + (7 * i + 5 * j) % 250 for j in range(20 + 23 * i)] for i in range(3)] + [[5, 6, 7, 8, 9] * 10]


@pytest.fixture(scope="module")
def target():
    return build_tiny(seed=0).model


def spec_llm(model="tiny", loaded=None, **kw) -> LLM:
    llm = LLM.__new__(LLM)
    base = dict(speculative_algorithm="mtp", speculative_num_draft_tokens=4, debug_checks=True)
    llm.engine = Engine(EngineConfig(model=model, **{**base, **kw}), loaded=loaded)
    return llm


# -- checkpoints: the DeepSeek-V3 MTP layout loads and drafts ------------------------------------------
def write_mtp_checkpoint(src, dst, arch: str):
    """src's tensors plus a seeded MTP layer (GLM: MoE sharing embed / head; V3.2: dense with its own
    embed_tokens and shared_head.head) and num_nextn_predict_layers 1 -> (folder, written MTP tensors)."""
    tcfg = read_config(src)
    mcfg = MtpConfig(layer=tcfg.num_layers, moe=arch == "glm", own_embed=arch == "v32", own_head=arch == "v32")
    module = MtpModule(mcfg, tcfg).init_random(torch.Generator().manual_seed(11))
    mtp = checkpoint_tensors(module)
    g = torch.Generator().manual_seed(12)
    L, H, iD = tcfg.num_layers, tcfg.hidden_size, tcfg.index_head_dim
    mtp[f"model.layers.{L}.self_attn.indexer.wk.weight"] = torch.randn(iD, H, generator=g)  # read, then set aside
    mtp[f"model.layers.{L}.self_attn.indexer.k_norm.bias"] = torch.zeros(iD)
    return save_single(checkpoint_state(src) | mtp, dst, src, num_nextn_predict_layers=1), mtp


@pytest.mark.parametrize("arch", ["glm", "v32"])
def test_checkpoint_mtp_layer_loads_and_drafts_exactly(hf_checkpoints, tmp_path, arch):
    folder, mtp = write_mtp_checkpoint(getattr(hf_checkpoints, arch), tmp_path / arch, arch)
    prompts = [[3 + (11 * i + 7 * j) % 120 for j in range(6 + 10 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(folder), page_size=4).generate(prompts, params)]
    llm = spec_llm(str(folder), page_size=4)
    drafter = llm.engine.spec.drafter
    assert isinstance(drafter, MtpDrafter) and isinstance(drafter, Drafter)
    got = checkpoint_tensors(drafter.module)
    assert set(got) == {n for n in mtp if ".indexer." not in n}
    assert all(torch.equal(got[n].cpu(), mtp[n].to(got[n].dtype)) for n in got)
    assert (drafter.embed is drafter.module.embed_tokens) == (arch == "v32")
    assert drafter.window == read_config(folder).index_topk == 4  # W = index_topk: exact DSA
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.engine.stats().as_dict()["spec_rounds"] > 0


def test_startup_errors_and_the_alias(hf_checkpoints, tmp_path):
    with pytest.raises(SpecConfigError, match=r"--speculative-algorithm mtp: .*num_nextn_predict_layers") as e:
        spec_llm(str(hf_checkpoints.glm))
    assert "\n" not in str(e.value)
    folder = save_single(checkpoint_state(hf_checkpoints.glm), tmp_path / "no_mtp", hf_checkpoints.glm,
                         num_nextn_predict_layers=1)
    with pytest.raises(SpecConfigError, match=r"lacks MTP tensors \['model.layers.5.enorm.weight'"):
        spec_llm(str(folder))
    assert isinstance(build_drafter(SpecConfig(algorithm="mtp"), loaded_v41().model), MtpDrafter)  # V4: test_spec_mtp_v4
    assert EngineConfig(speculative_algorithm="nextn").spec_config().algorithm == "mtp"


# -- the ring is the dense windowed reference ----------------------------------------------------------
def reference_drafts(d: MtpDrafter, ids: list[int], g: torch.Tensor, k: int) -> list[int]:
    """Greedy chain by re-running `forward_sequence` over the whole history each step. ids: tokens
    0..n (anchor last); g [n, H]: the hnorm inputs of positions 0..n-1."""
    m, emb, out, dev = d.module, d.embed, [], g.device
    E, Hd = emb(torch.tensor(ids[1:], device=dev)), g
    for _ in range(k):
        h = m.forward_sequence(E, Hd, torch.arange(E.shape[0], device=dev), d.window)[-1:]
        tok = int(d.head(m.head_input(h)).argmax())
        out.append(tok)
        E, Hd = torch.cat([E, emb(torch.tensor([tok], device=dev))]), torch.cat([Hd, m.chain_hidden(h)])
    return out


@torch.inference_mode()
def test_ring_wraparound_matches_the_dense_reference(target):
    d = MtpDrafter.random(target, seed=3, window=4, page=4, k_max=4, max_requests=2)
    assert d.ring_rows == 12 and d.capture_layers == (5,) and d.feature_window == 4
    gen = torch.Generator().manual_seed(0)
    ids = {"a": [(7 * i + 3) % 250 for i in range(6)], "b": [(5 * i + 1) % 250 for i in range(3)]}
    raw = {r: torch.randn(len(v) - 1, 64, generator=gen) for r, v in ids.items()}
    d.observe("a", {5: raw["a"][:2]}, 0)
    d.observe("a", {5: raw["a"][2:]}, 2)
    for step in range(25):  # 25 rounds x 1..4 positions: the 12-row slots wrap many times
        reqs = [DraftRequest(r, v[:-1], v[-1], 4, new_features={5: raw[r]} if step == 0 and r == "b" else None)
                for r, v in ids.items()]
        for r, prop in zip(ids, d.propose(reqs)):
            assert prop.probs is None and len(prop.tokens) == 3
            assert prop.tokens == reference_drafts(d, ids[r], target.model.norm(raw[r]), 3)
            acc = int(torch.randint(0, 4, (1,), generator=gen))
            new = torch.randn(acc + 1, 64, generator=gen)
            d.commit(r, acc, {5: new})
            raw[r] = torch.cat([raw[r], new])
            ids[r] = ids[r] + prop.tokens[:acc] + [int(torch.randint(3, 250, (1,), generator=gen))]
    with pytest.raises(ValueError, match="features for"):
        d.propose([DraftRequest("a", ids["a"], 1, 4)])  # one position never committed


# -- every preset: greedy output equals non-speculative resident ---------------------------------------
@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in LLM("tiny").generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("preset", ["resident", "hisparse", "adaptive"])
def test_every_preset_is_token_identical(reference, preset):
    llm = spec_llm(preset=preset, hot_cache_rows=16)
    assert llm.engine.spec.drafter.window == 16  # the tiny model's index_topk
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.engine.stats().as_dict()["spec_rounds"] > 0


# -- sampled drafts follow the returned q --------------------------------------------------------------
def chi2_ok(counts: torch.Tensor, expected: torch.Tensor) -> tuple[bool, float]:
    """Pearson chi-square with bins of expected < 5 merged; passes below the 0.999 quantile."""
    big = expected >= 5
    c = torch.cat([counts[big], counts[~big].sum()[None]])
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = e > 0
    stat = float(((c[keep] - e[keep]) ** 2 / e[keep]).sum())
    return stat < chi2.ppf(0.999, int(keep.sum()) - 1), stat


@torch.inference_mode()
def test_sampled_drafts_follow_the_returned_q(target):
    d = MtpDrafter.random(target, seed=4, page=4, k_max=3)
    feats = torch.randn(12, 64, generator=torch.Generator().manual_seed(1))
    ids = [(3 * i + 7) % 250 for i in range(12)]
    params = SamplingParams(temperature=2.0, top_k=6, seed=5)
    d.observe("s", {5: feats}, 0)
    n, V = 2000, 320
    first, second = torch.zeros(V), torch.zeros(V)
    q1_sum, q2_sum = torch.zeros(V), torch.zeros(V)
    for _ in range(n):  # no commit: the request's state stays, its generator advances
        p = d.propose([DraftRequest("s", ids, 9, 3, params=params)])[0]
        assert torch.allclose(p.probs.sum(-1), torch.ones(2)) and all(p.probs[i, t] > 0 for i, t in enumerate(p.tokens))
        first[p.tokens[0]] += 1
        second[p.tokens[1]] += 1
        q1_sum += p.probs[0]
        q2_sum += p.probs[1]
    assert int((q1_sum > 0).sum()) == 6  # top-k 6: q1 is the same every call
    for counts, expected in ((first, q1_sum), (second, q2_sum)):  # E[count] = sum of the q each draw used
        ok, stat = chi2_ok(counts, expected)
        assert ok, stat
    greedy = d.propose([DraftRequest("s", ids, 9, 3)])[0]
    assert greedy.probs is None and len(greedy.tokens) == 2


# -- a trained MTP block is accepted; a random or mis-wired one is not ---------------------------------
class SwappedMtp(MtpModule):
    """Mutation: enorm / hnorm inputs swapped (eh_proj's halves see the wrong tensors)."""

    def fuse(self, embeds, hidden, positions):
        return self.eh_proj(torch.cat([self.hnorm(hidden), self.enorm(embeds)], dim=-1))


def training_data(lm, prompts, outs):
    """(embeds of x_{t+1}, normed g_t, positions t, label = the target's greedy token at t + 2)."""
    E, G, P, Y = [], [], [], []
    last = lm.config.num_layers - 1
    for p, o in zip(prompts, outs):
        seq = p + o
        kv = DenseKV(lm.config)
        batch = ForwardBatch.build([(seq, 0)])
        out = lm(batch, kv.begin(batch, [0]), capture_layers=(last,))
        E.append(lm.model.embed_tokens(torch.tensor(seq[1:])))
        G.append(lm.model.norm(out.captured[last][:-1]))
        P.append(torch.arange(len(seq) - 1))
        Y.append(lm.logits(out.hidden[1:]).argmax(-1))
    return [torch.cat(x).clone() for x in (E, G, P, Y)]


def acceptance(prompts, module=None) -> dict:
    llm = spec_llm(debug_checks=False, device="cpu")  # the training below runs on CPU
    if module is not None:
        llm.engine.spec.drafter = MtpDrafter(module, llm.engine.model, k_max=4,
                                             max_requests=llm.engine.config.max_running_requests)
    llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    return llm.engine.stats().as_dict()


def test_trained_mtp_is_accepted_and_a_miswired_one_is_not():
    gen = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(3, 250, (3 + i % 4,), generator=gen).tolist() * 10)[:24] for i in range(8)]
    llm = LLM("tiny", device="cpu")
    outs = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))]
    lm = llm.engine.model
    with torch.no_grad():
        E, G, P, Y = training_data(lm, prompts, outs)
    rope_module._PERMS.clear()  # RoPE's permutation cache holds inference-mode tensors autograd cannot save
    m = MtpModule.random(lm.config, seed=1).train()
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    for _ in range(200):
        h = m.forward_sequence(E, G, P, lm.config.index_topk)
        loss = F.cross_entropy(lm.lm_head(m.head_input(h)), Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.05
    m.eval().requires_grad_(False)
    swapped = SwappedMtp(m.cfg, m.tcfg).eval()
    swapped.load_state_dict(m.state_dict())
    trained, random, wired = acceptance(prompts, m), acceptance(prompts), acceptance(prompts, swapped)
    # measured: pos1 0.785 / 0.0 / 0.013, tokens per round 2.23 / 1.0 / 1.01. Batched, some rounds hit
    # exact-zero indexer score ties of the tiny target on these repetitive prompts (a tie at the top-k
    # boundary breaks by batch layout), so a few outputs and features leave the training set; one
    # prompt at a time the trained block's pos1 is 1.0 on 7 of the 8 prompts.
    assert trained["spec_accept_pos1"] > 0.6 and trained["spec_tokens_per_round"] > 1.8
    assert random["spec_accept_pos1"] < 0.1 and wired["spec_accept_pos1"] < 0.1
    assert wired["spec_tokens_per_round"] < 1.2
    with pytest.raises(ValueError, match="hidden_input"):
        replace(m.cfg, hidden_input="pre-norm")
