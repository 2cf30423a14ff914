"""Triton sparse latent attention (MLA, absorbed form) for decode and verification queries.

Same semantics as `dhisparse.kernels.sparse_mla_ref.sparse_mla_reference`:

    q_abs [T, H, C], q_pe [T, H, R], rows (paged row space [P, per_page, W], or a tuple of two:
    location = space * SPACE + flat), loc [T, k] int64 (-1 = skip), scale, fmt  ->  out [T, H, C]
    fmt None / plain: W = C + R model-dtype values. fmt FP8 (core/kvformat.py, the 656-B FlashMLA
    layout): W bytes | C e4m3 | C/TILE fp32 scales | R bf16 |; c = e4m3 * scale in fp32, then the
    query dtype, exactly as `RowFormat.decode` (the reference dequantizes the gathered rows). How
    the kernel reads FP8 rows (four scale paths) lives in `kernels/sparse_mla_rows.py`.
    logit[t, h, i] = (q_abs[t, h] . c[loc[t, i]] + q_pe[t, h] . k_pe[loc[t, i]]) * scale
    out[t, h]      = softmax_i(logit[t, h]) . c          (fp32 softmax; no valid loc -> zeros)

Grid (T, cdiv(H, BLOCK_H)): one program per (token, head block). It walks the token's k locations
in blocks of BLOCK_K, gathers each block's rows once for all BLOCK_H heads (every MLA head reads the
same latent rows) and keeps an online softmax (running max / sum in fp32). Rows are read through
base pointers and (page, row) strides, so strided views such as `KVArena.latent[:, layer]` and the
staging arena are read in place. Rows per page are compile-time constants (PER0 / PER1): a
location's page and slot then cost a shift and a mask, not an int64 division by a runtime value.

Split rows (plan.split_rows = n > 0, flash-decoding): a decode pass has one program per token, 31
at 8K C36 on 132 SMs. With a split, program (t, hb, j) walks only locations j*n .. j*n+n-1 and
writes its partial (unnormalised acc [BLOCK_H, C], running max m, sum l) to a workspace; a combine
kernel merges the S = cdiv(k, n) partials of each token in a fixed order:

    M = max_j m_j      out = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) l_j      (0 if no valid row)

S depends on k only, never on the batch, so a token's arithmetic is the same in any pass
(verification reproduces decoding). On by default, n by tile (a model's heads fix it): 128 on the
narrow tile (DEFAULT_SPLIT_ROWS: on the H200 a 32K decode step's attention at 16 heads fell from 6.9 to
2.5 ms, bench/results/step_profile_32k_c18_split128_s10a_h200.json, mla_tune_s10b_h200.json) and 512 on
the wide one (WIDE_SPLIT_ROWS: at 64 heads, k 2,048, FP8 rows, 0.61-0.75x of 128's time over T 20-235 on
an H100, and the costed round's attention 25.5 -> 18.9 ms, mla_split_s48_h100.json). The environment
variable DHISPARSE_MLA_SPLIT_ROWS sets one n for every tile (0 = no split). Plan / run:

    plan = plan_sparse_mla(H, C, R)                         # block sizes, warps (host only)
    out = run_sparse_mla(plan, q_abs, q_pe, rows, loc, scale)
    out = sparse_mla(q_abs, q_pe, rows, loc, scale)         # dispatcher used by MLAttention

`sparse_mla` uses the kernel for CUDA tensors and the PyTorch reference otherwise, or always when
DHISPARSE_TORCH_KERNELS=1. On CPU the kernel runs under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dhisparse.kernels.backend import DEFAULT_SPLIT_ROWS, WIDE_SPLIT_ROWS, on_configure, settings, use_triton
from dhisparse.kernels.sparse_mla_ref import sparse_mla_reference
import triton
import triton.language as tl

from dhisparse.core.kvformat import RowFormat
from dhisparse.core.rows import SPACE
from dhisparse.kernels.sparse_mla_rows import _attend_block_fold, _fp8_args, _fp8_rows, _online_softmax

__all__ = ["SparseMLAPlan", "plan_sparse_mla", "run_sparse_mla", "sparse_mla", "backend"]

SPACE_BITS = SPACE.bit_length() - 1
assert SPACE == 1 << SPACE_BITS
LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(k0, q, qpe, m_i, l_i, acc, loc_ptr, r0_ptr, r1_ptr, K, PER0: tl.constexpr, ps0, rs0,
                  PER1: tl.constexpr, ps1, rs1, qk_scale, cc, rr, cm, rm, C: tl.constexpr, BLOCK_K: tl.constexpr,
                  TWO: tl.constexpr, SPACE_BITS: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                  SO: tl.constexpr, RO: tl.constexpr, TILE: tl.constexpr,
                  SCALES: tl.constexpr):
    """Locations k0 .. k0+BLOCK_K of one token (loc_ptr at its row): gather, score, online-softmax update."""
    cdt = q.dtype
    kk = k0 + tl.arange(0, BLOCK_K)
    loc = tl.load(loc_ptr + kk, mask=kk < K, other=-1)
    valid = loc >= 0
    if TWO:
        space = loc >> SPACE_BITS
        flat = loc & ((1 << SPACE_BITS) - 1)
        off0 = (flat // PER0) * ps0 + (flat % PER0) * rs0
        off1 = (flat // PER1) * ps1 + (flat % PER1) * rs1
        base = tl.where(space == 0, r0_ptr + off0, r1_ptr + off1)
    else:
        base = r0_ptr + (loc // PER0) * ps0 + (loc % PER0) * rs0
    cmask = valid[:, None] & cm[None, :]
    rmask = valid[:, None] & rm[None, :]
    if FP8:  # uint8 rows: e4m3 values, fp32 scales at byte SO (one per TILE), bf16 rope at byte RO
        cf, kpe8 = _fp8_rows(base, valid, cc, rr, cmask, rmask, C, BLOCK_K, SO, RO, TILE, SCALES)
        c, kpe = cf.to(cdt), kpe8.to(cdt)
    else:
        c = tl.load(base[:, None] + cc[None, :], mask=cmask, other=0.0).to(cdt)
        kpe = tl.load(base[:, None] + C + rr[None, :], mask=rmask, other=0.0).to(cdt)
    if IEEE:
        s = tl.dot(q, tl.trans(c), input_precision="ieee")
        s = tl.dot(qpe, tl.trans(kpe), s, input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(c))
        s = tl.dot(qpe, tl.trans(kpe), s)
    m_new, l_i, alpha, p = _online_softmax(s, valid, qk_scale, m_i, l_i)
    if IEEE:
        acc = tl.dot(p, c.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(cdt), c, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _attend_range(q_ptr, qpe_ptr, sq_t, sq_h, sp_t, sp_h, lp, r0_ptr, r1_ptr, t, heads, lo, hi,
                  H, PER0: tl.constexpr, ps0, rs0, PER1: tl.constexpr, ps1, rs1, qk_scale,
                  C: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr,
                  SPACE_BITS: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr, FP8: tl.constexpr,
                  SO: tl.constexpr, RO: tl.constexpr, TILE: tl.constexpr,
                  SCALES: tl.constexpr):
    """Token t's queries of `heads` over its locations lo .. hi-1 (lp at its row): the online-softmax
    state (m [BLOCK_H], l [BLOCK_H], unnormalised acc [BLOCK_H, BC], fp32).

    INTERP: the interpreter cannot run `range` over a runtime bound, so it walks k with `while`;
    compiled code uses `range` (software-pipelined over num_stages)."""
    hm = heads < H
    cc = tl.arange(0, BC)
    rr = tl.arange(0, BR)
    cm = cc < C
    rm = rr < R
    q = tl.load(q_ptr + t * sq_t + heads[:, None] * sq_h + cc[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
    qpe = tl.load(qpe_ptr + t * sp_t + heads[:, None] * sp_h + rr[None, :], mask=hm[:, None] & rm[None, :], other=0.0)
    if IEEE:  # fp32 math (fp32 inputs, or the interpreter, whose bf16 tl.dot is wrong)
        q = q.to(tl.float32)
    qpe = qpe.to(q.dtype)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if FP8 and SCALES == 3:  # scales folded into scores and p (`_attend_block_fold`)
        q3 = tl.permute(tl.reshape(q, (BLOCK_H, C // TILE, TILE)), (1, 0, 2))
        acc3 = tl.zeros([C // TILE, BLOCK_H, TILE], tl.float32)
        if INTERP:
            k0 = lo
            while k0 < hi:
                m_i, l_i, acc3 = _attend_block_fold(k0, q3, qpe, m_i, l_i, acc3, lp, r0_ptr, hi, PER0, ps0, rs0, qk_scale,
                                                    cc, rr, cm, rm, C, BLOCK_K, IEEE, SO, RO, TILE)
                k0 += BLOCK_K
        else:
            for k0 in range(lo, hi, BLOCK_K):
                m_i, l_i, acc3 = _attend_block_fold(k0, q3, qpe, m_i, l_i, acc3, lp, r0_ptr, hi, PER0, ps0, rs0, qk_scale,
                                                    cc, rr, cm, rm, C, BLOCK_K, IEEE, SO, RO, TILE)
        return m_i, l_i, tl.reshape(tl.permute(acc3, (1, 0, 2)), (BLOCK_H, BC))
    acc = tl.zeros([BLOCK_H, BC], tl.float32)
    if INTERP:
        k0 = lo
        while k0 < hi:
            m_i, l_i, acc = _attend_block(k0, q, qpe, m_i, l_i, acc, lp, r0_ptr, r1_ptr, hi, PER0, ps0, rs0, PER1, ps1,
                                          rs1, qk_scale, cc, rr, cm, rm, C, BLOCK_K, TWO, SPACE_BITS, IEEE, FP8, SO, RO, TILE, SCALES)
            k0 += BLOCK_K
    else:
        for k0 in range(lo, hi, BLOCK_K):
            m_i, l_i, acc = _attend_block(k0, q, qpe, m_i, l_i, acc, lp, r0_ptr, r1_ptr, hi, PER0, ps0, rs0, PER1, ps1,
                                          rs1, qk_scale, cc, rr, cm, rm, C, BLOCK_K, TWO, SPACE_BITS, IEEE, FP8, SO, RO, TILE, SCALES)
    return m_i, l_i, acc


@triton.jit
def sparse_mla_kernel(q_ptr, qpe_ptr, out_ptr, loc_ptr, r0_ptr, r1_ptr,
                      sq_t, sq_h, sp_t, sp_h, so_t, so_h, sl_t,
                      H, K, ps0, rs0, ps1, rs1, qk_scale, PER0: tl.constexpr, PER1: tl.constexpr,
                      C: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr,
                      SPACE_BITS: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr, FP8: tl.constexpr,
                      SO: tl.constexpr, RO: tl.constexpr, TILE: tl.constexpr,
                  SCALES: tl.constexpr):
    """Program (t, hb): heads hb*BLOCK_H .. +BLOCK_H of token t. qk_scale = scale * log2(e)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_i, l_i, acc = _attend_range(q_ptr, qpe_ptr, sq_t, sq_h, sp_t, sp_h, loc_ptr + t * sl_t, r0_ptr, r1_ptr, t, heads,
                                  0, K, H, PER0, ps0, rs0, PER1, ps1, rs1, qk_scale, C, R, BC, BR, BLOCK_H, BLOCK_K,
                                  TWO, SPACE_BITS, IEEE, INTERP, FP8, SO, RO, TILE, SCALES)
    cc = tl.arange(0, BC)
    o = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(out_ptr + t * so_t + heads[:, None] * so_h + cc[None, :], o.to(out_ptr.dtype.element_ty),
             mask=(heads < H)[:, None] & (cc < C)[None, :])


