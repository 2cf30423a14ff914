"""Triton GEMMs with both operands FP8 ("w8a8"): the contracts of `fp8_gemm_ref.py`'s w8a8 references.

  fp8_act_quant_triton(x [T, K])                                                 -> (x8 [T, K], xs [T, kb])
  fp8_act_round_trip_triton(x [T, K])                                            -> [T, K] (x's dtype)
  fp8_w8a8_linear_triton(x [T, K], w8 [N, K], scale [nb, kb])                    -> [T, N]
  fp8_w8a8_moe_triton(x [T, K], w8 [E, N, K], scale [E, nb, kb], expert_ids [T, top_k]) -> [T, top_k, N]

How DeepSeek-V3 / GLM-5 FP8 checkpoints are served (their quantization_config's activation_scheme
"dynamic"): each token's activations are quantized in groups of 128 columns (`fp8_act_quant_triton`, one
pass, bit-exact with `quantize_act_fp8`), and the GEMM multiplies FP8 by FP8 on the tensor cores, scaling
each 128-column k-block's partial product by the token's group scale and the weight's block scale:

    acc[m, n] += (x8[m, k-block] . w8[n, k-block]) * xs[m, kb] * ws[n // 128, kb]     (fp32)

`fp8_gemm.py`'s w8a16 kernels instead convert every weight tile to the activation's dtype in the kernel
(session 43 on an H100: at 100 rows they ran 2.6x slower than bf16 torch.matmul on q_a). Tiles, K splits
and the MoE grouping (`moe_align`) are `fp8_gemm.py`'s; BK divides 128, so a step lies in one group.
Under the interpreter (and for fp32 x) the dot runs in fp32 on the FP8 values, exactly.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch
import triton
import triton.language as tl

from dhisparse.kernels.fp8_tiles import _modes, _unit_last, checked_grouping, linear_launch, moe_align, moe_launch
from dhisparse.kernels.fp8_gemm import split_sum
from dhisparse.kernels.fp8_gemm_ref import BLOCK, FP8, FP8_MAX, check_act, dequantize_act_fp8

ACT_ROWS = 16  # rows a quantization program takes
_SHARED = threading.local()  # .memo: {view key: (x, (x8, xs)) or None} of the open `shared_activations` scopes


def _view_key(x: torch.Tensor) -> tuple:
    return x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device


@contextmanager
def shared_activations(x: torch.Tensor) -> Iterator[None]:
    """A scope in which the w8a8 GEMMs that read `x` quantize it once: the first call on this view of x
    (data pointer, shape, strides, dtype, device) runs `fp8_act_quant_triton`, later calls on an identical
    view reuse its (x8, xs) -- the same values, so the same products. Other activations are quantized per
    call and not kept. A layer opens it around GEMMs that share an input (MLA's q_a / kv_a on the hidden
    state; a MoE's routed gate-up and the shared experts' gate and up on theirs: layers/attention.py,
    layers/moe.py).

    Invariant: x is not written in place inside the scope (the memo cannot see writes: inference tensors
    keep no version counter), so scopes stay that narrow. The memo keeps x alive, so its address is not
    reused within the scope. Per thread; a scope opened inside another on the same view shares the outer
    one's quantization (a MoE's shared-experts MLP, its routed experts')."""
    memo = getattr(_SHARED, "memo", None)
    if memo is None:
        memo = _SHARED.memo = {}
    key = _view_key(x)
    mine = key not in memo
    if mine:
        memo[key] = None
    try:
        yield
    finally:
        if mine:
            del memo[key]


