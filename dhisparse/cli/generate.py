"""`dhisparse generate`: run prompts to completion and print text (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from dhisparse.cli.args import HelpFormatter, add_engine_args, build_engine, engine_config
from dhisparse.cli.flags import nonneg_int
from dhisparse.core.params import SamplingParams


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts", formatter_class=HelpFormatter)
    add_engine_args(p)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeat for a batch)")
    p.add_argument("--max-tokens", type=nonneg_int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed (default: --seed)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON: an object per prompt (a list for several)")
    p.add_argument("--progress-min-tokens", type=nonneg_int, default=2048,
                   help="print prefill progress lines on stderr when the prompts hold at least this many tokens")
    p.set_defaults(func=run)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def run(ns: argparse.Namespace) -> int:
    prompts: list = list(ns.prompt) + [parse_ids(t) for t in ns.prompt_ids]
    if not prompts:
        raise ValueError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_k=ns.top_k, top_p=ns.top_p,
                            seed=ns.sampling_seed if ns.sampling_seed is not None else ns.seed, stop=tuple(ns.stop))
    engine = build_engine(ns, engine_config(ns, full_loader=True))
    try:
        return _generate(ns, engine, prompts, params)
    finally:
        engine.close()  # a data-parallel world stops its ranks


def _generate(ns: argparse.Namespace, engine, prompts: list, params: SamplingParams) -> int:
    from dhisparse.engine.progress import PrefillProgress

    encoded = [engine.encode_prompt(p) for p in prompts]
    for ids in encoded:  # validate everything before queueing anything
        engine.validate(ids, params)
    progress = PrefillProgress(sum(len(ids) for ids in encoded), lambda line: print(line, file=sys.stderr, flush=True),
                               min_tokens=ns.progress_min_tokens)
    progress.start(engine.stats().as_dict())
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params) for p in prompts]
    final: dict = {}
    while len(final) < len(rids):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if progress.active and not progress.done:
            progress(engine.stats().as_dict())
    outs = [final[r] for r in rids]
    dt = time.perf_counter() - t0
    if ns.json:
        objs = [{"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason, "metrics": o.metrics.as_dict()} for o in outs]
        print(json.dumps(objs[0] if len(objs) == 1 else objs))
        return 0
    for i, o in enumerate(outs):
        print(f"[{i}] {o.text!r}  ({len(o.token_ids)} tokens, {o.finish_reason})")
    n = sum(len(o.token_ids) for o in outs)
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s)")
    return 0
