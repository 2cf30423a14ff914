"""A MoE layer's row grouping: the one-program kernel against the torch form, at decode and round sizes.

    python3 bench/moe_align_bench.py --out $OUT/moe_align_h200.json    # GPU (~30 s)
    python3 bench/moe_align_bench.py --quick --out /tmp/moe_align.json  # CPU smoke (interpreter)

`moe_align_torch` (the named baseline: the grouping before session 46, about 30 torch ops with a
stable int64 argsort) against `moe_align` (kernels/moe_align.py: one Triton program) for tokens x
top_k rows over E experts at the BM a grouped GEMM picks (`moe_block_m`), with random expert ids.
On CUDA each time is the median replay of a CUDA graph of --graph calls (the engine replays its
steps from graphs, so Python launch cost is not counted), L2 not flushed; every case checks that
both give the same grouping.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--quick" in sys.argv:  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from bench.kernel_bench import Timing, device_setup, ints, timed  # noqa: E402
from dhisparse.bench import results as R  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--tokens", default="19,47,90,235", help="tokens a pass (C20 decode, C47 decode, an 18 x 5 round, a 47 x 5 round)")
    a("--experts", default="12,24,256", help="routed experts (glm5-faithful on an H100 / H200, GLM-5)")
    a("--top-k", type=int, default=8)
    a("--reps", type=int, default=20); a("--warmup", type=int, default=3); a("--graph", type=int, default=20)
    a("--quick", action="store_true", help="tiny shapes on CPU under the interpreter")
    a("--out", default="bench/results/moe_align.json")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.tokens, ns.experts, ns.top_k, ns.reps, ns.warmup, ns.graph = "3,17", "4", 2, 2, 1, 1
    ns.argv = ["bench/moe_align_bench.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def main(argv=None) -> int:
    from dhisparse.kernels.fp8_tiles import moe_block_m
    from dhisparse.kernels.moe_align import moe_align, moe_align_torch

    ns = parse(argv)
    cuda, dev, _, g, device = device_setup(ns.quick)
    tm, runs = Timing(ns.warmup, ns.reps, ns.graph), []
    for E in ints(ns.experts):
        for T in ints(ns.tokens):
            ids = torch.randint(0, E, (T, ns.top_k), generator=g).to(dev)
            bm = moe_block_m(ids.numel(), E)
            a, b = moe_align_torch(ids, E, bm), moe_align(ids, E, bm)
            row = {"experts": E, "tokens": T, "rows": ids.numel(), "block_m": bm,
                   "same": bool(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])),
                   "torch_us": timed(lambda: moe_align_torch(ids, E, bm), tm, cuda) * 1e3,
                   "kernel_us": timed(lambda: moe_align(ids, E, bm), tm, cuda) * 1e3}
            row["kernel_over_torch"] = row["kernel_us"] / row["torch_us"]
            runs.append(row)
            print(f"E {E:3d} T {T:4d} rows {row['rows']:5d} BM {bm:3d}  torch {row['torch_us']:7.1f} us  "
                  f"kernel {row['kernel_us']:7.1f} us  x{row['kernel_over_torch']:.3f}  same {row['same']}", flush=True)
    notes = ["kernel_over_torch < 1: the one-program kernel is faster (same run, same ids)",
             "CUDA times: median graph replay / calls per graph; a glm5-faithful step runs 75 groupings"]
    R.write_bench("moe_align", ns, runs, notes, device=device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
