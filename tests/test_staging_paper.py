"""Paper staging (issue 26 item 1; kv/hier/promotion.py): chi arenas, rank stamps, promotion of
staged rows into the hot cache with copy-back after the group's readers.

Exact state of the rank / stamp / promotion rules on hand-built tables; the engine token-identical
to resident under `paper` and `single` staging on the tiny GLM model (3-layer groups, chi 3) and a
tiny DeepSeek-V3.2 checkpoint (one layer a group, chi 1), every location checked (I2, `checked`)
and every hot-cache row compared with its host copy after each step (debug checks); the reference
and Triton resolvers agree on every counter, promotions included.

Breakages tried, each failing a test here: the copy-back's bytes skipped; the promotion flushed
before the group's followers ran; every layer reading arena 0; promotion on equal ranks (exact-state
test); the first query ignored in the rank (exact-state test)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dhisparse.core.rows import SPACE
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.llm import LLM
from dhisparse.kv.hier import resolver_step as step_mod
from dhisparse.kv.hier import promotion
from dhisparse.kv.hier.context import HierContext
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from dhisparse import SamplingParams
from kv_check import checked

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [[3 + (7 * i + 5 * j) % 120 for j in range(60 + 23 * i)] for i in range(3)]


def test_union_ranks_count_queries_then_the_first_query():
    # K = 3 queries, k = 3: row 5 by all three, row 7 by queries 1 and 2, row 9 by query 0 only,
    # row 2 by query 2 only; KS = 4
    sel = torch.tensor([[[5, 9, -1], [7, 5, -1], [5, 7, 2]]])
    ur = promotion.union_ranks(sel, 4)
    got = {int(p): int(r) for p, r, f in zip(ur.skey[0], ur.rank[0], ur.first[0]) if f}
    assert got == {5: 2 * 4 + 3, 7: 1 * 4 + 2, 9: 0 * 4 + 3, 2: 0 * 4 + 1}
    assert int(ur.first.sum()) == 4 and bool((ur.rank[0][~(ur.skey[0] < promotion.BIG)] == -1).all())


def _kv(hot_pos, hot_stamp, now=3, ks=4):
    """A one-group hierarchy's tables (the fields promotion reads), one slot."""
    S, B = 1, hot_pos.numel()
    pos_flat = torch.cat([hot_pos, torch.tensor([-1])])
    stamp_flat = torch.cat([hot_stamp, torch.tensor([-1])])
    return SimpleNamespace(rank_span=ks, stamp_now=now * ks * ks, deferred=False, B_of=(B,),
                           _hot_pos_flat=pos_flat, _hot_stamp_flat=stamp_flat,
                           hot_pos=pos_flat[:-1].view(S, 1, B), hot_stamp=stamp_flat[:-1].view(S, 1, B),
                           hot_loc=torch.arange(100, 100 + B).view(S, B))


def test_rank_stamps_and_promotion_exact_state():
    now = 3 * 16
    # hot: entries 0..3 hold rows 5, 9, 7, 40; this round touched 5, 9, 7 (stamp now), 40 is older
    kv = _kv(torch.tensor([5, 9, 7, 40]), torch.tensor([now, now, now, 17]))
    sel = torch.tensor([[[5, 9, 11], [7, 5, 12], [5, 7, 11]]])
    slots = torch.tensor([0])
    ur, touched = promotion.rank_stamps(kv, 0, sel, slots)
    assert kv.hot_stamp[0, 0].tolist() == [now + 11, now + 3, now + 6, 17]  # 5: 3 queries; 9: q0; 7: q1, q2
    assert touched[0].tolist() == [True, True, True, False]
    # staged: 11 (queries 0 and 2: rank 4 + 3 = 7) at staging row 0, 12 (query 1: rank 2) at row 1
    loc = torch.full_like(sel, 0)
    loc[0, 0, 2] = loc[0, 2, 2] = SPACE + 0
    loc[0, 1, 2] = SPACE + 1
    p = promotion.plan_promotion(kv, 0, ur, touched, loc, slots)
    # 11 (7) beats the weakest touched row 9 (3); 12 (2) does not beat the next, 7 (6): one promotion
    assert p.copy_n.tolist() == [1] and p.keep[0].tolist()[:2] == [True, False]
    assert int(p.entry[0, 0]) == 1 and int(p.pos[0, 0]) == 11 and int(p.stamp[0, 0]) == now + 7
    assert int(p.src_pad[0, 0]) == 0 and int(p.dst_pad[0, 0]) == 101


