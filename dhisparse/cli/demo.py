"""`dhisparse demo`: the README's main job on the built-in model.

Runs a batch of requests through the engine, then prints sample text, throughput and the KV
memory the pool used.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from dhisparse.cli.args import add_engine_args, engine_config
from dhisparse.engine.memory import format_bytes
from dhisparse.engine.params import SamplingParams

PROMPTS = [
    "The hierarchy keeps every row on the host and a small hot cache on the GPU.",
    "Sparse attention reads only the top-k rows that the indexer selects.",
    "Speculative decoding verifies a drafted block in one target pass.",
    "Optional history grows while memory is spare and is reclaimed under load.",
]


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the built-in model end to end and report throughput and KV use",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(p)
    p.add_argument("--requests", type=int, default=16, help="number of requests")
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens per request")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from dhisparse.engine.llm import LLM

    console = Console()
    llm = LLM.from_config(engine_config(ns))
    prompts = [PROMPTS[i % len(PROMPTS)] + f" (request {i})" for i in range(ns.requests)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=ns.max_tokens, ignore_eos=True))
    dt = time.perf_counter() - t0
    st = llm.engine.stats()
    for o, p in list(zip(outs, prompts))[:3]:
        console.print(f"[bold]{p}[/bold]\n  -> {o.text!r}")
    n_out = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    t = Table(title=f"dhisparse demo: {llm.engine.config.model}, preset {llm.engine.config.preset}, {llm.engine.device}")
    for col in ("requests", "output tok/s", "TTFT mean (ms)", "TPOT mean (ms)", "KV pool", "KV peak used"):
        t.add_column(col, justify="right")
    t.add_row(str(len(outs)), f"{n_out / dt:.1f}", f"{1e3 * sum(ttft) / max(len(ttft), 1):.1f}",
              f"{1e3 * sum(tpot) / max(len(tpot), 1):.2f}", format_bytes(st.kv_pool_bytes), format_bytes(st.kv_peak_bytes))
    console.print(t)
    return 0
