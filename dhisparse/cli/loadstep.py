"""`dhisparse loadstep`: C_low -> C_high -> C_low closed loop with residency on and off (Fig. 6)."""

from __future__ import annotations

import argparse
import time

from dhisparse.cli.args import add_engine_args, engine_config
from dhisparse.cli.args import HelpFormatter
from dhisparse.cli.bench import add_output_args, add_workload_args, publish, workload_from


def add_parser(sub) -> None:
    p = sub.add_parser("loadstep", help="load step C_low -> C_high -> C_low, residency on/off, per-second counters",
                       formatter_class=HelpFormatter,
                       description="Runs each arm (a preset) through the same offered-load step and records per-second "
                                   "slots, coverage and host-fetched share. Arms default to the residency on/off pair "
                                   "(adaptive, hisparse) that this build has, else resident.")
    add_engine_args(p)
    g = p.add_argument_group("load step")
    g.add_argument("--c-low", type=int, default=4, help="offered concurrency before and after the step")
    g.add_argument("--c-high", type=int, default=16, help="offered concurrency during the step")
    g.add_argument("--low-duration", type=float, default=20.0, help="seconds of the first C_low phase")
    g.add_argument("--high-duration", type=float, default=20.0, help="seconds of the C_high phase")
    g.add_argument("--after-duration", type=float, default=None, help="seconds of the last C_low phase (default: --low-duration)")
    g.add_argument("--arms", default=None, help="comma-separated presets to compare (default: adaptive,hisparse where available)")
    add_workload_args(p, duration=None)
    add_output_args(p, "loadstep")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from dhisparse.bench import results as R
    from dhisparse.bench.loadstep import default_arms, run_loadstep, step_phases, unavailable_arms
    from dhisparse.bench.report import console as report_console, phase_table
    from dhisparse.bench.sweep import ProgressBar, check_presets

    if ns.c_high < ns.c_low:
        raise ValueError(f"--c-high ({ns.c_high}) must be >= --c-low ({ns.c_low})")
    console = report_console()
    arms = check_presets([a.strip() for a in ns.arms.split(",")]) if ns.arms else default_arms()
    phases = step_phases(ns.c_low, ns.c_high, ns.low_duration, ns.high_duration, ns.after_duration)
    workload = workload_from(ns, duration_s=phases.total_s)
    notes = [f"arm {a!r} is not available in this build yet" for a in unavailable_arms()]
    for n in notes:
        console.print(f"[yellow]note:[/yellow] {n}; running {', '.join(arms)}")
    base = engine_config(ns, preset=arms[0])
    t0 = time.perf_counter()
    with ProgressBar(not ns.no_progress, console) as bar:
        runs = run_loadstep(base, arms, phases, workload, bar, ns.sample_interval)
    config = {"engine": R.to_jsonable(base), "workload": R.to_jsonable(workload), "arms": arms,
              "unavailable_arms": unavailable_arms(), "phases": [p._asdict() for p in phases.phases],
              "wall_s": time.perf_counter() - t0}
    return publish(R.new_result("loadstep", getattr(ns, "argv", None), config, runs, notes), ns, console, phase_table)
