"""Compile the sparse-MLA split kernel, `moe_align` and the indexer's scoring kernels for sm_90 on a CPU machine.

    python3 bench/compile_sm90_mla.py [--out bench/results/compile_sm90_mla_cpu_sNN.json]

`sparse_mla_split_kernel` (kernels/sparse_mla.py) at glm5-faithful's shape (64 heads, latent 512 + rope 64,
FP8 656-B rows in 64-row pages, bf16 queries) for the shipped wide tile and its neighbours, each FP8
scale path (kernels/sparse_mla_rows.py) and bf16 rows; `moe_align_kernel` (kernels/moe_align.py) at 16, 32
and 256 experts; the indexer's per-token and grouped scoring kernels (kernels/indexer.py) at GLM-5's 32 index
heads x 128 over FP8 keys, 32 query rows a product: whether ptxas gets a warpgroup MMA, `wgmma`, or `mma.sync`
(`mma.sync`: sm_90's `wgmma` takes 64 rows; session 48's ways to 64 rows, padded heads and two tokens a product,
got `wgmma` and were 1.24-2.23x slower on an H100, `indexer_bh_s49_h100.json`, and were removed). Each is lowered to PTX and assembled by the ptxas
Triton's wheel ships (`ptxas -v`: registers and spill bytes, as `bench/compile_sm90.py` does for the
resolver). Pointers and the integer arguments in DIVISIBLE carry `tt.divisibility` 16, as Triton's JIT specializes a launch whose pointers
are 16-B aligned and whose integers are multiples of 16 (every stride at glm5-faithful's shape is).
The verification round's overflow staging (`stage_overflow_kernel`, kernels/stage_overflow.py) at widths 5
and 8. Static only: nothing runs, so speed and exactness still need the GPU; a spill is local-memory
traffic in every loop iteration that touches it.
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

os.environ.pop("TRITON_INTERPRET", None)  # bench.compile_sm90's imports may set it on a machine without CUDA
import triton.language as tl  # noqa: E402

from dhisparse.kernels import indexer as ix  # noqa: E402
from dhisparse.kernels import moe_align as ma  # noqa: E402
from dhisparse.kernels import sparse_mla as sm  # noqa: E402
from dhisparse.kernels import stage_overflow as so  # noqa: E402

MLA_PTRS = {"q_ptr": "*bf16", "qpe_ptr": "*bf16", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "loc_ptr": "*i64"}
DIVISIBLE = {"sq_t", "sq_h", "sp_t", "sp_h", "sl_t", "H", "K", "S", "CHUNK", "ps0", "rs0", "ps1", "rs1"}
SCALE_NAMES = {0: "gather", 1: "reshape", 2: "select", 3: "fold"}


def _compile(kern, ptrs: dict, consts: dict, num_warps: int, num_stages: int, wide: set[str] = frozenset()):
    sig, cst, attrs = {}, {}, {}
    for i, arg in enumerate(kern.arg_names):
        if arg in consts:
            sig[arg], cst[(i,)] = "constexpr", consts[arg]
            continue
        sig[arg] = ptrs.get(arg, "fp32" if arg == "qk_scale" else ("i64" if arg in wide else "i32"))
        if arg.endswith("_ptr") or arg in DIVISIBLE:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=kern, signature=sig, constexprs=cst, attrs=attrs), target=TARGET,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def mla_consts(bh: int, bk: int, fp8: bool, sc: int, two: bool = False, ieee: bool = False) -> dict:
    """The sparse-MLA kernels' constexprs at glm5-faithful's shape (C 512, R 64, 64-row pages; FP8 rows
    of the 656-B layout or bf16 rows) for a tile, scale path, one or two row spaces and fp32 math."""
    return dict(PER0=64, PER1=64, C=512, R=64, BC=512, BR=64, BLOCK_H=bh, BLOCK_K=bk, TWO=two,
                SPACE_BITS=sm.SPACE_BITS, IEEE=ieee, INTERP=False, FP8=fp8, SO=512 if fp8 else 0,
                RO=528 if fp8 else 0, TILE=128 if fp8 else 1, SCALES=sc)


def mla_variants() -> list[tuple[int, int, int, int, bool, int]]:
    """(block_h, block_k, warps, stages, fp8, scale path): the shipped plan first (plan_sparse_mla at 64 heads)."""
    p = sm.plan_sparse_mla(64, 512, 64)
    out = [(p.block_h, p.block_k, p.num_warps, p.num_stages, True, 2)]
    out += [(64, 64, 8, 1, True, s) for s in (0, 1, 3)] + [(64, 64, 8, 1, False, 0)]
    out += [(64, 32, 8, 1, True, 2), (32, 64, 8, 1, True, 2), (64, 64, 4, 1, True, 2), (64, 64, 8, 2, True, 2),
            (16, 32, 8, 2, True, 2)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0, records = time.time(), []
    for bh, bk, nw, st, fp8, sc in mla_variants():
        rows = "*u8" if fp8 else "*bf16"
        k = _compile(sm.sparse_mla_split_kernel, MLA_PTRS | {"r0_ptr": rows, "r1_ptr": rows}, mla_consts(bh, bk, fp8, sc),
                     nw, st, wide={"ps0", "rs0", "ps1", "rs1"})
        rec = {"kernel": "sparse_mla_split_kernel", "rows": "fp8" if fp8 else "bf16",
               "scales": SCALE_NAMES[sc] if fp8 else None, "block_h": bh, "block_k": bk, "num_warps": nw,
               "num_stages": st, "shared_bytes": k.metadata.shared, "ptxas": regs(k), "wgmma": "wgmma" in k.asm["ptx"]}
        records.append(rec)
        print(f"sparse_mla_split_kernel {rec['rows']} {rec['scales']} {bh}x{bk} w{nw} s{st}: {rec['ptxas']}, "
              f"shared {rec['shared_bytes']} B, {'wgmma' if rec['wgmma'] else 'mma.sync'}", flush=True)
    for ep in (16, 32, 256):
        consts = dict(BM=16, EP=ep, CH=ma.CHUNK, FILL=ma.FILL)
        k = _compile(ma.moe_align_kernel, {"ids_ptr": "*i64", "rows_ptr": "*i32", "blk_ptr": "*i32"}, consts, 4, 3)
        records.append({"kernel": "moe_align_kernel", "experts_padded": ep, "num_warps": 4, "ptxas": regs(k)})
        print(f"moe_align_kernel EP {ep}: {records[-1]['ptxas']}", flush=True)
    ptrs = {"q_ptr": "*bf16", "w_ptr": "*bf16", "k_ptr": "*u8", "s_ptr": "*u8", "loc_ptr": "*i64", "len_ptr": "*i64",
            "pos_ptr": "*i64", "req_ptr": "*i64", "out_ptr": "*fp32"}
    for kern, extra in ((ix.indexer_score_kernel, {}), (ix.indexer_score_group_kernel, {"QG": 8})):
        for bh in (32,):
            consts = dict(IPS=64, BH=bh, BD=128, BS=ix.BLOCK_S, IEEE=False, FP8=True, KDT=tl.bfloat16) | extra
            k = _compile(kern, ptrs, consts, 4, 3, wide={"ks0", "ks1", "ks2", "ss0", "ss1"})
            ptx = k.asm["ptx"]
            mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
            records.append({"kernel": kern.fn.__name__, "block_h": bh, "heads": 32, "num_warps": 4,
                            "group": extra.get("QG", 1), "shared_bytes": k.metadata.shared, "ptxas": regs(k), "mma": mma})
            print(f"{kern.fn.__name__} BH {bh}: {records[-1]['ptxas']}, {mma}", flush=True)
    ptrs = {f"{n}_ptr": "*i64" for n in ("sel", "loc", "slots", "sl", "ht", "src", "dst", "cnt")}
    ptrs |= {f"{n}_ptr": "*i32" for n in ("bits", "pre", "cn")}
    for kk in (2048 * 5, 2048 * 8):  # a round's K x k at widths 5 and 8, 100K positions of 64-row pages
        consts = dict(KK=kk, W=-(-1601 * 64 // 32), SPACE_=so.SPACE, BLOCK=1024, WB=1024)
        k = _compile(so.stage_overflow_kernel, ptrs, consts, 4, 3, wide={"sl_s0", "ht_s0", "host_ps"})
        records.append({"kernel": "stage_overflow_kernel", "KK": kk, "num_warps": 4, "ptxas": regs(k)})
        print(f"stage_overflow_kernel KK {kk}: {records[-1]['ptxas']}", flush=True)
    write_report(args.out, "compile_sm90_mla", "bench/compile_sm90_mla.py", t0, "sm_90 (ptxas -arch=sm_90a)", records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
