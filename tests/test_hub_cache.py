"""Loading (issue #28 item 7): `--model org/name` from the local Hugging Face cache (offline),
--revision, --tokenizer, --chat-template, --quantization; the shard progress bar; the
unsupported-family error naming every supported family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dhisparse.cli import main
from dhisparse.models.loader import ModelLoadError
from dhisparse.models.registry import SUPPORTED_FAMILIES, load_for_config, load_model, resolve_hub
from hf_fixtures import checkpoint_state, copy_config, save_sharded

COMMIT = "a" * 40
COMMIT_V1 = "b" * 40


def fake_cache(root: Path, repo: str, src: Path, refs: dict[str, str]) -> Path:
    """Lay out root/models--org--name/{refs/<name>, snapshots/<commit>/...} as huggingface_hub does."""
    base = root / ("models--" + repo.replace("/", "--"))
    for ref, commit in refs.items():
        (base / "refs").mkdir(parents=True, exist_ok=True)
        (base / "refs" / ref).write_text(commit)
        snap = base / "snapshots" / commit
        if not snap.exists():
            shutil.copytree(src, snap)
    return base


@pytest.fixture
def hub(tmp_path, monkeypatch, hf_checkpoints):
    cache = tmp_path / "hub"
    fake_cache(cache, "org/tiny-glm", hf_checkpoints.glm, {"main": COMMIT})
    v1 = tmp_path / "v1"
    copy_config(hf_checkpoints.glm, v1, max_position_embeddings=333)
    shutil.copy(hf_checkpoints.glm / "model.safetensors", v1 / "model.safetensors")
    fake_cache(cache, "org/tiny-glm", v1, {"v1": COMMIT_V1})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_resolves_from_local_cache(hub, hf_checkpoints):
    assert resolve_hub("org/tiny-glm") == hub / "models--org--tiny-glm" / "snapshots" / COMMIT
    got = load_model("org/tiny-glm")
    want = load_model(hf_checkpoints.glm)
    assert got.config == want.config
    sd, wd = got.model.state_dict(), want.model.state_dict()
    assert all(torch.equal(sd[k], wd[k]) for k in wd)


def test_revision_by_branch_and_commit(hub):
    assert load_model("org/tiny-glm", revision="v1").config.max_position_embeddings == 333
    assert load_model("org/tiny-glm", revision=COMMIT_V1).config.max_position_embeddings == 333
    with pytest.raises(ModelLoadError, match="revision 'nope'.*not in the local Hugging Face cache"):
        load_model("org/tiny-glm", revision="nope")
    with pytest.raises(ModelLoadError, match="--revision"):
        load_model("tiny", revision="v1")


def test_missing_hub_model_is_a_clear_error(hub):
    with pytest.raises(ModelLoadError, match=r"'org/absent' is not in the local Hugging Face cache .*hf download org/absent"):
        load_model("org/absent")


def test_cli_hub_model_and_missing_one(hub, capsys):
    assert main(["generate", "--model", "org/tiny-glm", "--prompt-ids", "1,5,6", "--max-tokens", "2", "--json",
                 "--device", "cpu", "--kv-pool-bytes", str(8 << 20)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 2
    assert main(["generate", "--model", "org/absent", "--prompt-ids", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "org/absent" in err and "local Hugging Face cache" in err


def test_tokenizer_from_another_folder(tmp_path, hf_checkpoints):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers

    raw = RawTokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    raw.save(str(tok_dir / "tokenizer.json"))
    loaded = load_model(hf_checkpoints.glm, tokenizer=str(tok_dir))
    assert loaded.tokenizer.encode("hello world") == [1, 2]
    assert type(load_model(hf_checkpoints.glm).tokenizer).__name__ == "ByteTokenizer"  # the fixture has none


def test_chat_template_file_and_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}<go>")
    msgs = [{"role": "user", "content": "hi"}]
    assert load_model("tiny", chat_template=str(f)).tokenizer.apply_chat_template(msgs) == "[user]hi<go>"
    text = "{{ messages[0].content | upper }}!"
    assert load_model("tiny", chat_template=text).tokenizer.apply_chat_template(msgs) == "HI!"
    with pytest.raises(ValueError, match="no such file"):
        load_model("tiny", chat_template=str(tmp_path / "absent.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_model("tiny", chat_template="{% for %}")


def test_engine_config_fields_reach_the_loader(tmp_path):
    from dhisparse.engine.config import EngineConfig

    cfg = EngineConfig(chat_template="<{{ messages[0].content }}>")
    assert load_for_config(cfg, "cpu").tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<x>"
    with pytest.raises(ModelLoadError, match="bfloat16"):
        load_for_config(EngineConfig(kv_cache_dtype="bfloat16"), "cpu")  # tiny loads as float32
    assert next(load_for_config(EngineConfig(kv_cache_dtype="bfloat16", dtype="bfloat16"), "cpu")
                .model.parameters()).dtype == torch.bfloat16


def test_quantization_flag(hf_checkpoints, tmp_path):
    with pytest.raises(ModelLoadError, match="quantization fp8.*does not quantize online"):
        load_model(hf_checkpoints.glm, quantization="fp8")
    with pytest.raises(ModelLoadError, match="fp8"):
        load_model("tiny", quantization="fp8")
    with pytest.raises(ModelLoadError, match="awq"):
        load_model("tiny", quantization="awq")
    assert load_model(hf_checkpoints.glm, quantization="none").config is not None


def test_unsupported_family_lists_all_three(tmp_path, hf_checkpoints):
    bad = copy_config(hf_checkpoints.glm, tmp_path / "llama", model_type="llama")
    with pytest.raises(ModelLoadError) as e:
        load_model(bad)
    assert SUPPORTED_FAMILIES == ("glm_moe_dsa", "deepseek_v32", "deepseek_v4")
    assert all(f in str(e.value) for f in SUPPORTED_FAMILIES) and "'llama'" in str(e.value)


def test_shard_progress_bar(tmp_path, hf_checkpoints, capsys):
    sharded = save_sharded(checkpoint_state(hf_checkpoints.glm), tmp_path / "sharded", hf_checkpoints.glm, n_shards=3)
    load_model(sharded, progress=True)
    err = capsys.readouterr().err
    assert "Loading safetensors checkpoint shards" in err and "3/3" in err
    load_model(sharded)
    assert "Loading" not in capsys.readouterr().err  # the Python API stays quiet unless asked
