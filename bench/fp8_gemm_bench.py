"""FP8-weight GEMMs (kernels/fp8_gemm.py) against bf16 torch.matmul on the same shapes, in one run.

    python3 bench/fp8_gemm_bench.py --out $OUT/fp8_gemm_bench_h200.json      # H200 (~1 min)
    python3 bench/fp8_gemm_bench.py --quick --out /tmp/fp8_gemm_bench.json   # CPU smoke (interpreter)

Shapes are glm5-faithful's (models/faithful.py): the attention projections q_a, q_b, kv_a, o_proj
and the shared expert's up / down as `Fp8Linear`, and one layer's routed experts (24 of width
2,048, top 8) as `Fp8Experts` (routing, the grouped gate-up GEMM, SiLU-GLU, the grouped down GEMM
and the weighted combine), at decode and verification pass sizes. The named baseline is bf16: the
same weights dequantized, through `nn.Linear` and through `layers.moe.Experts` (the bf16 path
glm52-scaled runs: every expert on every token for small passes). Each time is the median replay
of a CUDA graph of --graph calls (launch cost excluded, as in the engine's step graphs); weights
exceed L2 so every call streams them. `gbps` = weight bytes (FP8 + scales, or bf16) / time.
`w8a8_ms`: the same FP8 module with activations "dynamic" (kernels/fp8_w8a8.py: each token quantized per
group of 128 columns, FP8 x FP8 on the tensor cores, as FP8 checkpoints are served), timed in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--quick" in sys.argv:  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.kernel_bench import Timing, device_setup, ints, timed  # noqa: E402
from bench.resolver_timing import header  # noqa: E402
from dhisparse.kernels.fp8_gemm_ref import dequantize_block_fp8  # noqa: E402
from dhisparse.layers.fp8_linear import Fp8Experts, Fp8Linear  # noqa: E402

LINEARS = {"q_a": (2048, 6144), "q_b": (16384, 2048), "kv_a": (576, 6144), "o_proj": (6144, 16384),
           "shared_up": (2048, 6144), "shared_down": (6144, 2048)}  # name: (out, in)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--tokens", default="18,47,188", help="pass sizes T (decode: requests; verification: 4 x requests)")
    a("--prefill-tokens", type=int, default=8192, help="one prefill-chunk size for the linears (0 = none)")
    a("--experts", type=int, default=24); a("--top-k", type=int, default=8)
    a("--hidden", type=int, default=6144); a("--inter", type=int, default=2048)
    a("--reps", type=int, default=20); a("--warmup", type=int, default=3); a("--graph", type=int, default=10)
    a("--sweep", default="64:4:3,64:4:4,64:4:5,128:4:3,128:4:4,128:8:3,32:4:4,32:2:5",
      help="[BM:]BN:warps:stages tile configurations timed on the decode shapes (fp8 only; '' = none; "
           "BM left out: block_m_for's)")
    a("--sweep-tokens", default="47,188")
    a("--quick", action="store_true", help="tiny shapes on CPU under the interpreter")
    a("--out", default="bench/results/fp8_gemm_bench.json")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.tokens, ns.prefill_tokens, ns.experts, ns.top_k, ns.hidden, ns.inter = "3", 0, 3, 2, 128, 64
        ns.reps, ns.warmup, ns.graph, ns.sweep, ns.sweep_tokens = 2, 1, 1, "32:4:3", "3"
    return ns


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _pair(name: str, T: int, fp8: nn.Module, bf16: nn.Module, fn8, fn16, tm: Timing, cuda: bool) -> dict:
    """fp8 (w8a16, then w8a8: `fp8.activations` "dynamic") and bf16 times of one case."""
    t8, t16 = timed(fn8, tm, cuda), timed(fn16, tm, cuda)
    fp8.activations = "dynamic"
    try:
        t88 = timed(fn8, tm, cuda)
    finally:
        fp8.activations = "none"
    b8, b16 = _bytes(fp8), _bytes(bf16)
    row = {"case": name, "tokens": T, "fp8_ms": t8, "w8a8_ms": t88, "bf16_ms": t16, "fp8_over_bf16": t8 / t16,
           "w8a8_over_bf16": t88 / t16, "fp8_weight_bytes": b8, "bf16_weight_bytes": b16, "fp8_gbps": b8 / t8 / 1e6,
           "w8a8_gbps": b8 / t88 / 1e6, "bf16_gbps": b16 / t16 / 1e6}
    print(f"  {name:12} T{T:<5} fp8 {t8:8.4f} ms ({row['fp8_gbps']:7.0f} GB/s)  w8a8 {t88:8.4f} ms "
          f"({row['w8a8_gbps']:7.0f} GB/s)  bf16 {t16:8.4f} ms ({row['bf16_gbps']:7.0f} GB/s)  "
          f"fp8/bf16 {row['fp8_over_bf16']:.2f}  w8a8/bf16 {row['w8a8_over_bf16']:.2f}", flush=True)
    return row


def linear_rows(ns, tm: Timing, cuda: bool, dev: str, dtype: torch.dtype, g: torch.Generator) -> list[dict]:
    rows = []
    scale = ns.hidden / 6144
    for name, (n, k) in LINEARS.items():
        n, k = max(16, int(n * scale)), max(16, int(k * scale))
        lin = nn.Linear(k, n, bias=False).to(dev, dtype)
        f8 = Fp8Linear.from_linear(lin)
        lin.weight.data = dequantize_block_fp8(f8.weight, f8.weight_scale_inv).to(dtype)  # the same weights, dequantized
        for T in [*ints(ns.tokens), *([ns.prefill_tokens] if ns.prefill_tokens else [])]:
            x = torch.randn(T, k, generator=g).to(dev, dtype)
            rows.append(_pair(name, T, f8, lin, lambda: f8(x), lambda: lin(x), tm, cuda))
        del lin, f8
    return rows


def expert_rows(ns, tm: Timing, cuda: bool, dev: str, dtype: torch.dtype, g: torch.Generator) -> list[dict]:
    from dhisparse.core.config import ModelConfig
    from dhisparse.layers.moe import Experts, Routing
    from dhisparse.models.faithful import faithful_hf_config

    over = dict(hidden_size=ns.hidden, moe_intermediate_size=ns.inter, n_routed_experts=ns.experts, num_experts_per_tok=ns.top_k)
    cfg = ModelConfig.from_hf(faithful_hf_config("glm5-faithful", 4, over))
    with torch.device(dev):
        ex = Experts(cfg)
    ex.gate_up_proj.data = (torch.randn(ex.gate_up_proj.shape, generator=g) / ns.hidden**0.5).to(dev, dtype)
    ex.down_proj.data = (torch.randn(ex.down_proj.shape, generator=g) / ns.inter**0.5).to(dev, dtype)
    f8 = Fp8Experts.from_experts(ex)
    ex.gate_up_proj.data = dequantize_block_fp8(f8.gate_up_proj, f8.gate_up_proj_scale_inv).to(dtype)
    ex.down_proj.data = dequantize_block_fp8(f8.down_proj, f8.down_proj_scale_inv).to(dtype)
    rows = []
    for T in [*ints(ns.tokens), *([ns.prefill_tokens] if ns.prefill_tokens else [])]:  # a prefill chunk too
        x = torch.randn(T, ns.hidden, generator=g).to(dev, dtype)
        ids = torch.stack([torch.randperm(ns.experts, generator=g)[: ns.top_k] for _ in range(T)]).to(dev)
        r = Routing(ids, torch.rand(T, ns.top_k, generator=g).to(dev))
        rows.append(_pair(f"experts{ns.experts}", T, f8, ex, lambda: f8(x, r), lambda: ex(x, r), tm, cuda))
    return rows


def tile_config(text: str) -> tuple[int | None, int, int, int]:
    """'BN:warps:stages' or 'BM:BN:warps:stages' -> (BM or None, BN, warps, stages); ValueError naming --sweep."""
    parts = [int(v) for v in text.split(":")]
    if len(parts) not in (3, 4):
        raise ValueError(f"--sweep entries are [BM:]BN:warps:stages, got {text!r}")
    return (None, *parts) if len(parts) == 3 else tuple(parts)


def sweep_rows(ns, tm: Timing, cuda: bool, dev: str, dtype: torch.dtype, g: torch.Generator) -> list[dict]:
    """fp8 time of each --sweep tile configuration on the decode shapes: the linears' Triton call and
    the experts' gate-up and down grouped GEMMs (the defaults' row is the 64:4:3 one). A configuration
    of four fields sets BM too (BM:BN:warps:stages; `block_m` None in the row: `block_m_for`'s)."""
    from dhisparse.kernels.fp8_gemm import fp8_linear_triton, fp8_moe_triton
    from dhisparse.kernels.fp8_gemm_ref import quantize_block_fp8

    configs = [tile_config(c) for c in ns.sweep.split(",") if c]
    scale = ns.hidden / 6144
    shapes = {n: (max(16, int(a * scale)), max(16, int(b * scale))) for n, (a, b) in LINEARS.items()}
    shapes |= {"experts_gate_up": (2 * ns.inter, ns.hidden), "experts_down": (ns.hidden, ns.inter)}
    rows = []
    for name, (n, k) in shapes.items():
        stacked = name.startswith("experts")
        w = torch.randn((ns.experts, n, k) if stacked else (n, k), generator=g).to(dev) / k**0.5
        w8, sc = quantize_block_fp8(w)
        del w
        for T in ints(ns.sweep_tokens):
            x = torch.randn(T * (ns.top_k if name == "experts_down" else 1), k, generator=g).to(dev, dtype)
            ids = torch.stack([torch.randperm(ns.experts, generator=g)[: ns.top_k] for _ in range(T)]).to(dev)
            ids = ids.reshape(-1, 1) if name == "experts_down" else ids
            for bm, bn, warps, stages in configs:
                kw = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                fn = (lambda: fp8_moe_triton(x, w8, sc, ids, **kw)) if stacked else (lambda: fp8_linear_triton(x, w8, sc, **kw))
                t = timed(fn, tm, cuda)
                gbps = (w8.numel() + sc.numel() * 4) / t / 1e6
                rows.append({"case": name, "tokens": T, "block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages,
                             "fp8_ms": t, "fp8_gbps": gbps})
                print(f"  sweep {name:16} T{T:<4} BM{bm or '-':<4} BN{bn:<4} w{warps} s{stages}  {t:8.4f} ms ({gbps:6.0f} GB/s)", flush=True)
    return rows


def main(argv=None) -> int:
    ns = parse(argv)
    t0 = time.time()
    cuda, dev, dtype, g, gpu = device_setup(ns.quick)
    tm = Timing(ns.warmup, ns.reps, ns.graph)
    with torch.inference_mode():
        rows = linear_rows(ns, tm, cuda, dev, dtype, g) + expert_rows(ns, tm, cuda, dev, dtype, g)
        sweep = sweep_rows(ns, tm, cuda, dev, dtype, g) if ns.sweep else []
    doc = header("fp8_gemm_bench", "bench/fp8_gemm_bench.py", cuda, t0, gpu=gpu, dtype=str(dtype),
                 config={k: v for k, v in vars(ns).items()}, rows=rows, sweep=sweep,
                 baseline="bf16 torch.matmul (nn.Linear / layers.moe.Experts) on the dequantized weights, same run")
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"[done] {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
