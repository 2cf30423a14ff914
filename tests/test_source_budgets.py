"""Per-source hot-cache budgets (`--source-hot-cache-rows`, issue 26 item 7; the paper's V4.1 setting
gives the source five layers select from 8,192 rows and every other source 4,096): each source's
resolver sees only its own B_g entries, the output stays token-identical to `resident`, and bad
budgets are refused with the flag's name."""

from __future__ import annotations

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.engine.config import ConfigValueError, EngineConfig
from dhisparse.engine.llm import LLM
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from kv_check import checked
from v4_engine_util import SourceCheck, engine, generate, loaded_v41

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPTS = [[3 + (7 * i + 5 * j) % 120 for j in range(30 + 17 * i)] for i in range(3)]


@pytest.fixture(autouse=True)
def watch_hot_caches(monkeypatch):
    """Records, per store, 1 + the highest hot-cache entry of each group any request filled
    (read when the request is freed, before its slot is reset)."""
    seen: dict[int, list[int]] = {}
    orig = HierarchicalKV.free

    def free(kv, req):
        st = kv.reqs.get(req)
        if st is not None:
            used = seen.setdefault(id(kv), [0] * kv.hot_pos.shape[1])
            for g in range(kv.hot_pos.shape[1]):
                filled = (kv.hot_pos[st.slot, g] >= 0).nonzero()
                if filled.numel():
                    used[g] = max(used[g], int(filled.max()) + 1)
        orig(kv, req)

    monkeypatch.setattr(HierarchicalKV, "free", free)
    WATCHED.clear()
    WATCHED.update(seen=seen)
    yield


WATCHED: dict = {}


def assert_within_budgets(kv: HierarchicalKV, needed: bool = True) -> None:
    """No group filled an entry past its budget; `needed`: some group filled more than the smallest
    budget (so the budgets mattered)."""
    used = WATCHED["seen"].get(id(kv), [0] * len(kv.B_of))
    assert all(u <= b for u, b in zip(used, kv.B_of)), (used, kv.B_of)
    assert not needed or max(used) > min(kv.B_of), (used, kv.B_of)


@pytest.mark.parametrize("preset", ["hisparse", "adaptive"])
def test_v4_sources_keep_their_own_budgets(preset, monkeypatch):
    loaded = loaded_v41()
    ref = generate(engine(loaded), PROMPTS, GREEDY)
    SourceCheck().install(monkeypatch)
    eng = engine(loaded, preset=preset, source_hot_cache_rows=(8, 4))
    assert eng.store.kv.B_of == (8, 4) and eng.store.kv.B == 8
    assert generate(eng, PROMPTS, GREEDY) == ref
    assert_within_budgets(eng.store.kv, needed=preset == "hisparse")  # adaptive: history mostly optional here


def test_glm_selection_groups_keep_their_own_budgets():
    ref = [o.token_ids for o in LLM("tiny", page_size=4).generate(PROMPTS, GREEDY)]
    llm = checked(LLM("tiny", preset="hisparse", page_size=4, source_hot_cache_rows=(16, 32, 16), debug_checks=True))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert_within_budgets(llm.engine.store)


def test_bad_budgets_name_the_flag():
    with pytest.raises(ValueError, match=r"--source-hot-cache-rows needs 3 budgets .* >= the model's index_topk \(16\)"):
        LLM("tiny", preset="hisparse", source_hot_cache_rows=(16, 32))
    with pytest.raises(ValueError, match="--source-hot-cache-rows needs 3"):
        LLM("tiny", preset="hisparse", source_hot_cache_rows=(16, 8, 16))
    with pytest.raises(ConfigValueError, match="source_hot_cache_rows"):
        EngineConfig(source_hot_cache_rows=(16, 0))
    # past what the plan kernel ranks (16-bit victim counts): refused at configuration, not at a step
    with pytest.raises(ConfigValueError, match="source_hot_cache_rows must be at most 32768"):
        EngineConfig(source_hot_cache_rows=(16, 32769))
    with pytest.raises(ConfigValueError, match="hot_cache_rows must be at most 32768"):
        EngineConfig(hot_cache_rows=32769)
    assert EngineConfig(hot_cache_rows=32768).hot_cache_rows == 32768


def test_a_resolver_that_ignores_the_budget_is_caught(monkeypatch):
    """Breakage: every group's resolver sees the largest budget. The budget check must fail."""
    def unbounded(self, group):
        from dhisparse.kernels.resolver_ref import ResolverState
        return ResolverState(self.hot_pos[:, group], self.hot_stamp[:, group], self.hot_loc, self.tail_start,
                             self.tail_loc, self.host_table, self.host.page_size)

    monkeypatch.setattr(HierarchicalKV, "resolver_state", unbounded)
    llm = LLM("tiny", preset="hisparse", page_size=4, source_hot_cache_rows=(16, 32, 16))
    llm.generate(PROMPTS, GREEDY)
    with pytest.raises(AssertionError):
        assert_within_budgets(llm.engine.store)
    assert torch.is_tensor(llm.engine.store.hot_pos)


def test_the_flag_parses_a_comma_list():
    from dhisparse.cli import build_parser
    from dhisparse.cli.args import engine_config

    p = build_parser()
    cfg = engine_config(p.parse_args(["serve", "--preset", "hisparse", "--source-hot-cache-rows", "8192,4096,4096"]))
    assert cfg.source_hot_cache_rows == (8192, 4096, 4096)
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--source-hot-cache-rows", "8192,,4096"])
