"""DeepSeek-V4 compressed rows in the hierarchy (`hisparse`, `adaptive`): token-identical to
`resident` (I7) with and without speculation, every located row checked against a shadow copy
(I2), each resolver call copying exactly the rows absent from the source's device tiers,
rejections inside a compression window rolled back exactly (I5), pool / host integrity after
every step (I1, I4: debug_checks), load-adaptive reclaim under a tight pool."""

from __future__ import annotations

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.models.registry import load_model
from dhisparse.spec.dspark import VerifyCost
from v4_engine_util import SourceCheck, engine, generate
from v4_fixtures import one_thread as _one_thread, prompt_ids, save_v4_checkpoint, v4_config

pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
PROMPTS = [prompt_ids(n, seed=n) for n in (9, 22, 37)] + [[5, 6, 7, 8, 9] * 6]

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(save_v4_checkpoint(v4_config(), tmp_path_factory.mktemp("v4hier") / "hf", seed=3))


@pytest.fixture(scope="module")
def reference(loaded) -> dict:
    outs = generate(engine(loaded), PROMPTS, GREEDY)
    return {tuple(p): o for p, o in zip(PROMPTS, outs)}


def expected(reference) -> list[list[int]]:
    return [reference[tuple(p)] for p in PROMPTS]


@pytest.mark.parametrize("preset", ["hisparse", "adaptive"])
def test_v4_hierarchy_matches_resident(loaded, reference, preset, monkeypatch):
    ck = SourceCheck().install(monkeypatch)
    eng = engine(loaded, preset=preset, hot_cache_rows=4)
    assert generate(eng, PROMPTS, GREEDY) == expected(reference)
    st = eng.stats().as_dict()
    assert st["resolver_calls"] > 0 and ck.located > 0 and st["kv_pages_used"] == 0
    if preset == "hisparse":
        assert st["host_selected_rows"] > 0 and sum(ck.host_rows.values()) > 0  # misses were exercised
    else:
        assert st["host_fetched_share"] < eng.stats().as_dict()["resolver_direct_share"] + 1  # counters present
        assert st["coverage"] >= 0.0


def test_v4_adaptive_reclaims_under_a_tight_pool(loaded, reference):
    eng = engine(loaded, preset="adaptive", hot_cache_rows=4, kv_pool_bytes=80 * 1024, max_running_requests=4,
                 admission_reserve_pages=0)  # no reserve: the pool is tight enough to reclaim
    assert generate(eng, PROMPTS, GREEDY) == expected(reference)
    assert eng.stats().as_dict()["reclaimed_pages"] > 0


@pytest.mark.parametrize("preset", ["resident", "hisparse", "adaptive"])
def test_v4_speculation_with_rejections_inside_windows(loaded, reference, preset, monkeypatch):
    """Oracle drafts at ~2.5 tokens / round of width 4: rejections land inside compression
    windows (m = 4); the compressor state and the rows of the cut window are rolled back exactly."""
    ck = SourceCheck().install(monkeypatch)
    eng = engine(loaded, reference, preset=preset, hot_cache_rows=4, speculative_algorithm="oracle",
                 speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=2.5)
    backed = _watch_backups(eng, ck) if preset != "resident" else []
    assert generate(eng, PROMPTS, GREEDY) == expected(reference)
    st = eng.stats().as_dict()
    assert 1.5 < st["spec_tokens_per_round"] < 3.5 and ck.window_cuts > 0
    assert preset == "resident" or len(backed) > 0