def test_promotion_needs_a_strictly_higher_rank():
    now = 3 * 16
    kv = _kv(torch.tensor([5, 9]), torch.tensor([now, now]))
    sel = torch.tensor([[[5, 9], [5, 11]]])  # 9 (q0 only: rank 3) vs staged 11 (q1 only: rank 2)
    ur, touched = promotion.rank_stamps(kv, 0, sel, torch.tensor([0]))
    loc = torch.zeros_like(sel)
    loc[0, 1, 1] = SPACE
    assert promotion.plan_promotion(kv, 0, ur, touched, loc, torch.tensor([0])).copy_n.tolist() == [0]
    sel = torch.tensor([[[5, -1], [9, 11]]])  # a tie: 9 and staged 11 are both q1's alone (rank 2)
    kv = _kv(torch.tensor([5, 9]), torch.tensor([now, now]))
    ur, touched = promotion.rank_stamps(kv, 0, sel, torch.tensor([0]))
    loc = torch.zeros_like(sel)
    loc[0, 1, 1] = SPACE
    assert promotion.plan_promotion(kv, 0, ur, touched, loc, torch.tensor([0])).copy_n.tolist() == [0]
    sel = torch.tensor([[[5, 11], [5, 9]]])  # now 11 is q0's (rank 3) and 9 q1's (rank 2): promoted
    kv = _kv(torch.tensor([5, 9]), torch.tensor([now, now]))
    ur, touched = promotion.rank_stamps(kv, 0, sel, torch.tensor([0]))
    loc = torch.zeros_like(sel)
    loc[0, 0, 1] = SPACE
    assert promotion.plan_promotion(kv, 0, ur, touched, loc, torch.tensor([0])).copy_n.tolist() == [1]


def _engine(reference, model="tiny", resolver="torch", mode="paper", preset="hisparse", hot=16,
            drafter="oracle", lookup="scan") -> LLM:
    llm = LLM.__new__(LLM)
    oracle = {"speculative_oracle_tokens_per_round": 3.0} if drafter == "oracle" else {}
    pool = {"kv_pool_bytes": 1 << 19} if preset == "adaptive" else {}  # little optional history: overflow
    llm.engine = Engine(EngineConfig(model=model, preset=preset, resolver=resolver, hot_cache_rows=hot, page_size=4,
                                     max_running_requests=8, debug_checks=True, staging_mode=mode, resolver_lookup=lookup,
                                     speculative_algorithm=drafter, speculative_num_draft_tokens=4, **oracle, **pool),
                        oracle_reference=reference)
    return checked(llm)


@pytest.fixture(scope="module")
def reference() -> dict:
    return {tuple(p): o.token_ids for p, o in zip(PROMPTS, LLM("tiny").generate(PROMPTS, GREEDY))}


def _run(reference, prompts=PROMPTS, **kw) -> dict:
    llm = _engine(reference, **kw)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [reference[tuple(p)] for p in prompts]
    return llm.engine.stats().as_dict() | {"chi": llm.engine.store.chi}


@pytest.mark.parametrize("preset", ["hisparse", "adaptive"])
def test_paper_staging_is_exact_and_promotes(reference, preset):
    st = _run(reference, preset=preset)
    assert st["chi"] == 3  # tiny: groups of 3 layers
    assert st["resolver_overflow"] > 0 and st["staging_promoted_rows"] > 0
    assert st["staging_copyback_bytes"] > 0
    single = _run(reference, preset=preset, mode="single")
    assert single["chi"] == 1 and single["staging_promoted_rows"] == 0


