"""How the sparse-MLA kernels (`kernels/sparse_mla.py`) read FP8 rows, and the pieces they share.

FP8 rows (`core/kvformat.py`, FlashMLA's 656-B layout at GLM-5's shape) are bytes:

    | C x e4m3 | C / TILE x fp32 scale | R x bf16 rope |      at byte offsets 0, SO, RO

Four ways to apply a tile's scale (`_fp8_args` picks one; DHISPARSE_FP8_SCALES overrides):
  0 gather   each value's scale loaded (any C)
  1 reshape  one scale load per tile, broadcast through a reshape
  2 select   one scale load per tile, chosen per column (the default: fastest on the H200,
             bench/results/fp8_kernels_s16b_h200.json)
  3 fold     the values only converted; each tile's scale multiplies its partial scores and p
             (`_attend_block_fold`; one row space, TILE >= 16; not yet timed on the GPU)
Paths 0-2 compute c = e4m3 * scale in fp32, then the query dtype, exactly as `RowFormat.decode`
(bit for bit equal to each other); fold rounds differently (within the reference's tolerance).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from dhisparse.core.kvformat import RowFormat

FP8_SCALES_DEFAULT = 2  # per-tile select: fastest of the three on the H200 (bench/results/fp8_kernels_s16b_h200.json)


@triton.jit
def _online_softmax(s, valid, qk_scale, m_i, l_i):
    """Scores s [BLOCK_H, BLOCK_K] (masked by valid [BLOCK_K]) into the running state: (m_new,
    l_i, alpha = 2^(m_i - m_new), p = 2^(s - m_new)), fp32, empty rows kept at -inf / 0."""
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _fp8_rows(base, valid, cc, rr, cmask, rmask, C: tl.constexpr, BLOCK_K: tl.constexpr, SO: tl.constexpr,
              RO: tl.constexpr, TILE: tl.constexpr, SCALES: tl.constexpr):
    """FP8 rows at byte pointers base [BLOCK_K] -> (c [BLOCK_K, BC] fp32, scales applied by path
    SCALES 0-2 of the module docstring; kpe [BLOCK_K, BR] bf16). The caller converts both to the
    query dtype."""
    c8 = tl.load(base[:, None] + cc[None, :], mask=cmask, other=0)
    cf = c8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if SCALES == 1:  # reshape: C a power of two = NT * TILE, NT too; one scale load per tile, broadcast
        tt = tl.arange(0, C // TILE)
        sc = tl.load((base[:, None] + SO + tt[None, :] * 4).to(tl.pointer_type(tl.float32)),
                     mask=valid[:, None], other=0.0)
        cf = tl.reshape(tl.reshape(cf, (BLOCK_K, C // TILE, TILE)) * sc[:, :, None], (BLOCK_K, C))
    elif SCALES == 2:  # select: one scale load per tile, chosen per column (no gather, no layout change)
        tile = cc // TILE
        scale = tl.zeros_like(cf)
        for t in tl.static_range(C // TILE):
            st = tl.load((base + SO + t * 4).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
            scale = tl.where(tile[None, :] == t, st[:, None], scale)
        cf = cf * scale
    else:  # gather: each value's scale loaded (any C)
        cf = cf * tl.load((base[:, None] + SO + (cc // TILE)[None, :] * 4).to(tl.pointer_type(tl.float32)),
                          mask=cmask, other=0.0)
    kpe = tl.load((base[:, None] + RO + rr[None, :] * 2).to(tl.pointer_type(tl.bfloat16)), mask=rmask, other=0.0)
    return cf, kpe


@triton.jit
def _attend_block_fold(k0, q3, qpe, m_i, l_i, acc3, loc_ptr, r0_ptr, K, PER0: tl.constexpr, ps0, rs0, qk_scale,
                       cc, rr, cm, rm, C: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                       SO: tl.constexpr, RO: tl.constexpr, TILE: tl.constexpr):
    """`_attend_block` for FP8 rows with the scales folded out of the values (SCALES = 3, one row
    space): per tile t of the C values, its scores q_t . e4m3_t are scaled by the row's s_t, and
    its output columns take (p * s_t) . e4m3_t. The values are only converted (e4m3 -> the query
    dtype is exact), never multiplied.

      q3 [NT, BLOCK_H, TILE]   acc3 [NT, BLOCK_H, TILE]   (NT = C / TILE)"""
    cdt = q3.dtype
    NT: tl.constexpr = C // TILE
    kk = k0 + tl.arange(0, BLOCK_K)
    loc = tl.load(loc_ptr + kk, mask=kk < K, other=-1)
    valid = loc >= 0
    base = r0_ptr + (loc // PER0) * ps0 + (loc % PER0) * rs0
    c8 = tl.load(base[:, None] + cc[None, :], mask=valid[:, None] & cm[None, :], other=0)
    cq = c8.to(tl.float8e4nv, bitcast=True).to(cdt)  # [BLOCK_K, C]
    c3 = tl.permute(tl.reshape(cq, (BLOCK_K, NT, TILE)), (1, 2, 0))  # [NT, TILE, BLOCK_K]
    tt = tl.arange(0, NT)
    sc = tl.load((base[None, :] + SO + tt[:, None] * 4).to(tl.pointer_type(tl.float32)), mask=valid[None, :],
                 other=0.0)  # [NT, BLOCK_K]
    kpe = tl.load((base[:, None] + RO + rr[None, :] * 2).to(tl.pointer_type(tl.bfloat16)),
                  mask=valid[:, None] & rm[None, :], other=0.0).to(cdt)
    if IEEE:
        part = tl.dot(q3, c3, input_precision="ieee")  # [NT, BLOCK_H, BLOCK_K]
        s = tl.dot(qpe, tl.trans(kpe), tl.sum(part * sc[:, None, :], 0), input_precision="ieee")
    else:
        part = tl.dot(q3, c3)
        s = tl.dot(qpe, tl.trans(kpe), tl.sum(part * sc[:, None, :], 0))
    m_new, l_i, alpha, p = _online_softmax(s, valid, qk_scale, m_i, l_i)
    p3 = p[None, :, :] * sc[:, None, :]  # [NT, BLOCK_H, BLOCK_K]
    c3t = tl.permute(c3, (0, 2, 1))  # [NT, BLOCK_K, TILE]
    if IEEE:
        acc3 = tl.dot(p3, c3t.to(tl.float32), acc3 * alpha[None, :, None], input_precision="ieee")
    else:
        acc3 = tl.dot(p3.to(cdt), c3t, acc3 * alpha[None, :, None])
    return m_new, l_i, acc3


def _fp8_args(fmt: RowFormat | None, C: int, R: int, two: bool = False) -> tuple[bool, int, int, int, int]:
    """(FP8, SO, RO, TILE, SCALES) constexprs of the kernels for rows of `fmt`. SCALES: how a tile's
    scale reaches its values (0 gather per value: any C; 1 reshape-broadcast and 2 per-tile select:
    C and C / TILE powers of two; 3 fold: scales applied to per-tile scores and to p, the values only
    converted - C, C / TILE powers of two, TILE >= 16, one row space); DHISPARSE_FP8_SCALES=gather|
    reshape|select|fold picks one (benchmarks)."""
    if fmt is None or not fmt.fp8:
        return (False, 0, 0, 1, 0)
    if fmt.scale != "fp32" or fmt.rope_first or (fmt.quantized, fmt.rope) != (C, R):
        raise ValueError(f"the sparse-MLA kernel reads FlashMLA FP8 rows (C = {C} e4m3 values, fp32 scales, R = {R} "
                         f"bf16 rope values); got {fmt}")
    so, ro = fmt.offsets
    nt = C // fmt.tile
    pow2 = C == triton.next_power_of_2(C) and C >= 16 and nt == triton.next_power_of_2(nt)
    mode = {"gather": 0, "reshape": 1, "select": 2, "fold": 3}.get(os.environ.get("DHISPARSE_FP8_SCALES", ""),
                                                                   FP8_SCALES_DEFAULT)
    if mode == 3 and (two or fmt.tile < 16):
        mode = FP8_SCALES_DEFAULT  # fold reads one row space with tiles tl.dot can take
    return (True, so, ro, fmt.tile, mode if pow2 or mode == 0 else 0)


