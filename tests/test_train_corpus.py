"""The trained model's corpus and tokenizer (issue 29, first stage): the selection rule and the
file-level split are deterministic and disjoint, the manifest's hashes name the text exactly, the
tokenizer round-trips held-out code byte for byte and trains to the same file twice, and
`python -m dhisparse.train tokenizer` writes what the engine's tokenizer loader reads."""

from __future__ import annotations

import json

import pytest

from dhisparse.models.tokenizer import HFTokenizer
from dhisparse.train.__main__ import main
from dhisparse.train.corpus import Corpus, held_out, select
from dhisparse.train.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def corpus():
    return Corpus.build(max_files=60, share=0.2)


def test_selection_and_split(corpus):
    files = select(max_files=60)
    assert [f.path for f in files] == sorted(f.path for f in files)
    assert not any(part in {"test", "tests", "site-packages"} for f in files for part in f.path.split("/")[:-1])
    train, held = {f.path for f in corpus.train}, {f.path for f in corpus.heldout}
    assert train and held and not train & held and train | held == {f.path for f in files}
    assert all(held_out(p, 0.2) for p in held) and not any(held_out(p, 0.2) for p in train)
    again = Corpus.build(max_files=60, share=0.2).manifest()
    assert again == corpus.manifest() and again["heldout"]["sha256"] != again["train"]["sha256"]


def test_tokenizer_round_trips_and_is_deterministic(corpus):
    texts = [f.text for f in corpus.train]
    a, b = train_tokenizer(texts, 600), train_tokenizer(texts, 600)
    assert a.to_str() == b.to_str()
    for f in corpus.heldout:
        assert a.decode(a.encode(f.text).ids) == f.text
    assert a.get_vocab_size() == 600 and a.token_to_id("<|endoftext|>") == 0
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(texts, 100)


def test_the_stage_writes_a_record_the_engine_reads(tmp_path):
    assert main(["tokenizer", "--out", str(tmp_path), "--vocab-size", "600", "--max-files", "40",
                 "--heldout", "0.2"]) == 0
    record = json.loads((tmp_path / "train_record.json").read_text())
    assert record["corpus"]["train"]["files"] + record["corpus"]["heldout"]["files"] == 40
    assert record["heldout_bytes_per_token"] > 1.5 and "PSF" in record["corpus"]["license"]
    tok = HFTokenizer(tmp_path)
    assert tok.eos_token_ids == (0,) and tok.decode(tok.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    assert main(["tokenizer", "--out", str(tmp_path), "--max-files", "1"]) == 2  # one file cannot be split
