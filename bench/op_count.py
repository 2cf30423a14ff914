"""Host work of one decode step, counted on CPU: PyTorch ops dispatched per step and per layer.

    python3 bench/op_count.py --out bench/results/op_count_cpu.json

Each op the engine dispatches costs the host ~5-20 us on a GPU machine whether or not the GPU is
busy, so ops per decode step is a device-free proxy for the host-side time of a step. The run
takes the GPU code path on CPU: Triton kernels (interpreted, DHISPARSE_TRITON_KERNELS=1) and the
Triton resolver; ops dispatched inside a Triton launch (the interpreter's own tensor traffic) are
not counted, a launch counts as one op. Tiny model, C requests decoding, after warm-up steps.

    python3 bench/op_count.py --graphs step --drafter dflash2 --presets hisparse,adaptive+spec \
        --out bench/results/op_count_graphs_cpu.json

`--graphs step` replays the engine's whole-step graphs and the drafter's block graphs through
`OneOpRunner` (each replay one op), so the count is what the host dispatches around the graphs on
the GPU; a +spec step is then a verification round, with `--drafter dflash2` a random DFlash2 of
the paper's six layers (its commits and selection are outside its graph). It also times
`--steps` more steps less the time inside the replays (`host_ms_around_graphs`): the host's
Python and eager ops around the graphs on this CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DHISPARSE_TRITON_KERNELS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench.step_profile as sp  # noqa: E402
from bench.op_counter import OneOpRunner, OpCounter  # noqa: E402
from dhisparse.bench import results as R  # noqa: E402


def count(preset: str, ns, loaded, graphs: str = "none", draft_path: str | None = None, draft_window: int | None = None) -> dict:
    """Ops a step of `preset` dispatches (a verification round for +spec presets); graphs "step":
    the engine's whole-step graphs and the drafter's block graphs replayed by `OneOpRunner`, so
    what is counted is what the host dispatches on the GPU path around the graphs."""
    from dhisparse.engine.engine import Engine

    cfg = dataclasses.replace(sp.engine_config(ns, preset), resolver="triton")
    if draft_path and preset.endswith("+spec"):
        cfg = dataclasses.replace(cfg, speculative_draft_model_path=draft_path, speculative_draft_window_size=draft_window)
    engine = Engine(cfg, loaded=loaded)
    if graphs == "step":
        engine.step_graphs = engine.make_step_graphs(OneOpRunner())
        if engine.spec is not None:
            engine.spec.drafter.use_graphs(OneOpRunner(), cfg.graph_max_reqs)
    sp.drive_to_decode(engine, ns)
    for _ in range(ns.warmup):
        engine.step()
    with OpCounter() as c:
        for _ in range(ns.steps):
            engine.step()
    layers = engine.model_config.num_layers
    per_step = sum(c.ops.values()) / ns.steps
    host = host_ms_around_graphs(engine, ns.steps) if graphs == "step" else None
    return {"preset": preset, "C": ns.concurrency, "layers": layers, "graphs": graphs, "host_ms_around_graphs": host,
            "drafter": (ns.drafter if preset.endswith("+spec") else None), "ops_per_step": per_step,
            "ops_per_layer": per_step / layers, "top": {k: v / ns.steps for k, v in c.ops.most_common(20)},
            "top_sites": {k: v / ns.steps for k, v in c.sites.most_common(40)},
            "syncs_per_step": sum(c.syncs.values()) / ns.steps,
            "sync_sites": {k: v / ns.steps for k, v in c.syncs.most_common()},
            "host_data_tensors_per_step": sum(c.host_data.values()) / ns.steps,
            "host_data_sites": {k: v / ns.steps for k, v in c.host_data.most_common()}}


def host_ms_around_graphs(engine, steps: int) -> list[float]:
    """Wall ms of each of `steps` steps (no counter) less the time inside graph replays: the host's
    Python and the eager ops around the graphs, on this CPU (a proxy: the GPU's host also pays a
    launch a kernel, and this CPU is not the GPU machine's)."""
    out = []
    for _ in range(steps):
        OneOpRunner.inside_s = 0.0
        t = time.perf_counter()
        engine.step()
        out.append(1e3 * (time.perf_counter() - t - OneOpRunner.inside_s))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="resident,hisparse,adaptive,adaptive+spec")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--graphs", default="none", choices=("none", "step"),
                   help="step: whole-step and drafter graphs, each replay counted as one op (what the host dispatches on the GPU)")
    p.add_argument("--drafter", default="ngram", choices=("ngram", "dflash2"),
                   help="+spec presets: dflash2 = a random DFlash2 of the paper's six layers over the tiny target")
    p.add_argument("--spec-width", type=int, default=4)
    p.add_argument("--draft-window", type=int, default=64,
                   help="dflash2's window W (below the prompt, so every window is full, as at the paper's contexts)")
    p.add_argument("--out", default="bench/results/op_count_cpu.json")
    a = p.parse_args(argv)
    ns = sp.parse(["--quick"])
    ns.concurrency, ns.steps, ns.warmup, ns.drafter, ns.spec_width = a.concurrency, a.steps, 3, a.drafter, a.spec_width
    draft_path = None
    if a.drafter == "dflash2":
        from bench import drafter_checkpoint

        draft_path = os.path.join(tempfile.mkdtemp(), "dflash2")
        drafter_checkpoint.main(["--model", ns.model, "--kind", "dflash2", "--layers", "6", "--out", draft_path])
    from dhisparse.bench.sweep import load_shared_model
    from dhisparse.engine.config import EngineConfig

    loaded = load_shared_model(EngineConfig(model=ns.model, device=ns.device, dtype=ns.dtype))
    runs = [count(s.strip(), ns, loaded, a.graphs, draft_path, a.draft_window if draft_path else None)
            for s in a.presets.split(",") if s.strip()]
    for r in runs:
        host = "" if r["host_ms_around_graphs"] is None else f"host {min(r['host_ms_around_graphs']):.2f}-{max(r['host_ms_around_graphs']):.2f} ms around the graphs, "
        print(f"{r['preset']:14} C{r['C']} graphs {r['graphs']}: {r['ops_per_step']:7.0f} ops per step, {host}{r['ops_per_layer']:5.0f} per layer, "
              f"{r['syncs_per_step']:.0f} syncing ops, {r['host_data_tensors_per_step']:.0f} tensors from host data")
        for k, v in list(r["sync_sites"].items())[:12]:
            print(f"    sync {v:6.1f}  {k}")
        for k, v in list(r["host_data_sites"].items())[:8]:
            print(f"    data {v:6.1f}  {k}")
    doc = {"kind": "op_count", "date": R.now_iso(), "command": R.command_line(["bench/op_count.py"] + (argv or sys.argv[1:])),
           "machine": R.machine_info(), "commit": R.source_commit(), "model": ns.model, "runs": runs}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"[done] {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