def _act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_act_quant_triton(x)`, once per scope for a view a `shared_activations` scope names."""
    memo = getattr(_SHARED, "memo", None)
    key = _view_key(x) if memo else None
    if key is None or key not in memo:
        return fp8_act_quant_triton(x)
    if memo[key] is None:
        memo[key] = (x, fp8_act_quant_triton(x))
    return memo[key][1]


@triton.jit
def fp8_act_quant_kernel(x_ptr, q_ptr, s_ptr, T, K, sxt, sqt, sst, R: tl.constexpr, G: tl.constexpr, QMAX: tl.constexpr,
                         ROUND_TRIP: tl.constexpr = False):
    """Program (r, g): rows r*R .. +R, columns g*G .. +G (one group): scale = amax / QMAX (1.0 for an
    all-zero group), q = x / scale clamped to +-QMAX, both divisions rounded to nearest as torch's, stored in
    q's dtype (float8_e4m3fn; fp32 under the interpreter, whose FP8 rounding sends values just under a
    power of two to the power below: 124.3 -> 64 where e4m3 has 128). ROUND_TRIP (GPU only): q rounded to
    e4m3 and multiplied back by its scale (fp32), stored in q's dtype (x's), the scales not stored."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    cols = tl.program_id(1) * G + tl.arange(0, G)
    m = (rows < T)[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)
    v = tl.load(x_ptr + r64[:, None] * sxt + cols[None, :], mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    s = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), 1.0)
    q = tl.math.div_rn(v, tl.broadcast_to(s[:, None], v.shape))
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    if ROUND_TRIP:
        back = q.to(tl.float8e4nv).to(tl.float32) * s[:, None]
        tl.store(q_ptr + r64[:, None] * sqt + cols[None, :], back.to(q_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(q_ptr + r64[:, None] * sqt + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=m)
        tl.store(s_ptr + r64 * sst + tl.program_id(1), s, mask=rows < T)


@triton.jit
def _w8a8_step(acc, k0, x_ptr, xs_ptr, w_ptr, s_ptr, xrow, xsrow, rmask, wrow, srow, nmask, K,
               BK: tl.constexpr, IEEE: tl.constexpr):
    """acc + (x8 tile . w8 tile) x the rows' group scales x the columns' block scales, columns k0 .. k0+BK-1."""
    kk = k0 + tl.arange(0, BK)
    km = kk < K
    a = tl.load(x_ptr + xrow[:, None] + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
    b = tl.load(w_ptr + wrow[:, None] + kk[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
    sa = tl.load(xs_ptr + xsrow + k0 // 128, mask=rmask, other=0.0)
    sb = tl.load(s_ptr + srow + k0 // 128, mask=nmask, other=0.0)
    if IEEE:
        part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(a, tl.trans(b))
    return acc + part * sa[:, None] * sb[None, :]


@triton.jit
def _w8a8_dot(x_ptr, xs_ptr, w_ptr, s_ptr, xrow, xsrow, rmask, rn, nmask, k_lo, k_hi, K, swn, ssn,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """acc [BM, BN] fp32 over the K steps k_lo, k_lo + BK, .. < k_hi (`_w8a8_step`). xrow / xsrow [BM]
    int64 offsets of the rows in x8 / xs. INTERP: the interpreter walks K with `while` (no runtime `range`)."""
    wrow = rn.to(tl.int64) * swn
    srow = (rn // 128) * ssn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if INTERP:
        k0 = k_lo
        while k0 < k_hi:
            acc = _w8a8_step(acc, k0, x_ptr, xs_ptr, w_ptr, s_ptr, xrow, xsrow, rmask, wrow, srow, nmask, K, BK, IEEE)
            k0 += BK
    else:
        for k0 in range(k_lo, k_hi, BK):
            acc = _w8a8_step(acc, k0, x_ptr, xs_ptr, w_ptr, s_ptr, xrow, xsrow, rmask, wrow, srow, nmask, K, BK, IEEE)
    return acc


@triton.jit
def _w8a8_linear_program(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, T, N, K, KPER, sxt, sxst, swn, ssn, sos, sot,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    k_lo = tl.program_id(2) * KPER
    rmask, nmask = rm < T, rn < N
    r64 = rm.to(tl.int64)
    acc = _w8a8_dot(x_ptr, xs_ptr, w_ptr, s_ptr, r64 * sxt, r64 * sxst, rmask, rn, nmask, k_lo,
                    tl.minimum(k_lo + KPER, K), K, swn, ssn, BM, BN, BK, IEEE, INTERP)
    out = out_ptr + tl.program_id(2).to(tl.int64) * sos + r64[:, None] * sot + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def fp8_w8a8_linear_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, T, N, K, KPER, sxt, sxst, swn, ssn, sos, sot,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """Program (m, n, s): out[s, m*BM : +BM, n*BN : +BN] over K columns s*KPER .. +KPER (split K)."""
    _w8a8_linear_program(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, T, N, K, KPER, sxt, sxst, swn, ssn, sos, sot,
                         BM, BN, BK, IEEE, INTERP)


@triton.jit
def fp8_w8a8_expert_linear_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, T, N, K, KPER, sxt, sxst, swn, ssn, sos, sot,
                                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                                  INTERP: tl.constexpr):
    """`fp8_w8a8_linear_kernel` under the name a profile counts as expert GEMMs (the shared experts)."""
    _w8a8_linear_program(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, T, N, K, KPER, sxt, sxst, swn, ssn, sos, sot,
                         BM, BN, BK, IEEE, INTERP)


@triton.jit
def fp8_w8a8_moe_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, rows_ptr, bexp_ptr, M, N, K, E, TOPK,
                        sxt, sxst, swe, swn, sse, ssn, sot,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """`fp8_gemm.fp8_moe_kernel` over FP8 activations: sorted rows m*BM .. +BM of expert block_expert[m]."""
    pid_m = tl.program_id(0)
    e = tl.load(bexp_ptr + pid_m)
    if e < E:
        r = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM))
        rmask = r < M
        tok = (r // TOPK).to(tl.int64)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < N
        e64 = e.to(tl.int64)
        acc = _w8a8_dot(x_ptr, xs_ptr, w_ptr + e64 * swe, s_ptr + e64 * sse, tok * sxt, tok * sxst, rmask, rn, nmask,
                        0, K, K, swn, ssn, BM, BN, BK, IEEE, INTERP)
        out = out_ptr + r.to(tl.int64)[:, None] * sot + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def fp8_act_quant_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x8 float8_e4m3fn [T, K], xs fp32 [T, ceil(K/128)]): `quantize_act_fp8`, bit for bit."""
    check_act(x)
    T, K = x.shape
    kb = triton.cdiv(K, BLOCK)
    interp = _modes(x)["INTERP"]
    x8 = torch.empty(T, K, dtype=torch.float32 if interp else FP8, device=x.device)
    xs = torch.empty(T, kb, dtype=torch.float32, device=x.device)
    if T and K:
        x = _unit_last(x)
        fp8_act_quant_kernel[(triton.cdiv(T, ACT_ROWS), kb)](x, x8, xs, T, K, x.stride(0), x8.stride(0), xs.stride(0),
                                                             R=ACT_ROWS, G=BLOCK, QMAX=FP8_MAX)
    return (x8.to(FP8) if interp else x8), xs  # torch rounds the interpreter's fp32 values


def fp8_act_round_trip_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] 16-bit or fp32 -> [T, K] in x's dtype: x as the w8a8 GEMMs read it, quantized per token group and
    multiplied back (`dequantize_act_fp8(*quantize_act_fp8(x)).to(x.dtype)`, bit for bit) in one pass, for
    prefill-sized dynamic linears that multiply the dequantized weight (`fp8_dispatch.fp8_linear`). Under
    the interpreter: `fp8_act_quant_triton`, then torch's dequantization."""
    check_act(x)
    if _modes(x)["INTERP"]:
        return dequantize_act_fp8(*fp8_act_quant_triton(x)).to(x.dtype)
    T, K = x.shape
    out = torch.empty(T, K, dtype=x.dtype, device=x.device)
    if T and K:
        x = _unit_last(x)
        fp8_act_quant_kernel[(triton.cdiv(T, ACT_ROWS), triton.cdiv(K, BLOCK))](
            x, out, out, T, K, x.stride(0), out.stride(0), 0, R=ACT_ROWS, G=BLOCK, QMAX=FP8_MAX, ROUND_TRIP=True)
    return out


def fp8_w8a8_linear_triton(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, *, block_m: int | None = None,
                           block_n: int | None = None, block_k: int = 128, num_warps: int | None = None,
                           num_stages: int = 3, split_k: int | None = None, expert: bool = False) -> torch.Tensor:
    """x [T, K] quantized per token group, then x8 @ W.T -> [T, N] in x's dtype (contract of
    `fp8_linear_w8a8_reference`). Tiles and K splits as `fp8_gemm.fp8_linear_triton`'s; T == 0: no launch."""
    T, N, K, bm, bn, warps, split, kper = linear_launch(x, w8, scale, block_m, block_n, block_k, num_warps, split_k)
    if split == 0:
        return x.new_empty(T, N)
    x8, xs = _act_quant(x)
    out = x.new_empty(T, N) if split == 1 else torch.empty(split, T, N, dtype=torch.float32, device=x.device)
    w8, scale = _unit_last(w8), scale.contiguous()
    kernel = fp8_w8a8_expert_linear_kernel if expert else fp8_w8a8_linear_kernel
    kernel[(triton.cdiv(T, bm), triton.cdiv(N, bn), split)](
        x8, xs, w8, scale, out, T, N, K, kper, x8.stride(0), xs.stride(0), w8.stride(0), scale.stride(0),
        out.stride(0) if split > 1 else 0, out.stride(-2),
        BM=bm, BN=bn, BK=block_k, **_modes(x), num_warps=warps, num_stages=num_stages)
    return out if split == 1 else split_sum(out, x.dtype)


def fp8_w8a8_moe_triton(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, expert_ids: torch.Tensor, *,
                        block_m: int | None = None, block_n: int | None = None, block_k: int = 128,
                        num_warps: int | None = None, num_stages: int = 3,
                        grouping: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Grouped x [T, K] (each token quantized once) x experts -> [T, top_k, N] (contract of
    `fp8_moe_w8a8_reference`); ids, grouping and `grouping` as `fp8_gemm.fp8_moe_triton`'s. T == 0: no launch."""
    E, N, K, T, top_k, M, bm, bn, warps = moe_launch(x, w8, scale, expert_ids, block_m, block_n, block_k, num_warps)
    out = x.new_zeros(M, N)
    if M == 0 or N == 0:
        return out.reshape(T, top_k, N)
    x8, xs = _act_quant(x)
    rows, block_expert = checked_grouping(grouping, M, E, bm) if grouping is not None else moe_align(expert_ids, E, bm)
    w8, scale = _unit_last(w8), scale.contiguous()
    fp8_w8a8_moe_kernel[(block_expert.numel(), triton.cdiv(N, bn))](
        x8, xs, w8, scale, out, rows, block_expert, M, N, K, E, top_k,
        x8.stride(0), xs.stride(0), w8.stride(0), w8.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
        BM=bm, BN=bn, BK=block_k, **_modes(x), num_warps=warps, num_stages=num_stages)
    return out.reshape(T, top_k, N)
