"""Fused Triton resolver plan kernel: one program per request (grid = N).

Each program works over the union of its request's K*k selections (paper §3.2, eq. 5-6) in phases
separated by CTA barriers, with a per-program scratch in global memory (L2 resident). Distinct
rows are found with an open-addressing table (HT = 2*next_pow2(K*k) buckets, linear probing) built
in synchronous rounds: an active lane reads its bucket, claims it with its position if empty,
and after a barrier either finds its own position there (done: all lanes of one position agree on
one bucket) or steps to the next bucket. A bucket id is the uid of a distinct row.

  P1 dedup   bucket of every selection entry -> bidx [KK]; table T [HT] holds the positions
  P2 direct  tail (p >= tail_start) or optional map (direct_loc[p] >= 0) -> out[bucket]
  P3 hot     every hot slot probes T for its position; a hit on a not-direct row sets
             out[bucket] = hot_loc, protects the slot and refreshes its stamp
  P4 misses  keys (host location, bucket) compacted and sorted; victims = unprotected slots by
             (stamp, slot id): a stamp threshold found by bisection selects exactly the first
             nhost, which are then sorted; the r-th miss takes the r-th victim (copy plan row r)
  P5 output  loc[i] = out[bidx[i]] in selection order, -1 where the selection is -1; counters

Sorts only ever see the misses / victims of the call (size classes SA < SB < SC < SD = BP; more
than SD misses only happen on overflow: the nhost <= B smallest host keys are kept first). P3 and P4 run
only when needed: cost depends on K*k, B and the misses, never on the history length. Hot positions
must be unique per slot row, slots unique within a call, host locations distinct (as the reference
assumes); positions < 2^31.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dhisparse.kernels.resolver_evict import BIG, _assign, _compact_misses, _keep_smallest, _sort_two, _victims


@triton.jit
def _hash(p, LOGH: tl.constexpr):
    """Fibonacci hash of positions p (int64 >= 0) to [0, 2^LOGH)."""
    return (((p * 2654435761) & 0xFFFFFFFF) >> (32 - LOGH)).to(tl.int32)


@triton.jit
def _dedup(sel_ptr, KK, T, bidx, n, KKP: tl.constexpr, HT: tl.constexpr, LOGH: tl.constexpr, CHH: tl.constexpr):
    """P1. T [HT] <- distinct positions (-1 empty); bidx [KK] <- bucket of each valid entry.
    Returns the number of valid entries."""
    for c0 in range(0, HT, CHH):
        tl.store(T + c0 + tl.arange(0, CHH), tl.full([CHH], -1, tl.int32))
    tl.debug_barrier()
    i = tl.arange(0, KKP)
    p = tl.load(sel_ptr + n * KK + i, mask=i < KK, other=-1).to(tl.int64)
    valid = p >= 0
    b = _hash(tl.where(valid, p, 0), LOGH)
    active = valid
    nact = tl.sum(active.to(tl.int32), axis=0)
    while nact > 0:
        t = tl.load(T + b, mask=active, other=0)
        tl.store(T + b, p.to(tl.int32), mask=active & (t == -1))
        tl.debug_barrier()
        t2 = tl.load(T + b, mask=active, other=-1).to(tl.int64)
        active = active & (t2 != p)
        b = tl.where(active, (b + 1) & (HT - 1), b)
        nact = tl.sum(active.to(tl.int32), axis=0)
        tl.debug_barrier()
    tl.store(bidx + i, b, mask=valid)
    return tl.sum(valid.to(tl.int32), axis=0)


@triton.jit
def _direct(T, out, hflag, s, tail_start_ptr, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX, has_map,
            HT: tl.constexpr, CHH: tl.constexpr):
    """P2. out[bucket] = tail or optional-map location (raw tail value; -1 when not direct).
    Returns (direct rows, remaining rows)."""
    ts = tl.load(tail_start_ptr + s).to(tl.int64)
    ndir = tl.sum(tl.zeros([CHH], tl.int32), axis=0)
    nrest = ndir
    for c0 in range(0, HT, CHH):
        u = c0 + tl.arange(0, CHH)
        p = tl.load(T + u).to(tl.int64)
        occ = p >= 0
        in_tail = p >= ts
        t = p - ts
        tv = tl.load(tail_loc_ptr + s * s_tail + t, mask=occ & in_tail & (t < TT), other=-1).to(tl.int64)
        dv = tl.load(dmap_ptr + s * s_dmap + p, mask=occ & (~in_tail) & (p < LMAX) & (has_map != 0),
                     other=-1).to(tl.int64)
        o = tl.where(in_tail, tv, tl.where(dv >= 0, dv, -1))
        ndir += tl.sum((occ & (o >= 0)).to(tl.int32), axis=0)
        nrest += tl.sum((occ & (o < 0)).to(tl.int32), axis=0)
        tl.store(out + u, o)
        tl.store(hflag + u, tl.zeros([CHH], tl.int32))
    return ndir, nrest


@triton.jit
def _hot_scan(T, out, prot, s, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B, now,
              BP: tl.constexpr, HT: tl.constexpr, LOGH: tl.constexpr):
    """P3. Each slot probes T for its position; hits on non-direct rows: out[bucket] = hot_loc,
    prot[slot] = 1, stamp = now. Returns the number of hits."""
    sl = tl.arange(0, BP)
    bm = sl < B
    hp = tl.load(hot_pos_ptr + s * s_pos + sl, mask=bm, other=-1).to(tl.int64)
    act = bm & (hp >= 0)
    bk = _hash(tl.where(act, hp, 0), LOGH)
    found = tl.zeros([BP], tl.int1)
    nact = tl.sum(act.to(tl.int32), axis=0)
    while nact > 0:
        t = tl.load(T + bk, mask=act, other=-1).to(tl.int64)
        found = found | (act & (t == hp))
        act = act & (t != hp) & (t != -1)
        bk = tl.where(act, (bk + 1) & (HT - 1), bk)
        nact = tl.sum(act.to(tl.int32), axis=0)
    o = tl.load(out + bk, mask=found, other=0)
    hit = found & (o < 0)
    hl = tl.load(hot_loc_ptr + s * s_loc + sl, mask=hit, other=0).to(tl.int64)
    tl.store(out + bk, hl, mask=hit)
    tl.store(hot_stamp_ptr + s * s_stamp + sl, tl.zeros([BP], tl.int64) + now, mask=hit)
    tl.store(prot + sl, hit.to(tl.int32), mask=bm)
    return tl.sum(hit.to(tl.int32), axis=0)


@triton.jit
def _emit(sel_ptr, loc_ptr, KK, n, bidx, out, hflag, KKP: tl.constexpr, CH: tl.constexpr):
    """P5. loc row [KK] in selection order. Returns the host-selected entries."""
    hsel = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    for c0 in range(0, KKP, CH):
        if c0 < KK:
            i = c0 + tl.arange(0, CH)
            im = i < KK
            x = tl.load(sel_ptr + n * KK + i, mask=im, other=-1)
            valid = im & (x >= 0)
            bk = tl.load(bidx + i, mask=valid, other=0)
            o = tl.load(out + bk, mask=valid, other=-1)
            hsel += tl.sum(tl.load(hflag + bk, mask=valid, other=0), axis=0)
            tl.store(loc_ptr + n * KK + i, tl.where(valid, o, -1).to(loc_ptr.dtype.element_ty), mask=im)
    return hsel


@triton.jit(do_not_specialize=["now", "KK", "B", "TT", "HPW", "LMAX", "C", "ps", "has_map", "s_dmap"])
def resolve_plan_kernel(
    sel_ptr, slots_ptr, KK,
    hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B,
    tail_start_ptr, tail_loc_ptr, s_tail, TT,
    table_ptr, s_table, HPW, ps,
    dmap_ptr, s_dmap, LMAX, has_map,
    now,
    loc_ptr, src_ptr, dst_ptr, copy_n_ptr, cnt_ptr, C,
    scr64_ptr, scr32_ptr,
    KKP: tl.constexpr, BP: tl.constexpr, HT: tl.constexpr, LOGH: tl.constexpr, CH: tl.constexpr,
    CHH: tl.constexpr, CHB: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr, SC: tl.constexpr,
    SD: tl.constexpr,
):
    """Grid (N,). sel [N, KK]; state rows indexed by slots[n]; loc [N, KK]; src/dst [N, C] copy plan
    rows (host location, device location) sorted by host location; copy_n [N]; cnt [N, 6]
    (selected, direct, hot, host, host_selected, overflow). scr64 [N, HT + KKP + BP] int64,
    scr32 [N, 2*HT + KKP + BP] int32."""
    n = tl.program_id(0).to(tl.int64)
    s = tl.load(slots_ptr + n).to(tl.int64)
    now = now.to(tl.int64)
    out = scr64_ptr + n * (HT + KKP + BP)
    T = scr32_ptr + n * (2 * HT + KKP + BP)
    hflag = T + HT
    bidx = hflag + HT
    prot = bidx + KKP

    nsel = _dedup(sel_ptr, KK, T, bidx, n, KKP, HT, LOGH, CHH)
    tl.debug_barrier()
    ndir, nrest = _direct(T, out, hflag, s, tail_start_ptr, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX,
                          has_map, HT, CHH)
    tl.debug_barrier()
    nhot = ndir * 0
    if nrest > 0:
        nhot = _hot_scan(T, out, prot, s, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B, now,
                         BP, HT, LOGH)
        tl.debug_barrier()
    nmiss = nrest - nhot
    nhost = nmiss * 0
    if nmiss > 0:
        nhost = tl.minimum(nmiss, (B - nhot).to(tl.int32)).to(tl.int32)
        _compact_misses(T, out, out + HT, s, table_ptr, s_table, HPW, ps, HT, CHH)
        nsv = _victims(prot, out + HT + KKP, s, hot_stamp_ptr, s_stamp, B, nhost, BP)
        tl.debug_barrier()
        nsort = nmiss
        if nmiss > SD:
            _keep_smallest(out + HT, nmiss, nhost, KKP, CH)
            nsort = nhost
        _sort_two(out, HT, nsort, HT + KKP, nsv, SA, SB, SC, SD)
        _assign(T, out, hflag, out + HT, out + HT + KKP, s, n, C, nhost, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr,
                s_pos, s_stamp, s_loc, src_ptr, dst_ptr, now, BP, HT, CHB)
        tl.debug_barrier()
    tl.store(copy_n_ptr + n, nhost)
    hsel = _emit(sel_ptr, loc_ptr, KK, n, bidx, out, hflag, KKP, CH)
    c = cnt_ptr + n * 6
    tl.store(c + 0, nsel.to(tl.int64))
    tl.store(c + 1, ndir.to(tl.int64))
    tl.store(c + 2, nhot.to(tl.int64))
    tl.store(c + 3, nhost.to(tl.int64))
    tl.store(c + 4, hsel.to(tl.int64))
    tl.store(c + 5, (nmiss - nhost).to(tl.int64))
