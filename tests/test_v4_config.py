"""V4Config.from_hf: transformers keys vs upstream keys, defaults, errors naming the key."""

from __future__ import annotations

import pytest

from dhisparse.core.config import ConfigError
from dhisparse.core.v4_config import CSA, HCA, SLIDING, V4Config
from v4_fixtures import upstream_v4_config, v4_config


def _hf_normalized(d: dict) -> dict:
    """The config after transformers' own __post_init__, as save_pretrained writes it."""
    from transformers import AutoConfig

    out = AutoConfig.for_model(**d).to_dict()
    out["model_type"] = "deepseek_v4"
    return out


def test_tiny_hf_keys():
    c = V4Config.from_hf(v4_config())
    assert c.fp8_activation_scheme == "dynamic"  # no quantization_config: the FP8 checkpoints' scheme
    assert V4Config.from_hf(v4_config(quantization_config={"activation_scheme": "static"})).fp8_activation_scheme == "static"
    assert c.layer_types == (SLIDING, CSA, HCA, CSA)
    assert [c.compress_rate(i) for i in range(4)] == [0, 4, 8, 4]
    assert [c.rope_of(i) for i in range(4)] == ["main", "compress", "compress", "compress"]
    assert c.mlp_hash == (True, False, False, False) and c.rope_head_dim == 8
    assert c.has_indexer(1) and not c.has_indexer(2)
    assert c.rope_main.theta == 10000.0 and c.rope_compress.theta == 160000.0
    assert c.rope_compress.rope_type == "default" and c.eos_token_ids == (2,)


def test_upstream_keys():
    c = V4Config.from_hf(upstream_v4_config())
    assert c.layer_types == (SLIDING, CSA, HCA, CSA)  # trailing MTP entry of compress_ratios dropped
    assert (c.csa_rate, c.hca_rate) == (4, 8) and c.mlp_hash == (True, True, False, False)
    assert c.rope_head_dim == 8 and c.num_nextn_predict_layers == 1
    r = c.rope_compress
    assert (r.rope_type, r.theta, r.factor, r.original_max_position_embeddings) == ("yarn", 160000.0, 4.0, 32)
    assert r.attention_factor == 1.0 and c.rope_main.rope_type == "default"


@pytest.mark.parametrize("make", [v4_config, upstream_v4_config])
def test_upstream_and_transformers_keys_agree(make):
    pytest.importorskip("transformers")
    assert V4Config.from_hf(make()) == V4Config.from_hf(_hf_normalized(make()))


def test_flat_rope_parameters_apply_to_compress_only():
    d = v4_config(rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                                   "rope_theta": 5.0}, rope_theta=20000.0, compress_rope_theta=100000.0)
    c = V4Config.from_hf(d)
    assert c.rope_main.rope_type == "default" and c.rope_main.theta == 20000.0
    assert c.rope_compress.theta == 100000.0 and c.rope_compress.attention_factor == 1.0


def test_defaults_are_v4_pro_pattern():
    d = {k: v for k, v in v4_config(num_hidden_layers=6).items() if k not in ("layer_types", "mlp_layer_types")}
    c = V4Config.from_hf(d)
    assert c.layer_types == (HCA, HCA, HCA, CSA, HCA, CSA)
    assert c.mlp_hash == (True, True, True, False, False, False)


@pytest.mark.parametrize("over, key", [
    (dict(layer_types=None, compress_ratios=[0, 4, 3, 4]), "compress_ratios"),
    (dict(layer_types=[SLIDING, CSA]), "layer_types"),
    (dict(layer_types=[SLIDING, CSA, "dense", CSA]), "layer_types"),
    (dict(mlp_layer_types=["moe"] * 3), "mlp_layer_types"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(o_groups=3), "o_groups"),
    (dict(partial_rotary_factor=0.9), "partial_rotary_factor"),
    (dict(compress_rates={"csa": 4}), "compress_rates"),
    (dict(model_type="deepseek_v32"), "model_type"),
    (dict(hidden_size=[64]), "hidden_size"),
])
def test_errors_name_the_key(over, key):
    with pytest.raises(ConfigError, match=key):
        V4Config.from_hf(v4_config(**over))
