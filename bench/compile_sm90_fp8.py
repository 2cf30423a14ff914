"""Compile the FP8 weight GEMMs' Triton kernels for the H200 (sm_90) on a machine without a GPU.

    python3 bench/compile_sm90_fp8.py [--regs] [--out bench/results/compile_sm90_fp8_cpu_sNN.json]

The w8a16 kernels (`kernels/fp8_gemm.py`), the w8a8 ones (`kernels/fp8_w8a8.py`: FP8 x FP8 `tl.dot`, the
activation-quantization pass with its FP8 stores) and `split_sum`, at the tiles the engine picks for decode,
verification and prefill passes, lowered to PTX and assembled by the ptxas Triton's wheel ships
(`bench/compile_sm90.py` does the same for the resolver). A kernel the CPU interpreter runs but the GPU
compiler refuses (an FP8 dot it cannot lower, a conversion without an instruction) fails here before a
device call. Nothing runs: exactness and speed still need the GPU.

Pointers and the stride / size arguments in DIVISIBLE carry `tt.divisibility` 16, as Triton's JIT specializes a
launch whose pointers are 16-B aligned and whose integers are multiples of 16 (every glm5-faithful weight and
activation stride is). Without the hints ptxas reports 255 registers and 164-1,768 B of spills for every
GEMM here (no vector loads: a pointer a byte), which is not what the GPU runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter's jit functions cannot be compiled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.compile_sm90 import TARGET, regs, write_report  # noqa: E402
from dhisparse.kernels import fp8_gemm as fg  # noqa: E402
from dhisparse.kernels import fp8_w8a8 as fw  # noqa: E402

# pointer arguments' element types by kernel (the rest: i32 scalars); "out" is the activation dtype (bf16)
F8, F32, BF16, I32 = "*fp8e4nv", "*fp32", "*bf16", "*i32"
POINTERS = {
    "fp8_linear_kernel": {"x_ptr": BF16, "w_ptr": F8, "s_ptr": F32, "out_ptr": BF16},
    "fp8_moe_kernel": {"x_ptr": BF16, "w_ptr": F8, "s_ptr": F32, "out_ptr": BF16, "rows_ptr": I32, "bexp_ptr": I32},
    "fp8_w8a8_linear_kernel": {"x_ptr": F8, "xs_ptr": F32, "w_ptr": F8, "s_ptr": F32, "out_ptr": BF16},
    "fp8_w8a8_moe_kernel": {"x_ptr": F8, "xs_ptr": F32, "w_ptr": F8, "s_ptr": F32, "out_ptr": BF16,
                            "rows_ptr": I32, "bexp_ptr": I32},
    "fp8_act_quant_kernel": {"x_ptr": BF16, "q_ptr": F8, "s_ptr": F32},  # round trip: q_ptr bf16 (out type)
    "split_sum_kernel": {"p_ptr": F32, "out_ptr": BF16},
}
DIVISIBLE = {"sxt", "sxst", "sqt", "swn", "ssn", "sos", "sot", "swe", "sse", "K", "N", "KPER", "TN"}


def compile_one(kern, consts: dict, num_warps: int, out_ptr: str | None = None):
    """triton.compile one specialization of `kern` for sm_90 (constexprs `consts`; pointers as POINTERS says,
    `out_ptr` overriding the output's type: fp32 for a split-K linear's partials, bf16 for the quantization's round trip)."""
    name = kern.fn.__name__
    ptrs = POINTERS[name]
    ptrs = ptrs | ({"q_ptr" if "q_ptr" in ptrs else "out_ptr": out_ptr} if out_ptr else {})
    sig, cst, attrs = {}, {}, {}
    for i, arg in enumerate(kern.arg_names):
        if arg in consts:
            sig[arg], cst[(i,)] = "constexpr", consts[arg]
        else:
            sig[arg] = ptrs.get(arg, "i32")
            if arg.endswith("_ptr") or arg in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=kern, signature=sig, constexprs=cst, attrs=attrs), target=TARGET,
                          options={"num_warps": num_warps})


def variants() -> list[tuple[str, object, dict, int, str | None]]:
    """(label, kernel, constexprs, warps, out type) of every specialization checked: BM from `block_m_for` at
    decode / verification / prefill rows, with the tiles `tiles_for` picks (and BM 128 at BN 64, gemm43's)."""
    out = []
    gemm = dict(BK=128, IEEE=False, INTERP=False)
    for rows in (16, 47, 100, 188, 8192):
        bm = fg.block_m_for(rows)
        bn, warps = fg.tiles_for(rows, None, None)
        for kern in (fg.fp8_linear_kernel, fw.fp8_w8a8_linear_kernel):
            out.append((f"{kern.fn.__name__} rows {rows}", kern, gemm | dict(BM=bm, BN=bn), warps, None))
            out.append((f"{kern.fn.__name__} rows {rows} split", kern, gemm | dict(BM=bm, BN=bn), warps, F32))
        for kern in (fg.fp8_moe_kernel, fw.fp8_w8a8_moe_kernel):
            out.append((f"{kern.fn.__name__} rows/expert {rows}", kern, gemm | dict(BM=bm, BN=bn), warps, None))
    out.append(("fp8_w8a8_linear_kernel BM 128 BN 64", fw.fp8_w8a8_linear_kernel, gemm | dict(BM=128, BN=64), 4, None))
    out.append(("fp8_act_quant_kernel", fw.fp8_act_quant_kernel, dict(R=fw.ACT_ROWS, G=128, QMAX=448.0), 4, None))
    out.append(("fp8_act_quant_kernel round trip", fw.fp8_act_quant_kernel,
                dict(R=fw.ACT_ROWS, G=128, QMAX=448.0, ROUND_TRIP=True), 4, BF16))
    for S in (2, 9, 30):
        out.append((f"split_sum_kernel S {S}", fg.split_sum_kernel, dict(S=S, BLOCK=1024), 4, None))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regs", action="store_true", help="also registers and spills (ptxas -v)")
    ap.add_argument("--out", default=None, help="write the report as JSON (command, commit, date)")
    ns = ap.parse_args(argv)
    t0, records = time.time(), []
    for label, kern, consts, warps, out_ptr in variants():
        k = compile_one(kern, consts, warps, out_ptr)
        rec = {"variant": label, "num_warps": warps, "shared_bytes": k.metadata.shared}
        if ns.regs:
            rec["ptxas"] = regs(k)
        records.append(rec)
        print(f"{label}: ok, {warps} warps, shared {k.metadata.shared} B" + (f", {rec['ptxas']}" if ns.regs else ""),
              flush=True)
    write_report(ns.out, "compile_sm90_fp8", "bench/compile_sm90_fp8.py", t0, "sm_90", records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
