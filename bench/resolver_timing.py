"""Resolver benchmark timing: device times with the GPU spinning while the CPU enqueues, and one
case's plan + copy / plan only / copy only timings (used by resolver_bench.py and resolver_fig8.py)."""

from __future__ import annotations

import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.resolver_cases import Case, Rig, state_restorer  # noqa: E402
from dhisparse.bench import results as R  # noqa: E402
from dhisparse.kernels.resolver import PlanWorkspace, launch_copies, plan_triton  # noqa: E402

SPIN_CYCLES = 2_000_000  # ~1 ms at H200 clocks: longer than the CPU-side enqueue of one call


def timeit(rig: Rig, fn, restore, iters: int, warmup: int) -> tuple[list[float], list[float]]:
    """(device ms, host enqueue ms) of fn per call; restore() runs before each call, untimed. On CUDA
    the GPU first spins while the CPU enqueues, so device times exclude Python/launch overhead."""
    for _ in range(warmup):
        restore()
        fn()
    ts, host = [], []
    for _ in range(iters):
        restore()
        if rig.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SPIN_CYCLES)
            a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        if rig.cuda:
            b.record()
            ts.append((a, b))
    if rig.cuda:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in ts], host
    return host, host


def header(kind: str, script: str, cuda: bool, t0: float, **fields) -> dict:
    """The fields every micro-benchmark JSON here opens with: kind, date, the command as run, the
    commit (`dhisparse.bench.results.source_commit`), the machine, then `fields` and wall_s."""
    return {"kind": kind, "date": R.now_iso(), "command": " ".join(["python3", script, *sys.argv[1:]]),
            "commit": R.source_commit() or "", "machine": torch.cuda.get_device_name() if cuda else "cpu",
            **fields, "wall_s": time.time() - t0}


def stats(ts: tuple[list[float], list[float]]) -> dict:
    """Median, min, max, 10th / 90th percentile (nearest rank) of device times; median enqueue time."""
    s, h = sorted(ts[0]), sorted(ts[1])
    q = lambda f: s[round(f * (len(s) - 1))]  # noqa: E731
    return {"time_ms": s[len(s) // 2], "min_ms": s[0], "max_ms": s[-1], "p10_ms": q(0.1), "p90_ms": q(0.9),
            "n_timings": len(s), "host_enqueue_ms": h[len(h) // 2]}


def run_case(rig: Rig, case: Case, args, iters: int | None = None, engine_path: bool = True) -> dict:
    """Time plan+copy, plan alone and copy alone for one prepared case: `plan_triton` as called
    since session 6 (an int `now`, scratch allocated per call), and the engine's call (a persistent
    `PlanWorkspace` and `now` a device scalar: no fill launches) as `*_engine_path` (unless
    engine_path=False)."""
    iters = iters or args.iters
    st, sel, slots = case.state, case.sel, case.slots
    restore = state_restorer(st)
    now = int(st.hot_stamp.max()) + 1

    def plan():
        return plan_triton(sel, slots, st, now, defer=True)

    host, dev = rig.host_rows(case.rb), rig.dev_rows(case.rb, case.dev_rows)

    def both():
        launch_copies(plan(), host, dev)

    restore()
    p = plan().materialize()
    restore()
    c = p.counters
    rec = {"case": case.name, "row_bytes": case.rb, "K": sel.shape[1], "k": sel.shape[2], "N": sel.shape[0],
           "B": st.hot_pos.shape[1], "history": case.history, "miss_rows": c.host,
           "miss_bytes": c.host * case.rb, "overflow": c.overflow, "counters": c._asdict(), **case.meta}
    rec.update(stats(timeit(rig, both, restore, iters, args.warmup)))
    rec["plan_only"] = stats(timeit(rig, plan, restore, iters, args.warmup))
    rec["copy_only"] = stats(timeit(rig, lambda: launch_copies(p, host, dev), lambda: None, iters, args.warmup))
    if not engine_path:
        return rec
    ws, now_t = PlanWorkspace(rig.dev), torch.full((1,), now, dtype=torch.int64, device=rig.dev)

    def plan_engine():
        return plan_triton(sel, slots, st, now_t, defer=True, workspace=ws)

    rec["time_ms_engine_path"] = stats(timeit(rig, lambda: launch_copies(plan_engine(), host, dev), restore, iters,
                                              args.warmup))["time_ms"]
    rec["plan_only_engine_path"] = stats(timeit(rig, plan_engine, restore, iters, args.warmup))
    restore()
    return rec


