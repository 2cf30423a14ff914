"""One issue-33 case, warmed, then a few plan calls to profile (for `ncu`, `compute-sanitizer`).

    ncu --clock-control none --kernel-name resolve_plan_kernel --launch-skip 5 --launch-count 1 --set full \
        --import-source yes -o $OUT/plan python3 bench/resolver_one_call.py --level 0.1% --batch 8
    python3 bench/resolver_one_call.py --quick      # CPU smoke (TRITON_INTERPRET)

Builds the case as bench/resolver_peer.py does (one top-k query a request, k 2,048, H 4,096 by default),
checks it against the reference, runs `--warmup` plan calls (compiling), then `--calls` more; the state
is restored before each call, so every call plans the same misses. The launches to profile are the
calls after the warm-up (ncu's --launch-skip counts the warm-up's plan launches: one a call).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.resolver_cases import Rig, check_case, index_case, state_restorer  # noqa: E402
from bench.resolver_peer import MISS, build, shapes  # noqa: E402
from dhisparse.kernels.resolver import PlanWorkspace, plan_triton  # noqa: E402
from dhisparse.kernels.resolver_ref import miss_order_for  # noqa: E402
from dhisparse.kv.hier.context import RESOLVER_LOOKUPS  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", default="0.1%", choices=tuple(MISS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hot", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--distinct", type=int, default=1, help="plan_triton(distinct=) (the engine's K 1 call)")
    ap.add_argument("--lookup", choices=RESOLVER_LOOKUPS, default="scan",
                    help="the state keeps a hot_entry index (the plan looks hits up: --resolver-lookup index)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    rig = Rig(quick=args.quick, region=0 if args.quick else 256 << 20)
    sh = shapes(args.quick)
    H = sh["Hs"][0] if args.quick else args.hot
    N = sh["batches"][0] if args.quick else args.batch
    rig.fill(656)
    case = build(rig, sh, H, N, 656, args.level)
    case = index_case(case) if args.lookup == "index" else case
    order = miss_order_for(case.sel.shape[0], case.sel.shape[1] * case.sel.shape[2], bool(args.distinct))
    ok = all(v for k, v in check_case(rig, case, distinct=bool(args.distinct), miss_order=order).items()
             if k not in ("case", "copies"))
    st = case.state
    restore = state_restorer(st)
    now = torch.full((1,), int(st.hot_stamp.max()) + 1, dtype=torch.int64, device=rig.dev)
    ws = PlanWorkspace(rig.dev)
    for _ in range(args.warmup + args.calls):
        restore()
        plan = plan_triton(case.sel, case.slots, st, now, defer=True, workspace=ws, distinct=bool(args.distinct),
                           miss_order=order)
    c = plan.materialize().counters
    print(f"{case.name}: checks {'pass' if ok else 'FAIL'}; {args.warmup} warm-up + {args.calls} calls; counters {c}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
