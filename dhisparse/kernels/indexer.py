"""Batched lightning-indexer scoring and top-k over every request of a pass (no per-request loop).

For token t of request r = req_idx[t] at position pos[t], over the request's index keys
K[s] = rows[locs[r, s]] (a paged row space, flat location l -> rows[l // ips, l % ips]):

    score[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s] * iD^-0.5)   for s < min(lens[r], pos[t] + 1)
                = -inf                                           otherwise, s < Lmax

then the ordered top-k of each row (descending; -1 where the score is -inf, padded to k). This
equals `indexer_topk_reference` token for token. Two implementations, same signature:

  indexer_topk_triton  scores [T, Lmax] fp32 by a Triton kernel, grid (T, cdiv(Lmax, BS))
  indexer_topk_torch   plain PyTorch, tokens in chunks (keys gathered per token), the CPU path

Grouped scoring (group = G > 1): in a pass where every request runs G consecutive tokens (a
verification round), program (g, j) scores tokens g*G .. g*G+G-1, all of one request, against key
block j, reading the block once for the G queries (the per-token kernel reads it G times: at 32K C18
a K = 4 round spent 4.72 ms in scoring against 1.34 ms for a decode step; grouped, 1.90 ms). On by
default (the layer's GROUPED; DHISPARSE_INDEXER_GROUP=0 turns it off). A verification round must
reproduce decoding, so grouped and per-token scores must select the same rows: each score is the
same dot product over iD in the same order, and tests/test_indexer_kernel.py checks that the two
kernels' scores are bitwise equal (on the GPU in bf16, where it matters). Only verification-sized
groups (2 .. MAX_GROUP tokens) are grouped: a prefill chunk is one request's thousands of tokens,
whose query tile would exceed Triton's block limit, and the per-token kernel already reads each key
block once per token there. One product for the whole group (the G queries as one [G * iH, iD] tile)
was tried and dropped: 1.06-4.1x slower than scoring a token at a time, and not bitwise equal to the
per-token kernel on an H100 (indexer_tune_s46_h100.json).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dhisparse.core.batch import IndexTable
from dhisparse.kernels.indexer_torch import (  # noqa: F401  (re-exported: the kernel's reference)
    GATHER_ELEMS, SCORE_ELEMS, indexer_scores_torch, indexer_topk_torch, topk_in_chunks, topk_of_scores)

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
MAX_GROUP = 16  # largest group scored by the grouped kernel (a verification width); larger: per token
# keys a program scores (both kernels): 128 against 64 at glm5-faithful's shape (32 heads x 128, FP8
# keys, 100K a request) on an H100 is 0.84x for a C20 decode pass and 0.65x for an 18 x 5 round, scores
# unchanged bit for bit (bench/results/indexer_tune_s46_h100.json; 256: 0.91x / 0.86x; 8 warps slower)
BLOCK_S = 128


@triton.jit
def _key_block(k_ptr, s_ptr, lp, s, lim, D, IPS: tl.constexpr, ks0, ks1, ks2, ss0, ss1, BD: tl.constexpr,
               FP8: tl.constexpr, KDT: tl.constexpr):
    """Index keys of positions s [BS] below lim of one request (lp: its row of locations):
    (k [BD, BS], zero where not loaded; ok [BS], the positions that hold a key).
    FP8: e4m3 values at k_ptr (row strides ks0 / ks1, 16-B aligned in the arena's split layout) and
    an fp32 scale per key at s_ptr (strides ss0 / ss1), dequantized as e4m3 * scale in fp32, then
    KDT (the model dtype), exactly as `RowFormat.decode`."""
    sm = s < lim
    loc = tl.load(lp + s, mask=sm, other=0).to(tl.int64)
    ok = sm & (loc >= 0)
    base = (loc // IPS) * ks0 + (loc % IPS) * ks1  # [BS]; IPS constexpr: a shift, not an int64 division
    d = tl.arange(0, BD)
    kmask = (d < D)[:, None] & ok[None, :]
    if FP8:
        k8 = tl.load(k_ptr + base[None, :] + d[:, None], mask=kmask, other=0)
        sbase = (loc // IPS) * ss0 + (loc % IPS) * ss1
        sc = tl.load((s_ptr + sbase).to(tl.pointer_type(tl.float32)), mask=ok, other=0.0)
        k = (k8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[None, :]).to(KDT)
    else:
        k = tl.load(k_ptr + base[None, :] + d[:, None] * ks2, mask=kmask, other=0.0)
    return k, ok


@triton.jit
def _token_scores(q_ptr, w_ptr, t, k, H, D, qs0, qs1, qs2, ws0, ws1, scale,
                  BH: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr):
    """sum_h w[t, h] * relu(q[t, h] . k[:, s] * scale) for the key block k [BD, BS] -> [BS] fp32.
    Both kernels score every token through this one function (grouped scores equal per-token ones)."""
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    hm = h < H
    q = tl.load(q_ptr + t * qs0 + h[:, None] * qs1 + d[None, :] * qs2, mask=hm[:, None] & (d < D)[None, :], other=0.0)
    if IEEE:
        logit = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")  # [BH, BS]
    else:
        logit = tl.dot(q, k)  # same 16-bit dtype: exact products, fp32 accumulation
    logit = tl.maximum(logit * scale, 0.0)
    wv = tl.load(w_ptr + t * ws0 + h * ws1, mask=hm, other=0.0).to(tl.float32)
    return tl.sum(logit * wv[:, None], axis=0)


@triton.jit
def indexer_score_kernel(q_ptr, w_ptr, k_ptr, s_ptr, loc_ptr, len_ptr, pos_ptr, req_ptr, out_ptr,
                         Lmax, H, D, ks0, ks1, ks2, ss0, ss1, qs0, qs1, qs2, ws0, ws1, scale,
                         IPS: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, IEEE: tl.constexpr,
                         FP8: tl.constexpr, KDT: tl.constexpr):
    """Program (t, j) writes out[t, j*BS : (j+1)*BS] (row t of the chunk's scores [T, Lmax])."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    s = j * BS + tl.arange(0, BS)
    r = tl.load(req_ptr + t).to(tl.int64)
    lim = tl.minimum(tl.load(len_ptr + r), tl.load(pos_ptr + t) + 1)  # visible positions
    res = tl.full([BS], float("-inf"), tl.float32)
    if j * BS < lim:
        k, ok = _key_block(k_ptr, s_ptr, loc_ptr + r * Lmax, s, lim, D, IPS, ks0, ks1, ks2, ss0, ss1, BD, FP8, KDT)
        sc = _token_scores(q_ptr, w_ptr, t, k, H, D, qs0, qs1, qs2, ws0, ws1, scale, BH, BD, IEEE)
        res = tl.where(ok, sc, float("-inf"))
    tl.store(out_ptr + t * Lmax + s, res, mask=s < Lmax)


@triton.jit
def indexer_score_group_kernel(q_ptr, w_ptr, k_ptr, s_ptr, loc_ptr, len_ptr, pos_ptr, req_ptr, out_ptr,
                               Lmax, H, D, G, ks0, ks1, ks2, ss0, ss1, qs0, qs1, qs2, ws0, ws1, scale,
                               IPS: tl.constexpr, QG: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
                               IEEE: tl.constexpr, FP8: tl.constexpr, KDT: tl.constexpr):
    """Program (g, j) writes out[g*G + u, j*BS : (j+1)*BS] for u < G: the G tokens of one request
    (QG = G rounded up to a power of two). The key block is loaded once, up to the furthest of
    the G tokens' limits; each token is then scored by `_token_scores`, as in the per-token kernel
    (a key column's score does not depend on the other columns loaded with it)."""
    g = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    s = j * BS + tl.arange(0, BS)
    t0 = g * G
    r = tl.load(req_ptr + t0).to(tl.int64)
    n = tl.load(len_ptr + r)
    i = tl.arange(0, QG)
    pos = tl.load(pos_ptr + t0 + i, mask=i < G, other=-1)
    lim_max = tl.max(tl.where(i < G, tl.minimum(n, pos + 1), 0), 0)
    if j * BS < lim_max:
        k, ok = _key_block(k_ptr, s_ptr, loc_ptr + r * Lmax, s, lim_max, D, IPS, ks0, ks1, ks2, ss0, ss1, BD, FP8, KDT)
        for u in tl.static_range(QG):
            if u < G:
                lim = tl.minimum(n, tl.load(pos_ptr + t0 + u) + 1)
                sc = _token_scores(q_ptr, w_ptr, t0 + u, k, H, D, qs0, qs1, qs2, ws0, ws1, scale, BH, BD, IEEE)
                tl.store(out_ptr + (t0 + u) * Lmax + s, tl.where(ok & (s < lim), sc, float("-inf")), mask=s < Lmax)
    else:
        for u in tl.static_range(QG):
            if u < G:
                tl.store(out_ptr + (t0 + u) * Lmax + s, tl.full([BS], float("-inf"), tl.float32), mask=s < Lmax)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(n, 1)))


