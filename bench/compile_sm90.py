"""Compile the resolver's Triton kernels for the H200 (sm_90) on a machine without a GPU.

    python3 bench/compile_sm90.py        # ~3 min; prints one line per specialization, fails on the first error
    python3 bench/compile_sm90.py --regs # and each plan variant's registers and spills (ptxas -v, ~2 s more each)

Triton lowers each specialization to PTX and runs the ptxas its wheel ships, so a kernel change
that the CPU interpreter accepts but the GPU compiler would refuse (a loop-carried type, a shape
or layout the backend cannot lower, shared memory over the limit) is caught before a device call.
It does not run anything: exactness and speed still need the GPU. Integer arguments are typed i32
and pointers by their tensors' dtypes (the engine's specializations can differ in alignment hints).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter's jit functions cannot be compiled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dhisparse.kernels.resolver import PHASE_STOPS, _shape_consts, _sort_classes, fused_copy_rows  # noqa: E402
from bench.resolver_timing import header  # noqa: E402
from dhisparse.kernels.gather import gather_rows_kernel, gather_rows_per_prog, in_flight_units  # noqa: E402
from dhisparse.kernels.resolver_kernel import direct_pre_kernel, resolve_plan_kernel  # noqa: E402

INT32_PTRS = {"copy_n_ptr", "scr32_ptr", "bm_ptr", "pre_ptr"}
TARGET = GPUTarget("cuda", 90, 32)


def _type(name: str) -> str:
    if name in ("src_ptr", "dst_ptr"):  # gather_rows_kernel's row spaces (8-B copy units)
        return "*i64"
    if name.endswith("_ptr"):
        if name == "hitf_ptr":  # the hot lookup's hit flags
            return "*i8"
        return "*i16" if name in ("pv_ptr", "hmap_ptr") else ("*i32" if name in INT32_PTRS else "*i64")
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


def write_report(path: str | None, kind: str, script: str, t0: float, target: str, records: list) -> None:
    """Write a static compile report (command, commit, date, records) as JSON to `path` (None: nothing)."""
    if path:
        doc = header(kind, script, False, t0, target=target,
                     note="static: compiled and assembled on the CPU machine, nothing run", records=records)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


def regs(k) -> str:
    """ptxas's register and spill report of a compiled kernel's PTX (the ptxas Triton's wheel ships):
    a static check, no GPU; spills are local-memory traffic the CPU interpreter never shows."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(k.asm["ptx"])
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    used = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (f"{used.group(1) if used else '?'} registers, spills {spill.group(1)} / {spill.group(2)} B (stores / loads)"
            if spill else text.strip()[-200:])


def plan_consts(KKP: int, BP: int, pre: bool, upto: int = 50, distinct: bool = False) -> dict:
    """The constexprs `resolver._launch` passes for K*k padded to KKP and B padded to BP (host pages of
    64 rows, the engine's default)."""
    SA, SB, SC, SD = _sort_classes(min(KKP, BP))
    return dict(PS=64, KKP=KKP, PRE=pre, BP=BP, CH=min(KKP, 2048), CHB=min(BP, 2048), SA=SA, SB=SB, SC=SC, SD=SD,
                UPTO=upto, DISTINCT=distinct)


def _variants() -> list[tuple[str, dict, int]]:
    """(label, constexprs, warps) of every plan-kernel specialization checked."""
    out = []
    # decode (K 1, k 2,048) at H 4,096 / 8,192, verification (K 8) at 4,096; V4's k 512; with and without P0's pre-pass
    for KKP, BP in ((2048, 4096), (2048, 8192), (16384, 4096), (512, 8192)):
        warps = _shape_consts(KKP, BP)[2]
        for pre, distinct in ((False, False), (True, False), (False, True)):
            out.append((f"KKP {KKP} BP {BP} pre {pre} distinct {distinct}", plan_consts(KKP, BP, pre, distinct=distinct),
                        warps))
    for KKP, BP in ((2048, 4096), (2048, 8192), (16384, 4096)):  # --resolver-lookup index (the hot_entry lookup)
        for distinct in (False, True) if KKP <= 2048 else (False,):
            out.append((f"MAP KKP {KKP} BP {BP} distinct {distinct}",
                        plan_consts(KKP, BP, False, distinct=distinct) | {"MAP": 1}, _shape_consts(KKP, BP)[2]))
    for upto in PHASE_STOPS:  # bench/resolver_peer.py --phases
        out.append((f"UPTO {upto}", plan_consts(2048, 4096, False, upto, True), 16))
    for KKP, BP, W in ((2048, 4096, 82), (2048, 8192, 144), (16384, 4096, 82)):  # the fused copy (P6) of 656- / 1,152-B rows
        warps = _shape_consts(KKP, BP)[2]
        cp = dict(COPY=1, CPW=W, CCW=64, CVEC=2, CR=fused_copy_rows(warps, in_flight_units(W, 64)))
        consts = plan_consts(KKP, BP, False, distinct=KKP <= 2048) | cp
        out.append((f"COPY KKP {KKP} BP {BP} W {W}", consts, warps))
        if KKP <= 2048:  # with P0's pre-pass too (adaptive's optional map: --resolver-copy fused)
            pre = plan_consts(KKP, BP, True) | cp
            out.append((f"COPY pre KKP {KKP} BP {BP} W {W}", pre, _shape_consts(KKP, BP)[2]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regs", action="store_true", help="also each plan variant's registers and spills (ptxas -v)")
    ap.add_argument("--out", default=None, help="write the report as JSON (command, commit, date)")
    ap.add_argument("--match", default="", help="only the plan variants whose label contains this text")
    args = ap.parse_args()
    t0, records = time.time(), []
    for label, consts, warps in [v for v in _variants() if args.match in v[0]]:
        k = compile_kernel(resolve_plan_kernel, consts, warps)
        rec = {"kernel": "resolve_plan_kernel", "variant": label, "num_warps": warps, "shared_bytes": k.metadata.shared}
        if args.regs and not label.startswith("UPTO"):
            rec["ptxas"] = regs(k)
        records.append(rec)
        print(f"resolve_plan_kernel {label}: ok, {warps} warps, shared {k.metadata.shared} B"
              + (f", {rec['ptxas']}" if "ptxas" in rec else ""), flush=True)
    compile_kernel(direct_pre_kernel, {"CH": 1024}, 4)
    for W in (82, 144, 320):  # 656-, 1,152- and 2,560-B rows: 2, 3 and 5 column blocks
        compile_kernel(gather_rows_kernel, dict(W=W, R=gather_rows_per_prog(in_flight_units(W, 64)), CW=64, VEC=2), 4)
    records += [{"kernel": "direct_pre_kernel"}, {"kernel": "gather_rows_kernel"}]
    print("direct_pre_kernel, gather_rows_kernel: ok")
    write_report(args.out, "compile_sm90", "bench/compile_sm90.py", t0, "sm_90 (ptxas -arch=sm_90a for --regs)", records)


if __name__ == "__main__":
    main()