@triton.jit
def sparse_mla_split_kernel(q_ptr, qpe_ptr, acc_ptr, ml_ptr, loc_ptr, r0_ptr, r1_ptr,
                            sq_t, sq_h, sp_t, sp_h, sl_t,
                            H, K, S, CHUNK, ps0, rs0, ps1, rs1, qk_scale, PER0: tl.constexpr, PER1: tl.constexpr,
                            C: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr,
                            SPACE_BITS: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr, FP8: tl.constexpr,
                            SO: tl.constexpr, RO: tl.constexpr, TILE: tl.constexpr,
                  SCALES: tl.constexpr):
    """Program (t, hb, j): the partial of locations j*CHUNK .. min(K, j*CHUNK + CHUNK) of token t,
    heads hb*BLOCK_H ..: acc [T, S, H, C] (unnormalised) and ml [T, S, H, 2] (max, sum) in fp32."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.program_id(2)
    lo = j * CHUNK
    m_i, l_i, acc = _attend_range(q_ptr, qpe_ptr, sq_t, sq_h, sp_t, sp_h, loc_ptr + t * sl_t, r0_ptr, r1_ptr, t, heads,
                                  lo, tl.minimum(K, lo + CHUNK), H, PER0, ps0, rs0, PER1, ps1, rs1, qk_scale, C, R, BC,
                                  BR, BLOCK_H, BLOCK_K, TWO, SPACE_BITS, IEEE, INTERP, FP8, SO, RO, TILE, SCALES)
    hm = heads < H
    cc = tl.arange(0, BC)
    row = (t * S + j) * H + heads  # [BLOCK_H] rows of the workspaces
    tl.store(acc_ptr + row[:, None] * C + cc[None, :], acc, mask=hm[:, None] & (cc < C)[None, :])
    tl.store(ml_ptr + row * 2, m_i, mask=hm)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=hm)


@triton.jit
def sparse_mla_combine_kernel(acc_ptr, ml_ptr, out_ptr, so_t, so_h, H,
                              S: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (t, hb, cb): merge the S partials of token t (fixed order j = 0 .. S-1) into out,
    latent columns cb*BC .. cb*BC + BC - 1 (every column block recomputes the same weights, so a
    column's arithmetic does not depend on BC: a [T]-row grid had one program a token and layer)."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = heads < H
    cc = tl.program_id(2) * BC + tl.arange(0, BC)
    cm = cc < C
    M = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for j in tl.static_range(S):
        M = tl.maximum(M, tl.load(ml_ptr + ((t * S + j) * H + heads) * 2, mask=hm, other=float("-inf")))
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    num = tl.zeros([BLOCK_H, BC], tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(S):
        row = (t * S + j) * H + heads
        m = tl.load(ml_ptr + row * 2, mask=hm, other=float("-inf"))
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - M_safe))
        den += w * tl.load(ml_ptr + row * 2 + 1, mask=hm, other=0.0)
        num += w[:, None] * tl.load(acc_ptr + row[:, None] * C + cc[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
    o = tl.where(den[:, None] > 0, num / tl.where(den > 0, den, 1.0)[:, None], 0.0)
    tl.store(out_ptr + t * so_t + heads[:, None] * so_h + cc[None, :], o.to(out_ptr.dtype.element_ty),
             mask=hm[:, None] & cm[None, :])


@dataclass(frozen=True)
class SparseMLAPlan:
    """Launch shape for (H, C, R): heads per program, locations per block, warps, stages, and
    split_rows: locations per program when a token's k locations are split (0: one program walks
    all of them; else a multiple of block_k). wide: the tile holds [block_h, C] queries and a
    [block_k, C] row tile at C > 256 with block_h >= 32, which fits in shared memory only with
    16-bit queries (run_sparse_mla refuses fp32 ones on the GPU)."""

    H: int
    C: int
    R: int
    block_h: int
    block_k: int
    num_warps: int
    num_stages: int
    split_rows: int = 0
    wide: bool = False


def _p2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(1, n)))


WIDE_HEADS = 64  # heads a program takes at C > 256 with 16-bit queries (GLM-5's 64: one head block a token)


def plan_sparse_mla(H: int, C: int, R: int, block_h: int | None = None, block_k: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None, split_rows: int | None = None,
                    dtype: torch.dtype | None = None) -> SparseMLAPlan:
    """Pick block sizes (tl.dot needs every dim >= 16; smaller H, C, R are padded and masked).

    At C > 256 a program takes up to WIDE_HEADS heads: every head reads the same latent rows, so a
    token's rows are gathered (and FP8-decoded) once for all of them instead of once per 16-head
    block. From 32 heads a program walks 64 rows a block in one stage (fp32 acc [64, 512] plus a
    [64, 512] row tile on 8 warps); at 64 heads, k 2,048, FP8 rows that is 0.41x the 16 x 32
    tile's time at T 47 and 0.37x at T 188 (bench/results/mla_tune_64h_fp8_s29c_h200.json).
    fp32 queries (dtype float32: tests, the interpreter) keep 16 heads x 32 rows in two stages, as
    every C > 256 plan did before: the wide tile of fp32 queries needs ~280 KB of shared memory,
    over the H200's 227 KB, so pass the query dtype when it may be fp32 (dtype None plans for
    16-bit queries); small C takes up to 64 heads x 16 rows on 4 warps. split_rows
    (default KernelSettings.mla_split_rows; when that is None, WIDE_SPLIT_ROWS on the wide tile and
    DEFAULT_SPLIT_ROWS otherwise; 0 = off) is rounded up to a multiple of block_k."""
    big = C > 256
    bh = _p2(block_h or min(_p2(H), (16 if dtype == torch.float32 else WIDE_HEADS) if big else 64))
    wide = big and bh >= 32
    bk = _p2(block_k or (64 if wide else 32 if big else 16))
    nw = num_warps or (8 if big else 4)
    st = num_stages or (1 if wide else 2)
    n = settings().mla_split_rows if split_rows is None else split_rows
    if n is None:
        n = WIDE_SPLIT_ROWS if wide else DEFAULT_SPLIT_ROWS
    if n < 0:
        raise ValueError(f"split_rows must be >= 0 (0: no split), got {n}")
    return SparseMLAPlan(H, C, R, bh, bk, nw, st, -(-n // bk) * bk, wide)


class RowSpace(NamedTuple):
    """A [P, per_page, W] row space: rows per page (a compile-time constant of the kernels, so a
    location's page and slot cost a shift and a mask for a power-of-two page, not an int64
    division), page stride and row stride in elements."""

    per: int
    ps: int
    rs: int


def _space(r: torch.Tensor) -> RowSpace:
    """The RowSpace of a [P, per_page, W] row space with unit last stride."""
    if r.dim() != 3 or r.stride(-1) != 1:
        raise ValueError(f"row space must be [P, per_page, W] with unit last stride, got {tuple(r.shape)} {r.stride()}")
    return RowSpace(r.shape[1], r.stride(0), r.stride(1))


def run_sparse_mla(plan: SparseMLAPlan, q_abs: torch.Tensor, q_pe: torch.Tensor,
                   rows: torch.Tensor | tuple[torch.Tensor, ...], loc: torch.Tensor, scale: float,
                   fmt: RowFormat | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q_abs [T, H, C], q_pe [T, H, R], rows (one or two row spaces of `fmt` rows: None / plain =
    C + R values; FP8 = the 656-B layout, dequantized in the kernel), loc [T, k] int64 -> out [T, H, C]."""
    T, H, C = q_abs.shape
    R = q_pe.shape[-1]
    assert (H, C, R) == (plan.H, plan.C, plan.R), f"plan is for {(plan.H, plan.C, plan.R)}, got {(H, C, R)}"
    if plan.wide and q_abs.dtype == torch.float32 and not _interpreting():
        raise ValueError(f"q_abs: a wide plan ({plan.block_h} heads x {plan.block_k} rows at C {C}) needs 16-bit "
                         "queries on the GPU (fp32 overflows shared memory); plan with dtype=torch.float32")
    spaces = (rows,) if isinstance(rows, torch.Tensor) else tuple(rows)
    if not 1 <= len(spaces) <= 2:
        raise ValueError(f"the kernel reads one or two row spaces, got {len(spaces)}")
    fp8 = _fp8_args(fmt, C, R, len(spaces) == 2)
    width = fmt.width if fp8[0] else C + R
    for r in spaces:
        if r.shape[-1] != width or r.dtype != spaces[0].dtype:
            raise ValueError(f"row width {r.shape[-1]} != {width} (C + R = {C + R}, format {fmt}) or mixed row dtypes")
    if out is None:
        out = q_abs.new_empty(T, H, C)
    k = loc.shape[1] if loc.dim() == 2 else 0
    if T == 0:
        return out
    if k == 0:
        return out.zero_()
    q_abs = q_abs if q_abs.stride(-1) == 1 else q_abs.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    loc = loc.to(torch.int64)
    loc = loc if loc.stride(-1) == 1 else loc.contiguous()
    assert out.stride(-1) == 1
    s0 = _space(spaces[0])
    s1 = _space(spaces[1]) if len(spaces) == 2 else s0
    r1 = spaces[1] if len(spaces) == 2 else spaces[0]
    ieee = q_abs.dtype == torch.float32 or _interpreting()
    if plan.split_rows and k > plan.split_rows:
        return _run_split(plan, q_abs, q_pe, spaces[0], r1, s0, s1, loc, k, scale, out, ieee, len(spaces) == 2, fp8)
    grid = (T, triton.cdiv(H, plan.block_h))
    sparse_mla_kernel[grid](
        q_abs, q_pe, out, loc, spaces[0], r1,
        q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0), out.stride(1), loc.stride(0),
        H, k, s0.ps, s0.rs, s1.ps, s1.rs, float(scale) * LOG2E, PER0=s0.per, PER1=s1.per,
        C=C, R=R, BC=_p2(C), BR=_p2(R), BLOCK_H=plan.block_h, BLOCK_K=plan.block_k, TWO=len(spaces) == 2,
        SPACE_BITS=SPACE_BITS, IEEE=ieee, INTERP=_interpreting(), FP8=fp8[0], SO=fp8[1], RO=fp8[2], TILE=fp8[3],
        SCALES=fp8[4],
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    return out


