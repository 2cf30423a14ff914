"""`dhisparse table RESULT.json... [--baseline hisparse] [--ttft-bound-s 10 --tpot-bound-ms 40] [--scale-bounds-to
hisparse] [--out tables.json]`: the paper's Table 2, Tables A2 / A3 and the capacity under latency bounds, from bench results, and Table
A1 (per-phase statistics) from load-step results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dhisparse.cli.args import HelpFormatter


def add_parser(sub) -> None:
    p = sub.add_parser("table", help="Tables 2, A2, A3 and the capacity under latency bounds, from bench result JSON; Table A1 "
                       "from loadstep result JSON",
                       formatter_class=HelpFormatter,
                       description="Table 2: output (mean, min-max over repeats) and its ratio to the baseline "
                                   "preset's at the same load, the same over each window's central half (the steady "
                                   "rate, without the admission ramp), TTFT mean / post-wave / post-wave p99, TPOT and active / "
                                   "slots at every (C, preset); Table A2: mean TTFT split into allocation wait and hand-off (all requests and "
                                   "after the first wave); Table A3: TTFT, post-wave TTFT and TPOT (mean / p99) at every "
                                   "(preset, C), means over repeated runs; capacity: the highest C each preset sustains "
                                   "under the bounds, and its output. Bounds are yours to state: the paper's are 10 s "
                                   "post-wave p99 TTFT and 40 ms mean TPOT at its step times; --scale-bounds-to scales "
                                   "them to each source's.")
    p.add_argument("results", nargs="+", help="bench result JSON files (runs with per-request records), or loadstep "
                   "results (Table A1)")
    p.add_argument("--baseline", default="hisparse", help="Table 2's ratio is each preset's output over this one's")
    p.add_argument("--ttft-bound-s", type=float, default=10.0, help="post-wave p99 TTFT bound, seconds")
    p.add_argument("--tpot-bound-ms", type=float, default=40.0, help="mean TPOT bound, ms")
    p.add_argument("--scale-bounds-to", default=None, metavar="PRESET",
                   help="scale the two bounds to each source's step times: times PRESET's post-wave p99 TTFT and mean "
                        "TPOT at the source's lowest load over the paper's HiSparse at C4 (0.95 s, 19.4 ms), for a "
                        "setup whose steps are not the paper's (a scaled model, another GPU)")
    p.add_argument("--out", default=None, help="also write the three tables as JSON here")
    p.set_defaults(func=run)


def _s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ms(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _central(r: dict) -> str:
    if r["central_tok_s"] is None:
        return "-"
    return f"{r['central_tok_s']:.1f} [{r['central_min']:.1f}-{r['central_max']:.1f}]"


def _table2(rows: list[dict], baseline: str):
    """Table 2 as printed: output mean [min-max], the ratio to `baseline`, TTFT in s, TPOT in ms."""
    from rich.table import Table

    t = Table(title=f"Table 2: output (tok/s: mean, min-max over runs), against {baseline}, latency, active / slots")
    for c in ("source", "C", "preset", "runs", "output", f"vs {baseline}", "central half", "vs", "TTFT mean",
              "post-wave", "post-wave p99", "TPOT ms", "active / slots"):
        t.add_column(c, justify="left" if c in ("source", "preset") else "right")
    for r in rows:
        sec = [None if r[k] is None else r[k] / 1e3 for k in ("ttft_mean_ms", "post_wave_ttft_mean_ms",
                                                             "post_wave_ttft_p99_ms")]
        t.add_row(r["source"], str(r["C"]), r["preset"], str(r["runs"]),
                  f"{r['output_tok_s']:.1f} [{r['output_min']:.1f}-{r['output_max']:.1f}]",
                  "-" if r["vs_baseline"] is None else f"{r['vs_baseline']:.3f}x", _central(r),
                  "-" if r["central_vs_baseline"] is None else f"{r['central_vs_baseline']:.3f}x", *map(_s, sec),
                  _ms(r["tpot_mean_ms"]),
                  f"{_ms(r['active'])} / {'-' if r['slots'] is None else int(r['slots'])}")
    return t


def run(ns: argparse.Namespace) -> int:
    from rich.table import Table

    from dhisparse.bench.report import console
    from dhisparse.bench.results import read_json
    from dhisparse.bench.tables import (Bounds, capacity, latency_rows, scaled_bounds, source_notes, split_rows,
                                        table2_rows)

    if ns.ttft_bound_s <= 0 or ns.tpot_bound_ms <= 0:
        raise ValueError("--ttft-bound-s and --tpot-bound-ms must be > 0")
    results = [read_json(p) for p in ns.results]
    steps = [r for r in results if r.get("kind") == "loadstep" and r.get("runs")]
    results = [r for r in results if r.get("kind") == "bench" and r.get("runs")]
    if not results and not steps:
        raise ValueError("none of the files is a bench or loadstep result with runs; nothing to tabulate")
    out = console()
    a1 = table_a1(steps, out)
    if not results:
        _write(ns, {"sources": ns.results, "table_a1": a1})
        return 0
    t2, a2, a3 = table2_rows(results, ns.baseline), split_rows(results), latency_rows(results)
    per_source = (scaled_bounds(a3, ns.scale_bounds_to, Bounds(1e3 * ns.ttft_bound_s, ns.tpot_bound_ms))
                  if ns.scale_bounds_to else None)
    cap = capacity(a3, 1e3 * ns.ttft_bound_s, ns.tpot_bound_ms, per_source)
    out.print(_table2(t2, ns.baseline))
    notes = source_notes(results)
    for n in notes:  # the measurement tools a table's runs used, and what they leave out
        for line in n["notes"]:
            out.print(f"  [{n['source']}] {line}", markup=False, highlight=False)
    t = Table(title="Table A2: where first-token time goes (s; allocation wait + hand-off = TTFT)")
    for c in ("source", "preset", "C", "runs", "alloc", "hand-off", "TTFT", "post-wave alloc", "post-wave hand-off",
              "post-wave TTFT"):
        t.add_column(c, justify="left" if c in ("source", "preset") else "right")
    for r in a2:
        t.add_row(r["source"], r["preset"], str(r["C"]), str(r["runs"]), *[_s(r[f"{p}_{f}"]) for p in ("all", "post_wave")
                                                              for f in ("allocation_s", "handoff_s", "ttft_s")])
    out.print(t)
    t = Table(title="Table A3: latency at every load (TTFT s, TPOT ms; mean / p99; means over runs)")
    for c in ("source", "preset", "C", "runs", "out tok/s", "TTFT", "post-wave TTFT", "TPOT"):
        t.add_column(c, justify="left" if c in ("source", "preset") else "right")
    for r in a3:
        sec = [None if r[k] is None else r[k] / 1e3 for k in ("ttft_mean_ms", "ttft_p99_ms", "post_wave_ttft_mean_ms",
                                                             "post_wave_ttft_p99_ms")]
        t.add_row(r["source"], r["preset"], str(r["C"]), str(r["runs"]), _ms(r["output_tok_s"]), f"{_s(sec[0])} / {_s(sec[1])}",
                  f"{_s(sec[2])} / {_s(sec[3])}", f"{_ms(r['tpot_mean_ms'])} / {_ms(r['tpot_p99_ms'])}")
    out.print(t)
    out.print(_capacity_table(cap, ns))
    _write(ns, {"sources": ns.results, "notes": notes, "table_2": t2, "table_a2": a2, "table_a3": a3, "capacity": cap,
                **({"table_a1": a1} if a1 else {})})
    return 0


def _capacity_table(cap: list[dict], ns: argparse.Namespace):
    """The capacity rows as printed, each with the bounds it was held to (scaled ones name their anchor run)."""
    from rich.table import Table

    scaled = f", scaled to {ns.scale_bounds_to} at each source's lowest load" if ns.scale_bounds_to else ""
    t = Table(title=f"capacity: post-wave p99 TTFT <= {ns.ttft_bound_s:g} s and mean TPOT <= {ns.tpot_bound_ms:g} ms"
                    f"{scaled}")
    for c in ("source", "preset", "TTFT bound s", "TPOT bound ms", "highest C", "out tok/s"):
        t.add_column(c, justify="left" if c in ("source", "preset") else "right")
    for r in cap:
        b = r["bounds"]
        t.add_row(r["source"], r["preset"], _s(b["post_wave_ttft_p99_ms"] / 1e3), _ms(b["tpot_mean_ms"]),
                  "-" if r["C"] is None else str(r["C"]), _ms(r["output_tok_s"]))
    return t


def table_a1(steps: list[dict], out) -> list[dict]:
    """Table A1 of each load-step result (`dhisparse loadstep`, `bench/gpu_serving.py --load-step`), printed: per
    arm and phase, the requests that start and finish inside it, output, latency, slots, coverage, host-fetched
    share. Returns its rows (one a run and phase, with the result's model and input length as `source`)."""
    from dhisparse.bench.report import phase_table
    from dhisparse.bench.tables import source

    rows = []
    for res in steps:
        out.print(phase_table(res, f"Table A1: the load step, per phase ({source(res)})"))
        rows += [{"source": source(res), "arm": r["preset"], **p} for r in res["runs"] for p in r["phases"]]
    return rows


def _write(ns: argparse.Namespace, tables: dict) -> None:
    """The tables as JSON at --out, with what made them (command, date, commit, machine) first."""
    if ns.out:
        from dhisparse.bench import results as R

        made = {"kind": "tables", "command": R.command_line(getattr(ns, "argv", None)), "date": R.now_iso(),
                "commit": R.source_commit(), "machine": R.machine_info()}
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(made | tables, indent=1) + "\n")
        print(ns.out)