def indexer_scores_triton(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, req_idx: torch.Tensor,
                          table: IndexTable, block_s: int = BLOCK_S, group: int = 1,
                          num_warps: int | None = None) -> torch.Tensor:
    """q [T, iH, iD], w [T, iH], positions / req_idx [T] int64, table -> scores [T, Lmax] fp32.
    group G > 1: tokens g*G .. g*G+G-1 belong to one request (T a multiple of G; the grouped kernel
    when G <= MAX_GROUP, the per-token kernel above it). block_s (keys a program) and num_warps
    (None: Triton's 4) configure both kernels alike: grouped and per-token scores are bitwise
    equal only at the same configuration."""
    T, H, D = q.shape
    rows, locs, lens, fmt, scales = table
    fp8 = fmt is not None and fmt.fp8
    Lmax = locs.shape[1]
    if T == 0 or Lmax == 0 or rows.numel() == 0:
        return torch.full((T, Lmax), float("-inf"), dtype=torch.float32, device=q.device)
    out = torch.empty((T, Lmax), dtype=torch.float32, device=q.device)  # the kernel writes every score (-inf: not visible)
    if fp8 and (fmt.dim, fmt.rope, fmt.tile, fmt.scale) != (D, 0, D, "fp32"):
        raise ValueError(f"the indexer kernel reads FP8 keys of {D} e4m3 values and one fp32 scale; got {fmt}")
    if fp8 and scales is None:  # whole stored keys [.., Wi]: values and scales are two views of them
        rows, scales = rows[..., :D], rows[..., D:]
    assert rows.shape[-1] == D, (rows.shape, q.shape)
    sc = scales if fp8 else rows
    sstr = (sc.stride(0), sc.stride(1))
    key_dtype = fmt.dtype if fp8 else rows.dtype
    ieee = not (q.dtype == key_dtype and q.dtype in (torch.bfloat16, torch.float16))
    kdt = _TL_DTYPES.get(key_dtype, tl.float32)
    locs = locs.contiguous()
    if group > 1 and T % group:
        raise ValueError(f"grouped indexer scoring needs T ({T}) to be a multiple of group ({group})")
    launch = {} if num_warps is None else {"num_warps": num_warps}
    if 1 < group <= MAX_GROUP:
        indexer_score_group_kernel[(T // group, triton.cdiv(Lmax, block_s))](
            q, w, rows, sc, locs, lens.contiguous(), positions.contiguous(), req_idx.contiguous(), out,
            Lmax, H, D, group, *rows.stride(), *sstr, *q.stride(), *w.stride(), D**-0.5,
            IPS=rows.shape[1], QG=triton.next_power_of_2(group), BH=_pow2(H), BD=_pow2(D), BS=block_s,
            IEEE=ieee, FP8=fp8, KDT=kdt, **launch)
        return out
    grid = (T, triton.cdiv(Lmax, block_s))
    indexer_score_kernel[grid](
        q, w, rows, sc, locs, lens.contiguous(), positions.contiguous(), req_idx.contiguous(), out,
        Lmax, H, D, *rows.stride(), *sstr, *q.stride(), *w.stride(), D**-0.5,
        IPS=rows.shape[1], BH=_pow2(H), BD=_pow2(D), BS=block_s, IEEE=ieee, FP8=fp8, KDT=kdt, **launch)
    return out


def indexer_topk_triton(q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, req_idx: torch.Tensor,
                        table: IndexTable, topk: int, group: int = 1) -> torch.Tensor:
    """Selection [T, topk] int64 of every token of the pass, scored by the Triton kernel (grouped
    when 1 < group <= MAX_GROUP: see the module docstring)."""
    group = group if group <= MAX_GROUP else 1
    score = functools.partial(indexer_scores_triton, group=group)
    return topk_in_chunks(score, q, w, positions, req_idx, table, topk, group=group)
