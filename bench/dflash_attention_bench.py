"""The DFlash drafter's attention for 16-bit inputs: the fused form against the upcast one, one layer.

    python3 bench/dflash_attention_bench.py --out $OUT/dflash_attention_h200.json   # GPU (~20 s)
    python3 bench/dflash_attention_bench.py --quick --out /tmp/dflash_attention.json  # CPU smoke

`upcast_grouped` (the named baseline: the form before session 46, K/V upcast to fp32 once per K/V
head, fp32 GEMMs, softmax, NaN pass) against `fused_grouped` (one scaled_dot_product_attention in
bf16), on the paper's GLM-5 DFlash2 layer shape (48 query heads over 4 K/V heads of 128, a block of
16, a 2,048-row context window) for --requests requests, each with a random share of its window
not yet written (the mask of `attention_mask`). Both forms get the same inputs; each row reports the
median of --reps timed calls (CUDA events, after --warmup), fused / upcast measured in the same run,
and the largest difference between the two outputs (bf16 rounding of the probabilities).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.kernel_bench import Timing, ints, timed  # noqa: E402
from dhisparse.bench import results as R  # noqa: E402
from dhisparse.spec.dflash_model import attention_mask, fused_grouped, upcast_grouped  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--requests", default="20,47"); a("--block", type=int, default=16); a("--window", type=int, default=2048)
    a("--heads", type=int, default=48); a("--kv-heads", type=int, default=4); a("--head-dim", type=int, default=128)
    a("--reps", type=int, default=20); a("--warmup", type=int, default=3)
    a("--quick", action="store_true", help="tiny shapes on the CPU")
    a("--out", default="bench/results/dflash_attention.json")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.requests, ns.block, ns.window, ns.heads, ns.kv_heads, ns.head_dim, ns.reps, ns.warmup = "2", 4, 32, 6, 2, 8, 2, 1
    ns.argv = ["bench/dflash_attention_bench.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def inputs(ns, n: int, dev: str, g: torch.Generator):
    """(q, ctx_k, ctx_v, k_blk, v_blk, visible) of one layer for n requests in bf16."""
    b, L, hq, kvh, d = ns.block, ns.window, ns.heads, ns.kv_heads, ns.head_dim
    r = lambda *s: torch.randn(*s, generator=g).to(dev, torch.bfloat16)  # noqa: E731
    written = torch.randint(L // 2, L + 1, (n, 1), generator=g)  # context rows written so far
    valid = torch.cat([torch.arange(L)[None] < written, torch.ones(n, b, dtype=torch.bool)], 1)
    q_pos = L + torch.arange(b)[None].expand(n, -1)
    k_pos = torch.arange(L + b)[None].expand(n, -1)
    visible = attention_mask(q_pos, k_pos, valid, None, False).to(dev)
    return r(n, b, hq, d), r(n, L, kvh, d), r(n, L, kvh, d), r(n, b, kvh, d), r(n, b, kvh, d), visible


def main(argv=None) -> int:
    ns = parse(argv)
    cuda = torch.cuda.is_available() and not ns.quick
    dev = "cuda" if cuda else "cpu"
    g = torch.Generator().manual_seed(0)
    tm, runs = Timing(ns.warmup, ns.reps, 0), []  # graph 0: CUDA events around each call
    for n in ints(ns.requests):
        args = inputs(ns, n, dev, g)
        up, fu = upcast_grouped(*args), fused_grouped(*args)
        row = {"requests": n, "upcast_ms": timed(lambda: upcast_grouped(*args), tm, cuda),
               "fused_ms": timed(lambda: fused_grouped(*args), tm, cuda),
               "max_abs_diff": float((fu.float() - up).abs().max())}
        row["fused_over_upcast"] = row["fused_ms"] / row["upcast_ms"]
        runs.append(row)
        print(f"N {n:3d}  upcast {row['upcast_ms']:7.3f} ms  fused {row['fused_ms']:7.3f} ms  "
              f"x{row['fused_over_upcast']:.3f}  max diff {row['max_abs_diff']:.2e}", flush=True)
    notes = ["one drafter layer's attention; fused_over_upcast < 1: the fused form is faster (same run, same inputs)",
             "a round runs it once per drafter layer (6 at the paper's shape)"]
    R.write_bench("dflash_attention", ns, runs, notes, device=torch.cuda.get_device_name() if cuda else "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
