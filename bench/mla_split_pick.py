"""Pick the sparse-MLA split (rows a program walks) from an `mla_tune_bench.py` sweep of splits.

    python3 bench/mla_split_pick.py $OUT/mla_split_h200.json [--margin 0.97]   # prints the split

The rule, fixed before the sweep ran: for every split of the sweep's runs (the default plan's tile,
other fields equal), the geometric mean over the sweep's pass sizes T of its time over the default
plan's at the same T; the smallest mean wins if it is below --margin, else the default stays. One
split serves every pass (a token's arithmetic must not depend on the batch: verification reproduces
decoding), so it is judged over decode and round sizes together, never at one point.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def pick(runs: list[dict], default: int, margin: float) -> tuple[int, dict[int, float]]:
    """(split, {split: geometric-mean ratio against the default}) from mla_tune_bench's runs."""
    by: dict[int, list[float]] = {}
    tokens = {r["tokens"] for r in runs}
    for r in runs:
        by.setdefault(r["split_rows"], []).append(r["vs_default"])
    means = {n: math.exp(sum(map(math.log, v)) / len(v)) for n, v in by.items() if len(v) == len(tokens)}
    best = min(means, key=means.get)
    return (best if means[best] < margin else default), means


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep")
    p.add_argument("--margin", type=float, default=0.97, help="a split must beat the default by this much")
    ns = p.parse_args(argv)
    d = json.load(open(ns.sweep))
    default = d["runs"][0]["split_rows"]  # the bench puts the default plan first at every T
    n, means = pick(d["runs"], default, ns.margin)
    print(" ".join(f"{k}:{v:.3f}" for k, v in sorted(means.items())), file=sys.stderr)
    print(n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
