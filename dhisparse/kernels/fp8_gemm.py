"""Triton GEMMs over block-scaled FP8 weights ("w8a16"): the contracts of `fp8_gemm_ref.py`.

  fp8_linear_triton(x [T, K], w8 [N, K], scale [nb, kb])                        -> [T, N]
  fp8_moe_triton(x [T, K], w8 [E, N, K], scale [E, nb, kb], expert_ids [T, top_k]) -> [T, top_k, N]

Weights stay float8_e4m3fn in memory and are converted in the kernel to the activation's dtype
(bf16 / fp16 on GPU; fp32 for fp32 x, and always under the interpreter, whose 16-bit tl.dot is
wrong). A program owns an output tile [BM, BN] and walks K in steps of BK (a divisor of 128, so a
step lies in one k-block); BN divides 128, so the step's scales are one per column,
scale[(n0 + arange(BN)) // 128, k0 // 128], and acc += tl.dot(x_tile, w_tile.T) * scale[None, :]
in fp32 -- the reference's sum in another order. Masks cover ragged T, N and K.
Decode-sized linears have too few (m, n) tiles to stream their weight at HBM rate (q_a at T 47:
32 tiles on 132 SMs), so they split K (`split_k_for`): fp32 partials added in a fixed order.

The MoE kernel is grouped: `moe_align` sorts the T * top_k (token, slot) rows by expert on the
device with no host sync (CUDA-graph safe), each expert's run padded to a multiple of BM, so each
m-block of the sorted list is one expert's; a program gathers its rows' tokens (row // top_k),
multiplies by that expert's weight tile and writes each row at its flat index t * top_k + j.
Block sizes are keyword arguments (tests pass small ones; the defaults are for the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dhisparse.kernels.fp8_gemm_ref import check_weight
from dhisparse.kernels.fp8_tiles import (LARGE_ROWS, SPLIT_MAX_ROWS, _blocks, _modes, _unit_last,  # noqa: F401
                                        block_m_for, checked_grouping, linear_launch, moe_align, moe_grouping,
                                        moe_launch, padded_rows, split_k_for, tiles_for)


@triton.jit
def _k_step(acc, k0, x_ptr, w_ptr, s_ptr, xrow, rmask, wrow, srow, nmask, K, BK: tl.constexpr, IEEE: tl.constexpr):
    """acc + (x tile @ w tile.T) * scale[n-blocks, k0 // 128] for columns k0 .. k0+BK-1 (all in one k-block)."""
    kk = k0 + tl.arange(0, BK)
    km = kk < K
    a = tl.load(x_ptr + xrow[:, None] + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
    b = tl.load(w_ptr + wrow[:, None] + kk[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
    s = tl.load(s_ptr + srow + k0 // 128, mask=nmask, other=0.0)
    if IEEE:
        part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(a, tl.trans(b.to(a.dtype)))
    return acc + part * s[None, :]


@triton.jit
def _scaled_dot(x_ptr, w_ptr, s_ptr, xrow, rmask, rn, nmask, k_lo, k_hi, K, swn, ssn,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """acc [BM, BN] fp32 = sum over the K steps k_lo, k_lo + BK, .. < k_hi of (x[rows] tile @ w[rn]
    tile.T) * the step's scales (k_lo a multiple of BK; K bounds the last step's mask).
    xrow [BM] int64 element offsets of the x rows; w_ptr / s_ptr point at one [N, K] weight.
    INTERP: the interpreter cannot run `range` over a runtime bound, so it walks K with `while`."""
    wrow = rn.to(tl.int64) * swn
    srow = (rn // 128) * ssn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if INTERP:
        k0 = k_lo
        while k0 < k_hi:
            acc = _k_step(acc, k0, x_ptr, w_ptr, s_ptr, xrow, rmask, wrow, srow, nmask, K, BK, IEEE)
            k0 += BK
    else:
        for k0 in range(k_lo, k_hi, BK):
            acc = _k_step(acc, k0, x_ptr, w_ptr, s_ptr, xrow, rmask, wrow, srow, nmask, K, BK, IEEE)
    return acc


@triton.jit
def fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, KPER, sxt, swn, ssn, sos, sot,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                      INTERP: tl.constexpr):
    """Program (m, n, s): out[s, m*BM : +BM, n*BN : +BN] = x [T, K] @ W [N, K].T over K columns
    s*KPER .. s*KPER + KPER - 1 (split K; KPER a multiple of BK; one split writes out itself)."""
    _linear_program(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, KPER, sxt, swn, ssn, sos, sot, BM, BN, BK, IEEE, INTERP)


@triton.jit
def fp8_expert_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, KPER, sxt, swn, ssn, sos, sot,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                             INTERP: tl.constexpr):
    """`fp8_linear_kernel` under another name, for the shared experts' GEMMs: the same program,
    so the same bits; a profile then counts them with the routed experts (the paper's "expert
    matrix products") instead of with the dense projections."""
    _linear_program(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, KPER, sxt, swn, ssn, sos, sot, BM, BN, BK, IEEE, INTERP)


@triton.jit
def _linear_program(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, KPER, sxt, swn, ssn, sos, sot,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    k_lo = tl.program_id(2) * KPER
    rmask = rm < T
    nmask = rn < N
    acc = _scaled_dot(x_ptr, w_ptr, s_ptr, rm.to(tl.int64) * sxt, rmask, rn, nmask, k_lo, tl.minimum(k_lo + KPER, K),
                      K, swn, ssn, BM, BN, BK, IEEE, INTERP)
    out = out_ptr + tl.program_id(2).to(tl.int64) * sos + rm.to(tl.int64)[:, None] * sot + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def fp8_moe_kernel(x_ptr, w_ptr, s_ptr, out_ptr, rows_ptr, bexp_ptr, M, N, K, E, TOPK,
                   sxt, swe, swn, sse, ssn, sot,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                   INTERP: tl.constexpr):
    """Program (m, n): sorted rows m*BM .. +BM (all of expert block_expert[m]; pads = M) times that
    expert's W[n*BN : +BN].T, written at each row's flat index into out [M, N]. Blocks past the
    used count (block_expert = E) exit at once."""
    pid_m = tl.program_id(0)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        r = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM))
        rmask = r < M
        xrow = (r // TOPK).to(tl.int64) * sxt
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < N
        e64 = e.to(tl.int64)
        acc = _scaled_dot(x_ptr, w_ptr + e64 * swe, s_ptr + e64 * sse, xrow, rmask, rn, nmask, 0, K, K, swn, ssn,
                          BM, BN, BK, IEEE, INTERP)
        out = out_ptr + r.to(tl.int64)[:, None] * sot + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def split_sum_kernel(p_ptr, out_ptr, TN, S: tl.constexpr, BLOCK: tl.constexpr):
    """Program i: out[i*BLOCK : +BLOCK] = sum over s = 0 .. S-1, in that order, of partials[s, same] (fp32),
    cast once to out's dtype; partials [S, T, N] and out [T, N] contiguous."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < TN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(p_ptr + s * TN + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


def split_sum(partials: torch.Tensor, dtype: torch.dtype, block: int = 1024) -> torch.Tensor:
    """partials fp32 [S, T, N] (a split-K linear's, contiguous) -> [T, N] in `dtype`: the splits added in order
    and cast in one pass (torch's `sum(0).to(dtype)` is two kernels: session 42's step ran 546 reduces and 623
    casts)."""
    S, T, N = partials.shape
    out = torch.empty(T, N, dtype=dtype, device=partials.device)
    if T * N:
        split_sum_kernel[(triton.cdiv(T * N, block),)](partials.contiguous(), out, T * N, S=S, BLOCK=block)
    return out


@triton.jit
def fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, swn, ssn, son, BN: tl.constexpr, BK: tl.constexpr):
    """Program (n, k): out[n*BN : +BN, k*BK : +BK] = w8 * scale[n // 128, k // 128] in out's dtype
    (BN, BK divide 128: one scale a tile)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (rn < N)[:, None] & (rk < K)[None, :]
    w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * swn + rk[None, :], mask=m, other=0.0)
    s = tl.load(s_ptr + (tl.program_id(0) * BN // 128) * ssn + tl.program_id(1) * BK // 128)
    tl.store(out_ptr + rn.to(tl.int64)[:, None] * son + rk[None, :], (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=m)


def fp8_dequantize_triton(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, block: int = 64) -> torch.Tensor:
    """w8 float8_e4m3fn [N, K] x its block scales -> [N, K] in `dtype` (contract of
    `dequantize_block_fp8(w8, scale).to(dtype)`, bit for bit: one fp32 product, one cast)."""
    check_weight(w8, scale, stacked=False)
    _blocks(block, block, 16)
    N, K = w8.shape
    out = torch.empty(N, K, dtype=dtype, device=w8.device)
    if N and K:
        w8, scale = _unit_last(w8), scale.contiguous()
        fp8_dequant_kernel[(triton.cdiv(N, block), triton.cdiv(K, block))](
            w8, scale, out, N, K, w8.stride(0), scale.stride(0), out.stride(0), BN=block, BK=block)
    return out


def fp8_linear_triton(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, *, block_m: int | None = None,
                      block_n: int | None = None, block_k: int = 128, num_warps: int | None = None, num_stages: int = 3,
                      split_k: int | None = None, expert: bool = False) -> torch.Tensor:
    """x [T, K] @ W.T -> [T, N] in x's dtype (contract of `fp8_linear_reference`). T == 0: no launch.
    split_k: K splits (None: `split_k_for`); with more than one, each split writes fp32 partial
    sums [split, T, N] that `split_sum` adds in split order (deterministic) and casts. expert: launch
    `fp8_expert_linear_kernel` (the same program under the name a profile counts as experts)."""
    T, N, K, bm, bn, warps, split, kper = linear_launch(x, w8, scale, block_m, block_n, block_k, num_warps, split_k)
    if split == 0:
        return x.new_empty(T, N)
    out = x.new_empty(T, N) if split == 1 else torch.empty(split, T, N, dtype=torch.float32, device=x.device)
    x, w8, scale = _unit_last(x), _unit_last(w8), scale.contiguous()
    kernel = fp8_expert_linear_kernel if expert else fp8_linear_kernel
    kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn), split)](
        x, w8, scale, out, T, N, K, kper, x.stride(0), w8.stride(0), scale.stride(0),
        out.stride(0) if split > 1 else 0, out.stride(-2),
        BM=bm, BN=bn, BK=block_k, **_modes(x), num_warps=warps, num_stages=num_stages)
    return out if split == 1 else split_sum(out, x.dtype)


def fp8_moe_triton(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, expert_ids: torch.Tensor, *,
                   block_m: int | None = None, block_n: int | None = None, block_k: int = 128,
                   num_warps: int | None = None, num_stages: int = 3,
                   grouping: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Grouped x [T, K] x experts -> [T, top_k, N] (contract of `fp8_moe_reference`). Sync-free on
    CUDA, where ids are not checked (that would sync): a row whose id is outside [0, E) is zero.
    On CPU ids are checked like the reference. T == 0: no launch. grouping: `moe_align(expert_ids, E, BM)`
    made beforehand (`moe_grouping`), so a layer's two grouped GEMMs sort their rows once."""
    E, N, K, T, top_k, M, bm, bn, warps = moe_launch(x, w8, scale, expert_ids, block_m, block_n, block_k, num_warps)
    out = x.new_zeros(M, N)
    if M == 0 or N == 0:
        return out.reshape(T, top_k, N)
    rows, block_expert = checked_grouping(grouping, M, E, bm) if grouping is not None else moe_align(expert_ids, E, bm)
    x, w8, scale = _unit_last(x), _unit_last(w8), scale.contiguous()
    fp8_moe_kernel[(block_expert.numel(), triton.cdiv(N, bn))](
        x, w8, scale, out, rows, block_expert, M, N, K, E, top_k,
        x.stride(0), w8.stride(0), w8.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
        BM=bm, BN=bn, BK=block_k, **_modes(x), num_warps=warps, num_stages=num_stages)
    return out.reshape(T, top_k, N)
