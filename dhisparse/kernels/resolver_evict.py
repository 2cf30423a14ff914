"""Miss / victim phases of the fused resolver plan kernel (see resolver_kernel.py).

Misses are keyed (host location, uid), compacted in uid order, and (HOSTORD: the plan's miss order
"host") sorted in scratch with the smallest of four power-of-two size classes; in "selection" order
(distinct selections: the uid is the entry) the compaction's order is already the miss order and
nothing is sorted. The victims (the LRU-oldest unprotected slots) are found by a threshold stamp and
listed in slot order, unsorted, and the r-th miss is paired with the r-th victim exactly as the
PyTorch reference does.
"""

from __future__ import annotations

import triton
import triton.language as tl

BIG = tl.constexpr(9223372036854775807)  # int64 max: sorts after every real key


@triton.jit
def _rep_chunk(sel_ptr, rep, n, KK, c0, CH: tl.constexpr):
    """One chunk of request n's flattened selection: (uids u, positions p, is_rep) where is_rep
    marks the valid entries that represent their distinct row (rep[u] == u)."""
    u = c0 + tl.arange(0, CH)
    um = u < KK
    p = tl.load(sel_ptr + n * KK + u, mask=um, other=-1).to(tl.int64)
    is_rep = um & (p >= 0) & (tl.load(rep + u, mask=um, other=-1) == u)
    return u, p, is_rep


@triton.jit
def _compact_misses(sel_ptr, KK, n, rep, out, mk, s, table_ptr, s_table, HPW, ps: tl.constexpr,
                    KKP: tl.constexpr, CH: tl.constexpr):
    """P4a. mk[r] = host_location * KKP + uid for every missing distinct row, in uid order. Returns M."""
    m = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    for c0 in range(0, KKP, CH):
        if c0 < KK:
            u, p, is_rep = _rep_chunk(sel_ptr, rep, n, KK, c0, CH)
            miss = is_rep & (tl.load(out + u, mask=is_rep, other=0) < 0)
            page = p // ps
            hpg = tl.load(table_ptr + s * s_table + page, mask=miss & (page < HPW), other=-1).to(tl.int64)
            mi = miss.to(tl.int32)
            r = m + tl.cumsum(mi, axis=0) - 1
            tl.store(mk + r, (hpg * ps + p % ps) * KKP + u, mask=miss)
            m += tl.sum(mi, axis=0)
    return m


@triton.jit
def _keep_smallest(mk, m, need, KKP: tl.constexpr, CH: tl.constexpr):
    """P4a'. Overflow (m misses > largest sort class): keep the `need` smallest keys of mk[0:m]
    (distinct) at mk[0:need], by bisection on the key value then an order-preserving compaction."""
    lo = tl.min(tl.full([CH], BIG, tl.int64), axis=0)
    hi = -lo
    for c0 in range(0, KKP, CH):
        i = c0 + tl.arange(0, CH)
        x = tl.load(mk + i, mask=i < m, other=BIG)
        lo = tl.minimum(lo, tl.min(x, axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(i < m, x, -BIG), axis=0))
    while lo < hi:  # smallest key value v with #(keys <= v) >= need
        mid = lo + (hi - lo) // 2
        c = tl.sum(tl.zeros([CH], tl.int32), axis=0)
        for c0 in range(0, KKP, CH):
            i = c0 + tl.arange(0, CH)
            x = tl.load(mk + i, mask=i < m, other=BIG)
            c += tl.sum((x <= mid).to(tl.int32), axis=0)
        hi = tl.where(c >= need, mid, hi)
        lo = tl.where(c >= need, lo, mid + 1)
    tl.debug_barrier()
    carry = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    for c0 in range(0, KKP, CH):
        i = c0 + tl.arange(0, CH)
        x = tl.load(mk + i, mask=i < m, other=BIG)
        keep = x <= lo
        tl.store(mk + carry + tl.cumsum(keep.to(tl.int32), axis=0) - 1, x, mask=keep)
        carry += tl.sum(keep.to(tl.int32), axis=0)
        tl.debug_barrier()


@triton.jit
def _min_count(av, ac, bv, bc):
    """Combine of a (minimum, how many hold it) reduction."""
    v = tl.minimum(av, bv)
    return v, tl.where(av == v, ac, 0) + tl.where(bv == v, bc, 0)


