"""Cross-layer KV sources (DeepSeek-V4.1 style: Full / Reindex / Reuse): config keys and their
errors, transformers parity when every layer is its own Full source, and on a tiny two-source
V4.1 config every preset token-identical to `resident` with and without speculation (I7), one
cache state per physical source: a Reuse consumer makes no resolver call and reads exactly its
source's latest selected rows, a Reindex consumer copies from host only rows absent from the
source's device tiers and hits rows earlier layers fetched (I2 via the shadow check)."""

from __future__ import annotations

import json

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.core.config import ConfigError
from dhisparse.core.v4_config import V4Config
from dhisparse.models.v4_loader import load_v4_checkpoint
from dhisparse.spec.dspark import VerifyCost
from v4_engine_util import V41_LAYERS, SourceCheck, engine, generate, loaded_v41, tiny_v41
from v4_fixtures import V4_TINY, build_v4_hf, one_thread as _one_thread, prompt_ids, v4_config

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
PROMPTS = [prompt_ids(n, seed=n) for n in (11, 26, 41)]


def test_source_keys_parse_and_describe_layers():
    c = tiny_v41()
    assert c.csa_sources == (1, 2) and c.selecting_layers == (1, 2, 5, 7)
    assert [c.source_of(i) for i in range(9)] == V41_LAYERS["kv_source_layer_ids"]
    assert [c.produces_rows(i) for i in range(9)] == [False, True, True, False, True, False, False, False, False]
    plain = V4Config.from_hf(v4_config())
    assert plain.csa_sources == (1, 3) and plain.selection_type(3) == "full" and plain.source_of(3) == 3


@pytest.mark.parametrize("change, key", [
    (dict(kv_source_layer_ids=[0, 1, 2]), "kv_source_layer_ids"),
    (dict(selection_types=["full"] * 8 + ["copy"]), "selection_types"),
    (dict(kv_source_layer_ids=[0, 1, 2, 1, 4, 1, 1, 2, 1], selection_types=["full"] * 9), "'full'"),
    (dict(kv_source_layer_ids=[0, 1, 2, 1, 1, 1, 1, 2, 2]), "layer 4 is"),
    (dict(kv_source_layer_ids=[0, 1, 2, 1, 4, 3, 1, 2, 2]), "kv_source_layer_ids'\\[5\\]"),
    (dict(kv_source_layer_ids=[0, 1, 2, 4, 4, 1, 1, 2, 2]), "kv_source_layer_ids'\\[3\\]"),
])
def test_bad_source_keys_name_the_key_and_fix(change, key):
    with pytest.raises(ConfigError, match=key):
        V4Config.from_hf({**V4_TINY, **V41_LAYERS, **change})