def test_paper_staging_same_counters_on_both_resolvers():
    """The reference and Triton resolvers, and the Triton one with the hot_entry index (promotions
    rewrite hot entries outside the resolver: the index follows, `promotion._reindex`)."""
    pytest.importorskip("triton")
    # ngram drafts are a function of the tokens alone: both runs take the same rounds (repetitive
    # prompts: its drafts fill the width, so unions overflow)
    ps = [[5, 6, 7, 8, 9] * 8, [3, 4, 5] * 13 + [7]]  # two prompts: the Triton resolver is interpreted on CPU
    ref = {tuple(p): o.token_ids for p, o in zip(ps, LLM("tiny").generate(ps, GREEDY))}
    a = _run(ref, ps, resolver="torch", drafter="ngram")
    b = _run(ref, ps, resolver="triton", drafter="ngram")
    c = _run(ref, ps, resolver="triton", drafter="ngram", lookup="index")  # promotions keep the index (debug checks)
    assert a["staging_promoted_rows"] > 0
    keys = ("selected_rows", "host_selected_rows", "resolver_overflow", "staging_promoted_rows", "resolver_bytes_moved")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys} == {k: c[k] for k in keys}


def test_paper_staging_is_exact_on_a_v32_checkpoint(hf_checkpoints):
    path = str(hf_checkpoints.v32)
    ref = {tuple(p): o.token_ids for p, o in zip(PROMPTS, LLM(path).generate(PROMPTS, GREEDY))}
    st = _run(ref, model=path, hot=4)  # index_topk 4: a 4-query union overflows a 4-row hot cache
    assert st["chi"] == 1 and st["resolver_overflow"] > 0 and st["staging_promoted_rows"] > 0


def test_v4_keeps_single_staging_and_refuses_paper(tmp_path):
    """On a tiny V4.1-style checkpoint (the scaled V4.1 took ~40 s of CI to build twice)."""
    import json

    from safetensors.torch import save_file

    from dhisparse.models.v4_scaled import build_v4_random
    from v4_engine_util import V41_LAYERS, tiny_v41
    from v4_fixtures import V4_TINY

    (tmp_path / "config.json").write_text(json.dumps({**V4_TINY, **V41_LAYERS}))
    state = build_v4_random(tiny_v41(), 5).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="staging_mode 'paper'"):
        LLM(str(tmp_path), preset="hisparse", speculative_algorithm="ngram", staging_mode="paper", max_running_requests=2)
    llm = LLM(str(tmp_path), preset="hisparse", speculative_algorithm="ngram", max_running_requests=2)
    assert llm.engine.store.kv.staging_mode == "single"


# -- mutations: each breakage must fail a check ------------------------------------------------------
def _no_copyback(p, src, dst):
    return None


def _early(self, but):
    return HierContext._flush_orig(self, None)  # flush the group being read too


@pytest.mark.parametrize("breakage", ["skip copy-back", "flush early", "one arena"])
def test_paper_staging_breakages_fail(reference, monkeypatch, breakage):
    if breakage == "skip copy-back":
        monkeypatch.setattr(promotion, "copy_layered_torch", _no_copyback)
        monkeypatch.setattr(step_mod, "copy_layered_torch", _no_copyback)
    elif breakage == "flush early":
        monkeypatch.setattr(HierContext, "_flush_orig", HierContext._flush, raising=False)
        monkeypatch.setattr(HierContext, "_flush", _early)
    else:  # every layer stages into and reads arena 0: the copy-back takes arenas 1.. unwritten
        monkeypatch.setattr(HierarchicalKV, "staging_rows", lambda self, layer=0: self.stage)
    with pytest.raises(AssertionError):
        _run(reference)
