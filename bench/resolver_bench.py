"""Resolver microbenchmark: plan+copy time against unique host-miss bytes, and the zero-copy ceiling.

    python3 bench/resolver_bench.py --out $OUT/resolver.json          # H200, < 4 min
    python3 bench/resolver_bench.py --fig8bc --out $OUT/resolver.json # + Fig. 8 b/c (and its PNG)
    python3 bench/resolver_bench.py --quick --fig8bc --out /tmp/resolver.json  # CPU smoke (TRITON_INTERPRET)

--fig8bc (paper Fig. 8 b, c; --only-fig8bc skips the cases below): DeepSeek-V4.1-Flash single query
(K=1, k=512, 656-B rows) at batch 8 and 160: no-miss time against B in 2048..32768 with every row in
the hot cache (scan) and with every row in the optional map (direct path); at B=4096 with 77 host
misses per request; GLM shape (k=2048, B=4096, batch 32, K=8 partial and K=1) direct vs scan. Median,
p10, p90 over --fig8-iters timings, plus host enqueue time; summary["fig8"], summary
["direct_vs_scan_B4096"] (GLM K=8, plan+copy) and a PNG next to the JSON. On CUDA the kernel shapes
are compiled first in parallel worker processes (Triton's disk cache), and each direct case checks
that plan_triton(defer=True) runs under torch's sync debug mode "error".

Batch N=32, k=2048, B=4096, rows of 656 B (fp16 W=328) and 1152 B (bf16 W=576). For each case the
hot-cache state is restored before every timed call (outside the CUDA events); a call is
`plan_triton(defer=True)` + `launch_copies` (the engine's no-sync path). Cases: cold cache and warm
caches with a swept miss share; selections shared / partial (90% common) / disjoint across K=8
queries, and K=1; no-miss calls at history 8K/32K/128K/512K; all-direct vs all-hot at B=4096; 8
identical selections vs 1. The same run gathers the same numbers of random rows from a >= 4 GiB pinned
region with the same Triton kernel, random and sorted by address (the ceiling). Least squares of
plan+copy time vs unique miss bytes over the miss cases whose union fits the hot cache gives the
rate (GB/s, R^2), reported against the sorted ceiling; overflow cases (K=8 disjoint: union > B) are
fitted separately. Times are device times (the GPU spins while the CPU enqueues; the CPU enqueue
time is recorded as host_enqueue_ms). Several cases are first checked bit for bit against
plan_reference on CPU copies, and every copied row's bytes against the pinned source.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.resolver_cases import Rig, check_case, fit, index_case  # noqa: E402
from bench.resolver_fig8 import await_precompile, plot, precompile, precompile_worker, run_fig8, summarise_fig8  # noqa: E402
from bench.resolver_timing import run_case, stats, timeit  # noqa: E402
from dhisparse.kernels.gather import gather_rows_padded  # noqa: E402
from dhisparse.kv.hier.context import RESOLVER_LOOKUPS  # noqa: E402


CHECKED = ("miss_partial_K8_cold", "miss_disjoint_K8_cold", "miss_partial_K8_warm10", "miss_single_K1_warm50",
           "miss_partial_K2_cold", "miss_disjoint_K2_cold", "miss_partial_K2_warm10", "miss_single_K1_warm50")


def ceiling(rig: Rig, rb: int, counts: list[int], args) -> list[dict]:
    """Plain gather of n random rows of the pinned region, random order and sorted by address."""
    host = rig.host_rows(rb)
    total = host.shape[0] * host.shape[1]
    out = []
    for n in counts:
        idx = torch.randperm(total, device=rig.dev)[:n]
        dst = torch.arange(n, device=rig.dev).view(1, n)
        buf = torch.empty((n, 1, host.shape[-1]), dtype=host.dtype, device=rig.dev)
        cnt = torch.full((1,), n, dtype=torch.int32, device=rig.dev)
        for order, src in (("random", idx), ("sorted", idx.sort().values)):
            src = src.view(1, n)
            ts = timeit(rig, lambda: gather_rows_padded(host, buf, src, dst, cnt), lambda: None,
                        args.iters, args.warmup)
            r = {"case": f"ceiling_{order}", "row_bytes": rb, "rows": n, "miss_bytes": n * rb, **stats(ts)}
            r["GBps"] = r["miss_bytes"] / r["time_ms"] / 1e6
            out.append(r)
    return out


def _fits(res: list[dict], key=lambda r: r["time_ms"]) -> dict:
    return fit([r["miss_bytes"] for r in res], [key(r) for r in res])


def summarise(records: list[dict], rbs: list[int]) -> dict:
    """Per row size: fitted rate of plan+copy time vs miss bytes over the miss cases that fit the hot
    cache (overflow cases, where the union exceeds B, are fitted separately), against the ceiling."""
    summ = {}
    for rb in rbs:
        mine = [r for r in records if r["row_bytes"] == rb]
        miss = [r for r in mine if r["case"].startswith("miss")]
        res = [r for r in miss if r["overflow"] == 0]
        f = _fits(res)
        ceil = {o: max((r for r in mine if r["case"] == f"ceiling_{o}"), key=lambda r: r["rows"])
                for o in ("random", "sorted")}
        cfit = _fits([r for r in mine if r["case"] == "ceiling_sorted"])
        s = {"fit_GBps": f["GBps"], "fit_r2": f["r2"], "fit_intercept_ms": f["intercept_ms"], "fit_cases": len(res),
             "ceiling_random_GBps": ceil["random"]["GBps"], "ceiling_sorted_GBps": ceil["sorted"]["GBps"],
             "ceiling_sorted_fit_GBps": cfit["GBps"]}
        s["fit_over_sorted_ceiling"] = s["fit_GBps"] / s["ceiling_sorted_GBps"]
        s["fit_over_sorted_fit"] = s["fit_GBps"] / s["ceiling_sorted_fit_GBps"]
        for K in sorted({r["K"] for r in res}):
            fk = _fits([r for r in res if r["K"] == K])
            s[f"fit_K{K}_GBps"], s[f"fit_K{K}_r2"] = fk["GBps"], fk["r2"]
        fa = _fits(miss)
        s["fit_incl_overflow_GBps"], s["fit_incl_overflow_r2"] = fa["GBps"], fa["r2"]
        cf = _fits(res, key=lambda r: r["copy_only"]["time_ms"])
        s["copy_only_fit_GBps"], s["copy_only_fit_r2"] = cf["GBps"], cf["r2"]
        s["nomiss_ms_by_history"] = {r["history"]: r["time_ms"] for r in mine if r["case"] == "nomiss"}
        by = {r["case"]: r["time_ms"] for r in mine}
        if "direct_all" in by and "hot_all" in by:
            s["direct_ms"], s["hot_scan_ms"] = by["direct_all"], by["hot_all"]
            s["direct_vs_scan_B4096"] = by["hot_all"] / by["direct_all"]
        if "dedup_K8_identical" in by and "dedup_K1" in by:
            s["identical8_over_1"] = by["dedup_K8_identical"] / by["dedup_K1"]
        summ[str(rb)] = s
    return summ


# -- Fig. 8 (b), (c), GLM direct vs scan (--fig8bc) ---------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, CPU-friendly smoke test")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement (>= 9 on GPU)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--row-bytes", type=int, nargs="+", default=[656, 1152])
    ap.add_argument("--no-check", action="store_true", help="skip the bit-exact check against the reference")
    ap.add_argument("--fig8bc", action="store_true", help="also run the Fig. 8 (b)/(c) and GLM direct-vs-scan cases")
    ap.add_argument("--only-fig8bc", action="store_true", help="run only the Fig. 8 (b)/(c) and GLM cases")
    ap.add_argument("--fig8-iters", type=int, default=None, help="timed calls per Fig. 8 measurement (>= 9)")
    ap.add_argument("--fig8-row-bytes", type=int, default=656)
    ap.add_argument("--lookup", choices=RESOLVER_LOOKUPS, default="scan",
                    help="hot-cache hits scanned for, or looked up in a hot_entry index (--resolver-lookup)")
    ap.add_argument("--precompile-shape", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.precompile_shape:
        return precompile_worker(args.precompile_shape, args.fig8_row_bytes)
    args.fig8bc |= args.only_fig8bc
    args.fig8_iters = args.fig8_iters or (3 if args.quick else 21)
    args.iters = args.iters or (2 if args.quick else 11)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 3)
    t0 = time.time()
    workers = precompile(args) if args.fig8bc else []
    rig = Rig(quick=args.quick)
    if workers:
        rig.fill(args.fig8_row_bytes)  # fill the pinned region while the workers compile
    pre = await_precompile(workers, t0)
    records, checks = [], []
    for rb in ([] if args.only_fig8bc else args.row_bytes):
        rig.fill(rb)
        cases = rig.cases(rb)
        if args.lookup == "index":  # the same inputs on states that keep the hot_entry index
            cases = [dataclasses.replace(index_case(c), name=c.name) for c in cases]
        for case in ([] if args.no_check else [c for c in cases if c.name in CHECKED]):
            t1 = time.time()
            checks.append(check_case(rig, case))
            checks[-1]["seconds_incl_compile"] = time.time() - t1
            print(f"[{time.time() - t0:6.1f}s] rb={rb} reference check: {checks[-1]}", flush=True)
        counts = sorted({r for r in rig.ceiling_counts()})
        records += ceiling(rig, rb, counts, args)
        for case in cases:
            rec = run_case(rig, case, args)
            records.append(rec)
            print(f"[{time.time() - t0:6.1f}s] rb={rb:5d} {case.name:22s} misses={rec['miss_rows']:7d} "
                  f"{rec['time_ms']:8.3f} ms (plan {rec['plan_only']['time_ms']:.3f}, "
                  f"copy {rec['copy_only']['time_ms']:.3f})", flush=True)
    summary = summarise(records, [] if args.only_fig8bc else args.row_bytes)
    fig8_records = []
    if args.fig8bc:
        fig8_records, fig8_checks = run_fig8(rig, args, t0)
        checks += fig8_checks
        f8 = summary["fig8"] = summarise_fig8(fig8_records, args.quick)
        g = f8["shapes"]["glm"]
        summary[f"direct_vs_scan_B{g['B']}"] = f8["glm"][f"K{g['Ks'][0]}"][f"direct_vs_scan_B{g['B']}"]
        summary[f"direct_vs_scan_B{g['B']}_plan_only"] = f8["glm"][f"K{g['Ks'][0]}"][f"direct_vs_scan_B{g['B']}_plan_only"]
    doc = {"command": " ".join([sys.executable] + sys.argv), "quick": args.quick, "lookup": args.lookup,
           "machine": torch.cuda.get_device_name() if rig.cuda else "cpu (TRITON_INTERPRET)",
           "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "shapes": rig.shape_doc(), "checks": checks, "summary": summary, "records": records,
           "fig8_records": fig8_records, "precompile": pre, "wall_s": time.time() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    if args.fig8bc:
        plot(summary["fig8"], os.path.splitext(os.path.abspath(args.out))[0] + "_fig8bc.png")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
