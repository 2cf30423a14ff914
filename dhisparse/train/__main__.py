"""Training stages, each writing a record (`train_record.json` / `model_record.json`) into its folder.

    python -m dhisparse.train tokenizer --out DIR    the corpus, a byte-level BPE on its train split
                                                     (tokenizer.json, tokenizer_config.json)
    python -m dhisparse.train model --tokenizer DIR --out DIR [--steps-dense N --steps-warmup N
        --steps-sparse N --device cuda]              the DSA recipe (train/dsa.py): a glm_moe_dsa
                                                     checkpoint our loader reads, loss curves,
                                                     held-out bits per byte dense vs sparse

    python -m dhisparse.train mtp --model DIR [--steps N --device cuda]
                                                     the MTP block (train/mtp.py) on the frozen
                                                     target's hidden states, written into DIR;
                                                     held-out next-next-token accuracy, and the
                                                     engine's acceptance with --speculative-algorithm mtp

    python -m dhisparse.train drafter --target DIR --out DIR [--steps N --device cuda]
                                                     a DFlash2 drafter trained on the target's own
                                                     greedy outputs (train/drafter.py)
    python -m dhisparse.train evaluate --model DIR   greedy completions of 20 held-out signatures
                                                     (the share that ast.parse accepts), curves.png

`--max-files N` is the CPU smoke mode (the first N files of the corpus)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from dhisparse.train import drafter, dsa, evaluate, mtp
from dhisparse.train.corpus import Corpus
from dhisparse.train.records import write_record
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
    m = sub.add_parser("model", help="the DSA recipe: dense, indexer warm-up, sparse")
    m.add_argument("--tokenizer", required=True, help="a folder written by the tokenizer stage")
    m.add_argument("--out", required=True, help="folder for the checkpoint and model_record.json")
    for stage, steps in (("dense", 2000), ("warmup", 300), ("sparse", 1000)):
        m.add_argument(f"--steps-{stage}", type=int, default=steps)
    m.add_argument("--seq-len", type=int, default=256)
    m.add_argument("--batch", type=int, default=32)
    m.add_argument("--lr", type=float, default=3e-3)
    m.add_argument("--topk", type=int, default=64, help="index_topk of the sparse stage and the checkpoint")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device", default="cpu")
    m.add_argument("--heldout", type=float, default=0.05)
    m.add_argument("--max-files", type=int, default=None, help="CPU smoke mode: only the first N files")
    m.add_argument("--max-heldout-bytes", type=int, default=200_000, help="held-out text evaluated (bits per byte)")
    m.add_argument("--save-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of the saved weights (bfloat16: half the bytes; held-out bits per byte are "
                        "measured again on the saved weights)")
    q = sub.add_parser("mtp", help="the MTP block, trained on the frozen target and written into its folder")
    q.add_argument("--model", required=True, help="a folder written by the model stage (changed in place)")
    q.add_argument("--steps", type=int, default=1000)
    q.add_argument("--seq-len", type=int, default=256)
    q.add_argument("--batch", type=int, default=32)
    q.add_argument("--lr", type=float, default=3e-3)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--device", default="cpu")
    q.add_argument("--heldout", type=float, default=0.05)
    q.add_argument("--max-files", type=int, default=None, help="CPU smoke mode: only the first N files")
    q.add_argument("--max-heldout-bytes", type=int, default=200_000)
    q.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts served with the block as drafter")
    q.add_argument("--eval-tokens", type=int, default=64, help="greedy tokens generated per evaluation prompt")
    e = sub.add_parser("evaluate", help="greedy completions of held-out signatures (ast.parse share) and the curves")
    e.add_argument("--model", required=True, help="a trained model folder (its records are plotted)")
    e.add_argument("--signatures", type=int, default=20)
    e.add_argument("--max-tokens", type=int, default=256)
    e.add_argument("--device", default="cpu")
    e.add_argument("--heldout", type=float, default=0.05)
    e.add_argument("--max-files", type=int, default=None, help="CPU smoke mode: only the first N files")
    e.add_argument("--plot", default=None, help="PNG of the training curves (default: the model folder's curves.png)")
    drafter.add_parser(sub)
    ns = p.parse_args(argv)
    if ns.stage == "drafter":
        return drafter.drafter_stage(ns, argv)
    if ns.stage == "evaluate":
        return evaluate_stage(ns, argv)
    if ns.stage == "model":
        return model_stage(ns, argv)
    if ns.stage == "mtp":
        return mtp_stage(ns, argv)
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
    record = write_record(out, "train_record.json", "tokenizer", argv, corpus=corpus.manifest(),
                          vocab_size=tok.get_vocab_size(), heldout_tokens=n_tokens,
                          heldout_bytes_per_token=len(held.encode()) / max(n_tokens, 1),
                          seconds=round(time.perf_counter() - t0, 2))
    print(json.dumps({k: record[k] for k in ("vocab_size", "heldout_tokens", "heldout_bytes_per_token", "seconds")}))
    return 0


def model_stage(ns, argv) -> int:
    t0 = time.perf_counter()
    try:
        corpus = Corpus.build(share=ns.heldout, max_files=ns.max_files)
        tok = Tokenizer.from_file(str(Path(ns.tokenizer) / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - a bad corpus or tokenizer folder (tokenizers raises plain Exception) is the user's
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(ns.seed)
    train = torch.tensor(tok.encode(Corpus.text(corpus.train)).ids)
    held_text = Corpus.text(corpus.heldout)[: ns.max_heldout_bytes]
    held = torch.tensor(tok.encode(held_text).ids)
    config = dsa.small_config(tok.get_vocab_size(), index_topk=ns.topk)
    model = dsa.build_model(config, ns.seed).to(ns.device)
    stages = []
    for stage in dsa.STAGES:
        steps = getattr(ns, f"steps_{stage}")
        r = dsa.train_stage(model, stage, train, steps, seq_len=ns.seq_len, batch=ns.batch, lr=ns.lr, topk=ns.topk,
                            seed=ns.seed + len(stages))
        stages.append({"stage": r.stage, "steps": r.steps, "lm_loss": r.lm_loss, "kl_loss": r.kl_loss})
    nbytes = len(held_text.encode())

    def bpb() -> dict:  # held-out bits per byte, dense attention and sparse selection
        return {"dense": dsa.bits_per_byte(model, held, nbytes, ns.seq_len),
                "sparse": dsa.bits_per_byte(model, held, nbytes, ns.seq_len, topk=ns.topk)}

    trained, saved = bpb(), None
    if ns.save_dtype != "float32":  # the shipped weights' own numbers
        model = model.to(getattr(torch, ns.save_dtype))
        saved = {"dtype": ns.save_dtype, **bpb()}
    dsa.set_topk(model, ns.topk)
    model.save_pretrained(ns.out)
    save_tokenizer(tok, ns.out)
    record = write_record(ns.out, "model_record.json", "model", argv, corpus=corpus.manifest(), config=config,
                          device=ns.device, params=sum(p.numel() for p in model.parameters()),
                          train_tokens=int(train.numel()), stages=stages, heldout_bytes=nbytes,
                          heldout_bits_per_byte=trained, saved_weights_bits_per_byte=saved,
                          sparse_over_dense=trained["sparse"] / trained["dense"],
                          seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps({k: record[k] for k in ("params", "heldout_bits_per_byte", "sparse_over_dense", "seconds")}))
    return 0


def mtp_stage(ns, argv) -> int:
    t0 = time.perf_counter()
    folder = Path(ns.model)
    try:
        corpus = Corpus.build(share=ns.heldout, max_files=ns.max_files)
        tok, target = dsa.load_target(folder, ns.device, flag="--model")
    except Exception as e:  # noqa: BLE001 - a bad folder / corpus is the user's (tokenizers / transformers raise plain errors)
        print(f"error: {e}", file=sys.stderr)
        return 2
    topk = target.config.index_topk
    train = torch.tensor(tok.encode(Corpus.text(corpus.train)).ids)
    held_text = Corpus.text(corpus.heldout)[: ns.max_heldout_bytes]
    held = torch.tensor(tok.encode(held_text).ids)
    block = mtp.build_block(target, ns.seed)
    before = mtp.accuracy(target, block, held, ns.seq_len, topk)
    r = mtp.train_block(target, block, train, ns.steps, seq_len=ns.seq_len, batch=ns.batch, lr=ns.lr, topk=topk,
                        seed=ns.seed)
    after = mtp.accuracy(target, block, held, ns.seq_len, topk)
    mtp.write_mtp(folder, block)
    g = torch.Generator().manual_seed(ns.seed)
    starts = torch.randint(0, max(1, held.numel() - 129), (ns.eval_prompts,), generator=g).tolist()
    prompts = [held[s : s + 128].tolist() for s in starts]
    served = mtp.engine_acceptance(folder, prompts, ns.eval_tokens, ns.device)
    record = write_record(folder, "mtp_record.json", "mtp", argv, corpus=corpus.manifest(), device=ns.device,
                          steps=r.steps, loss=r.loss, params=sum(p.numel() for p in block.parameters()),
                          window=block.tcfg.index_topk, heldout_next_next={"untrained": before, "trained": after},
                          served=served, seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps({"trained_top1": after["top1"], "served": served, "seconds": record["seconds"]}))
    return 0


def evaluate_stage(ns, argv) -> int:
    folder = Path(ns.model)
    if not (folder / "config.json").is_file():
        print(f"error: {folder} is not a model folder (no config.json)", file=sys.stderr)
        return 2
    corpus = Corpus.build(share=ns.heldout, max_files=ns.max_files)
    check = evaluate.completion_check(folder, corpus.heldout, ns.signatures, ns.max_tokens, ns.device)
    png = evaluate.plot_curves(evaluate.load_records(folder), ns.plot or folder / "curves.png")
    write_record(folder, "eval_record.json", "evaluate", argv, corpus=corpus.manifest(), completions=check, plot=str(png))
    print(json.dumps({"parsed": check["parsed"], "of": check["of"], "plot": str(png)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