def _watch_backups(eng, ck) -> list:
    """I5 / eq. 8: only committed rows (w < committed // m) reach host, with the committed bytes."""
    kv, m, backed = eng.store.kv, eng.model_config.csa_rate, []
    orig = kv._pages_to_host

    def copy(req, dev_pages, start):
        end = start + len(dev_pages) * kv.page_size
        st = eng.store.states[req]
        assert end <= st.committed // m, f"rows [{start}, {end}) backed up past the committed frontier {st.committed}"
        orig(req, dev_pages, start)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the backup is an asynchronous copy into pinned memory
        host = kv.host.locations(req, start, end)
        for g, layer in enumerate(eng.model_config.csa_sources):
            rows = kv.host.layer_rows(g)[host // kv.host.page_size, host % kv.host.page_size]
            want = torch.stack([ck.rows[(req, layer, w)] for w in range(start, end)])
            torch.testing.assert_close(rows, want.to(rows.device), rtol=0, atol=0)
        backed.append((req, start, end))

    kv._pages_to_host = copy
    return backed


@pytest.mark.parametrize("preset", ["resident", "hisparse"])
def test_v4_dspark_is_exact(loaded, reference, preset, monkeypatch):
    """DSpark (confidence-scheduled widths over a DFlash drafter conditioned on V4 features)."""
    ck = SourceCheck().install(monkeypatch)
    eng = engine(loaded, preset=preset, hot_cache_rows=4, speculative_algorithm="dspark",
                 speculative_num_draft_tokens=4)
    eng.spec.drafter.cost = VerifyCost.linear(1.0, 0.0)  # free width: every round drafts (and mostly rejects)
    assert generate(eng, PROMPTS, GREEDY) == expected(reference)
    st = eng.stats().as_dict()
    assert st["spec_rounds"] > 0 and "spec_accept_pos1" in st and ck.window_cuts > 0


def test_v4_hier_store_bad_settings(loaded):
    with pytest.raises(ValueError, match="hot_cache_rows"):
        engine(loaded, preset="hisparse", hot_cache_rows=2)
    eng = engine(loaded, preset="hisparse")
    assert eng.prepare_prefix(PROMPTS[0]) == len(PROMPTS[0])  # V4 prefixes: tests/test_v4_prefix.py
    assert torch.is_tensor(eng.store.kv.hot_pos)


def test_v4_host_counted_direct_passes_equal_the_device_census(loaded, reference, monkeypatch):
    """V4's row hierarchy under `adaptive` counts its all-direct passes like the GLM path: the
    host count equals the per-group device counters."""
    from dhisparse.kv.hier import context as hier_context

    stats = {}
    for host in (False, True):
        monkeypatch.setattr(hier_context.HierContext, "HOST_CENSUS", host)
        eng = engine(loaded, preset="adaptive", hot_cache_rows=4)
        assert generate(eng, PROMPTS, GREEDY) == expected(reference)
        st = eng.stats().as_dict()
        stats[host] = {k: v for k, v in st.items() if k.startswith(("resolver", "selected", "host_"))}
    assert stats[True] == stats[False]


@pytest.mark.parametrize("preset", ["hisparse", "adaptive"])
def test_v4_fused_resolver_copies_are_exact(loaded, reference, preset, monkeypatch):
    """The deferred Triton resolver with its copies fused into the plan kernel (resolver_copy="fused")
    on V4's compressed sources, and with the hot_entry index (resolver_lookup="index", held to
    hot_pos's inverse by the debug checks): resident's tokens, every located row checked against the
    shadow copy, and the same census as the separate copy launch."""
    pytest.importorskip("triton")
    stats = {}
    for copy, lookup in (("separate", "scan"), ("fused", "scan"), ("separate", "index")):
        ck = SourceCheck().install(monkeypatch)
        eng = engine(loaded, preset=preset, hot_cache_rows=4, resolver="triton", resolver_copy=copy,
                     resolver_lookup=lookup, debug_checks=lookup == "index")
        assert eng.store.kv.fuse_copies == (copy == "fused")
        assert (eng.store.kv.hot_entry is not None) == (lookup == "index")
        assert generate(eng, PROMPTS, GREEDY) == expected(reference)
        assert ck.located > 0
        st = eng.stats().as_dict()
        stats[copy, lookup] = {k: v for k, v in st.items() if k.startswith(("resolver", "selected", "host_"))}
    assert stats["fused", "scan"] == stats["separate", "scan"] == stats["separate", "index"]
    assert preset == "adaptive" or stats["fused", "scan"]["host_selected_rows"] > 0
