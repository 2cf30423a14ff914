"""Verification staging of a deferred plan's overflow: the rows of a request's union that found no hot-cache
victim get staging rows, ranked by position (kv/hier/staging.py's `stage_overflow_deferred` calls one of
these two; the same signature, the same outputs bit for bit).

    per request n, its entries e < KK = K * k (a verification round's K queries of k rows):

        missing  sel[n, e] >= 0 and loc[n, e] < 0            (the plan placed it nowhere)
        rank     distinct missing positions of n below sel[n, e]
        loc[n, e]          <- stage_loc[slot, rank]           (SPACE + a staging row; written in place)
        src_pad[n, rank]   =  host row of the position        (host_table page * host_ps + offset)
        dst_pad[n, rank]   =  stage_loc[slot, rank] - SPACE
        copy_n[n]          =  distinct missing positions      (src_pad / dst_pad are 0 from there on)
        counts             =  [0, 0, 0, sum copy_n, sum missing entries, 0]

`stage_overflow_torch` is the plain-PyTorch form (a sort, a cumsum and ~35 small ops a call: ~3-4 ms of a
costed glm5-faithful round, 42 calls, session 48's profile). `stage_overflow_triton` is one program a
request: the missing positions set bits of a per-request bitmap (scratch, [N, W] int32 words over the
host positions), an exclusive prefix of the words' popcounts ranks them, and each missing entry reads its
rank back (prefix of its word + the bits below it). No sort; no op waits for the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dhisparse.core.rows import SPACE


def stage_overflow_torch(sel: torch.Tensor, loc: torch.Tensor, slots: torch.Tensor, stage_loc: torch.Tensor,
                         host_table: torch.Tensor, host_ps: int):
    """sel / loc [N, K, k] int64 (loc rewritten in place), slots [N] int64, stage_loc [S, >= K*k] (SPACE +
    staging rows), host_table [S, HP] host pages; all on one device (the caller moves slots there). Returns (src_pad, dst_pad [N, K*k] int64, copy_n [N] int32,
    counts [6] int64) as the module docstring says.

        per request (sorted):  pos  3  3  7  9  9  9 | BIG ...      BIG = no staged entry
                               first 1  0  1  1  0  0
                               rank  0  0  1  2  2  2  -> staging row stage_loc[slot, rank]
    """
    N, K, k = sel.shape
    KK = K * k
    big = torch.iinfo(torch.int64).max
    missing = (sel >= 0) & (loc < 0)
    skey, order = torch.where(missing, sel, big).reshape(N, KK).sort(dim=1)
    valid = skey != big
    first = valid.clone()
    first[:, 1:] &= skey[:, 1:] != skey[:, :-1]
    rank = (first.cumsum(1) - 1).clamp(min=0)
    s = slots[:, None]
    stage_row = stage_loc[s, rank]  # [N, KK] SPACE + staging-arena row
    flat = loc.reshape(N, KK)
    flat.scatter_(1, order, torch.where(valid, stage_row, flat.gather(1, order)))
    pos = torch.where(valid, skey, 0)
    src = host_table[s, pos // host_ps] * host_ps + pos % host_ps
    slot_of = torch.where(first, rank, KK)  # non-first entries land in a trash column
    src_pad = torch.zeros((N, KK + 1), dtype=torch.int64, device=sel.device).scatter_(1, slot_of, src)[:, :KK].contiguous()
    dst_pad = torch.zeros((N, KK + 1), dtype=torch.int64, device=sel.device).scatter_(1, slot_of, stage_row - SPACE)[:, :KK].contiguous()
    copy_n = first.sum(1)
    zero = torch.zeros((), dtype=torch.int64, device=sel.device)
    counts = torch.stack([zero, zero, zero, copy_n.sum(), valid.sum(), zero])
    return src_pad, dst_pad, copy_n.to(torch.int32), counts


@triton.jit
def _popc(x):
    """Set bits of each uint32 lane (SWAR)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24