def test_explicit_full_sources_equal_transformers(tmp_path):
    """Every layer its own Full source (keys written out) is transformers' DeepSeek-V4."""
    hf = build_v4_hf(v4_config(), seed=2)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(kv_source_layer_ids=[0, 1, 2, 3], selection_types=["full"] * 4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = load_v4_checkpoint(tmp_path).model
    assert ours.config.selection_types == ("full",) * 4
    from v4_fixtures import chunked_logits

    ids = prompt_ids(30, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = chunked_logits(ours, [ids[:13], ids[13:]])
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@pytest.fixture(scope="module")
def loaded():
    return loaded_v41()


@pytest.fixture(scope="module")
def reference(loaded) -> dict:
    return {tuple(p): o for p, o in zip(PROMPTS, generate(engine(loaded), PROMPTS, GREEDY))}


def _expected(reference):
    return [reference[tuple(p)] for p in PROMPTS]


@pytest.mark.parametrize("preset", ["hisparse", "adaptive"])
def test_v41_presets_match_resident_with_one_state_per_source(loaded, reference, preset, monkeypatch):
    ck = SourceCheck().install(monkeypatch)
    eng = engine(loaded, preset=preset, hot_cache_rows=4)
    assert generate(eng, PROMPTS, GREEDY) == _expected(reference)
    # selecting layers 1, 5 (source 1) and 2, 7 (source 2) call the resolver; reuse layers 3, 6, 8 never do
    assert ck.calls == {1: 2 * ck.decode_passes, 2: 2 * ck.decode_passes} and ck.decode_passes > 0
    assert eng.store.census.calls == 4 * ck.decode_passes
    assert ck.reused == 3 * eng.stats().steps == eng.store.counters.reuse_reads
    if preset == "hisparse":  # (adaptive keeps these short histories, decoded pages too, resident: all direct)
        assert ck.reindex_hits > 0  # a reindex call found rows the full layer fetched into the shared cache
        assert sum(ck.host_rows.values()) > 0


@pytest.mark.parametrize("preset", ["resident", "hisparse", "adaptive"])
def test_v41_speculation_is_exact(loaded, reference, preset, monkeypatch):
    ck = SourceCheck().install(monkeypatch)
    eng = engine(loaded, reference, preset=preset, hot_cache_rows=4, speculative_algorithm="oracle",
                 speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=2.5)
    assert generate(eng, PROMPTS, GREEDY) == _expected(reference)
    assert ck.window_cuts > 0
    if preset == "hisparse":
        assert eng.stats().as_dict()["resolver_overflow"] > 0  # unions beyond B went through staging
        assert eng.store.counters.stage_replays > 0  # reuse after another source refilled staging


def test_v41_dspark_is_exact(loaded, reference, monkeypatch):
    ck = SourceCheck().install(monkeypatch)
    eng = engine(loaded, preset="adaptive", hot_cache_rows=4, speculative_algorithm="dspark",
                 speculative_num_draft_tokens=4)
    eng.spec.drafter.cost = VerifyCost.linear(1.0, 0.0)
    assert generate(eng, PROMPTS, GREEDY) == _expected(reference)
    assert "spec_accept_pos1" in eng.stats().as_dict() and ck.window_cuts > 0


def test_v41_scaled_benchmark_config():
    """Item 5's shape: k 512, four shared CSA sources read by eight selecting layers (+ 8 reuse)."""
    from dhisparse.models.v4_scaled import v41_scaled_config

    c = v41_scaled_config()
    assert (c.num_layers, c.index_topk, c.head_dim, c.csa_rate, c.hca_rate) == (34, 512, 512, 4, 128)
    assert len(c.csa_sources) == 4 and len(c.selecting_layers) == 8
    assert c.selection_types.count("reuse") == 8 and c.selection_types.count("reindex") == 4
    assert v41_scaled_config(1).selecting_layers == (2, 6) and v41_scaled_config(1).csa_sources == (2,)


def test_hierarchy_needs_a_csa_source():
    from dhisparse.models.loader import LoadedModel
    from dhisparse.models.tokenizer import ByteTokenizer
    from dhisparse.models.v4_scaled import build_v4_random

    cfg = V4Config.from_hf(v4_config(layer_types=["sliding_attention", "heavily_compressed_attention"] * 2))
    loaded = LoadedModel(build_v4_random(cfg, 0), cfg, {}, ByteTokenizer())
    with pytest.raises(ValueError, match="compressed_sparse_attention.*--preset resident"):
        engine(loaded, preset="hisparse")
    assert generate(engine(loaded), PROMPTS[:1], SamplingParams(max_tokens=3))[0]


def test_v41_triton_resolver_is_exact(loaded, reference, monkeypatch):
    """The fused Triton resolver plan + copies (interpreted on CPU) serve V4.1's compressed rows."""
    pytest.importorskip("triton")
    ck = SourceCheck().install(monkeypatch)
    eng = engine(loaded, reference, preset="hisparse", hot_cache_rows=4, resolver="triton", speculative_algorithm="oracle",
                 speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=2.5)
    assert eng.store.kv.plan_fn.__name__ == "plan_triton"
    assert generate(eng, PROMPTS, GREEDY) == _expected(reference)
    assert sum(ck.host_rows.values()) > 0 and ck.window_cuts > 0
