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
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.resolver_cases import Case, Rig, check_case, fig8_cases, fig8_shapes, fig8_specs, fit  # noqa: E402
from dhisparse.kernels.gather import gather_rows_padded  # noqa: E402
from dhisparse.kernels.resolver import launch_copies, plan_triton  # noqa: E402


CHECKED = ("miss_partial_K8_cold", "miss_disjoint_K8_cold", "miss_partial_K8_warm10", "miss_single_K1_warm50",
           "miss_partial_K2_cold", "miss_disjoint_K2_cold", "miss_partial_K2_warm10", "miss_single_K1_warm50")
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


def stats(ts: tuple[list[float], list[float]]) -> dict:
    """Median, min, max, 10th / 90th percentile (nearest rank) of device times; median enqueue time."""
    s, h = sorted(ts[0]), sorted(ts[1])
    q = lambda f: s[round(f * (len(s) - 1))]  # noqa: E731
    return {"time_ms": s[len(s) // 2], "min_ms": s[0], "max_ms": s[-1], "p10_ms": q(0.1), "p90_ms": q(0.9),
            "n_timings": len(s), "host_enqueue_ms": h[len(h) // 2]}


def run_case(rig: Rig, case: Case, args, iters: int | None = None) -> dict:
    """Time plan+copy, plan alone and copy alone for one prepared case."""
    iters = iters or args.iters
    st, sel, slots = case.state, case.sel, case.slots
    snap = (st.hot_pos.clone(), st.hot_stamp.clone())
    now = int(st.hot_stamp.max()) + 1

    def restore():
        st.hot_pos.copy_(snap[0])
        st.hot_stamp.copy_(snap[1])

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
    return rec


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

def _fig8_checked(quick: bool) -> set[str]:
    sh = fig8_shapes(quick)
    names = {f"fig8b_{p}_N{N}_B{sh['B_ref']}" for p in ("scan", "direct") for N in sh["batches"]}
    names |= {f"fig8c_miss{sh['miss']}_N{N}" for N in sh["batches"]}
    names |= {f"fig8b_scan_N{sh['batches'][0]}_B{max(sh['Bs'])}", f"glm_scan_K{sh['glm']['Ks'][0]}",
              f"glm_direct_K{sh['glm']['Ks'][0]}"}
    return names


def sync_free(rig: Rig, case: Case):
    """CUDA: one deferred plan under torch's sync debug mode "error" (True, or the error text);
    None on CPU. Run on all-direct cases, whose state the plan leaves untouched."""
    if not rig.cuda:
        return None
    now = int(case.state.hot_stamp.max()) + 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan_triton(case.sel, case.slots, case.state, now, defer=True)
        ok = True
    except RuntimeError as e:
        ok = str(e)[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return ok


def run_fig8(rig: Rig, args, t0: float) -> tuple[list[dict], list[dict]]:
    """Every Fig. 8 case: reference check (a few), then plan+copy / plan / copy timings."""
    rb = args.fig8_row_bytes
    rig.fill(rb)
    records, checks, want = [], [], set() if args.no_check else _fig8_checked(args.quick)
    for case in fig8_cases(rig, rb, args.quick):
        if case.name in want:
            t1 = time.time()
            checks.append(check_case(rig, case))
            checks[-1]["seconds_incl_compile"] = time.time() - t1
            print(f"[{time.time() - t0:6.1f}s] fig8 reference check: {checks[-1]}", flush=True)
        rec = run_case(rig, case, args, iters=args.fig8_iters)
        if case.meta["path"] == "direct":
            rec["defer_sync_free"] = sync_free(rig, case)
        records.append(rec)
        print(f"[{time.time() - t0:6.1f}s] {case.name:24s} misses={rec['miss_rows']:6d} {rec['time_ms'] * 1e3:9.1f} us "
              f"(p10 {rec['p10_ms'] * 1e3:.1f}, p90 {rec['p90_ms'] * 1e3:.1f}; plan {rec['plan_only']['time_ms'] * 1e3:.1f}, "
              f"enqueue {rec['host_enqueue_ms'] * 1e3:.0f})", flush=True)
        del case
    return records, checks


def _pick(r: dict, keys=("time_ms", "p10_ms", "p90_ms", "host_enqueue_ms")) -> dict:
    out = {k: r[k] for k in keys}
    out["plan_only_ms"] = r["plan_only"]["time_ms"]
    return out


def summarise_fig8(records: list[dict], quick: bool) -> dict:
    """(b) per batch: scan and direct time per B; direct-vs-scan at B_ref; growth for a 4x larger cache.
    (c) per batch: no miss vs `miss` misses per request, added us per request. glm: direct vs scan."""
    sh = fig8_shapes(quick)
    by = {r["case"]: r for r in records}
    Bs, ref, m = list(sh["Bs"]), sh["B_ref"], sh["miss"]
    out = {"shapes": sh, "b": {}, "c": {}, "glm": {}}
    for N in sh["batches"]:
        scan = [by[f"fig8b_scan_N{N}_B{B}"] for B in Bs]
        direct = [by[f"fig8b_direct_N{N}_B{B}"] for B in Bs]
        b = {"B": Bs, "scan": [_pick(r) for r in scan], "direct": [_pick(r) for r in direct]}
        i = Bs.index(ref)
        b[f"direct_vs_scan_B{ref}"] = scan[i]["time_ms"] / direct[i]["time_ms"]
        b[f"direct_vs_scan_B{ref}_plan_only"] = scan[i]["plan_only"]["time_ms"] / direct[i]["plan_only"]["time_ms"]
        if 4 * ref in Bs:
            b[f"scan_B{4 * ref}_over_B{ref}"] = scan[Bs.index(4 * ref)]["time_ms"] / scan[i]["time_ms"]
        b["direct_sync_free"] = all(r.get("defer_sync_free") in (True, None) for r in direct)
        out["b"][f"batch{N}"] = b
        miss = by[f"fig8c_miss{m}_N{N}"]
        out["c"][f"batch{N}"] = {"no_miss": _pick(scan[i]), f"miss{m}": _pick(miss), "miss_rows": miss["miss_rows"],
                                 "added_us_per_request": (miss["time_ms"] - scan[i]["time_ms"]) * 1e3 / N}
    for K in sh["glm"]["Ks"]:
        sc, di = by[f"glm_scan_K{K}"], by[f"glm_direct_K{K}"]
        out["glm"][f"K{K}"] = {"scan": _pick(sc), "direct": _pick(di),
                               f"direct_vs_scan_B{sh['glm']['B']}": sc["time_ms"] / di["time_ms"],
                               f"direct_vs_scan_B{sh['glm']['B']}_plan_only":
                                   sc["plan_only"]["time_ms"] / di["plan_only"]["time_ms"]}
    return out


def precompile(args) -> list[subprocess.Popen]:
    """CUDA: start one worker process per Fig. 8 kernel shape (the default cases' shapes included);
    each compiles its specialization into Triton's on-disk cache, so the shapes compile in parallel and
    the timed process loads them. A failed worker only costs time (the main process compiles)."""
    if args.quick or not torch.cuda.is_available():
        return []
    me = os.path.abspath(__file__)
    procs = []
    for kk, b in fig8_specs(False):
        err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty worker never blocks
        procs.append((subprocess.Popen([sys.executable, me, "--out", os.devnull, "--precompile-shape", f"{kk}x{b}",
                                        "--fig8-row-bytes", str(args.fig8_row_bytes)],
                                       stdout=subprocess.DEVNULL, stderr=err), err))
    return procs


def await_precompile(procs: list, t0: float) -> list[dict]:
    out = []
    for p, err in procs:
        try:
            p.wait(timeout=max(1.0, 420 - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        err.seek(0)
        out.append({"shape": p.args[-3], "rc": p.returncode, "done_s": time.time() - t0,
                    "stderr_tail": err.read()[-300:] if p.returncode else ""})
        err.close()
        print(f"[{time.time() - t0:6.1f}s] precompile {out[-1]}", flush=True)
    return out


def precompile_worker(shape: str, rb: int) -> None:
    """Build the first Fig. 8 case of one kernel shape on a small pinned region and plan it once."""
    kk, b = (int(x) for x in shape.split("x"))
    rig = Rig(quick=False, region=256 << 20)
    for case in fig8_cases(rig, rb, False, only=(kk, b)):
        plan_triton(case.sel, case.slots, case.state, int(case.state.hot_stamp.max()) + 1, defer=True)
        if rig.cuda:
            torch.cuda.synchronize()
        print(f"compiled {shape}: {case.name}")
        return


def plot(fig8: dict, png: str) -> None:
    """Fig. 8 (b)/(c) PNG next to the JSON; skipped (with the reason) when matplotlib is missing:
    `dhisparse plot RESULT.json --out DIR` draws it later from the JSON."""
    try:
        from dhisparse.bench.plots import plot_fig8bc
    except ImportError as e:
        print(f"no plot ({e}); the JSON holds everything the figure needs")
        return
    print(f"wrote {plot_fig8bc(fig8, png)}")


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
    doc = {"command": " ".join([sys.executable] + sys.argv), "quick": args.quick,
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
