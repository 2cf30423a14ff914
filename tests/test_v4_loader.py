"""V4 checkpoint loading: upstream / transformers-module / transformers-saved names, per-expert
tensors, dtypes kept in fp32, MTP extras, FP8 dequantization, errors."""

from __future__ import annotations

import json

import pytest
import torch

from dhisparse.models.loader import ModelLoadError
from dhisparse.models.v4_loader import canonical_name, is_v4_folder, load_v4_checkpoint
from v4_fixtures import build_v4_hf, chunked_logits, one_thread, prompt_ids, save_state, upstream_state, v4_config

pytest.importorskip("transformers")
_threads = pytest.fixture(scope="module", autouse=True)(one_thread)
FP32_NAMES = ("attn_hc.", "ffn_hc.", "hc_head.", "self_attn.sinks", "position_bias", "e_score_correction_bias",
              "norm.weight")


@pytest.fixture(scope="module")
def hf_model():
    return build_v4_hf(v4_config(), seed=3)


@pytest.fixture(scope="module")
def saved(hf_model, tmp_path_factory):
    """Folder written by transformers' save_pretrained (its mixed dialect)."""
    folder = tmp_path_factory.mktemp("v4l") / "saved"
    hf_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(saved):
    return load_v4_checkpoint(saved)


def _same(a, b) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_saved_dialect_matches_in_memory(hf_model, reference):
    hf_state = hf_model.state_dict()
    ours = reference.model.state_dict()
    assert ours.keys() == hf_state.keys()
    for k in ours:
        assert torch.equal(ours[k], hf_state[k]), k
    assert reference.extra == {}


def test_upstream_names_with_mtp_extras(hf_model, reference, tmp_path):
    state = upstream_state(hf_model.state_dict(), 32)
    state["mtp.0.attn.wkv.weight"] = torch.zeros(4, 4)
    state["layers.4.attn_norm.weight"] = torch.ones(64)  # an MTP layer past num_hidden_layers
    lm = load_v4_checkpoint(save_state(state, tmp_path / "up", v4_config()))
    _same(lm, reference)
    assert sorted(lm.extra) == ["layers.4.attn_norm.weight", "mtp.0.attn.wkv.weight"]
    assert is_v4_folder(tmp_path / "up")


def test_module_names_stacked_and_per_expert(hf_model, reference, tmp_path):
    state = dict(hf_model.state_dict())
    _same(load_v4_checkpoint(save_state(state, tmp_path / "stacked", v4_config())), reference)
    gu, dn = state.pop("model.layers.1.mlp.experts.gate_up_proj"), state.pop("model.layers.1.mlp.experts.down_proj")
    for e in range(4):
        state[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] = gu[e, :32]
        state[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = gu[e, 32:]
        state[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] = dn[e]
    _same(load_v4_checkpoint(save_state(state, tmp_path / "split", v4_config())), reference)


def test_bf16_keeps_fp32_tensors(saved):
    lm = load_v4_checkpoint(saved, dtype="bfloat16")
    sd = lm.model.state_dict()
    for name, t in sd.items():
        if name.endswith("tid2eid"):
            assert t.dtype == torch.int64
        elif any(s in name for s in FP32_NAMES):
            assert t.dtype == torch.float32, name
        else:
            assert t.dtype == torch.bfloat16, name
    logits = chunked_logits(lm.model, [prompt_ids(12, seed=1)])
    assert torch.isfinite(logits).all()


def test_fp8_weight_with_block_scale(hf_model, reference, tmp_path):
    state = upstream_state(hf_model.state_dict(), 32)
    w = state["layers.0.attn.wq_b.weight"]  # [128, 32]
    scale = torch.tensor([[w.abs().max().item() / 448.0]])
    state["layers.0.attn.wq_b.weight"] = (w / scale).to(torch.float8_e4m3fn)
    state["layers.0.attn.wq_b.scale"] = scale
    lm = load_v4_checkpoint(save_state(state, tmp_path / "fp8", v4_config()))
    got = lm.model.state_dict()["model.layers.0.self_attn.q_b_proj.weight"]
    assert (got - w).abs().max() <= 0.07 * w.abs().max() and not torch.equal(got, w)


def test_missing_and_mismatched_tensors(hf_model, tmp_path):
    state = upstream_state(hf_model.state_dict(), 32)
    del state["layers.2.attn.compressor.ape"]
    with pytest.raises(ModelLoadError, match="missing"):
        load_v4_checkpoint(save_state(state, tmp_path / "miss", v4_config()))
    state = upstream_state(hf_model.state_dict(), 32)
    with pytest.raises(ModelLoadError, match="shape"):
        load_v4_checkpoint(save_state(state, tmp_path / "shape", v4_config(sliding_window=8, head_dim=16,
                                                                           partial_rotary_factor=0.5)))
    del state["layers.1.ffn.experts.3.w2.weight"]
    with pytest.raises(ModelLoadError, match="expert 3"):
        load_v4_checkpoint(save_state(state, tmp_path / "exp", v4_config()))


def test_canonical_names():
    assert canonical_name("layers.3.attn.indexer.compressor.ape", 4) == \
        "model.layers.3.self_attn.compressor.indexer.position_bias"
    assert canonical_name("model.layers.0.attn.norm.weight", 4) == "model.layers.0.self_attn.kv_norm.weight"
    assert canonical_name("head.weight", 4) == "lm_head.weight"
    assert canonical_name("layers.1.ffn.experts.7.w3.weight", 4) == (1, 7, "up")
    assert canonical_name("mtp.0.norm.weight", 4) is None and canonical_name("layers.4.ffn_norm.weight", 4) is None
    assert not is_v4_folder("/nonexistent")


def test_config_json_errors(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load_v4_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(v4_config()))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_v4_checkpoint(tmp_path)
