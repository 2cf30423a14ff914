"""Where the resolver plan's time goes, finer than resolver_peer.py --phases: the plan kernel stopped after
each phase, the full plan across num_warps and with / without `distinct` (K 1), K 8 unions.

    python3 bench/resolver_probe.py --out $OUT/resolver_probe.json          # H200, ~3 min with a cold cache
    python3 bench/resolver_probe.py --quick --out /tmp/resolver_probe.json  # CPU smoke (TRITON_INTERPRET)

Plan alone (`plan_triton(defer=True, workspace=ws)`), same timing as resolver_peer.py (L2 flushed, state
restored, 20 calls, median), one query per request, top-k 2,048. A floor: an empty Triton kernel on the same
grid, timed the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402  (after TRITON_INTERPRET is set)
import triton.language as tl  # noqa: E402

import dhisparse.kernels.resolver as kr  # noqa: E402
from bench.resolver_cases import Rig, state_restorer  # noqa: E402
from bench.resolver_cases import Case  # noqa: E402
from bench.resolver_peer import MISS, Flush, build, plan_bench_args, plan_bench_start, shapes  # noqa: E402
from bench.resolver_timing import header, stats, timeit  # noqa: E402

STOPS = (0, 10, 30, 41, 43, 45, 50)


@triton.jit
def _empty(x_ptr):
    if tl.program_id(0) < 0:
        tl.store(x_ptr, 0)


def variants(H: int, quick: bool, K: int = 1) -> list[dict]:
    """(warps, UPTO, D) to time; D: plan_triton(distinct=) (one top-k query a request: no read-back
    of the claims). Every stop at 16 warps with D; the full plan without D and at 32 warps (H 4,096);
    the full plan at 16 and 32 warps (H 8,192, K 8 unions: D does not apply to K 8)."""
    if quick:
        return [{"warps": 4, "UPTO": u, "D": d} for u in (10, 50) for d in ((0, 1) if K == 1 else (0,))]
    if K > 1:
        return [{"warps": w, "UPTO": 50, "D": 0} for w in (16, 32)]
    if H == 4096:
        return ([{"warps": 16, "UPTO": u, "D": 1} for u in STOPS] + [{"warps": 16, "UPTO": 50, "D": 0},
                                                                      {"warps": 32, "UPTO": 50, "D": 1}])
    return [{"warps": w, "UPTO": 50, "D": 1} for w in (16, 32)]


def planner(case, st, now, ws, v: dict):
    return lambda: kr.plan_triton(case.sel, case.slots, st, now, defer=True, num_warps=v["warps"],
                                  upto_phase=v["UPTO"], workspace=ws, distinct=bool(v["D"]))


def build_k(rig: Rig, sh: dict, K: int, kind: str, H: int, N: int, level: str):
    """A verification-width case: K queries per request, `kind` union (resolver_cases' selection)."""
    sel = rig.selection(kind, K, sh["L"], N=N, k=sh["k"])
    st = rig.state(656, sh["L"], N=N, B=H, rows=N * (H + rig.TT))
    rig.warm(st, sel, MISS[level], sh["L"])
    return Case(f"K{K}_{kind}_{level}_N{N}_H{H}", 656, st, sel, torch.arange(N, device=rig.dev), sh["L"],
                {"K": K, "union": kind}, N * (H + rig.TT))


def run_cases(rig: Rig, sh: dict, flush: Flush, iters: int, levels: tuple, t0: float, H: int,
              K: int = 1, kind: str = "shared") -> list[dict]:
    recs = []
    for N in sh["batches"]:
        for level in levels:
            if (H != 4096 or K > 1) and N != sh["batches"][0]:
                continue
            case = build(rig, sh, H, N, 656, level) if K == 1 else build_k(rig, sh, K, kind, H, N, level)
            st = case.state
            restore = state_restorer(st, flush)
            now = torch.full((1,), int(st.hot_stamp.max()) + 1, dtype=torch.int64, device=rig.dev)

            ws = kr.PlanWorkspace(rig.dev)
            x = torch.zeros(1, dtype=torch.int32, device=rig.dev)
            rec = {"case": case.name, "N": N, "H": H, "K": K, "union": kind, "miss_level": level,
                   "empty_kernel": stats(timeit(rig, lambda: _empty[(N, 1)](x), restore, iters, 3)), "variants": []}
            for v in variants(H, rig.quick, K):
                restore()
                t = stats(timeit(rig, planner(case, st, now, ws, v), restore, iters, 3))
                rec["variants"].append({**v, **t})
            restore()
            recs.append(rec)
            print(f"[{time.time() - t0:6.1f}s] {case.name}: empty {rec['empty_kernel']['time_ms'] * 1e3:.1f}  "
                  + "  ".join(f"w{v['warps']}u{v['UPTO']}d{v['D']} {v['time_ms'] * 1e3:.1f}" for v in rec["variants"]),
                  flush=True)
    return recs


def precompile_worker(spec: str) -> None:
    H, K, w, u, d = (int(v) for v in spec.split(":"))
    rig = Rig(quick=False, region=256 << 20)
    sh = shapes(False) | {"L": 4096}
    case = build(rig, sh, H, 2, 656, "20%") if K == 1 else build_k(rig, sh, K, "partial", H, 2, "20%")
    planner(case, case.state, torch.full((1,), 1000, dtype=torch.int64, device=rig.dev), None,
            {"warps": w, "UPTO": u, "D": d})()
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    plan_bench_args(ap)
    args = ap.parse_args()
    if args.precompile:
        return precompile_worker(args.precompile)
    t0, sh, iters = plan_bench_start(args)
    if torch.cuda.is_available() and not args.quick:
        specs = ([f"{H}:1:{v['warps']}:{v['UPTO']}:{v['D']}" for H in sh["Hs"] for v in variants(H, False)]
                 + [f"4096:8:{v['warps']}:50:0" for v in variants(4096, False, 8)])
        procs = []
        for sp in specs:  # at most 14 compiling at once (16 cores)
            while sum(p.poll() is None for p in procs) >= 14:
                time.sleep(0.5)
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--out", os.devnull,
                                           "--precompile", sp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in procs:
            p.wait()
        print(f"[{time.time() - t0:6.1f}s] {len(specs)} precompiled", flush=True)
    rig = Rig(quick=args.quick)
    flush = Flush(rig.dev, args.quick)
    rig.fill(656)
    recs = []
    for H in sh["Hs"]:
        recs += run_cases(rig, sh, flush, iters, ("0.1%", "20%", "all"), t0, H)
        if H == sh["Hs"][0]:
            for kind in ("shared", "partial", "disjoint"):
                recs += run_cases(rig, sh, flush, iters, ("0.1%", "20%"), t0, H, 2 if args.quick else 8, kind)
        doc = header("resolver_probe", "bench/resolver_probe.py", rig.cuda, t0, iters=iters, records=recs)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
