"""ModelConfig.from_hf: transformers 5.x keys vs legacy / upstream keys, schedules, errors."""

from __future__ import annotations

import pytest

from dhisparse.core.config import ConfigError, ModelConfig
from hf_fixtures import glm_config, v32_config

YARN = dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
            mscale=1.0, mscale_all_dim=1.0)


def _legacy_glm(**over) -> dict:
    """A GLM-5.2-style config.json: rope_theta + rope_scaling, freq/offset schedule, no derived lists."""
    d = glm_config(num_hidden_layers=14, first_k_dense_replace=2, rope_theta=50000.0, rope_scaling=dict(YARN),
                   index_topk_freq=4, index_skip_topk_offset=3, indexer_rope_interleave=True,
                   max_position_embeddings=163840)
    for k in ("indexer_types", "rope_parameters"):
        d.pop(k)
    d.update(over)
    return d


def _hf_normalized(d: dict) -> dict:
    """The same config after transformers' own __post_init__ (5.x keys), as save_pretrained writes it."""
    from transformers import AutoConfig

    out = AutoConfig.for_model(**d).to_dict()
    out["model_type"] = d["model_type"]
    return out


def test_tiny_configs_parse():
    v = ModelConfig.from_hf(v32_config())
    assert v.architecture == "deepseek_v32" and v.indexer_full == (True,) * 3
    assert v.mlp_moe == (False, True, True) and (v.n_group, v.topk_group) == (2, 1)
    assert v.indexer_rope_interleave is False and v.qk_head_dim == 24 and v.latent_dim == 40
    g = ModelConfig.from_hf(glm_config())
    assert g.indexer_full == (True, True, False, False, True) and g.indexer_rope_interleave is True
    assert [g.producer_of(i) for i in range(5)] == [0, 1, 1, 1, 4]
    assert g.eos_token_ids == (2,) and g.bos_token_id == 1 and g.pad_token_id == 0


def test_legacy_rope_keys():
    cfg = ModelConfig.from_hf(_legacy_glm())
    r = cfg.rope
    assert (r.rope_type, r.theta, r.factor, r.original_max_position_embeddings) == ("yarn", 50000.0, 40.0, 4096)
    assert (r.beta_fast, r.beta_slow, r.mscale, r.mscale_all_dim) == (32.0, 1.0, 1.0, 1.0)


def test_legacy_and_transformers_keys_agree():
    pytest.importorskip("transformers")
    for legacy in (_legacy_glm(), v32_config(rope_theta=20000.0, rope_scaling=dict(YARN), rope_parameters=None,
                                             first_k_dense_replace=2)):
        ours = ModelConfig.from_hf({k: v for k, v in legacy.items() if v is not None})
        hf = ModelConfig.from_hf(_hf_normalized({k: v for k, v in legacy.items() if v is not None}))
        assert ours == hf


def test_first_k_dense_replace():
    cfg = ModelConfig.from_hf(v32_config(first_k_dense_replace=2))
    assert cfg.mlp_moe == (False, False, True)
    explicit = ModelConfig.from_hf(v32_config(mlp_layer_types=["dense", "sparse", "dense"]))
    assert explicit.mlp_moe == (False, True, False)


def test_glm52_schedule_freq4_offset3():
    d = _legacy_glm(num_hidden_layers=78)
    cfg = ModelConfig.from_hf(d)
    full = cfg.full_layers
    assert len(full) == 21 and cfg.num_layers - len(full) == 57
    assert full[:6] == (0, 1, 2, 6, 10, 14) and full[-1] == 74
    assert ModelConfig.from_hf(_legacy_glm()).indexer_full == tuple(c == "F" for c in "FFFSSSFSSSFSSS")


def test_glm_default_schedule_is_all_full():
    d = _legacy_glm()
    del d["index_topk_freq"], d["index_skip_topk_offset"]
    assert all(ModelConfig.from_hf(d).indexer_full)


def test_index_topk_pattern():
    cfg = ModelConfig.from_hf(_legacy_glm(num_hidden_layers=6, index_topk_pattern="FSSFSF"))
    assert cfg.indexer_full == (True, False, False, True, False, True)
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        ModelConfig.from_hf(_legacy_glm(num_hidden_layers=6, index_topk_pattern="FSXFSF"))


def test_indexer_rope_interleave():
    assert ModelConfig.from_hf(glm_config()).indexer_rope_interleave is True
    assert ModelConfig.from_hf(glm_config(indexer_rope_interleave=False)).indexer_rope_interleave is False
    assert ModelConfig.from_hf(v32_config(indexer_rope_interleave=True)).indexer_rope_interleave is False


def test_fp8_quantization_config():
    q = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
    assert ModelConfig.from_hf(v32_config(quantization_config=q)).fp8_block_size == (128, 128)
    assert ModelConfig.from_hf(v32_config()).fp8_block_size is None
    # the activation scheme --fp8-activations auto follows: DeepSeek-V3 / GLM-5 FP8 checkpoints say "dynamic"
    assert ModelConfig.from_hf(v32_config(quantization_config=q)).fp8_activation_scheme == "dynamic"
    static = dict(q, activation_scheme="static")
    assert ModelConfig.from_hf(v32_config(quantization_config=static)).fp8_activation_scheme == "static"
    with pytest.raises(ConfigError, match="quantization"):
        ModelConfig.from_hf(v32_config(quantization_config={"quant_method": "awq"}))


def test_eos_list_and_dtype():
    cfg = ModelConfig.from_hf(glm_config(eos_token_id=[2, 7], torch_dtype="bfloat16"))
    assert cfg.eos_token_ids == (2, 7) and cfg.torch_dtype == "bfloat16"


def test_error_unsupported_model_type():
    with pytest.raises(ConfigError, match="llama"):
        ModelConfig.from_hf(glm_config(model_type="llama"))


def test_error_shared_first_layer():
    with pytest.raises(ConfigError, match="indexer_types"):
        ModelConfig.from_hf(glm_config(indexer_types=["shared", "full", "shared", "shared", "full"]))


@pytest.mark.parametrize("key,value", [
    ("indexer_types", ["full", "shared", "full"]),
    ("mlp_layer_types", ["dense", "sparse"]),
])
def test_error_mismatched_lengths(key, value):
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_hf(glm_config(**{key: value}))


def test_error_bad_indexer_type_and_missing_q_lora():
    with pytest.raises(ConfigError, match="'full' or 'shared'"):
        ModelConfig.from_hf(glm_config(indexer_types=["full", "full", "shared", "dense", "full"]))
    with pytest.raises(ConfigError, match="q_lora_rank"):
        ModelConfig.from_hf(v32_config(q_lora_rank=None))


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_omitted_keys_take_transformers_defaults(model_type):
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    full = AutoConfig.for_model(model_type).to_dict()
    keep = ("model_type", "vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size", "q_lora_rank",
            "n_routed_experts", "num_experts_per_tok", "bos_token_id", "eos_token_id")
    minimal = {k: full[k] for k in keep}
    assert ModelConfig.from_hf(minimal) == ModelConfig.from_hf(full)
