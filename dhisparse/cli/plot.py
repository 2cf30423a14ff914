"""`dhisparse plot RESULT.json... --out DIR`: PNG figures in the paper's form."""

from __future__ import annotations

import argparse

from dhisparse.cli.args import HelpFormatter
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="PNG figures from bench / loadstep / resolver result JSON",
                       formatter_class=HelpFormatter,
                       description="bench results -> serving.png (output vs concurrency, TTFT and TPOT vs "
                                   "output; all files on one figure) and series.png per file (output and requests "
                                   "decoding over time); bench results of one C at several context lengths with resident -> context.png "
                                   "(output vs context and over resident's, where the hierarchy overtakes it); bench "
                                   "results at several hot-cache sizes (one or more loads) -> budget.png (Fig. 9); arms of "
                                   "verification widths (--arms speculative_num_draft_tokens=...) -> widths.png (Fig. 7); a baseline "
                                   "and arms of set tokens a round (--arms speculative_oracle_tokens_per_round=...) -> costed.png "
                                   "(the costed sweep: output over the baseline against tokens a round, a round's time split); loadstep -> loadstep.png (slots, coverage, host-fetched share "
                                   "vs time); step_profile -> step_profile.png (Fig. 10: a decode step by kernel "
                                   "family); resolver microbenchmark {records: [{miss_bytes, time_ms, case}]} -> "
                                   "resolver.png.")
    p.add_argument("results", nargs="+", help="result JSON files")
    p.add_argument("--out", default="figures", help="output folder")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from dhisparse.bench.plots import plot_results
    from dhisparse.bench.results import read_json

    results = []
    for path in ns.results:
        data = read_json(path)
        data.setdefault("label", Path(path).stem)
        results.append(data)
    written = plot_results(results, ns.out)
    if not written:
        raise ValueError("none of the files is a bench, loadstep, step_profile (with kernel data) or resolver result; "
                         "nothing to plot")
    for png in written:
        print(png)
    return 0