SPLIT_WORKSPACE_BYTES = 1 << 30  # split-rows partials of one launch; longer passes run in token chunks
COMBINE_COLUMNS = 64  # latent columns a combine program merges (C 512: 8 programs a token and head block)
COMBINE_HEADS = 16  # heads a combine program merges, whatever the split tile's block_h (the wide tile's 64 in
# one program gave a quarter of the programs: 4.5 ms a glm5-faithful step against 2.4 at 16, s30a vs s29b)


def _run_split(plan: SparseMLAPlan, q_abs, q_pe, r0, r1, s0, s1, loc, k: int, scale: float, out, ieee: bool,
               two: bool, fp8: tuple) -> torch.Tensor:
    """The split-rows launch (module docstring): partials over S = cdiv(k, split_rows) chunks, then
    the combine. Workspaces acc [Tc, S, H, C] and ml [Tc, S, H, 2] fp32, Tc tokens a launch so they
    stay under SPLIT_WORKSPACE_BYTES (a prefill chunk of GLM-5's 64 heads would need 17 GB at once);
    a token's arithmetic is the same in any chunk."""
    T, H, C = q_abs.shape
    S = triton.cdiv(k, plan.split_rows)
    per_token = S * H * (C + 2) * 4
    Tc = max(1, min(T, SPLIT_WORKSPACE_BYTES // per_token))
    acc = torch.empty((Tc, S, H, C), dtype=torch.float32, device=q_abs.device)
    ml = torch.empty((Tc, S, H, 2), dtype=torch.float32, device=q_abs.device)
    for t0 in range(0, T, Tc):
        t1 = min(T, t0 + Tc)
        _split_launch(plan, q_abs[t0:t1], q_pe[t0:t1], r0, r1, s0, s1, loc[t0:t1], k, S, scale, out[t0:t1],
                      acc, ml, ieee, two, fp8)
    return out


def _split_launch(plan: SparseMLAPlan, q_abs, q_pe, r0, r1, s0, s1, loc, k: int, S: int, scale: float, out,
                  acc, ml, ieee: bool, two: bool, fp8: tuple) -> None:
    """One token chunk of `_run_split` (q_abs / q_pe / loc / out: that chunk's rows; acc / ml: at least as many)."""
    T, H, C = q_abs.shape
    R = q_pe.shape[-1]
    hb = triton.cdiv(H, plan.block_h)
    sparse_mla_split_kernel[(T, hb, S)](
        q_abs, q_pe, acc, ml, loc, r0, r1,
        q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), loc.stride(0),
        H, k, S, plan.split_rows, s0.ps, s0.rs, s1.ps, s1.rs, float(scale) * LOG2E, PER0=s0.per, PER1=s1.per,
        C=C, R=R, BC=_p2(C), BR=_p2(R), BLOCK_H=plan.block_h, BLOCK_K=plan.block_k, TWO=two,
        SPACE_BITS=SPACE_BITS, IEEE=ieee, INTERP=_interpreting(), FP8=fp8[0], SO=fp8[1], RO=fp8[2], TILE=fp8[3],
        SCALES=fp8[4],
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    bc, bh = min(_p2(C), COMBINE_COLUMNS), min(plan.block_h, COMBINE_HEADS)
    sparse_mla_combine_kernel[(T, triton.cdiv(H, bh), triton.cdiv(C, bc))](acc, ml, out, out.stride(0), out.stride(1), H,
                                                                          S=S, C=C, BC=bc, BLOCK_H=bh, num_warps=4)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_PLANS: dict[tuple[int, int, int, torch.dtype], SparseMLAPlan] = {}
on_configure(_PLANS.clear)  # a new split setting takes effect at the next engine build


def sparse_mla_triton(q_abs: torch.Tensor, q_pe: torch.Tensor, rows, loc: torch.Tensor, scale: float,
                      fmt: RowFormat | None = None) -> torch.Tensor:
    """`run_sparse_mla` with a cached default plan for this (H, C, R) and query dtype."""
    key = (q_abs.shape[1], q_abs.shape[2], q_pe.shape[-1], q_abs.dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = plan_sparse_mla(*key[:3], dtype=key[3])
    return run_sparse_mla(plan, q_abs, q_pe, rows, loc, scale, fmt)


def backend(q: torch.Tensor) -> str:
    """'triton' for CUDA tensors (kernels/backend.py: KernelSettings.backend), else 'torch'."""
    return "triton" if use_triton(q) else "torch"


def sparse_mla(q_abs: torch.Tensor, q_pe: torch.Tensor, rows, loc: torch.Tensor, scale: float,
               fmt: RowFormat | None = None) -> torch.Tensor:
    """Dispatcher: same contract as `sparse_mla_reference`."""
    if backend(q_abs) == "triton":
        return sparse_mla_triton(q_abs, q_pe, rows, loc, scale, fmt)
    return sparse_mla_reference(q_abs, q_pe, rows, loc, scale, fmt)
