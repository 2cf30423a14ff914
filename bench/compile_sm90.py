"""Compile the resolver's Triton kernels for the H200 (sm_90) on a machine without a GPU.

    python3 bench/compile_sm90.py        # ~1 min; prints one line per specialization, fails on the first error

Triton lowers each specialization to PTX and runs the ptxas its wheel ships, so a kernel change
that the CPU interpreter accepts but the GPU compiler would refuse (a loop-carried type, a shape
or layout the backend cannot lower, shared memory over the limit) is caught before a device call.
It does not run anything: exactness and speed still need the GPU. Integer arguments are typed i32
and pointers by their tensors' dtypes (the engine's specializations can differ in alignment hints).
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter's jit functions cannot be compiled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dhisparse.kernels.resolver import PHASE_STOPS, _shape_consts, _sort_classes  # noqa: E402
from dhisparse.kernels.gather import gather_rows_kernel  # noqa: E402
from dhisparse.kernels.resolver_kernel import direct_pre_kernel, resolve_plan_kernel  # noqa: E402

INT32_PTRS = {"copy_n_ptr", "scr32_ptr", "bm_ptr", "pre_ptr"}
TARGET = GPUTarget("cuda", 90, 32)


def _type(name: str) -> str:
    if name in ("src_ptr", "dst_ptr"):  # gather_rows_kernel's row spaces (8-B copy units)
        return "*i64"
    if name.endswith("_ptr"):
        return "*i16" if name == "pv_ptr" else ("*i32" if name in INT32_PTRS else "*i64")
    return "i32"


def compile_kernel(kern, consts: dict, num_warps: int):
    """triton.compile one specialization of `kern` (constexprs `consts`, the kernel's defaults for the
    rest) for sm_90."""
    consts = {p.name: p.default for p in kern.params if p.is_constexpr and p.has_default} | consts
    sig, cst = {}, {}
    for i, name in enumerate(kern.arg_names):
        if name in consts:
            sig[name], cst[(i,)] = "constexpr", consts[name]
        else:
            sig[name] = _type(name)
    return triton.compile(ASTSource(fn=kern, signature=sig, constexprs=cst), target=TARGET,
                          options={"num_warps": num_warps})


def plan_consts(KKP: int, BP: int, pre: bool, upto: int = 50, distinct: bool = False) -> dict:
    """The constexprs `resolver._launch` passes for K*k padded to KKP and B padded to BP."""
    SA, SB, SC, SD = _sort_classes(min(KKP, BP))
    return dict(KKP=KKP, PRE=pre, BP=BP, CH=min(KKP, 2048), CHB=min(BP, 2048), SA=SA, SB=SB, SC=SC, SD=SD,
                CHC=min(KKP, 1024), UPTO=upto, DISTINCT=distinct)


def main() -> None:
    # decode (K 1, k 2,048) at H 4,096 / 8,192, verification (K 8) at 4,096; V4's k 512; with and without P0's pre-pass
    for KKP, BP in ((2048, 4096), (2048, 8192), (16384, 4096), (512, 8192)):
        warps = _shape_consts(KKP, BP)[2]
        for pre, distinct in ((False, False), (True, False), (False, True)):
            k = compile_kernel(resolve_plan_kernel, plan_consts(KKP, BP, pre, distinct=distinct), warps)
            print(f"resolve_plan_kernel KKP {KKP} BP {BP} pre {pre} distinct {distinct}: ok, {warps} warps, "
                  f"shared {k.metadata.shared} B", flush=True)
    for upto in PHASE_STOPS:  # bench/resolver_peer.py --phases
        compile_kernel(resolve_plan_kernel, plan_consts(2048, 4096, False, upto, True), 16)
        print(f"resolve_plan_kernel UPTO {upto}: ok", flush=True)
    for KKP, BP, W in ((2048, 4096, 82), (2048, 8192, 144), (16384, 4096, 82)):  # the fused copy (P6) of
        warps = _shape_consts(KKP, BP)[2]                                       # 656- / 1,152-B rows
        consts = plan_consts(KKP, BP, False, distinct=KKP <= 2048) | dict(COPY=1, CPW=W, CCW=64, CVEC=2, CR=64)
        k = compile_kernel(resolve_plan_kernel, consts, warps)
        print(f"resolve_plan_kernel COPY KKP {KKP} BP {BP} W {W}: ok, shared {k.metadata.shared} B", flush=True)
    compile_kernel(direct_pre_kernel, {"CH": 1024}, 4)
    print("direct_pre_kernel: ok")
    compile_kernel(gather_rows_kernel, dict(W=82, R=16, CW=64, VEC=2), 4)
    print("gather_rows_kernel: ok")


if __name__ == "__main__":
    main()
