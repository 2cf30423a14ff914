"""`python -m dhisparse.train tokenizer --out DIR`: build the corpus, train the tokenizer on its
train split, save tokenizer.json / tokenizer_config.json and a record (`train_record.json`: the
command, corpus manifest with hashes, vocabulary, held-out bytes per token) into DIR.
`--max-files N` is the CPU smoke mode (the first N files)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dhisparse.train.corpus import Corpus
from dhisparse.train.tokenizer import save_tokenizer, train_tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dhisparse.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    t = sub.add_parser("tokenizer", help="corpus + byte-level BPE tokenizer")
    t.add_argument("--out", required=True, help="folder for tokenizer.json and train_record.json")
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--heldout", type=float, default=0.05, help="held-out share of files")
    t.add_argument("--max-files", type=int, default=None, help="CPU smoke mode: only the first N files")
    ns = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        corpus = Corpus.build(share=ns.heldout, max_files=ns.max_files)
        tok = train_tokenizer([f.text for f in corpus.train], ns.vocab_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = save_tokenizer(tok, ns.out)
    held = Corpus.text(corpus.heldout)
    n_tokens = len(tok.encode(held).ids)
    record = {"stage": "tokenizer", "command": "python -m dhisparse.train " + " ".join(argv or sys.argv[1:]),
              "corpus": corpus.manifest(), "vocab_size": tok.get_vocab_size(),
              "heldout_tokens": n_tokens, "heldout_bytes_per_token": len(held.encode()) / max(n_tokens, 1),
              "seconds": round(time.perf_counter() - t0, 2)}
    (Path(out) / "train_record.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("vocab_size", "heldout_tokens", "heldout_bytes_per_token", "seconds")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
