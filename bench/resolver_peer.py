"""Issue 33's resolver cases: ours against the figures of SGLang's HiSparse kernel, under one timing method.

    python3 bench/resolver_peer.py --out $OUT/resolver_peer.json            # H200, ~4 min with a cold cache
    python3 bench/resolver_peer.py --quick --out /tmp/resolver_peer.json    # CPU smoke (TRITON_INTERPRET)

Cases (the issue's, SGLang's own benchmark shapes): one query per request (K = 1), top-k 2,048, hot cache
H = 4,096 and 8,192, batch 8 / 32 / 100, rows of 656 and 1,152 B, and three miss levels: 0.1% of the
selection misses (2 rows), 20% (410 rows), and every row (a full hot cache holding none of the
selection). Each selection is one top-k (distinct positions), so ours is called with distinct=True, as
the engine's decode step calls it (kv/hier/context.py). Per case: plan + copy (`plan_triton(defer=True,
workspace=ws)` + `launch_copies`, the engine's no-sync path with a store's persistent scratch), plan and
copy fused in one launch (`plan_triton(copy=...)`, the engine's `--resolver-copy fused`), plan alone
(also without the workspace: scratch allocated and zero-filled per call), and the host time to enqueue a
call (Python and launches, outside CUDA graphs). The L2 is flushed (a 256-MiB write) and the hot-cache
state restored before every timed call, untimed; 20 timed calls, median; device times with the GPU spinning
while the CPU enqueues (bench/resolver_timing.py).

Every case also runs on a copy of its state that keeps the hot_entry index (`--resolver-lookup index`:
the plan looks each selected row's hot entry up instead of scanning the hot cache; `index_case`): its
plan + copy, fused plan + copy and plan alone are recorded under `index`, checked bit for bit too.

`--phases` adds the plan kernel stopped after each of its phases (P1 entries: claims, representatives
and direct rows; P3 hot scan; P4 misses, by parts; `plan_triton(upto_phase=...)`, profiling only) at H = 4,096,
656-B rows, every batch and miss level: the differences are what each phase costs.

The peer's figures are the issue's (SGLang 0.5.23's `load_cache_to_device_buffer_kernel`, measured on one
H200 with the same inputs; `PEER_US`); the peer is not run here (its source is not vendored). Each case is
checked bit for bit against `plan_reference` first (bench/resolver_cases.py's `check_case`).
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

from bench.resolver_cases import Case, Rig, case_order, check_case, index_case, state_restorer  # noqa: E402
from bench.resolver_timing import header, stats, timeit  # noqa: E402
from dhisparse.kernels.gather import row_copy  # noqa: E402
import dhisparse.kernels.resolver as kr  # noqa: E402
from dhisparse.kernels.resolver import PHASE_STOPS, PlanWorkspace, launch_copies, plan_triton  # noqa: E402
from dhisparse.kernels.resolver_ref import MISS_ORDERS  # noqa: E402

# issue 33's table (H 4,096): (miss level, batch, row bytes) -> (peer us, ours us at filing)
PEER_US = {("0.1%", 8, 656): (17.7, 50.2), ("0.1%", 32, 656): (18.7, 51.8), ("0.1%", 100, 656): (20.1, 60.1),
           ("20%", 8, 656): (77.5, 99.7), ("20%", 32, 656): (199.5, 236.5), ("20%", 8, 1152): (91.4, 127.8),
           ("all", 8, 1152): (387.6, 460.2), ("all", 100, 656): (2875.0, 2952.0)}
PEER_PLAN_US = {4096: (14.0, 16.0), 8192: (21.0, 24.0)}  # the peer's plan alone (copy compiled out), any misses
MISS = {"0.1%": 0.001, "20%": 0.2, "all": 1.0}
PHASES = PHASE_STOPS  # plan_triton(upto_phase=) stops


def shapes(quick: bool) -> dict:
    if quick:
        return {"k": 16, "Hs": (32, 64), "batches": (2, 3), "L": 256, "row_bytes": (656,)}
    return {"k": 2048, "Hs": (4096, 8192), "batches": (8, 32, 100), "L": 32768, "row_bytes": (656, 1152)}


def build(rig: Rig, sh: dict, H: int, N: int, rb: int, level: str) -> Case:
    """One case: N requests, H hot slots warmed so that `level` of each selection misses."""
    sel = rig.selection("shared", 1, sh["L"], N=N, k=sh["k"])
    rows = N * (H + rig.TT)
    st = rig.state(rb, sh["L"], N=N, B=H, rows=rows)
    rig.warm(st, sel, MISS[level], sh["L"])
    return Case(case_name(H, N, rb, level), rb, st, sel, torch.arange(N, device=rig.dev), sh["L"],
                {"miss_level": level, "batch": N, "H": H}, rows)


class Flush:
    """A 256-MiB buffer written before every timed call: no case reads a warm L2 (H200: 50 MiB)."""

    def __init__(self, dev: torch.device, quick: bool):
        self.buf = torch.empty((1 << 20) if quick else (256 << 20), dtype=torch.uint8, device=dev)

    def __call__(self) -> None:
        self.buf.fill_(1)


def time_case(rig: Rig, case: Case, flush: Flush, iters: int, warmup: int, upto: tuple[int, ...] = (),
              host_n: int = 30) -> dict:
    """plan + copy, plan alone, plan stopped after each phase in `upto`, and the host split."""
    st = case.state
    now = torch.full((1,), int(st.hot_stamp.max()) + 1, dtype=torch.int64, device=rig.dev)  # a device scalar, as
    host, dev = rig.host_rows(case.rb), rig.dev_rows(case.rb, case.dev_rows)               # the engine's now_t

    restore = state_restorer(st, flush)
    ws = PlanWorkspace(rig.dev)  # the engine's path: a store's persistent scratch

    order = case_order(case)  # the engine's miss order for the shape

    def plan(u: int = 50, workspace: PlanWorkspace | None = ws):
        return plan_triton(case.sel, case.slots, st, now, defer=True, upto_phase=u, workspace=workspace,
                           distinct=True, miss_order=order)

    restore()
    c = plan().materialize().counters
    rec = {"case": case.name, "row_bytes": case.rb, "N": case.sel.shape[0], "k": case.sel.shape[2],
           "H": st.hot_pos.shape[1], "history": case.history, "miss_rows": c.host, "counters": c._asdict(),
           "miss_order": order, **case.meta}
    rec["plan_copy"] = stats(timeit(rig, lambda: launch_copies(plan(), host, dev), restore, iters, warmup))
    fused = row_copy(host, dev)  # prepared once, as a store's producer target is
    rec["plan_copy_fused"] = stats(timeit(rig, lambda: plan_triton(case.sel, case.slots, st, now, defer=True,
                                                                   workspace=ws, distinct=True, copy=fused,
                                                                   miss_order=order),
                                          restore, iters, warmup))
    rec["plan_only"] = stats(timeit(rig, plan, restore, iters, warmup))
    rec["plan_only_no_workspace"] = stats(timeit(rig, lambda: plan(50, None), restore, iters, warmup))
    rec["phases"] = {PHASES[u]: stats(timeit(rig, lambda u=u: plan(u), restore, iters, warmup)) for u in upto}
    rec["host_split_us"] = host_split(rig, plan, restore, ws, host_n)
    restore()
    return rec


def host_split(rig: Rig, plan, restore, ws: PlanWorkspace, n: int = 30) -> dict:
    """Median host microseconds of one plan call, split: the whole call (with the workspace: its bound
    launches after the first call, as a store's repeat calls); its Python alone (the compiled launcher
    replaced by a no-op: kernels/launch.py `_run`); one plan-kernel launch through the held compiled
    handle's launcher (`_run`: the raw launcher on the call's values) and through the JIT's dispatch,
    with the same arguments; the whole call without the bound launches (each call marshals every
    argument through `CompiledLaunch`, as before session 37); and the whole call and its Python with the
    workspace's kept output blocks (`PlanWorkspace.reuse_outputs`: no output allocation or views)."""
    import dhisparse.kernels.launch as kl

    def med(fn) -> float:
        ts = []
        for _ in range(n):
            restore()
            if rig.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return sorted(ts)[n // 2]

    plan()  # binds (the workspace's held launches)
    out = {"call": med(plan)}
    real_run, got = kl._run, {}
    kl._run = lambda k, grid, stream, vals: got.update(run=(k, grid, stream, list(vals)))
    try:
        out["python"] = med(plan)
    finally:
        kl._run = real_run
    if "run" in got:  # (under TRITON_INTERPRET nothing reaches a compiled launcher)
        k, grid, stream, vals = got["run"]  # the plan kernel's (launched last)
        out["launch_compiled"] = med(lambda: real_run(k, grid, stream, vals))

    class Record:  # the plan kernel's (grid, args, consts, warps), through the unbound path
        def __call__(self, *call):
            got["call"] = call

        def bind(self, *a, **kw):
            return None

    bound, real = ws.launches, (kr._PLAN, kr._PRE)
    saved = dict(bound)
    bound.clear()
    kr._PLAN, kr._PRE = Record(), (lambda *a: None)
    try:
        plan()
    finally:
        kr._PLAN, kr._PRE = real
    grid, args, consts, warps = got["call"]
    out["launch_jit"] = med(lambda: kr.resolve_plan_kernel[grid](*args, **consts, num_warps=warps))
    unbound = kr.CompiledLaunch.bind
    kr.CompiledLaunch.bind = lambda *a, **kw: None
    try:
        out["call_unbound"] = med(plan)
    finally:
        kr.CompiledLaunch.bind = unbound
        bound.update(saved)
    was, ws.reuse_outputs = ws.reuse_outputs, True  # kept output blocks (DHISPARSE_PLAN_OUTPUT_REUSE's experiment)
    try:
        plan()  # makes the block the timed calls reuse (each call's plan is dropped before the next)
        out["call_reuse"] = med(plan)
        kl._run = lambda k, grid, stream, vals: None
        out["python_reuse"] = med(plan)
    finally:
        kl._run, ws.reuse_outputs = real_run, was
    if rig.cuda:
        torch.cuda.synchronize()
    return out


def compare(rec: dict) -> dict | None:
    """Ours / peer for a case in the issue's table (plan + copy) and for plan alone; with an `index`
    record (the hot_entry lookup), the same for it."""
    out = {}
    key = (rec["miss_level"], rec["batch"], rec["row_bytes"])
    us = rec["plan_copy"]["time_ms"] * 1e3
    fused = rec["plan_copy_fused"]["time_ms"] * 1e3
    ix = rec.get("index")
    if rec["H"] == 4096 and key in PEER_US:
        peer, filed = PEER_US[key]
        out |= {"peer_us": peer, "ours_at_filing_us": filed, "ours_us": us, "ours_over_peer": us / peer,
                "ours_fused_us": fused, "ours_fused_over_peer": fused / peer}
        if ix:
            out |= {"ours_index_us": ix["plan_copy"]["time_ms"] * 1e3,
                    "ours_index_over_peer": ix["plan_copy"]["time_ms"] * 1e3 / peer,
                    "ours_index_fused_over_peer": ix["plan_copy_fused"]["time_ms"] * 1e3 / peer}
    lo, hi = PEER_PLAN_US.get(rec["H"], (None, None))
    if lo:
        p = rec["plan_only"]["time_ms"] * 1e3
        out |= {"peer_plan_us": [lo, hi], "ours_plan_us": p, "ours_plan_over_peer_high": p / hi}
        if ix:
            pi = ix["plan_only"]["time_ms"] * 1e3
            out |= {"ours_index_plan_us": pi, "ours_index_plan_over_peer_high": pi / hi}
    return out or None


def precompile_specs(sh: dict, phases: bool) -> list[str]:
    """"H:phase:index" of every plan-kernel specialization the timed cases use (`parse_spec` reads one)."""
    jobs = [(H, 50, i) for H in sh["Hs"] for i in (0, 1)]
    jobs += [(sh["Hs"][0], u, i) for u in PHASES for i in (0, 1)] if phases else []
    return [f"{H}:{u}:{i}" for H, u, i in jobs]


def parse_spec(spec: str) -> tuple[int, int, bool]:
    """(H, phase stop, index) of a `precompile_specs` entry."""
    H, u, index = (int(x) for x in spec.split(":"))
    return H, u, bool(index)


def precompile(args, sh: dict) -> list:
    """CUDA: one worker per plan-kernel specialization compiling into Triton's disk cache."""
    if args.quick or not torch.cuda.is_available():
        return []
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--out", os.devnull, "--precompile", spec],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for spec in precompile_specs(sh, args.phases)]


def precompile_worker(spec: str) -> None:
    H, u, index = parse_spec(spec)
    rig = Rig(quick=False, region=256 << 20)
    sh = shapes(False) | {"L": 2048}
    case = build(rig, sh, H, 2, 656, "20%")
    case = index_case(case) if index else case
    for o in MISS_ORDERS:  # batch 8 plans in selection order, larger batches in host order (`case_order`)
        plan_triton(case.sel, case.slots, case.state, 1000, defer=True, upto_phase=u, distinct=True, miss_order=o)
        launch_copies(plan_triton(case.sel, case.slots, case.state, 1001, defer=True, distinct=True, miss_order=o),
                      rig.host_rows(656), rig.dev_rows(656, case.dev_rows))
        if u == 50:  # the fused plan + copy of each row size (its own specializations)
            for i, rb in enumerate(sh["row_bytes"]):
                plan_triton(case.sel, case.slots, case.state, 1002 + i, defer=True, distinct=True, miss_order=o,
                            copy=(rig.host_rows(rb), rig.dev_rows(rb, case.dev_rows)))
    torch.cuda.synchronize()


def plan_bench_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the plan benchmarks (this file, resolver_probe.py): --out, --quick, --iters, and
    the hidden --precompile SPEC of their compile workers (one plan-kernel specialization each)."""
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes for the CPU interpreter")
    ap.add_argument("--iters", type=int, default=0, help="timed calls per measurement (default 20; quick 2)")
    ap.add_argument("--precompile", default=None, help=argparse.SUPPRESS)


def plan_bench_start(args) -> tuple[float, dict, int]:
    """A plan benchmark's start time, shapes and timed calls per measurement (`plan_bench_args`)."""
    return time.time(), shapes(args.quick), args.iters or (2 if args.quick else 20)


def start_rig(args, sh: dict, t0: float) -> tuple[Rig, Flush]:
    """The rig (pinned region filled for every row size) and the L2 flush, with the plan kernel's
    specializations compiled meanwhile by worker processes (`precompile`)."""
    workers = precompile(args, sh)
    rig = Rig(quick=args.quick)
    flush = Flush(rig.dev, args.quick)
    for rb in sh["row_bytes"]:
        rig.fill(rb)
    for w in workers:
        w.wait()
    print(f"[{time.time() - t0:6.1f}s] {len(workers)} precompile workers done", flush=True)
    return rig, flush


def case_name(H: int, N: int, rb: int, level: str) -> str:
    """A case's name, e.g. 20%_N8_H4096_1152B (`build`; resolver_peer_live.py's --cases matches it)."""
    return f"{level}_N{N}_H{H}_{rb}B"


def case_grid(sh: dict):
    """(H, batch, row bytes, miss level) of every case, in run order."""
    for H in sh["Hs"]:
        for N in sh["batches"]:
            for rb in sh["row_bytes"]:
                for level in MISS:
                    yield H, N, rb, level


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    plan_bench_args(ap)
    ap.add_argument("--phases", action="store_true", help="also time the plan stopped after each phase (H 4,096, 656 B)")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if args.precompile:
        return precompile_worker(args.precompile)
    t0, sh, iters = plan_bench_start(args)
    rig, flush = start_rig(args, sh, t0)
    records, checks = [], []
    for H, N, rb, level in case_grid(sh):
        case = build(rig, sh, H, N, rb, level)
        icase = index_case(case)  # the same inputs, hits looked up through hot_entry
        if N == sh["batches"][0]:
            checks += [check_case(rig, c, distinct=True, miss_order=case_order(c)) for c in (case, icase)]
        upto = tuple(PHASES) if args.phases and H == sh["Hs"][0] and rb == 656 else ()
        rec = time_case(rig, case, flush, iters, args.warmup, upto)
        irec = time_case(rig, icase, flush, iters, args.warmup, upto)
        rec["index"] = {k: irec[k] for k in ("plan_copy", "plan_copy_fused", "plan_only", "phases",
                                             "host_split_us", "counters")}
        rec["vs_peer"] = compare(rec)
        records.append(rec)
        print(f"[{time.time() - t0:6.1f}s] {case.name}: plan+copy {rec['plan_copy']['time_ms'] * 1e3:7.1f} us"
              f"  fused {rec['plan_copy_fused']['time_ms'] * 1e3:7.1f} us"
              f"  plan {rec['plan_only']['time_ms'] * 1e3:6.1f} us  host {rec['plan_only']['host_enqueue_ms'] * 1e3:5.0f} us"
              f" (no ws {rec['plan_only_no_workspace']['time_ms'] * 1e3:.1f} / {rec['plan_only_no_workspace']['host_enqueue_ms'] * 1e3:.0f})"
              + "".join(f"  {p[:2]} {v['time_ms'] * 1e3:.1f}" for p, v in rec["phases"].items())
              + "  host split " + " / ".join(f"{k} {v:.0f}" for k, v in rec["host_split_us"].items())
              + f"\n        index: plan+copy {irec['plan_copy']['time_ms'] * 1e3:7.1f} us"
              f"  fused {irec['plan_copy_fused']['time_ms'] * 1e3:7.1f} us"
              f"  plan {irec['plan_only']['time_ms'] * 1e3:6.1f} us"
              + "".join(f"  {p[:2]} {v['time_ms'] * 1e3:.1f}" for p, v in irec["phases"].items()), flush=True)
        del case, icase
        write(args.out, rig, sh, iters, checks, records, t0)
    ok = write(args.out, rig, sh, iters, checks, records, t0)
    print(f"checks {'pass' if ok else 'FAIL'}; wrote {args.out} in {time.time() - t0:.0f} s")


def write(out: str, rig: Rig, sh: dict, iters: int, checks: list, records: list, t0: float) -> bool:
    """The JSON so far (rewritten after every case: a call cut short keeps what it measured)."""
    ok = all(all(v for k, v in c.items() if k not in ("case", "copies")) for c in checks)
    doc = header("resolver_peer", "bench/resolver_peer.py", rig.cuda, t0, shapes=sh, iters=iters,
                 peer_source="issue 33 (SGLang 0.5.23 load_cache_to_device_buffer_kernel on one H200, same inputs)",
                 checks_pass=ok, checks=checks, records=records)
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return ok


if __name__ == "__main__":
    main()
