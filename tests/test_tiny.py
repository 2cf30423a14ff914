"""The built-in tiny model and the `load_model` registry."""

from __future__ import annotations

import pytest
import torch

from dhisparse.models.loader import ModelLoadError
from dhisparse.models.registry import load_model
from dhisparse.models.tiny import TINY_CONFIG, build_tiny
from dhisparse.models.tokenizer import ByteTokenizer
from hf_fixtures import greedy_ours


def _equal_states(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_build_tiny_is_deterministic():
    assert _equal_states(build_tiny(0), build_tiny(0))
    assert not _equal_states(build_tiny(0), build_tiny(1))


def test_tiny_shape():
    lm = build_tiny()
    cfg = lm.config
    assert cfg.architecture == "glm_moe_dsa" and cfg.num_layers == 6 and cfg.vocab_size >= 259
    assert cfg.indexer_full == (True, True, False, False, True, False)
    assert cfg.mlp_moe == (False,) + (True,) * 5 and cfg.index_n_heads >= 8
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1 and cfg.pad_token_id == 0
    assert lm.model.model.layers[2].self_attn.indexer is None
    assert lm.model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0


def test_load_model_tiny_with_tokenizer_and_dtype():
    lm = load_model("tiny")
    assert isinstance(lm.tokenizer, ByteTokenizer)
    assert _equal_states(lm, build_tiny(0))
    bf = load_model("tiny", dtype="bfloat16", seed=3)
    assert bf.model.lm_head.weight.dtype == torch.bfloat16
    assert bf.model.model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_tiny_greedy_output_varies():
    lm = load_model("tiny")
    prompt = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    assert len(prompt) > lm.config.index_topk  # selection is sparse
    out = greedy_ours(lm, prompt, 20)
    assert len(set(out)) >= 5
    assert all(t < lm.tokenizer.vocab_size for t in out)  # padding ids are never preferred
    assert greedy_ours(load_model("tiny"), prompt, 20) == out


def test_tiny_config_is_a_valid_transformers_config():
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**TINY_CONFIG)
    assert hf.indexer_types == TINY_CONFIG["indexer_types"]


def test_load_model_folder(hf_checkpoints):
    lm = load_model(str(hf_checkpoints.glm))
    assert lm.config.num_layers == 5 and isinstance(lm.tokenizer, ByteTokenizer)


def test_load_model_unknown_spec():
    with pytest.raises(ModelLoadError, match=r"--model 'nonesuch'.*tiny"):
        load_model("nonesuch")
