"""World size 1 through the parallel front vs the plain engine (issue 30: "no measurable overhead").

One engine is built once; the same closed batch of greedy requests is then generated through it
directly ("engine") and through a `Coordinator` over a torch.distributed world of one rank
("coordinator": every step a gloo broadcast of the control message and a gather of the reply,
the path a DP / TP world's rank 0 takes). The arms alternate, the order rotated every repeat, on
the same warm engine (graphs, Triton cache), so the ratio isolates the front's per-step cost.

    python bench/world1_overhead.py --device cuda --model glm52-scaled --input-len 2048 \
        --concurrency 8 --max-tokens 64 --repeats 3 --out bench/results/world1_overhead_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from dhisparse import LLM
from dhisparse.bench.results import command_line, machine_info, now_iso, source_commit
from dhisparse.core.parallel import ControlChannel, ParallelConfig, init_rank, leave
from dhisparse.core.params import SamplingParams
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.distributed import Coordinator
from dhisparse.engine.engine import Engine
from dhisparse.engine.launch import free_addr


def parse(argv: list[str] | None) -> argparse.Namespace:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--model", default="tiny")
    a.add_argument("--preset", default="adaptive")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--input-len", type=int, default=256)
    a.add_argument("--concurrency", type=int, default=8)
    a.add_argument("--max-tokens", type=int, default=32)
    a.add_argument("--repeats", type=int, default=3)
    a.add_argument("--engine-arg", action="append", default=[], help="NAME=VALUE EngineConfig setting (ints parsed)")
    a.add_argument("--out", default=None)
    return a.parse_args(argv)


def engine_config(ns: argparse.Namespace) -> EngineConfig:
    kw: dict = {}
    for item in ns.engine_arg:
        k, _, v = item.partition("=")
        kw[k] = int(v) if v.isdigit() else v
    return EngineConfig(model=ns.model, preset=ns.preset, device=ns.device, **kw)


def run_arm(front, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One closed batch through `front` (Engine or Coordinator): tokens, seconds, tok/s, steps."""
    llm = LLM.__new__(LLM)
    llm.engine = front
    steps0 = front.stats().steps
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    return {"tokens": n, "seconds": dt, "tok_s": n / dt, "steps": front.stats().steps - steps0,
            "token_ids": [o.token_ids for o in outs]}


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    engine = Engine(engine_config(ns))
    init_rank(ParallelConfig(), 0, free_addr(), str(engine.device))
    coord = Coordinator(engine, ControlChannel(0, 1), [], beat_s=1.0)
    fronts = {"engine": engine, "coordinator": coord}
    vocab = engine.model_config.vocab_size
    prompts = [[(7 + 13 * i + 31 * j) % (vocab - 10) + 5 for j in range(ns.input_len)] for i in range(ns.concurrency)]
    params = SamplingParams(max_tokens=ns.max_tokens, ignore_eos=True)
    for name in fronts:  # warm-up: graphs captured, kernels compiled, outside the timed runs
        run_arm(fronts[name], prompts, params)
    runs, first = [], None
    names = list(fronts)
    for rep in range(ns.repeats):
        for name in names[rep % 2:] + names[: rep % 2]:
            r = run_arm(fronts[name], prompts, params)
            runs.append({"arm": name, "repeat": rep, **{k: v for k, v in r.items() if k != "token_ids"}})
            print(f"[run] {name:12s} repeat {rep}: {r['tok_s']:.1f} tok/s ({r['steps']} steps, {r['seconds']:.2f} s)")
            first = first if first is not None else r["token_ids"]
            runs[-1]["tokens_equal_first_run"] = r["token_ids"] == first
    coord.close()
    leave()
    mean = {n: statistics.mean(r["tok_s"] for r in runs if r["arm"] == n) for n in names}
    spread = {n: [min(r["tok_s"] for r in runs if r["arm"] == n), max(r["tok_s"] for r in runs if r["arm"] == n)] for n in names}
    ratio = mean["coordinator"] / mean["engine"]
    print(f"[ratio] coordinator / engine = {ratio:.3f}  (engine {mean['engine']:.1f} {spread['engine']}, "
          f"coordinator {mean['coordinator']:.1f} {spread['coordinator']})")
    result = {"kind": "world1_overhead", "date": now_iso(), "commit": source_commit(), "command": command_line(argv),
              "machine": machine_info(), "config": vars(ns), "runs": runs, "mean_tok_s": mean, "spread_tok_s": spread,
              "ratio_coordinator_over_engine": ratio,
              "notes": ["one engine; arms alternate on it, order rotated each repeat; a warm-up run of each arm first",
                        "coordinator: a Coordinator over a world of one rank (gloo broadcast + gather every step)"]}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["tokens_equal_first_run"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
