"""Kernel families of a CUDA trace and their busy / exclusive ("alone") time (Fig. 10 b).

`family_times([(name, start_us, end_us), ...])` -> {"busy_ms", "family_ms", "alone_ms", "overlap_ms",
"kernels"}: busy is the union of all kernel intervals; family_ms sums each family's kernel
durations; alone_ms is time in which only that family runs; overlap_ms is time with several
families at once. Names are matched by substring, first match wins.
"""

from __future__ import annotations

FAMILIES = (
    ("resolver", ("resolve_plan", "resolver", "evict")),
    ("cache copy", ("gather_rows", "gather_copy", "copy_rows", "Memcpy", "memcpy", "scatter")),
    ("attention", ("sparse_mla", "_mla_", "flash", "attn")),
    ("indexer", ("indexer", "topk", "top_k", "sort", "radix")),
    # FP8 activations' per-token-group quantization (w8a8, and the prefill round trip) and the weights'
    # dequantization for prefill's bf16 matmuls
    ("fp8 quant", ("act_quant", "fp8_dequant")),
    # fp8_linear / fp8_w8a8_linear and their split-K sum (session 45: w8a8's linear had fallen into "other")
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_", "cublas", "matmul", "xmma", "fp8_linear", "fp8_w8a8_linear",
              "split_sum")),
    # glm5-faithful's expert GEMMs: fp8_moe_kernel (routed) and fp8_expert_linear_kernel (shared, from c. s30)
    ("moe", ("moe", "expert", "index_add", "scatter_add")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "norm", "rope", "softmax", "cat", "fill", "copy_")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return fam
    return "other"


def family_times(kernels: list[tuple[str, float, float]]) -> dict:
    """kernels: (name, start_us, end_us). Times returned in ms."""
    if not kernels:
        return {"busy_ms": 0.0, "family_ms": {}, "alone_ms": {}, "overlap_ms": 0.0, "kernels": 0}
    fam_ms: dict[str, float] = {}
    events = []
    for name, a, b in kernels:
        f = family(name)
        fam_ms[f] = fam_ms.get(f, 0.0) + (b - a) / 1e3
        events += [(a, 1, f), (b, -1, f)]
    events.sort(key=lambda e: (e[0], e[1]))
    live: dict[str, int] = {}
    busy = overlap = 0.0
    alone: dict[str, float] = {}
    prev = events[0][0]
    for t, delta, f in events:
        span = t - prev
        active = [k for k, n in live.items() if n > 0]
        if active and span > 0:
            busy += span
            if len(active) == 1:
                alone[active[0]] = alone.get(active[0], 0.0) + span / 1e3
            else:
                overlap += span
        live[f] = live.get(f, 0) + delta
        prev = t
    return {"busy_ms": busy / 1e3, "family_ms": fam_ms, "alone_ms": alone, "overlap_ms": overlap / 1e3,
            "kernels": len(kernels)}
