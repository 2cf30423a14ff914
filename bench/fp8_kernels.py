"""FP8 vs bf16 rows in the kernels that read them (issue 25): sparse-MLA attention per layer and
indexer scoring, timed in one run on the same locations.

    python3 bench/fp8_kernels.py --out $OUT/fp8_kernels_h200.json        # H200 (~1.5 min)
    python3 bench/fp8_kernels.py --quick --out /tmp/fp8_kernels.json     # CPU smoke (interpreter)

Attention: one layer at the scaled GLM's shape (16 heads, latent 512 + rope 64), k = --topk random
locations in a paged row space of --pages x --page-size rows, for a decode pass (T = requests) and
a width-K verification pass (T = K x requests), with the engine's default plan (split rows). The
same values are stored as 1,152-B bf16 rows and as 656-B FP8 rows (core/kvformat.py); the FP8
kernel dequantizes in the kernel, once per way of applying the per-tile scales (reshape, select,
gather, which agree bit for bit, and fold, which scales per-tile scores and p instead of the values:
DHISPARSE_FP8_SCALES). Indexer: one full layer's scoring of T queries against --index-len
keys per request (8 heads x 128), bf16 256-B keys vs FP8 132-B keys, stored in a page slot of a
KVArena as the engine stores them (`--key-layout arena`, the default). On CUDA every time is the
median replay of a CUDA graph of --graph calls (Python launch cost excluded, as in the engine's
step graphs), L2 not flushed between calls (rows of k = 2,048 x 16 requests exceed the 60 MB L2 in
bf16, not always in FP8: the FP8 advantage includes that). Each row reports fp8 / bf16 measured in
the same run and the largest output difference between the two formats.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--quick" in sys.argv:  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from dhisparse.bench import results as R  # noqa: E402
from bench.kernel_bench import Timing, device_setup, ints, timed  # noqa: E402


SCALE_MODES = ("reshape", "select", "gather", "fold")  # how the FP8 kernel applies per-tile scales (kernels/sparse_mla.py)
EXACT_MODES = SCALE_MODES[:3]  # dequantize the values: bit for bit equal; fold rounds differently (scales on scores and p)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--requests", default="4,18,36", help="requests per pass")
    a("--widths", default="1,4", help="tokens per request (1 = decode, K = a width-K verification pass)")
    a("--heads", type=int, default=16); a("--latent", type=int, default=512); a("--rope", type=int, default=64)
    a("--topk", type=int, default=2048); a("--pages", type=int, default=16384); a("--page-size", type=int, default=64)
    a("--index-heads", type=int, default=8); a("--index-dim", type=int, default=128)
    a("--index-len", type=int, default=32768, help="keys per request scored by the indexer")
    a("--key-layout", default="arena", choices=("arena", "contiguous"),
      help="index keys in a KVArena page slot as the engine stores them, or one contiguous block")
    a("--index-model", default="glm52-scaled", help="the layer layout of --key-layout arena")
    a("--index-slot", type=int, default=1, help="which full layer's slot of the page holds the keys")
    a("--reps", type=int, default=15); a("--warmup", type=int, default=3); a("--graph", type=int, default=10)
    a("--quick", action="store_true", help="tiny shapes on CPU under the interpreter")
    a("--out", default="bench/results/fp8_kernels.json")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.requests, ns.widths, ns.heads, ns.latent, ns.rope, ns.topk = "2", "1,2", 4, 128, 16, 40
        ns.pages, ns.page_size, ns.index_heads, ns.index_dim, ns.index_len = 8, 8, 2, 16, 64
        ns.reps, ns.warmup, ns.graph = 2, 1, 1
    ns.argv = ["bench/fp8_kernels.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def attention_rows(ns, dev, dtype, g):
    """The same values as bf16 rows [P, ps, C+R] and as FP8 rows [P, ps, 656] (and their format)."""
    from dhisparse.core.kvformat import KVFormats

    C, Rr = ns.latent, ns.rope
    fmt = KVFormats.mla("fp8_e4m3", C + Rr, Rr, ns.index_dim, dtype).latent
    vals = torch.randn(ns.pages * ns.page_size, C + Rr, generator=g).to(dev)
    fp8 = torch.empty(ns.pages * ns.page_size, fmt.width, dtype=torch.uint8, device=dev)
    for a in range(0, vals.shape[0], 1 << 16):  # encode in chunks (fp32 temporaries)
        fp8[a : a + (1 << 16)] = fmt.encode(vals[a : a + (1 << 16)])
    plain = vals.to(dtype).view(ns.pages, ns.page_size, C + Rr)
    return plain, fp8.view(ns.pages, ns.page_size, fmt.width), fmt


def attention_runs(ns, dev, dtype, cuda, g) -> list[dict]:
    from dhisparse.kernels.sparse_mla import plan_sparse_mla, run_sparse_mla

    H, C, Rr = ns.heads, ns.latent, ns.rope
    plain, fp8, fmt = attention_rows(ns, dev, dtype, g)
    plan, tm, runs = plan_sparse_mla(H, C, Rr, dtype=dtype), Timing(ns.warmup, ns.reps, ns.graph), []
    for n in ints(ns.requests):
        for K in ints(ns.widths):
            T = n * K
            q = torch.randn(T, H, C, generator=g).to(dev, dtype)
            qp = torch.randn(T, H, Rr, generator=g).to(dev, dtype)
            loc = torch.randint(0, ns.pages * ns.page_size, (T, ns.topk), generator=g).to(dev)
            outs, ms = {}, {}
            variants = [("bf16", plain, None, "")] + [(f"fp8_{m}", fp8, fmt, m) for m in SCALE_MODES]
            for name, rows, f, mode in variants:
                os.environ["DHISPARSE_FP8_SCALES"] = mode
                out = torch.empty(T, H, C, device=dev, dtype=dtype)
                run_sparse_mla(plan, q, qp, rows, loc, C**-0.5, f, out=out)
                ms[name] = timed(lambda: run_sparse_mla(plan, q, qp, rows, loc, C**-0.5, f, out=out), tm, cuda)
                outs[name] = out.float()
            os.environ.pop("DHISPARSE_FP8_SCALES", None)
            ref = outs["fp8_gather"]
            same = all(torch.equal(outs[f"fp8_{m}"], ref) for m in EXACT_MODES)
            fold_diff = float((outs["fp8_fold"] - ref).abs().max())
            diff = float((ref - outs["bf16"]).abs().max())
            rel = float(((ref - outs["bf16"]).norm(dim=-1) / outs["bf16"].norm(dim=-1)).mean())
            best = min(SCALE_MODES, key=lambda m: ms[f"fp8_{m}"])
            runs.append({"kernel": "sparse_mla", "requests": n, "width": K, "tokens": T, "topk": ns.topk,
                         "bf16_ms": ms["bf16"], **{f"fp8_{m}_ms": ms[f"fp8_{m}"] for m in SCALE_MODES},
                         "fp8_over_bf16": {m: ms[f"fp8_{m}"] / ms["bf16"] for m in SCALE_MODES}, "best_mode": best,
                         "modes_bitwise_equal": same, "fold_max_abs_diff": fold_diff, "row_bytes": {"bf16": (C + Rr) * 2, "fp8": fmt.nbytes},
                         "max_abs_diff": diff, "mean_rel_diff": rel})
            print(f"attention n={n:3d} K={K}  bf16 {ms['bf16'] * 1e3:7.1f} us  fp8 " + "  ".join(
                f"{m} {ms[f'fp8_{m}'] * 1e3:7.1f} (x{ms[f'fp8_{m}'] / ms['bf16']:.2f})" for m in SCALE_MODES)
                + f"  equal {same}  rel diff {rel:.3g}", flush=True)
    return runs


def index_keys(ns, kv: str, keys, dev, dtype):
    """keys [n * L, D] stored as the engine stores them -> (table rows, scales, row format or None).
    --key-layout arena: written into index slot --index-slot of a KVArena at --index-model's layer
    layout (the engine's page slots: their alignment is the arena's, `keys_per_index_page`);
    contiguous: one [n*L/ips, ips, W] block per format, always 16-B aligned (the fifteenth round's
    layout, which hid the misaligned slots)."""
    from dhisparse.core.kvformat import KVFormats
    from dhisparse.kv.memory.arena import KVArena
    from dhisparse.models.scaled import scaled_config
    from dhisparse.models.tiny import tiny_config

    D = keys.shape[1]
    if ns.key_layout == "arena":
        cfg = tiny_config() if ns.quick else scaled_config(ns.index_model)
        cfg = cfg.with_updates(index_head_dim=D)
        fmts = KVFormats.of_model(kv, cfg, dtype)
        probe = KVArena(cfg, 1, ns.page_size, "meta", dtype, fmts)
        arena = KVArena(cfg, -(-keys.shape[0] // probe.index_page_size), ns.page_size, dev, dtype, fmts)
        layer = arena.layout.index_layers[ns.index_slot % len(arena.layout.index_layers)]
        loc = torch.arange(keys.shape[0], device=dev)
        for a in range(0, keys.shape[0], 1 << 16):
            arena.write_index(layer, loc[a : a + (1 << 16)], fmts.index.encode(keys[a : a + (1 << 16)]))
        vals, scales = arena.index_spaces(layer)
        return vals, scales, fmts.index if fmts.index.fp8 else None
    fmt = KVFormats.mla("fp8_e4m3", ns.latent + ns.rope, ns.rope, D, dtype).index
    ips = 64 if keys.shape[0] % 64 == 0 else 8
    if kv == "auto":
        return keys.to(dtype).view(-1, ips, D), None, None
    enc = fmt.encode(keys).view(-1, ips, fmt.width)  # values, then scales
    return enc[..., :D].contiguous(), enc[..., D:].contiguous(), fmt


def indexer_runs(ns, dev, dtype, cuda, g) -> list[dict]:
    from dhisparse.core.batch import IndexTable
    from dhisparse.kernels.indexer import indexer_scores_triton

    D, Hi, L = ns.index_dim, ns.index_heads, ns.index_len
    tm, runs = Timing(ns.warmup, ns.reps, ns.graph), []
    for n in ints(ns.requests):
        keys = torch.randn(n * L, D, generator=g).to(dev)
        stored = {name: index_keys(ns, kv, keys, dev, dtype) for name, kv in (("bf16", "auto"), ("fp8", "fp8_e4m3"))}
        locs = torch.arange(n * L, device=dev).view(n, L)
        lens = torch.full((n,), L, device=dev)
        for K in ints(ns.widths):
            T = n * K
            q = torch.randn(T, Hi, D, generator=g).to(dev, dtype)
            w = torch.randn(T, Hi, generator=g).to(dev, dtype)
            req = torch.arange(n, device=dev).repeat_interleave(K)
            pos = torch.full((T,), L - 1, device=dev)
            ms, outs = {}, {}
            for name, (rows, sc, f) in stored.items():
                tab = IndexTable(rows, locs, lens, f, sc)
                fn = lambda: indexer_scores_triton(q, w, pos, req, tab, group=K)  # noqa: E731
                outs[name] = fn()
                ms[name] = timed(fn, tm, cuda)
            agree = float((outs["fp8"].topk(min(ns.topk, L)).indices.sort().values
                           == outs["bf16"].topk(min(ns.topk, L)).indices.sort().values).float().mean())
            fp8_rows, fp8_scales = stored["fp8"][0], stored["fp8"][1]
            runs.append({"kernel": "indexer_scores", "requests": n, "width": K, "tokens": T, "keys": L,
                         "key_layout": ns.key_layout, "bf16_ms": ms["bf16"], "fp8_ms": ms["fp8"],
                         "fp8_over_bf16": ms["fp8"] / ms["bf16"], "fp8_values_ptr_mod16": fp8_rows.data_ptr() % 16,
                         "fp8_scales_ptr_mod4": fp8_scales.data_ptr() % 4,
                         "key_bytes": {"bf16": D * 2, "fp8": D + 4}, "topk_position_agreement": agree})
            print(f"indexer   n={n:3d} K={K}  bf16 {ms['bf16'] * 1e3:8.1f} us  fp8 {ms['fp8'] * 1e3:8.1f} us  "
                  f"x{ms['fp8'] / ms['bf16']:.3f}  ({ns.key_layout}, fp8 base mod 16 = {fp8_rows.data_ptr() % 16})", flush=True)
    return runs


def main(argv=None) -> int:
    ns = parse(argv)
    cuda, dev, dtype, g, gpu = device_setup(ns.quick)
    runs = attention_runs(ns, dev, dtype, cuda, g) + indexer_runs(ns, dev, dtype, cuda, g)
    notes = ["fp8_over_bf16 < 1: the FP8 rows are faster; both formats timed in this run on the same locations",
             "CUDA times: median graph replay / calls per graph; L2 not flushed"]
    R.write_bench("fp8_kernels", ns, runs, notes, gpu=gpu, dtype=str(dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
