"""Does a model's greedy output depend on which requests share its batches? (issue 31, session 42)

    PYTHONPATH=. python3 bench/batch_variance.py --dtypes bfloat16,float32 \
        --out bench/results/batch_variance_faithful_small_cpu_s42.json

The oracle drafter replays a reference decoded in one batch; a served request decodes in other batches. If
rounding differs with the batch (a GEMM's blocking over the rows, a reduction's split) and the model's greedy
margins are last-bit small, the served output leaves its reference and the oracle's drafts stop matching
(session 42's costed sweep: 94.7% of proposals off the reference). This decodes the same prompts with the same
preset in one batch and one request at a time (and a second preset in two batches), and reports the first
token at which each prompt's outputs differ (null: identical). Small glm5-faithful geometry (models/faithful.py
`SMALL_OVERRIDES`), 6 layers, random weights, the full head.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from dhisparse import SamplingParams
from dhisparse.bench import results as R
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.llm import LLM
from dhisparse.models.faithful import SMALL_OVERRIDES as SMALL, build_faithful
from dhisparse.models.tokenizer import ByteTokenizer



def decode(loaded, dtype: str, preset: str, batches: list[list[list[int]]], tokens: int) -> list[list[int]]:
    """Greedy outputs of each batch in turn, one engine."""
    llm = LLM.__new__(LLM)
    llm.engine = Engine(EngineConfig(model="glm5-faithful", preset=preset, dtype=dtype, hot_cache_rows=128), loaded=loaded)
    out = []
    for b in batches:
        out += [o.token_ids for o in llm.generate(b, SamplingParams(max_tokens=tokens, ignore_eos=True))]
    return out


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--out", default="bench/results/batch_variance.json")
    ns = p.parse_args(argv)
    ns.argv = ["bench/batch_variance.py"] + list(sys.argv[1:] if argv is None else argv)
    prompts = [[3 + (7 * i + 5 * j) % 250 for j in range(300 + 37 * i)] for i in range(ns.prompts)]
    rows, t0 = [], time.perf_counter()
    for dtype in ns.dtypes.split(","):
        loaded = dataclasses.replace(build_faithful(num_layers=ns.layers, overrides=SMALL, dtype=getattr(torch, dtype)),
                                     tokenizer=ByteTokenizer())
        one = decode(loaded, dtype, "adaptive", [prompts], ns.tokens)
        singles = decode(loaded, dtype, "adaptive", [[q] for q in prompts], ns.tokens)
        split = decode(loaded, dtype, "hisparse", [prompts[:2], prompts[2:]], ns.tokens)
        row = {"dtype": dtype, "distinct_ids": [len(set(o)) for o in one],
               "first_diff_one_batch_vs_singles": [first_diff(a, b) for a, b in zip(one, singles)],
               "first_diff_one_batch_vs_hisparse_2_then_rest": [first_diff(a, b) for a, b in zip(one, split)]}
        rows.append(row)
        print(row, flush=True)
    R.write_doc("batch_variance", ns, ns.out, geometry=SMALL, rows=rows, wall_s=time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
