"""Localise a whole-step graph failure on the GPU: every preset in its own process, a sync after
each engine step, the step graph's capture / replay phases reported.

    python3 bench/step_graph_debug.py [--runner eager|cuda] [--model tiny] [--presets ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one(preset: str, runner: str, model: str, n: int, plen: int) -> None:
    import torch

    from dhisparse import SamplingParams
    from dhisparse.engine import step_graphs as sg
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine
    from dhisparse.models.graphs import CudaGraphRunner, EagerRunner

    orig_cap, orig_fwd = sg.StepGraphs._capture, sg.StepGraphs.forward

    def cap(self, *a):
        print(f"  capture {a[1:3]} K={a[1].K} variant={a[1].variant}", flush=True)
        e = orig_cap(self, *a)
        torch.cuda.synchronize()
        print("  capture ok", flush=True)
        return e

    def fwd(self, batch, ctx, capture_layers=()):
        out = orig_fwd(self, batch, ctx, capture_layers)
        torch.cuda.synchronize()
        print(f"  pass N={batch.num_reqs} T={batch.num_tokens} -> {'replayed' if out is not None else 'eager'}", flush=True)
        return out

    sg.StepGraphs._capture, sg.StepGraphs.forward = cap, fwd
    kw = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4) if preset.endswith("+spec") else {}
    cfg = EngineConfig(model=model, preset=preset, page_size=8 if model == "tiny" else 64, hot_cache_rows=16 if model == "tiny" else None,
                       cuda_graphs="layer", kv_pool_bytes=1 << 28, host_pool_bytes=1 << 28, **kw)
    eng = Engine(cfg)
    eng.step_graphs = eng.make_step_graphs(EagerRunner() if runner == "eager" else CudaGraphRunner())
    prompts = [[5 + (3 * i + j) % 90 for j in range(plen + 9 * i)] for i in range(n)]
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        torch.cuda.synchronize()
        steps += 1
    print(f"[ok] {preset} runner={runner}: {steps} steps, {eng.stats().as_dict().get('step_graph_replays')} replays", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runner", default="cuda"); p.add_argument("--model", default="tiny")
    p.add_argument("--presets", default="resident,hisparse,adaptive,adaptive+spec")
    p.add_argument("--n", type=int, default=3); p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--one", default=None)
    ns = p.parse_args()
    if ns.one:
        try:
            one(ns.one, ns.runner, ns.model, ns.n, ns.prompt_len)
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        return
    for preset in ns.presets.split(","):
        print(f"== {preset} runner={ns.runner}", flush=True)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", preset, "--runner", ns.runner, "--model", ns.model,
                            "--n", str(ns.n), "--prompt-len", str(ns.prompt_len)], capture_output=True, text=True)
        lines = (r.stdout + r.stderr).splitlines()
        print("\n".join(l[:220] for l in lines[-30:]), flush=True)


if __name__ == "__main__":
    main()
