"""Fingerprint the sm_90 PTX of the sparse-MLA kernels, to show on the CPU that a refactor leaves the GPU code unchanged.

    python3 bench/ptx_fingerprint.py [--tree DIR] [--out bench/results/ptx_fingerprint_sNN.json]

Each kernel (`sparse_mla_split_kernel`, `sparse_mla_kernel`) is compiled for sm_90 (Triton's own
lowering, as `bench/compile_sm90_mla.py` does) at the engine's configurations: the wide 64 x 64 and
narrow 16 x 32 tiles, FP8 rows by each shipped scale path and plain bf16 rows, one and two row
spaces, and fp32 (IEEE) math. The PTX is hashed after dropping what does not reach the GPU's
instructions: the debug sections, `.loc` / `.file` lines, comments and the `$L__tmpN` labels that
mark inlined function boundaries. Equal hashes at two commits (--tree: a folder holding that commit's
`dhisparse/` only, `git archive COMMIT dhisparse | tar -x -C DIR`, so this checkout's bench helpers
compile it) mean the same instructions, so a CUDA exactness run of one covers the other; unequal
hashes say nothing, and a diff of the PTX shows what moved. A constexpr in EXTRA (one some trees'
kernels take) is passed only where the kernel names it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import sys
import time

# (tile h x k, warps, stages, fp8, scale path, two row spaces, fp32 math)
CONFIGS = [(64, 64, 8, 1, True, 2, False, False), (64, 64, 8, 1, False, 0, False, False),
           (16, 32, 8, 2, True, 2, False, False), (16, 32, 8, 2, False, 0, True, False),
           (64, 64, 8, 1, True, 0, True, False), (16, 32, 8, 2, True, 1, False, True)]


# constexprs some trees' kernels take beyond CONFIGS' (session 48's value split), at their off value
EXTRA = {"VS": 1}


def normalized(ptx: str) -> str:
    """The PTX's instructions: debug sections, .loc / .file lines, comments, inlining labels and blank lines dropped."""
    text = re.split(r"\.section\s+\.debug", ptx)[0]
    return "\n".join(line for line in text.splitlines()
                     if line.strip() and not re.match(r"\s*(\.loc|\.file|//|\$L__tmp\d+:)", line))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # the interpreter's jit functions cannot be compiled (here, not at
    # import: a test importing `normalized` must not turn the interpreter off for the tests after it)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    sys.path[:0] = [os.path.abspath(args.tree), here]  # the tree's dhisparse, this checkout's bench helpers
    sm = importlib.import_module("dhisparse.kernels.sparse_mla")
    from bench.compile_sm90 import write_report
    from bench.compile_sm90_mla import MLA_PTRS, _compile, mla_consts

    t0, records = time.time(), []
    for kern in (sm.sparse_mla_split_kernel, sm.sparse_mla_kernel):
        for bh, bk, nw, st, fp8, sc, two, ieee in CONFIGS:
            rows = "*u8" if fp8 else "*bf16"
            consts = mla_consts(bh, bk, fp8, sc, two, ieee) | {n: v for n, v in EXTRA.items() if n in kern.arg_names}
            ptrs = MLA_PTRS | {"r0_ptr": rows, "r1_ptr": rows}
            if kern is sm.sparse_mla_kernel:
                ptrs = {"q_ptr": "*bf16", "qpe_ptr": "*bf16", "out_ptr": "*bf16", "loc_ptr": "*i64"} | ptrs
            k = _compile(kern, ptrs, consts, nw, st, wide={"ps0", "rs0", "ps1", "rs1"})
            rec = {"tree": os.path.abspath(args.tree), "kernel": kern.fn.__name__, "tile": f"{bh}x{bk}", "num_warps": nw, "num_stages": st,
                   "rows": "fp8" if fp8 else "bf16", "scales": sc, "two_spaces": two, "ieee": ieee,
                   "ptx_sha1": hashlib.sha1(normalized(k.asm["ptx"]).encode()).hexdigest()}
            records.append(rec)
            print(" ".join(str(v) for v in list(rec.values())[1:]), flush=True)
    write_report(args.out, "ptx_fingerprint", "bench/ptx_fingerprint.py", t0, "sm_90 (Triton's PTX)", records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
