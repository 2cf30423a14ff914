"""What one program's Triton primitives cost on this GPU: the building blocks of the resolver's plan kernel.

    python3 bench/triton_prims.py --out $OUT/triton_prims.json          # H200, ~1 min
    python3 bench/triton_prims.py --quick --out /tmp/triton_prims.json  # CPU smoke (TRITON_INTERPRET)

Each op runs R times in a dependent chain inside one program per request (grid N = 8, 16 warps), over a
register tensor of S elements; the per-op cost is (time at R = 9 - time at R = 1) / 8, device time with
the L2 flushed before each call (as bench/resolver_peer.py), 20 calls, median. Ops: cumsum, sum, min,
debug_barrier, a dependent gather from global memory (a 64-KiB table, L2 after the first touch), a
gather through `tl.gather` (register tensor, shared memory), a sort of S, and a vector atomic_add on one
address with A lanes active.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402  (after TRITON_INTERPRET is set)
import triton.language as tl  # noqa: E402

from bench.resolver_cases import Rig  # noqa: E402
from bench.resolver_peer import Flush  # noqa: E402
from bench.resolver_timing import header, stats, timeit  # noqa: E402

OPS = ("cumsum", "sum", "min", "barrier", "gather_global", "gather_reg", "sort", "atomic")


@triton.jit
def _prim(x_ptr, t_ptr, c_ptr, y_ptr, TMASK, A, OP: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
          WIDE: tl.constexpr):
    n = tl.program_id(0)
    i = tl.arange(0, S)
    v = tl.load(x_ptr + n * S + i)
    if WIDE:
        v = v.to(tl.int64)
    for _ in tl.static_range(R):
        if OP == 0:
            v = tl.cumsum(v, axis=0) & 1023
        elif OP == 1:
            v = v + (tl.sum(v, axis=0) & 7)
        elif OP == 2:
            v = v + (tl.min(v, axis=0) & 7)
        elif OP == 3:
            tl.debug_barrier()
            v = v + 1
        elif OP == 4:
            v = tl.load(t_ptr + (v & TMASK)).to(v.dtype)
        elif OP == 5:
            v = tl.gather(v, (v & (S - 1)).to(tl.int32), axis=0)
        elif OP == 6:
            v = tl.sort(v)
        else:
            v = v + tl.atomic_add(c_ptr + n + i * 0, 1, mask=i < A, sem="relaxed").to(v.dtype)
    tl.store(y_ptr + n * S + i, v.to(tl.int32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    rig = Rig(quick=args.quick, region=1 << 20)
    dev, N = rig.dev, 8
    flush = Flush(dev, args.quick)
    iters = 2 if args.quick else 20
    sizes = (64,) if args.quick else (2048, 4096)
    tmask = (1 << 15) - 1
    tab = torch.randint(0, 1 << 20, (tmask + 1,), dtype=torch.int32, device=dev)
    cnt = torch.zeros(N, dtype=torch.int32, device=dev)
    recs = []
    for S in sizes:
        x = torch.randint(0, 1 << 20, (N, S), dtype=torch.int32, device=dev)
        y = torch.empty_like(x)
        for op_i, op in enumerate(OPS):
            for wide in (0, 1):
                if op in ("gather_reg", "sort", "atomic", "barrier") and wide:
                    continue
                for A in ((2, 32, 512) if op == "atomic" else (0,)):
                    if op == "atomic" and A > S:
                        continue
                    t = {}
                    try:
                        for R in ((1, 2) if args.quick else (1, 9)):
                            fn = lambda R=R: _prim[(N,)](x, tab, cnt, y, tmask, A, OP=op_i, R=R, S=S,  # noqa: E731
                                                         WIDE=wide, num_warps=4 if args.quick else 16)
                            t[R] = stats(timeit(rig, fn, flush, iters, 3))
                    except Exception as e:  # noqa: BLE001  (an op this Triton cannot build at S: recorded)
                        recs.append({"op": op, "S": S, "int64": bool(wide), "lanes": A, "error": repr(e)[:300]})
                        print(f"{op} S {S}: {e!r:.200}", flush=True)
                        continue
                    hi = max(t)
                    per = (t[hi]["time_ms"] - t[1]["time_ms"]) / (hi - 1) * 1e3
                    rec = {"op": op, "S": S, "int64": bool(wide), "lanes": A, "us_per_op": per,
                           "r1_us": t[1]["time_ms"] * 1e3, f"r{hi}_us": t[hi]["time_ms"] * 1e3}
                    recs.append(rec)
                    print(f"[{time.time() - t0:5.1f}s] {op:13s} S {S:5d} {'i64' if wide else 'i32'} A {A:3d}: "
                          f"{per:6.2f} us/op  (R1 {rec['r1_us']:.1f}, R{hi} {rec[f'r{hi}_us']:.1f})", flush=True)
    doc = header("triton_prims", "bench/triton_prims.py", rig.cuda, t0, grid=N, num_warps=16, iters=iters,
                 records=recs)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
