"""Test helpers for the training stages (dhisparse/train): the CPU smoke corpus and a tiny model
folder written through the CLI."""

from __future__ import annotations

from pathlib import Path

import torch

from dhisparse.train.corpus import Corpus
from dhisparse.train.tokenizer import train_tokenizer

SMOKE = ["--max-files", "12", "--heldout", "0.2"]  # the corpus slice every CLI smoke run uses


def smoke_corpus(vocab: int = 400, train_tokens: int = 20000):
    """(tokenizer, train token ids [<= train_tokens], held-out text) of the 12-file corpus slice."""
    corpus = Corpus.build(max_files=12, share=0.2)
    tok = train_tokenizer([f.text for f in corpus.train], vocab)
    train = torch.tensor(tok.encode(Corpus.text(corpus.train)).ids[:train_tokens])
    return tok, train, Corpus.text(corpus.heldout)


def cli_model(tmp: Path, *extra: str) -> Path:
    """tokenizer + model stages in smoke mode (a few steps, index_topk 16) -> the model folder."""
    from dhisparse.train.__main__ import main

    assert main(["tokenizer", "--out", str(tmp / "tok"), "--vocab-size", "400", *SMOKE]) == 0
    assert main(["model", "--tokenizer", str(tmp / "tok"), "--out", str(tmp / "m"), *SMOKE, "--steps-dense", "4",
                 "--steps-warmup", "2", "--steps-sparse", "2", "--seq-len", "64", "--batch", "2", "--topk", "16",
                 "--max-heldout-bytes", "2000", *extra]) == 0
    return tmp / "m"
