"""Paper Fig. 8 (b, c) cases of the resolver benchmark: no-miss time vs hot-cache size at two batch
sizes with the direct path, and 77 host misses per request; kernel-shape precompilation in worker
processes; the Fig. 8b/c plot. Run through `bench/resolver_bench.py --fig8bc`."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.resolver_cases import Case, Rig, check_case, fig8_cases, fig8_shapes, fig8_specs  # noqa: E402
from bench.resolver_timing import run_case  # noqa: E402
from dhisparse.kernels.resolver import plan_triton  # noqa: E402

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resolver_bench.py")


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
        rec = run_case(rig, case, args, iters=args.fig8_iters, engine_path=False)
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
    me = BENCH
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
        from dhisparse.bench.plot_resolver import plot_fig8bc
    except ImportError as e:
        print(f"no plot ({e}); the JSON holds everything the figure needs")
        return
    print(f"wrote {plot_fig8bc(fig8, png)}")