@triton.jit
def stage_overflow_kernel(sel_ptr, loc_ptr, slots_ptr, sl_ptr, sl_s0, ht_ptr, ht_s0, bits_ptr, pre_ptr,
                          src_ptr, dst_ptr, cn_ptr, cnt_ptr, host_ps, KK: tl.constexpr, W: tl.constexpr,
                          SPACE_: tl.constexpr, BLOCK: tl.constexpr, WB: tl.constexpr):
    """Program n stages request n's overflow (module docstring). bits / pre: [N, W] int32 scratch. KK (a
    round's K * k) and W (the host table's reach in 32-position words) are fixed for a store: constexpr.
    The phases share scratch through global memory: a barrier between them, and the bitmap (set by atomics,
    which L2 performs) and the prefix read back at L2 (`.cg`), never from a stale L1 line."""
    n = tl.program_id(0).to(tl.int64)
    s = tl.load(slots_ptr + n).to(tl.int64)
    row0, wrow = n * KK, n * W
    for w0 in range(0, W, WB):  # 1. clear the bitmap
        w = w0 + tl.arange(0, WB)
        tl.store(bits_ptr + wrow + w, tl.zeros((WB,), tl.int32), mask=w < W)
    tl.debug_barrier()
    entries = tl.zeros((), tl.int64)
    for i0 in range(0, KK, BLOCK):  # 2. a bit per missing position
        i = i0 + tl.arange(0, BLOCK)
        p = tl.load(sel_ptr + row0 + i, mask=i < KK, other=-1)
        miss = (p >= 0) & (tl.load(loc_ptr + row0 + i, mask=i < KK, other=0) < 0)
        bit = (tl.full((BLOCK,), 1, tl.uint32) << (p & 31).to(tl.uint32)).to(tl.int32, bitcast=True)
        tl.atomic_or(bits_ptr + wrow + tl.where(miss, p >> 5, 0), bit, mask=miss)
        entries += tl.sum(miss.to(tl.int64), 0)
    tl.debug_barrier()
    total = tl.zeros((), tl.int32)
    for w0 in range(0, W, WB):  # 3. exclusive prefix of the words' popcounts
        w = w0 + tl.arange(0, WB)
        c = _popc(tl.load(bits_ptr + wrow + w, mask=w < W, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)).to(tl.int32)
        tl.store(pre_ptr + wrow + w, total + tl.cumsum(c, 0) - c, mask=w < W)
        total += tl.sum(c, 0)
    tl.debug_barrier()
    for i0 in range(0, KK, BLOCK):  # 4. ranks, staging rows, the copy plan; zeros from copy_n on
        i = i0 + tl.arange(0, BLOCK)
        pad = (i < KK) & (i >= total)
        tl.store(src_ptr + row0 + i, tl.zeros((BLOCK,), tl.int64), mask=pad)
        tl.store(dst_ptr + row0 + i, tl.zeros((BLOCK,), tl.int64), mask=pad)
        p = tl.load(sel_ptr + row0 + i, mask=i < KK, other=-1)
        miss = (p >= 0) & (tl.load(loc_ptr + row0 + i, mask=i < KK, other=0) < 0)
        q = tl.where(miss, p, 0)
        word = tl.load(bits_ptr + wrow + (q >> 5), mask=miss, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        below = (tl.full((BLOCK,), 1, tl.uint32) << (q & 31).to(tl.uint32)) - 1
        rank = (tl.load(pre_ptr + wrow + (q >> 5), mask=miss, other=0, cache_modifier=".cg")
                + _popc(word & below).to(tl.int32)).to(tl.int64)
        row = tl.load(sl_ptr + s * sl_s0 + rank, mask=miss, other=0)
        tl.store(loc_ptr + row0 + i, row, mask=miss)
        src = tl.load(ht_ptr + s * ht_s0 + q // host_ps, mask=miss, other=0) * host_ps + q % host_ps
        tl.store(src_ptr + row0 + rank, src, mask=miss)
        tl.store(dst_ptr + row0 + rank, row - SPACE_, mask=miss)
    tl.store(cn_ptr + n, total)
    tl.atomic_add(cnt_ptr + 3, total.to(tl.int64))
    tl.atomic_add(cnt_ptr + 4, entries)


def stage_overflow_triton(sel: torch.Tensor, loc: torch.Tensor, slots: torch.Tensor, stage_loc: torch.Tensor,
                          host_table: torch.Tensor, host_ps: int):
    """`stage_overflow_torch` in one launch (module docstring); the same arguments and outputs. sel and loc
    must be contiguous int64 (a plan's); positions must be below host_table's reach (HP * host_ps)."""
    N, K, k = sel.shape
    KK, dev = K * k, sel.device
    W = max(1, -(-host_table.shape[1] * host_ps // 32))
    scratch = torch.empty((2, N, W), dtype=torch.int32, device=dev)
    src_pad = torch.empty((N, KK), dtype=torch.int64, device=dev)
    dst_pad = torch.empty((N, KK), dtype=torch.int64, device=dev)
    copy_n = torch.empty((N,), dtype=torch.int32, device=dev)
    counts = torch.zeros((6,), dtype=torch.int64, device=dev)
    if not (N and KK):
        return src_pad, dst_pad, copy_n.zero_(), counts
    stage_overflow_kernel[(N,)](sel, loc, slots, stage_loc, stage_loc.stride(0), host_table, host_table.stride(0),
                                scratch[0], scratch[1], src_pad, dst_pad, copy_n, counts, host_ps, KK=KK, W=W,
                                SPACE_=SPACE, BLOCK=1024, WB=1024, num_warps=4)
    return src_pad, dst_pad, copy_n, counts
