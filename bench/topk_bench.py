"""The indexer's top-k with its tie rule, two ways, at the indexer's shapes (issue 31: a verification
round's rows scale the indexer's top-k with its tokens; at 100K C47 the top-k and its sorts were about
half of the indexer's 19.9 ms a step).

    python3 bench/topk_bench.py --out $OUT/topk_bench_h200.json       # H200, ~1 min
    python3 bench/topk_bench.py --quick --out /tmp/topk_bench.json    # CPU smoke

`stable_topk` (the named baseline, what the indexer runs: two top-k passes and two sorts of k) against
`packed_topk` (one top-k over int64 (score, index) keys) and `lean_topk` (the two top-k passes, the
first unsorted, and one sort of packed keys), on [T, L] fp32 score rows shaped like the
lightning indexer's: a sum of ReLUs, so a share of exact zeros (`--zero-share`), the rest positive,
and each row's tail past its history at -inf (rows of one pass have different lengths). Every case
checks that all give the same picks and values; times are CUDA-event medians of `--iters` calls
(`resolver_timing.timeit`: the GPU spins while each call is enqueued) after a warm-up, the functions taking turns within each repeat and their order rotated between
repeats; ratios are each form / stable per repeat.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.resolver_timing import header, timeit  # noqa: E402
from dhisparse.bench import results as R  # noqa: E402
from dhisparse.core.topk import lean_topk, packed_topk, stable_topk  # noqa: E402

FNS = {"stable": stable_topk, "packed": packed_topk, "lean": lean_topk}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="20,47,100", help="T: rows a call (decode C20 / C47, a width-5 round at C20)")
    p.add_argument("--length", type=int, default=102400 + 16, help="L: the longest history of the pass")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--zero-share", type=float, default=0.3, help="share of exact-zero scores (every head's logit < 0)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/topk_bench.json")
    p.add_argument("--quick", action="store_true", help="CPU-sized: rows 3,5, length 700, top-k 64, 3 iterations")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.rows, ns.length, ns.topk, ns.iters, ns.repeats = "3,5", 700, 64, 3, 2
    ns.row_list = [int(x) for x in ns.rows.split(",")]
    if ns.topk > ns.length or min(ns.row_list) < 1:
        p.error("--topk must be at most --length and every --rows value at least 1")
    return ns


def scores(T: int, L: int, zero_share: float, dev: torch.device, seed: int = 0) -> torch.Tensor:
    """[T, L] fp32 indexer-like scores: |N(0, 1)| with `zero_share` exact zeros (some of them -0.0), each
    row's history 90-100% of L and -inf past it."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, L, generator=g).abs()
    x[torch.rand(T, L, generator=g) < zero_share] = 0.0
    cols = x[:, 1::7]
    x[:, 1::7] = torch.where(cols == 0, torch.full_like(cols, -0.0), cols)  # -0.0 among the zeros (w < 0 times 0)
    lens = (L * (0.9 + 0.1 * torch.rand(T, generator=g))).long().clamp(max=L)
    x[torch.arange(L)[None, :] >= lens[:, None]] = float("-inf")
    return x.to(dev)


def time_ms(fn, x: torch.Tensor, k: int, iters: int) -> list[float]:
    """Per-call ms of fn(x, k): `resolver_timing.timeit`'s device times on a GPU (the GPU spinning while
    the call is enqueued), wall times on the CPU."""
    return timeit(SimpleNamespace(cuda=x.is_cuda), lambda: fn(x, k), lambda: None, iters, 0)[0]


def one_case(T: int, ns, dev: torch.device) -> dict:
    x = scores(T, ns.length, ns.zero_share, dev)
    want = stable_topk(x, ns.topk)
    same = all(torch.equal(want[1], got[1]) and torch.equal(want[0], got[0])
               for got in (fn(x, ns.topk) for fn in FNS.values()))
    for fn in FNS.values():  # warm-up: allocator, kernels
        time_ms(fn, x, ns.topk, 3)
    med = {name: [] for name in FNS}
    for rep in range(ns.repeats):
        names = list(FNS)
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            t = sorted(time_ms(FNS[name], x, ns.topk, ns.iters))
            med[name].append(t[len(t) // 2])
    ratios = {f"{name}_over_stable": [t / b for t, b in zip(med[name], med["stable"])] for name in FNS if name != "stable"}
    return {"rows": T, "length": ns.length, "topk": ns.topk, "same_picks": bool(same), "median_ms": med, **ratios}


def main(argv=None) -> int:
    ns = parse(argv)
    t0 = time.time()
    cuda = torch.cuda.is_available() and not ns.quick
    dev = torch.device("cuda" if cuda else "cpu")
    cases = [one_case(T, ns, dev) for T in ns.row_list]
    for c in cases:
        ms = "  ".join(f"{n} {min(v):.3f}-{max(v):.3f} ms" for n, v in c["median_ms"].items())
        rs = "  ".join(f"{n} {min(c[f'{n}_over_stable']):.3f}-{max(c[f'{n}_over_stable']):.3f}" for n in FNS if n != "stable")
        print(f"[topk] T {c['rows']:4}  {ms}  ratios {rs}  same {c['same_picks']}", flush=True)
    doc = header("topk_bench", "bench/topk_bench.py", cuda, t0, baseline="stable_topk", cases=cases,
                 zero_share=ns.zero_share, iters=ns.iters, repeats=ns.repeats)
    R.write_json(doc, ns.out)
    print(f"[done] {ns.out}")
    return 0 if all(c["same_picks"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
