"""The SASS lines of one kernel that hold the most warp-stall samples, from an ncu source export.

    ncu --import plan.ncu-rep --page source --csv --print-source sass > plan_source.csv   # bench/gpu_session.sh ncu33
    python3 bench/ncu_top.py plan_source.csv --top 40

Reads the CSV ncu writes (any preamble before the header row is skipped), sums the "Warp Stall Sampling
(All Samples)" column and prints the `--top` lines in program order with their share, so a stall hot spot
shows with the instructions around it. `--json` writes the same as a record for bench/results/.
"""

from __future__ import annotations

import argparse
import csv
import io
import json

SAMPLES = "warp stall sampling (all"


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of ncu's source CSV; the header is the first row that names the samples column."""
    with open(path, newline="") as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    for i, r in enumerate(rows):
        if any(SAMPLES in c.lower() for c in r):
            return r, rows[i + 1:]
    raise ValueError(f"{path}: no '{SAMPLES}...)' column: not an ncu --page source --csv export")


def column(header: list[str], name: str) -> int:
    for i, h in enumerate(header):
        if name in h.lower():
            return i
    raise ValueError(f"no column containing '{name}' in {header}")


def top_lines(path: str, top: int) -> dict:
    """{'total': samples, 'lines': [(index, samples, share, source)]} for the `top` lines, in program order."""
    header, rows = read_rows(path)
    si, ci = column(header, SAMPLES), column(header, "source")
    data = []
    for r in rows:
        try:
            data.append((float(r[si] or 0), r[ci]))
        except (ValueError, IndexError):
            continue
    total = sum(v for v, _ in data) or 1.0
    keep = sorted(sorted(range(len(data)), key=lambda i: -data[i][0])[:top])
    return {"total": total, "lines": [(i, data[i][0], data[i][0] / total, data[i][1]) for i in keep]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    res = top_lines(args.csv, args.top)
    print(f"{res['total']:.0f} samples; the {args.top} lines that hold the most, in program order:")
    for i, v, share, src in res["lines"]:
        print(f"{i:6d} {v:8.0f} {100 * share:5.1f}%  {src[:120]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": "ncu_top", "source": args.csv, **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