@triton.jit
def _victims(cand, st, vk, nhost, BP: tl.constexpr, STEPS: tl.constexpr):
    """P4b. vk[0:nhost] <- slot ids of the first nhost candidate slots (cand [BP]: in range and
    unprotected) in (stamp, slot) order (stamps st [BP] int64), stored in slot order (misses pair
    with them in that order: no sort). The threshold stamp s* (the smallest with #(candidates,
    stamp <= s*) >= nhost) is found by walking up the distinct stamps from the oldest, at most
    STEPS of them (one group of equal stamps usually covers a round's misses), then by bisection on
    what is left. (A five-way search, four pivots counted in one int64 reduction a pass, was measured
    against this in session 52 and removed: on an H100, 14 of 16 cases that search came to 1-9% more of
    the peer's plan than session 51's bisection, the cases that never search 7% less to 1% more, across two
    machines. A radix selection of s*, 256-bin histograms of 8-bit digits, was measured against this in
    session 39 and removed: 4-6% faster at 20% and all misses with H 8,192, 10-14% slower at 0.1% misses
    with H 4,096.)"""
    sl = tl.arange(0, BP)
    # the oldest stamp and how many candidates hold it, in one reduction (`_min_count`)
    lo, have = tl.reduce((tl.where(cand, st, BIG), cand.to(tl.int32)), 0, _min_count)
    nbelow = have * 0  # #(candidates with stamp < lo): none below the oldest
    j = 0
    while (have < nhost) & (j < STEPS):  # the next distinct stamp up: what was <= lo is now < lo
        nbelow = have
        up = cand & (st > lo)
        lo, more = tl.reduce((tl.where(up, st, BIG), up.to(tl.int32)), 0, _min_count)
        have += more
        j += 1
    if have < nhost:  # s* lies in (lo, hi]
        hi = tl.max(tl.where(cand, st, -BIG), axis=0)
        lo = lo + 1
        while lo < hi:
            mid = lo + (hi - lo) // 2
            ok = tl.sum((cand & (st <= mid)).to(tl.int32), axis=0) >= nhost
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid + 1)
        nbelow = tl.sum((cand & (st < lo)).to(tl.int32), axis=0)
    below = cand & (st < lo)
    eq = cand & (st == lo)
    # one int32 scan for both running counts: below in the low 16 bits, equal stamps in the high ones
    # (each < 2^15: BP <= 32,768); the equal-stamp slots taken are the first (nhost - nbelow) in slot
    # order, so a taken slot's rank is (belows before it) + min(equals before it, nhost - nbelow)
    tl.static_assert(BP <= 32768)
    cs = tl.cumsum(below.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
    ce = cs >> 16
    take = below | (eq & (ce <= nhost - nbelow))
    r = (cs & 0xFFFF) + tl.minimum(ce, nhost - nbelow) - 1
    tl.store(vk + r, sl.to(tl.int64), mask=take)


@triton.jit
def _sort_block(ptr, cnt, S: tl.constexpr):
    i = tl.arange(0, S)
    x = tl.sort(tl.load(ptr + i, mask=i < cnt, other=BIG))
    tl.store(ptr + i, x, mask=i < cnt)


@triton.jit
def _rank_block(ptr, cnt, S: tl.constexpr):
    """Sort ptr[0:cnt] (distinct int64 keys, cnt <= S) by rank counting: key i goes to the number of
    keys below it. An [S, S] comparison: for small S far cheaper than a bitonic sort in one program."""
    i = tl.arange(0, S)
    x = tl.load(ptr + i, mask=i < cnt, other=BIG)
    r = tl.sum((x[None, :] < x[:, None]).to(tl.int32), axis=1)
    tl.debug_barrier()
    tl.store(ptr + r, x, mask=i < cnt)


@triton.jit
def _sort_keys(scr, cnt, SA: tl.constexpr, SB: tl.constexpr, SC: tl.constexpr, SD: tl.constexpr):
    """Sort scr[0:cnt] (int64, distinct) in place with the smallest size class (SA < SB < SC < SD) that
    holds it: rank counting up to 128 keys, a bitonic sort above."""
    if cnt > 1:
        if cnt <= SA:
            if SA <= 128:
                _rank_block(scr, cnt, SA)
            else:
                _sort_block(scr, cnt, SA)
        elif cnt <= SB:
            if SB <= 128:
                _rank_block(scr, cnt, SB)
            else:
                _sort_block(scr, cnt, SB)
        elif cnt <= SC:
            _sort_block(scr, cnt, SC)
        else:
            _sort_block(scr, cnt, SD)
    tl.debug_barrier()


@triton.jit
def _assign(sel_ptr, KK, n, out, hflag, mk, vk, s, C, nhost, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos,
            s_stamp, s_loc, src_ptr, dst_ptr, now, loc_row, hmap_ptr, s_hmap, KKP: tl.constexpr, BP: tl.constexpr,
            CHB: tl.constexpr, DISTINCT: tl.constexpr, MAP: tl.constexpr):
    """P4d. Miss r < nhost (host order) takes victim r (slot order): copy plan row r, state update.
    Its location goes to out[u] and its flag is set (P5 reads both), or with DISTINCT (uid u is the
    entry; no P5) straight to loc_row[u]. MAP: the hot_entry index follows (the victim's old
    position unmapped, the miss's position mapped to it; the two sets are disjoint, since a miss's
    position is in no hot entry, so no two threads write one cell)."""
    for r0 in range(0, BP, CHB):
        if r0 < nhost:
            r = r0 + tl.arange(0, CHB)
            take = r < nhost
            key = tl.load(mk + r, mask=take, other=0)
            u = key % KKP
            v = tl.load(vk + r, mask=take, other=0)
            lv = tl.load(hot_loc_ptr + s * s_loc + v, mask=take, other=0).to(tl.int64)
            pu = tl.load(sel_ptr + n * KK + u, mask=take, other=0)
            if MAP:  # the old position is read before this thread overwrites it below
                old = tl.load(hot_pos_ptr + s * s_pos + v, mask=take, other=-1)
                tl.store(hmap_ptr + s * s_hmap + old, tl.full([CHB], -1, tl.int16), mask=take & (old >= 0))
                tl.store(hmap_ptr + s * s_hmap + pu, v.to(tl.int16), mask=take)
            if DISTINCT:
                tl.store(loc_row + u, lv.to(loc_row.dtype.element_ty), mask=take)
            else:
                tl.store(out + u, lv, mask=take)
                tl.store(hflag + u, tl.full([CHB], 1, tl.int32), mask=take)
            tl.store(hot_pos_ptr + s * s_pos + v, pu.to(hot_pos_ptr.dtype.element_ty), mask=take)
            tl.store(hot_stamp_ptr + s * s_stamp + v, tl.zeros([CHB], tl.int64) + now, mask=take)
            tl.store(src_ptr + n * C + r, key // KKP, mask=take)
            tl.store(dst_ptr + n * C + r, lv, mask=take)


@triton.jit
def _pair_misses(sel_ptr, KK, n, out, hflag, mk, vk, s, nmiss, nhost, bm, hit, hs, hot_pos_ptr, hot_stamp_ptr,
                 hot_loc_ptr, s_pos, s_stamp, s_loc, src_ptr, dst_ptr, C, now, loc_row, hmap_ptr, s_hmap,
                 KKP: tl.constexpr, BP: tl.constexpr, CH: tl.constexpr, CHB: tl.constexpr, SA: tl.constexpr,
                 SB: tl.constexpr, SC: tl.constexpr, SD: tl.constexpr, VSTEPS: tl.constexpr,
                 UPTO: tl.constexpr, DISTINCT: tl.constexpr, MAP: tl.constexpr, HOSTORD: tl.constexpr):
    """P4b-d, after the nmiss miss keys are compacted into mk in uid order: victims (the oldest nhost
    of the slots in range bm not hit, by their stamps hs as read before P3), HOSTORD: the nhost
    smallest keys sorted (else the first nhost in uid order, as compacted), and miss r paired with
    victim r. UPTO 41 / 43 (profiling): stop after P4b / P4c."""
    _victims(bm & (~hit), hs, vk, nhost, BP, VSTEPS)
    tl.debug_barrier()
    if UPTO >= 43:
        if HOSTORD:
            nsort = nmiss
            if nmiss > SD:
                _keep_smallest(mk, nmiss, nhost, KKP, CH)
                nsort = nhost
            _sort_keys(mk, nsort, SA, SB, SC, SD)
        if UPTO >= 45:
            _assign(sel_ptr, KK, n, out, hflag, mk, vk, s, C, nhost, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr,
                    s_pos, s_stamp, s_loc, src_ptr, dst_ptr, now, loc_row, hmap_ptr, s_hmap, KKP, BP, CHB,
                    DISTINCT, MAP)
            tl.debug_barrier()
