"""FP8 KV rows on the other checkpoints: the HF-format GLM and V3.2 checkpoints exact under FP8 and
their prefill logits close to bf16's (measured), and DeepSeek-V4.1's presets token-identical under FP8
(quantizer and kernels: test_kv_fp8.py)."""

from __future__ import annotations

import pytest
from kv_check import checked
from test_kv_fp8_serving import GREEDY, PROMPTS

from dhisparse.core.kvformat import KVFormats
from dhisparse.engine.llm import LLM


@pytest.mark.parametrize("arch", ["glm", "v32"])
def test_hf_checkpoints_are_exact_under_fp8_and_close_to_bf16(hf_checkpoints, arch):
    folder, prompts = getattr(hf_checkpoints, arch), [[t % 120 + 3 for t in p] for p in PROMPTS[:3]]  # vocab 128
    ref = [o.token_ids for o in LLM(folder, kv_cache_dtype="fp8_e4m3", page_size=4).generate(prompts, GREEDY)]
    for preset, kw in (("hisparse", {}), ("adaptive+spec", {"speculative_algorithm": "dflash"}),
                       ("adaptive", {"kv_pool_bytes": 48 * 1024, "admission_reserve_pages": 0, "max_running_requests": 3})):
        llm = checked(LLM(folder, preset=preset, kv_cache_dtype="fp8_e4m3", page_size=4, hot_cache_rows=16,
                          debug_checks=True, **kw))
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref, preset
    rel = prefill_error(llm.engine.model, llm.engine.model_config, prompts[2])
    assert 0 < rel["mean"] < 1.0, rel  # measured, not bounded tightly: tiny random models amplify any KV
    # perturbation (bf16 rounding alone moves their logits by ~5%; bench/fp8_quality.py reports both)


def prefill_error(model, cfg, ids: list[int]) -> dict:
    """Relative error of prefill logits with FP8 rows against plain rows (DenseKV, same model)."""
    from dhisparse.core.batch import ForwardBatch
    from dhisparse.kv.resident.dense import DenseKV

    out = {}
    for name, formats in (("plain", None), ("fp8", KVFormats.mla("fp8_e4m3", cfg.latent_dim, cfg.qk_rope_head_dim,
                                                                 cfg.index_head_dim, model.dtype))):
        kv = DenseKV(cfg, next(model.parameters()).device, model.dtype, formats)
        batch = ForwardBatch.build([(list(ids), 0)], device=next(model.parameters()).device)
        out[name] = model.logits(model(batch, kv.begin(batch, [0])).hidden).float()
    d = (out["fp8"] - out["plain"]).norm(dim=-1) / out["plain"].norm(dim=-1)
    return {"mean": float(d.mean()), "max": float(d.max())}


def test_v4_presets_are_token_identical_under_fp8(monkeypatch):
    from v4_engine_util import SourceCheck, engine, generate, loaded_v41

    loaded, prompts = loaded_v41(), [[t % 120 + 3 for t in p] for p in PROMPTS[:3]]  # vocab 128
    ref = generate(engine(loaded, kv_cache_dtype="fp8_e4m3"), prompts, GREEDY)
    assert engine(loaded, kv_cache_dtype="fp8_e4m3").store.cache.store.row_format("kv").nbytes == 24 + 16 + 1 + 7
    ck = SourceCheck().install(monkeypatch)
    for preset, kw in (("hisparse", {}), ("adaptive", {"speculative_algorithm": "ngram"}),
                       ("adaptive", {"speculative_algorithm": "dspark", "kv_pool_bytes": 80 * 1024,
                                     "admission_reserve_pages": 0})):
        eng = engine(loaded, preset=preset, hot_cache_rows=4, kv_cache_dtype="fp8_e4m3", **kw)
        assert eng.arena.formats.fp8
        assert generate(eng, prompts, GREEDY) == ref
    assert ck.located > 0
