"""Tokenizers: ByteTokenizer, HFTokenizer over a small trained BPE, chat templates, streaming."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse.models.tokenizer import (
    ByteStreamDetokenizer, ByteTokenizer, HFTokenizer, IncrementalDetokenizer, Tokenizer, TokenizerError, load_tokenizer,
    stream_detokenizer,
)

TEXTS = ["Hello, world!", "héllo wörld", "naïve café 你好 🙂 end", "", "tabs\tand\nnewlines"]
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|endoftext|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.feed(i) for i in ids]


# ---- ByteTokenizer ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_byte_roundtrip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and all(3 <= i < 259 for i in ids)
    assert tok.decode(ids) == text


def test_byte_specials_and_invalid_utf8():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 259)
    ids = [1] + tok.encode("hi") + [2, 300]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "<|bos|>hi<|eos|>"
    assert tok.decode([0xFF + 3, ord("a") + 3]) == "\ufffda"


def test_byte_chat_template():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = ByteTokenizer().apply_chat_template(msgs)
    assert text == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_incremental_detokenizer_holds_split_multibyte_chars():
    tok = ByteTokenizer()
    text = "a🙂é你"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = _stream(detok, ids)
    assert pieces == ["a", "", "", "", "🙂", "", "é", "", "", "你"]
    assert "\ufffd" not in "".join(pieces) and detok.text == text
    assert detok.flush() == ""


def test_incremental_detokenizer_flushes_incomplete_tail():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    ids = tok.encode("ok") + tok.encode("🙂")[:2]
    assert "".join(_stream(detok, ids)) == "ok"
    assert detok.flush() == "\ufffd"


@pytest.mark.parametrize("cls", [IncrementalDetokenizer, ByteStreamDetokenizer])
def test_byte_stream_detokenizer_pieces(cls):
    tok = ByteTokenizer()
    detok = cls(tok)
    pieces = _stream(detok, tok.encode("a🙂é你"))
    assert pieces == ["a", "", "", "", "🙂", "", "é", "", "", "你"] and detok.flush() == ""
    assert stream_detokenizer(tok).__class__ is ByteStreamDetokenizer


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 300), max_size=40), skip=st.booleans())
def test_byte_stream_detokenizer_equals_decode(ids, skip):
    """Every emitted prefix is a prefix of the whole decode, and text + flush() is the whole decode
    (invalid bytes, split sequences, specials and out-of-vocabulary ids included)."""
    tok = ByteTokenizer()
    full = tok.decode(ids, skip_special=skip)
    detok = ByteStreamDetokenizer(tok, skip_special=skip)
    text = ""
    for i in ids:
        text += detok.feed(i)
        assert full.startswith(text) and detok.text == text
    assert text + detok.flush() == full


# ---- HFTokenizer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["hello world, the quick brown fox", "héllo wörld café"] * 20, trainer)
    folder = tmp_path_factory.mktemp("hftok")
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "chat_template": TEMPLATE,
    }))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [raw.token_to_id("<|endoftext|>")]}))
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return folder


def test_hf_roundtrip_and_specials(hf_folder):
    tok = load_tokenizer(hf_folder)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (6, 2)  # generation_config first, then tokenizer_config / config
    ids = tok.encode("<|user|>hello</s>")
    assert ids[0] == 3 and ids[-1] == 2
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special=False) == "<|user|>hello</s>"
    assert tok.vocab_size <= 300


def test_hf_chat_template(hf_folder):
    tok = HFTokenizer(hf_folder)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
    assert tok.apply_chat_template(msgs) == "<s><|user|>hi<|assistant|>yo<|user|>?<|assistant|>"


def test_hf_default_template_and_jinja_file(hf_folder, tmp_path):
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_text((hf_folder / name).read_text())
    msgs = [{"role": "user", "content": "hi"}]
    assert HFTokenizer(tmp_path).apply_chat_template(msgs) == "<|user|>\nhi\n<|assistant|>\n"
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert HFTokenizer(tmp_path).apply_chat_template(msgs) == "[hi]"
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(TokenizerError, match="no system role"):
        HFTokenizer(tmp_path).apply_chat_template(msgs)


def test_hf_incremental_detokenizer(hf_folder):
    tok = HFTokenizer(hf_folder)
    text = "hello wörld 🙂 你好 the fox"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # rare chars are split into byte tokens
    detok = IncrementalDetokenizer(tok)
    pieces = _stream(detok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text


def test_load_tokenizer_fallbacks(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        HFTokenizer(tmp_path)


def test_byte_tokenizer_fast_decode_equals_the_general_path():
    """The skip_special fast path equals decoding the kept bytes one by one (specials, padding ids
    and broken UTF-8 included)."""
    from hypothesis import given, settings
    from hypothesis import strategies as hs

    from dhisparse.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()

    @settings(deadline=None, max_examples=200)
    @given(hs.lists(hs.integers(0, 300), max_size=24))
    def check(ids):
        kept = bytearray(i - tok.OFFSET for i in ids if tok.OFFSET <= i < tok.vocab_size)
        assert tok.decode(ids) == kept.decode("utf-8", errors="replace")

    check()
