"""Sparse-MLA attention launch configurations against the shipped default plan, one layer.

    python3 bench/mla_tune_bench.py --out $OUT/mla_tune_h200.json      # H200 (~2 min, mostly compiles)
    python3 bench/mla_tune_bench.py --quick --out /tmp/mla_tune.json    # CPU smoke (interpreter)

For each pass size T (a decode pass has one token per request, a verification pass K per request)
and each configuration (block_h, split_rows, block_k, num_warps, num_stages, and for FP8 rows the
scale path) one layer's attention at the scaled GLM's shape (16 heads, latent 512 + rope 64, k = 512
random locations in a paged row space; --heads 64 --topk 2048 --kv-cache-dtype fp8_e4m3 is
glm5-faithful's) is timed. On CUDA, --graph launches are captured in one CUDA graph and replayed (the engine replays
its steps from graphs, so Python launch cost is not part of the kernel's time); the time is the
median replay over --reps, divided by --graph. Every row reports the ratio against the default plan
(`plan_sparse_mla(H, C, R)`, first in the list) measured in the same run at the same T, and the
largest difference from that plan's output.
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

from bench.kernel_bench import Timing, device_setup, ints, timed  # noqa: E402
from dhisparse.bench import results as R  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--tokens", default="18,36,72,144", help="pass sizes T")
    a("--splits", default="0,64,128", help="split_rows values (0 = one program walks all k)")
    a("--block-k", default="16,32,64"); a("--warps", default="4,8"); a("--stages", default="1,2,3")
    a("--block-h", default="", help="head blocks to sweep (default: the plan's own only)")
    a("--kv-cache-dtype", default="auto", help="auto: plain model-dtype rows; fp8_e4m3: the 656-B FlashMLA rows")
    a("--scales", default="", help="FP8 scale paths to sweep (gather,reshape,select,fold; default: the shipped one)")
    a("--heads", type=int, default=16); a("--latent", type=int, default=512); a("--rope", type=int, default=64)
    a("--topk", type=int, default=512); a("--pages", type=int, default=4096); a("--page-size", type=int, default=64)
    a("--reps", type=int, default=20); a("--warmup", type=int, default=3); a("--graph", type=int, default=20)
    a("--quick", action="store_true", help="tiny shapes on CPU under the interpreter")
    a("--out", default="bench/results/mla_tune.json")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.tokens, ns.splits, ns.block_k, ns.warps, ns.stages = "2,3", "0,16", "16", "4", "2"
        ns.heads, ns.latent, ns.rope, ns.topk = 4, 32, 8, 40
        ns.pages, ns.page_size, ns.reps, ns.warmup, ns.graph = 8, 4, 2, 1, 1
    ns.argv = ["bench/mla_tune_bench.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def plans(H: int, C: int, R: int, splits: list[int], block_ks: list[int], warps: list[int], stages: list[int],
          block_hs: list[int] | None = None, dtype: torch.dtype | None = None):
    """The default plan for (H, C, R) and query dtype first, then every swept configuration that
    differs from it (block_hs empty: the default plan's head block only)."""
    from dhisparse.kernels.sparse_mla import plan_sparse_mla

    default = plan_sparse_mla(H, C, R, dtype=dtype)
    out = [default]
    for bh, n, bk, nw, st in itertools.product(block_hs or [default.block_h], splits, block_ks, warps, stages):
        if n and n % bk:
            continue
        plan = plan_sparse_mla(H, C, R, block_h=bh, block_k=bk, num_warps=nw, num_stages=st, split_rows=n)
        if plan not in out:
            out.append(plan)
    return out


def row_space(ns, dev: str, dtype: torch.dtype, g: torch.Generator):
    """(rows [pages, page_size, W], fmt): plain C + R model-dtype values, or FP8 rows of the
    656-B layout (core/kvformat.py) encoded from the same random values."""
    from dhisparse.core.kvformat import KVFormats

    C, Rr = ns.latent, ns.rope
    vals = torch.randn(ns.pages * ns.page_size, C + Rr, generator=g).to(dev, dtype)
    if ns.kv_cache_dtype == "auto":
        return vals.view(ns.pages, ns.page_size, C + Rr), None
    fmt = KVFormats.mla(ns.kv_cache_dtype, C + Rr, Rr, 128, dtype).latent
    rows = torch.cat([fmt.encode(vals[a : a + (1 << 16)]) for a in range(0, vals.shape[0], 1 << 16)])
    return rows.view(ns.pages, ns.page_size, fmt.width), fmt


def main(argv=None) -> int:
    ns = parse(argv)
    cuda, dev, dtype, g, gpu = device_setup(ns.quick)
    from dhisparse.kernels.sparse_mla import run_sparse_mla

    H, C, Rr = ns.heads, ns.latent, ns.rope
    rows, fmt = row_space(ns, dev, dtype, g)
    scales = [s for s in ns.scales.split(",") if s] if fmt is not None else []
    config = {k: v for k, v in vars(ns).items() if k != "argv"} | {
        "gpu": gpu, "dtype": str(dtype), "row_bytes": rows.shape[-1] * rows.element_size()}
    runs, path = [], None
    tm = Timing(ns.warmup, ns.reps, ns.graph)
    for T in ints(ns.tokens):
        q = torch.randn(T, H, C, generator=g).to(dev, dtype)
        qp = torch.randn(T, H, Rr, generator=g).to(dev, dtype)
        loc = torch.randint(0, ns.pages * ns.page_size, (T, ns.topk), generator=g).to(dev)
        base_ms = base_out = None
        for sc in [None, *scales]:  # None: the shipped scale path (the default plan's row is first)
            if sc is None:
                os.environ.pop("DHISPARSE_FP8_SCALES", None)
            else:
                os.environ["DHISPARSE_FP8_SCALES"] = sc
            for plan in plans(H, C, Rr, ints(ns.splits), ints(ns.block_k), ints(ns.warps), ints(ns.stages),
                              ints(ns.block_h), dtype):
                out = torch.empty(T, H, C, device=dev, dtype=dtype)
                run_sparse_mla(plan, q, qp, rows, loc, C**-0.5, fmt, out=out)
                ms = timed(lambda: run_sparse_mla(plan, q, qp, rows, loc, C**-0.5, fmt, out=out), tm, cuda)
                if base_ms is None:
                    base_ms, base_out = ms, out.clone()
                diff = float((out.float() - base_out.float()).abs().max())
                cfg = {"block_h": plan.block_h, "split_rows": plan.split_rows, "block_k": plan.block_k,
                       "num_warps": plan.num_warps, "num_stages": plan.num_stages, "scales": sc or "default"}
                runs.append({"tokens": T, **cfg, "ms": ms, "vs_default": ms / base_ms, "max_abs_diff_vs_default": diff})
                print(f"T={T:4d} {cfg}  {ms * 1e3:8.1f} us  x{ms / base_ms:.3f} of default  diff {diff:.2g}", flush=True)
        os.environ.pop("DHISPARSE_FP8_SCALES", None)
        best = min((r for r in runs if r["tokens"] == T), key=lambda r: r["ms"])
        print(f"best at T={T}: {best}", flush=True)
        path = R.write_json(R.new_result("mla_tune_bench", ns.argv, config, runs), ns.out)  # after every T
    print(f"[done] {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
