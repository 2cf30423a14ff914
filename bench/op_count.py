"""Host work of one decode step, counted on CPU: PyTorch ops dispatched per step and per layer.

    python3 bench/op_count.py --out bench/results/op_count_cpu.json

Each op the engine dispatches costs the host ~5-20 us on a GPU machine whether or not the GPU is
busy, so ops per decode step is a device-free proxy for the host-side time of a step. The run
takes the GPU code path on CPU: Triton kernels (interpreted, DHISPARSE_TRITON_KERNELS=1) and the
Triton resolver; ops dispatched inside a Triton launch (the interpreter's own tensor traffic) are
not counted, a launch counts as one op. Tiny model, C requests decoding, after warm-up steps.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DHISPARSE_TRITON_KERNELS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import bench.step_profile as sp  # noqa: E402
from dhisparse.bench import results as R  # noqa: E402


# ops that make the host wait for the device on CUDA (a value or a size read back), and tensors
# built from host data (torch.tensor(list, device=cuda) copies from pageable memory and syncs)
SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten._unique2", "aten.unique_dim", "aten.masked_select",
            "aten.unique_consecutive", "aten.item"}
HOST_DATA_OPS = {"aten.lift_fresh"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name; ops inside an interpreted Triton launch count once, as the launch.
    Syncing ops and host-data tensors are also counted by their dhisparse call site."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.host_data: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()  # every op by its innermost dhisparse call site
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            name = str(func.overloadpacket)
            self.ops[name] += 1
            self.sites[sp.dhisparse_site()] += 1
            if name in SYNC_OPS:
                self.syncs[f"{name} @ {sp.dhisparse_site()}"] += 1
            elif name in HOST_DATA_OPS:
                self.host_data[sp.dhisparse_site()] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        counter, run = self, InterpretedFunction.run

        def counted(fn_self, *a, **kw):
            if not counter.inside:
                counter.ops["triton_launch"] += 1
                counter.sites[sp.dhisparse_site()] += 1
            counter.inside += 1
            try:
                return run(fn_self, *a, **kw)
            finally:
                counter.inside -= 1

        self._restore = (InterpretedFunction, run)
        InterpretedFunction.run = counted
        return super().__enter__()

    def __exit__(self, *exc):
        cls, run = self._restore
        cls.run = run
        return super().__exit__(*exc)


def count(preset: str, ns, loaded) -> dict:
    from dhisparse.engine.engine import Engine

    cfg = dataclasses.replace(sp.engine_config(ns, preset), resolver="triton")
    engine = Engine(cfg, loaded=loaded)
    sp.drive_to_decode(engine, ns)
    for _ in range(ns.warmup):
        engine.step()
    with OpCounter() as c:
        for _ in range(ns.steps):
            engine.step()
    layers = engine.model_config.num_layers
    per_step = sum(c.ops.values()) / ns.steps
    return {"preset": preset, "C": ns.concurrency, "layers": layers, "ops_per_step": per_step,
            "ops_per_layer": per_step / layers, "top": {k: v / ns.steps for k, v in c.ops.most_common(20)},
            "top_sites": {k: v / ns.steps for k, v in c.sites.most_common(40)},
            "syncs_per_step": sum(c.syncs.values()) / ns.steps,
            "sync_sites": {k: v / ns.steps for k, v in c.syncs.most_common()},
            "host_data_tensors_per_step": sum(c.host_data.values()) / ns.steps,
            "host_data_sites": {k: v / ns.steps for k, v in c.host_data.most_common()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="resident,hisparse,adaptive,adaptive+spec")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="bench/results/op_count_cpu.json")
    a = p.parse_args(argv)
    ns = sp.parse(["--quick"])
    ns.concurrency, ns.steps, ns.warmup = a.concurrency, a.steps, 3
    from dhisparse.bench.sweep import load_shared_model
    from dhisparse.engine.config import EngineConfig

    loaded = load_shared_model(EngineConfig(model=ns.model, device=ns.device, dtype=ns.dtype))
    runs = [count(s.strip(), ns, loaded) for s in a.presets.split(",") if s.strip()]
    for r in runs:
        print(f"{r['preset']:14} C{r['C']}: {r['ops_per_step']:7.0f} ops per decode step, {r['ops_per_layer']:5.0f} per layer, "
              f"{r['syncs_per_step']:.0f} syncing ops, {r['host_data_tensors_per_step']:.0f} tensors from host data")
        for k, v in list(r["sync_sites"].items())[:12]:
            print(f"    sync {v:6.1f}  {k}")
        for k, v in list(r["host_data_sites"].items())[:8]:
            print(f"    data {v:6.1f}  {k}")
    doc = {"kind": "op_count", "date": R.now_iso(), "command": R.command_line(["bench/op_count.py"] + (argv or sys.argv[1:])),
           "machine": R.machine_info(), "model": ns.model, "runs": runs}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"[done] {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
