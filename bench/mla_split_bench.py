"""Sparse-MLA attention with split rows (flash-decoding) against the one-program-per-token kernel.

    python3 bench/mla_split_bench.py --out $OUT/mla_split_h200.json      # H200
    python3 bench/mla_split_bench.py --quick --out /tmp/mla_split.json     # CPU smoke (interpreter)

For each pass size T (tokens: a decode pass has one per request, a verification pass K per
request) and each split_rows n, one layer's attention at the scaled GLM's shape (16 heads, latent
512 + rope 64, k = 512 random locations in a paged row space) is timed with CUDA events (median of
--reps after --warmup). Every row reports its time and the ratio against n = 0 (no split) measured
in the same run, plus the largest difference from the unsplit output.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dhisparse.bench import results as R  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--tokens", default="18,31,72,124", help="pass sizes T")
    a("--splits", default="0,64,128,256", help="split_rows values (0 = no split, the baseline)")
    a("--heads", type=int, default=16); a("--latent", type=int, default=512); a("--rope", type=int, default=64)
    a("--topk", type=int, default=512); a("--pages", type=int, default=4096); a("--page-size", type=int, default=64)
    a("--reps", type=int, default=50); a("--warmup", type=int, default=10)
    a("--quick", action="store_true", help="tiny shapes on CPU under the interpreter")
    a("--out", default="bench/results/mla_split.json")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.tokens, ns.splits, ns.heads, ns.latent, ns.rope, ns.topk = "2,3", "0,16", 4, 32, 8, 40
        ns.pages, ns.page_size, ns.reps, ns.warmup = 8, 4, 2, 1
    ns.argv = ["bench/mla_split_bench.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def timed(fn, reps: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of `fn()`."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main(argv=None) -> int:
    ns = parse(argv)
    if ns.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from dhisparse.kernels.sparse_mla import plan_sparse_mla, run_sparse_mla

    cuda = torch.cuda.is_available() and not ns.quick
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    H, C, Rr = ns.heads, ns.latent, ns.rope
    rows = torch.randn(ns.pages, ns.page_size, C + Rr, generator=g).to(dev, dtype)
    runs = []
    for T in [int(x) for x in ns.tokens.split(",")]:
        q = torch.randn(T, H, C, generator=g).to(dev, dtype)
        qp = torch.randn(T, H, Rr, generator=g).to(dev, dtype)
        loc = torch.randint(0, ns.pages * ns.page_size, (T, ns.topk), generator=g).to(dev)
        base_ms = base_out = None
        for n in [int(x) for x in ns.splits.split(",")]:
            plan = plan_sparse_mla(H, C, Rr, split_rows=n)
            out = run_sparse_mla(plan, q, qp, rows, loc, C**-0.5)
            ms = timed(lambda: run_sparse_mla(plan, q, qp, rows, loc, C**-0.5), ns.reps, ns.warmup, cuda)
            if n == 0:
                base_ms, base_out = ms, out
            diff = float((out.float() - base_out.float()).abs().max()) if base_out is not None else None
            runs.append({"tokens": T, "split_rows": plan.split_rows, "ms": ms,
                         "vs_unsplit": ms / base_ms if base_ms else None, "max_abs_diff_vs_unsplit": diff})
            print(f"T={T:4d} split_rows={plan.split_rows:4d}  {ms * 1e3:8.1f} us  "
                  f"x{runs[-1]['vs_unsplit'] or float('nan'):.3f} of unsplit  diff {diff}", flush=True)
    config = {k: v for k, v in vars(ns).items() if k != "argv"} | {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "dtype": str(dtype)}
    print(f"[done] {R.write_json(R.new_result('mla_split_bench', ns.argv, config, runs), ns.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
