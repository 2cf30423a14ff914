"""A byte-level BPE tokenizer for the built-in trained model, trained with the `tokenizers` library
on the corpus's train split and saved as a Hugging Face `tokenizer.json` (plus the
tokenizer_config.json the engine's HFTokenizer reads: bos / eos tokens).

Byte-level pre-tokenization covers every byte, so any text round-trips exactly; the special tokens
are <|endoftext|> (id 0: end of a document, the model's eos) and <|pad|> (id 1). Training is
deterministic for a given text and settings (the `tokenizers` BPE trainer counts pairs and breaks
ties by order), which `tests/test_train_corpus.py` checks.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ("<|endoftext|>", "<|pad|>")


def train_tokenizer(texts: list[str], vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids (specials first) trained on `texts` (one per document)."""
    if vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIALS)} (every byte plus the specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok: Tokenizer, folder: str | Path) -> Path:
    """tokenizer.json + tokenizer_config.json (eos = <|endoftext|>) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": SPECIALS[0], "pad_token": SPECIALS[1], "model_max_length": 1 << 20}, indent=1))
    return folder
