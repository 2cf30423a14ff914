"""Indexer scoring launch configurations against the shipped one, decode and verification passes.

    python3 bench/indexer_tune_bench.py --out $OUT/indexer_tune_h200.json   # GPU (~2 min, mostly compiles)
    python3 bench/indexer_tune_bench.py --quick --out /tmp/indexer_tune.json  # CPU smoke (interpreter)

One full indexer layer of glm5-faithful's shape (32 index heads x 128, FP8 132-B keys in a KVArena
page slot, as the engine stores them) scores --index-len keys per request for a decode pass (one
token for each of --decode-requests) and a verification pass (--width tokens for each of
--round-requests: the grouped kernel). Each configuration is (block_s keys a program, num_warps),
applied to both kernels. The shipped configuration (`kernels.indexer.BLOCK_S`, Triton's 4 warps) is
first and every ratio is against it, measured in the same run. (Session 46 also timed a grouped
kernel with one product for the whole group, since removed: indexer_tune_s46_h100.json.)

Exactness: a verification round must select what decoding selects, so every round configuration
reports `equal_to_decode`: its scores bit for bit against the per-token kernel's at the same
(block_s, num_warps) on the round's tokens, and `decode_equal_to_shipped`: the per-token kernel's
scores at this configuration against the shipped one's (a change of decode arithmetic is allowed
when decode and verification change together, but it is reported). On CUDA every time is the
median replay of a CUDA graph of --graph calls (as the engine replays its steps); L2 not flushed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--quick" in sys.argv:  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from dhisparse.bench import results as R  # noqa: E402
from bench.fp8_kernels import index_keys  # noqa: E402
from bench.kernel_bench import Timing, device_setup, ints, timed  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--decode-requests", type=int, default=20); a("--round-requests", type=int, default=18)
    a("--width", type=int, default=5, help="tokens a request scores in the round (drafts + 1)")
    a("--index-heads", type=int, default=32); a("--index-dim", type=int, default=128)
    a("--index-len", type=int, default=102400, help="keys per request")
    a("--block-s", default="64,128,256"); a("--warps", default="4,8")
    a("--key-layout", default="arena", choices=("arena", "contiguous"))
    a("--index-model", default="glm52-scaled", help="the arena's layer layout (--key-layout arena)")
    a("--index-slot", type=int, default=1); a("--page-size", type=int, default=64)
    a("--latent", type=int, default=512); a("--rope", type=int, default=64)
    a("--reps", type=int, default=15); a("--warmup", type=int, default=3); a("--graph", type=int, default=5)
    a("--quick", action="store_true", help="tiny shapes on CPU under the interpreter")
    a("--out", default="bench/results/indexer_tune.json")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.decode_requests, ns.round_requests, ns.width, ns.index_heads, ns.index_dim = 3, 2, 3, 4, 16
        ns.index_len, ns.block_s, ns.warps, ns.page_size = 96, "16,32", "4", 8
        ns.reps, ns.warmup, ns.graph = 2, 1, 1
    ns.argv = ["bench/indexer_tune_bench.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def configs(ns) -> list[tuple[int, int]]:
    """(block_s, num_warps; 0: Triton's default, 4): the shipped configuration first, then every
    swept one that differs from it."""
    from dhisparse.kernels.indexer import BLOCK_S

    out = [(BLOCK_S, 0)]
    for bs, nw in itertools.product(ints(ns.block_s), ints(ns.warps)):
        c = (bs, 0 if (bs, nw) == (BLOCK_S, 4) else nw)
        if c not in out:
            out.append(c)
    return out


def main(argv=None) -> int:
    from dhisparse.core.batch import IndexTable
    from dhisparse.kernels.indexer import indexer_scores_triton

    ns = parse(argv)
    cuda, dev, dtype, g, gpu = device_setup(ns.quick)
    D, H, L, K = ns.index_dim, ns.index_heads, ns.index_len, ns.width
    n = max(ns.decode_requests, ns.round_requests)
    keys = torch.randn(n * L, D, generator=g).to(dev)
    rows, sc, fmt = index_keys(ns, "fp8_e4m3", keys, dev, dtype)
    table = IndexTable(rows, torch.arange(n * L, device=dev).view(n, L), torch.full((n,), L, device=dev), fmt, sc)
    passes = {}
    for name, reqs, width in (("decode", ns.decode_requests, 1), ("round", ns.round_requests, K)):
        T = reqs * width
        q = torch.randn(T, H, D, generator=g).to(dev, dtype)
        w = (torch.randn(T, H, generator=g) * H**-0.5).to(dev, dtype)
        req = torch.arange(reqs, device=dev).repeat_interleave(width)
        pos = (L - width + torch.arange(width, device=dev)).repeat(reqs)  # the round's last token sees every key
        passes[name] = (q, w, pos, req)
    tm, runs, base = Timing(ns.warmup, ns.reps, ns.graph), [], {}
    shipped_decode = indexer_scores_triton(*passes["decode"], table)
    for bs, nw in configs(ns):
        opts = {"block_s": bs, "num_warps": nw or None}
        q, w, pos, req = passes["round"]
        decode_fn = lambda: indexer_scores_triton(*passes["decode"], table, **opts)  # noqa: E731
        round_fn = lambda: indexer_scores_triton(q, w, pos, req, table, group=K, **opts)  # noqa: E731
        per_token = indexer_scores_triton(q, w, pos, req, table, **opts)
        row = {"block_s": bs, "num_warps": nw or 4,
               "equal_to_decode": bool(torch.equal(round_fn(), per_token)),
               "decode_equal_to_shipped": bool(torch.equal(decode_fn(), shipped_decode)),
               "decode_ms": timed(decode_fn, tm, cuda), "round_ms": timed(round_fn, tm, cuda)}
        base = base or row
        row |= {"decode_over_shipped": row["decode_ms"] / base["decode_ms"],
                "round_over_shipped": row["round_ms"] / base["round_ms"]}
        runs.append(row)
        print(f"block_s {bs:4d} warps {nw or 4}  decode {row['decode_ms'] * 1e3:8.1f} us "
              f"x{row['decode_over_shipped']:.3f}  round {row['round_ms'] * 1e3:8.1f} us x{row['round_over_shipped']:.3f}  "
              f"round==decode {row['equal_to_decode']}  decode==shipped {row['decode_equal_to_shipped']}", flush=True)
    notes = ["ratios against the shipped configuration (kernels.indexer.BLOCK_S, 4 warps) in the same run",
             "equal_to_decode: the round's scores bit for bit equal to the per-token kernel's at the same "
             "block_s / num_warps (a configuration is usable only where it holds)",
             "CUDA times: median graph replay / calls per graph; L2 not flushed"]
    R.write_bench("indexer_tune", ns, runs, notes, gpu=gpu, dtype=str(dtype), key_bytes=fmt.width if fmt else D * 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
