"""Does a request's copy plan need to be in host-address order? (issue 33)

The resolver plan sorts each request's misses by host location before pairing them with victims
(`kernels/resolver_ref.py` step 3), because a gather of random rows from a 4 GiB pinned region ran
at 25 GB/s against 44-47 GB/s sorted (docs/design.md §5; `resolver_bench.py`'s ceiling). That
ceiling is one request whose rows span the whole region. SGLang's HiSparse kernel copies a request's
misses in selection order and its copies ran as fast as ours (issue 33's table). The sort costs the
plan 4 us at 20% misses and 29 us when every row misses (`resolver_peer_s36_h200.json`'s phases).

This times `gather_rows_padded` (the resolver's copy kernel) on the same copy plan twice: each
request's rows in host-address order and in selection (random) order. Requests' host pages are
scattered over a pinned region of --region-gib, as a shared host pool interleaves pages of
concurrent requests; batch 8 / 32 / 100, 410 and 2,048 misses a request (20% and all of k 2,048),
rows of 656 and 1,152 B, the L2 flushed before each call, 20 timed calls, median. Both orders write the
same device rows in ascending order (the plan lists its victims in slot order), and each is checked to
copy host[src] to dev[dst] byte for byte (`copies_right`; copy_order_s38_h100.json predates the check).

    python3 bench/copy_order.py --out $OUT/copy_order_h200.json      # H200 (~1 min + pinning)
    python3 bench/copy_order.py --quick --out /tmp/copy_order.json   # CPU smoke (TRITON_INTERPRET)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.resolver_timing import header, stats, timeit  # noqa: E402  (first: sets TRITON_INTERPRET on CPU)
from bench.resolver_cases import Rig  # noqa: E402
from bench.resolver_peer import Flush  # noqa: E402
from dhisparse.kernels.gather import gather_rows_padded  # noqa: E402


def plan_rows(pages: int, ps: int, N: int, L: int, m: int, g: torch.Generator, dev) -> torch.Tensor:
    """src [N, m] host row indices: request n's history of L positions lives on L / ps host pages (ps rows
    each) drawn at random (without replacement across requests) from `pages`; its m misses are distinct
    random positions, in selection (random) order."""
    per = -(-L // ps)
    table = torch.randperm(pages, generator=g, device=dev)[: N * per].view(N, per)
    pos = torch.stack([torch.randperm(L, generator=g, device=dev)[:m] for _ in range(N)])
    return table.gather(1, pos // ps) * ps + pos % ps


def copies_right(host: torch.Tensor, dev_rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                 cnt: torch.Tensor) -> bool:
    """One copy of the plan (src, dst) [N, m] leaves dev_rows[dst] == host[src] byte for byte (checked
    against torch indexing)."""
    dev_rows.view(torch.uint8).fill_(0)
    gather_rows_padded(host, dev_rows, src, dst, cnt)
    hp, dp = host.shape[1], dev_rows.shape[1]
    s, d = src.flatten().cpu(), dst.flatten().to(dev_rows.device)
    want = host[s // hp, s % hp].to(dev_rows.device)
    return bool(torch.equal(dev_rows[d // dp, d % dp].view(torch.uint8), want.view(torch.uint8)))


def run(args) -> dict:
    rig = Rig(quick=False, region=int(args.region_gib * (1 << 30)))  # the pinned region and its row views (ps 64)
    flush = Flush(rig.dev, args.quick)
    recs = []
    for rb in args.row_bytes:
        host = rig.host_rows(rb)  # [HP, ps, W]
        hp, ps, W = host.shape
        for N in args.batches:
            for m in args.misses:
                src = plan_rows(hp, ps, N, args.history, m, rig.g, rig.dev)
                dst = torch.arange(N * m, device=rig.dev).view(N, m)
                dev_rows = torch.empty((-(-N * m // ps), ps, W), dtype=host.dtype, device=rig.dev)
                cnt = torch.full((N,), m, dtype=torch.int64, device=rig.dev)
                rec = {"row_bytes": rb, "batch": N, "misses": m, "bytes": N * m * rb}
                # both orders write the same device rows in ascending order, as the plan's victims are listed
                for order, s in (("host", src.sort(dim=1).values), ("selection", src)):
                    ts = timeit(rig, lambda s=s: gather_rows_padded(host, dev_rows, s, dst, cnt), flush,
                                args.iters, args.warmup)
                    rec[order] = stats(ts)
                    rec[order]["GBps"] = rec["bytes"] / rec[order]["time_ms"] / 1e6
                    rec[order]["copies_right"] = copies_right(host, dev_rows, s, dst, cnt)
                rec["selection_over_host"] = rec["selection"]["time_ms"] / rec["host"]["time_ms"]
                print(f"{rb} B  N {N:3d}  m {m:4d}: host order {rec['host']['time_ms'] * 1e3:8.1f} us "
                      f"({rec['host']['GBps']:.1f} GB/s), selection order {rec['selection']['time_ms'] * 1e3:8.1f} us "
                      f"({rec['selection']['GBps']:.1f} GB/s): {rec['selection_over_host']:.3f}x", flush=True)
                recs.append(rec)
    return {"region_bytes": rig.region.numel(), "host_page_rows": rig.ps, "history": args.history, "records": recs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke shapes")
    ap.add_argument("--region-gib", type=float, default=16.0, help="pinned host region the pages are drawn from")
    ap.add_argument("--history", type=int, default=32768, help="positions a request's history holds")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 100])
    ap.add_argument("--misses", type=int, nargs="+", default=[410, 2048])
    ap.add_argument("--row-bytes", type=int, nargs="+", default=[656, 1152])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.quick:
        args.region_gib, args.history, args.batches, args.misses, args.row_bytes = 1 / 64, 512, [2, 3], [5, 16], [656]
        args.iters, args.warmup = 2, 1
    t0 = time.time()
    body = run(args)
    doc = header("copy_order", "bench/copy_order.py", torch.cuda.is_available(), t0, **body)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
