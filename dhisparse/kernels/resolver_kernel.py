"""Fused Triton resolver plan kernel: one program per request (grid = N), after an optional P0 pre-pass.

Each program works over the union of its request's K*k selections (paper §3.2, eq. 5-6) in phases
separated by CTA barriers, with a per-program scratch in global memory (L1/L2 resident).

Distinct rows are found by hash arbitration rounds, each in a region of its own (sizes HT, HT/2,
...; HT = 2 * next_pow2(K*k)) with its own multiplicative hash: every unresolved entry writes its
packed key (position * KKP + index, int64) into its bucket, and after a barrier reads the winner's
back; entries whose winner holds the same position are resolved with that winner as representative
(uid). All entries of one position share every bucket, so they resolve together. A handful of rounds
resolves everything in practice; entries still unresolved after RMAX rounds are resolved exactly one
position at a time ("leftovers"). Lookups (hot slots) read the same buckets, one load a round: a key
holding the slot's position names its representative. The tables (`tab`) are -1 at entry: each
program clears the buckets it wrote before it ends (`_leave_clean`), so a persistent workspace
stays valid; a per-call allocation is filled with -1.

  P1 dedup   rep [KK]: uid (representative entry) of every valid entry
  P2 direct  tail (p >= tail_start) or optional map (direct_loc[p] >= 0) -> out[uid]
  P3 hot     every hot slot looks its position up; a hit on a not-direct row sets out[uid] = hot_loc,
             protects the slot and refreshes its stamp
  P4 misses  keys (host location, uid) compacted and sorted; victims = the LRU-oldest unprotected
             slots by (stamp, slot id), listed in slot order; the r-th miss takes the r-th victim
             (copy plan row r)  [resolver_evict]
  P5 output  loc[i] = out[rep[i]] in selection order, -1 where the selection is -1; counters

Direct fast path (P0, paper §3.2: "a lookup skips the hot-cache scan only when every selected row
resolves through a ready mapping or the tail"): each selection entry is first mapped through its
tail / optional map and loc written in selection order, in chunks of CH entries: with an optional
map (adaptive) by `direct_pre_kernel`, one program per chunk, before the plan kernel; without one
inside the plan kernel, stopping at the first chunk that does not resolve. Each
directly resolved entry also sets its position's bit in the request's row of a zeroed bitmap
(`bm` [N, WORDS] int32, one bit per history position) with an atomic OR; an entry whose bit was
not yet set is a new distinct row, so the distinct count needs no dedup and no table wider than a
chunk. If every valid entry resolved, the program exits: no dedup, hot scan, eviction or copy
plan (copy_n = 0, hot-cache state untouched, as the reference leaves it). Otherwise P1-P5 run
unchanged and P5 overwrites the speculative loc row.

Cost depends on K*k, B and the misses, never on the history length. Hot positions must be unique
per slot row, slots unique within a call, host locations distinct (as the reference assumes),
positions < 2^31.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dhisparse.kernels.resolver_evict import _assign, _compact_misses, _keep_smallest, _rep_chunk, _sort_keys, _victims


@triton.jit
def _hash(p, r: tl.constexpr, LOGB: tl.constexpr):
    """Multiplicative hash of round r of positions p (int64 >= 0) to [0, 2^LOGB)."""
    if r == 0:
        m = 2654435761
    elif r == 1:
        m = 2246822519
    elif r == 2:
        m = 3266489917
    else:
        m = 2028178513
    return (((p * m) & 0xFFFFFFFF) >> (32 - LOGB)).to(tl.int32)


@triton.jit
def _dedup(sel_ptr, KK, n, T, rep, lf, KKP: tl.constexpr, HT: tl.constexpr, LOGH: tl.constexpr,
           RMAX: tl.constexpr, LOGK: tl.constexpr):
    """P1. rep [KK] <- representative entry of each valid entry's position. Returns (valid entries,
    rounds run, leftover count); leftover representatives are listed in lf. A bucket holds the
    packed key p * KKP + i of the entry that won it, so the winner's position is read with it."""
    i = tl.arange(0, KKP)
    p = tl.load(sel_ptr + n * KK + i, mask=i < KK, other=-1).to(tl.int64)
    valid = p >= 0
    u = tl.full([KKP], -1, tl.int32)
    active = valid
    nact = tl.sum(active.to(tl.int32), axis=0)
    nr = nact * 0
    for r in tl.static_range(RMAX):
        if nact > 0:
            reg = T + 2 * HT - 2 * (HT >> r)
            h = _hash(p, r, LOGH - r)
            tl.store(reg + h, p * KKP + i, mask=active)
            tl.debug_barrier()
            kw = tl.load(reg + h, mask=active, other=-1)
            got = active & ((kw >> LOGK) == p)
            u = tl.where(got, (kw & (KKP - 1)).to(tl.int32), u)
            active = active & (~got)
            nact = tl.sum(active.to(tl.int32), axis=0)
            nr += 1
            tl.debug_barrier()
    nlf = nact * 0
    while nact > 0:  # leftovers: one position at a time
        j0 = tl.min(tl.where(active, i, KKP), axis=0)
        q = tl.load(sel_ptr + n * KK + j0).to(tl.int64)
        same = active & (p == q)
        u = tl.where(same, j0, u)
        active = active & (~same)
        tl.store(lf + nlf, j0)
        nlf += 1
        nact = tl.sum(active.to(tl.int32), axis=0)
    tl.store(rep + i, u, mask=i < KK)
    return tl.sum(valid.to(tl.int32), axis=0), nr, nlf


@triton.jit
def _direct_loc(p, m, s, ts, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX, has_map):
    """Direct location of positions p [CH] (int64) of slot s where mask m holds: the tail's row for
    p >= tail_start ts, else the optional map's; -1 when neither (or masked)."""
    in_tail = p >= ts
    t = p - ts
    tv = tl.load(tail_loc_ptr + s * s_tail + t, mask=m & in_tail & (t < TT), other=-1).to(tl.int64)
    dv = tl.load(dmap_ptr + s * s_dmap + p, mask=m & (~in_tail) & (p < LMAX) & (has_map != 0), other=-1).to(tl.int64)
    return tl.where(in_tail, tv, tl.where(dv >= 0, dv, -1))


@triton.jit
def _direct(sel_ptr, KK, n, rep, out, hflag, s, tail_start_ptr, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap,
            LMAX, has_map, KKP: tl.constexpr, CH: tl.constexpr):
    """P2. out[uid] = tail or optional-map location (raw tail value; -1 when not direct).
    Returns (direct rows, remaining rows)."""
    ts = tl.load(tail_start_ptr + s).to(tl.int64)
    ndir = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    nrest = ndir
    for c0 in range(0, KKP, CH):
        if c0 < KK:
            u, p, is_rep = _rep_chunk(sel_ptr, rep, n, KK, c0, CH)
            o = _direct_loc(p, is_rep, s, ts, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX, has_map)
            ndir += tl.sum((is_rep & (o >= 0)).to(tl.int32), axis=0)
            nrest += tl.sum((is_rep & (o < 0)).to(tl.int32), axis=0)
            tl.store(out + u, o, mask=is_rep)
            tl.store(hflag + u, tl.zeros([CH], tl.int32), mask=is_rep)
    return ndir, nrest


@triton.jit
def _direct_chunk(sel_ptr, loc_ptr, KK, n, i, s, ts, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX, has_map,
                  bm_ptr, WORDS, CH: tl.constexpr):
    """P0 over entries i [CH] of request n: loc[n, i] = tail / optional-map location, -1 for
    padding (written speculatively), and the position's bit set in bitmap row n (a position past
    the bitmap counts as not direct). Returns (valid entries, entries not direct, new distinct
    direct rows)."""
    im = i < KK
    p = tl.load(sel_ptr + n * KK + i, mask=im, other=-1).to(tl.int64)
    valid = p >= 0
    o = _direct_loc(p, valid, s, ts, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX, has_map)
    word = p >> 5
    ok = valid & (o >= 0) & (word < WORDS)
    bit = (tl.full([CH], 1, tl.int64) << (p & 31)).to(tl.int32)  # bit 31 wraps to the sign bit
    old = tl.atomic_or(bm_ptr + n * WORDS + word, bit, mask=ok, sem="relaxed")
    tl.store(loc_ptr + n * KK + i, tl.where(valid, o, -1).to(loc_ptr.dtype.element_ty), mask=im)
    return (tl.sum(valid.to(tl.int32), axis=0), tl.sum((valid & (~ok)).to(tl.int32), axis=0),
            tl.sum((ok & ((old & bit) == 0)).to(tl.int32), axis=0))


@triton.jit
def _direct_entries(sel_ptr, loc_ptr, KK, n, s, tail_start_ptr, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX,
                    has_map, bm_ptr, WORDS, KKP: tl.constexpr, CH: tl.constexpr):
    """P0 inside the program, chunk after chunk (`_direct_chunk`); stops after the first chunk
    holding a valid entry that does not resolve directly. Returns (valid entries, entries not
    direct, distinct direct rows)."""
    ts = tl.load(tail_start_ptr + s).to(tl.int64)
    nval = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    nnd = nval
    ndist = nval
    for c0 in range(0, KKP, CH):
        if (c0 < KK) & (nnd == 0):
            a, b, d = _direct_chunk(sel_ptr, loc_ptr, KK, n, c0 + tl.arange(0, CH), s, ts, tail_loc_ptr, s_tail, TT,
                                    dmap_ptr, s_dmap, LMAX, has_map, bm_ptr, WORDS, CH)
            nval += a
            nnd += b
            ndist += d
    return nval, nnd, ndist


@triton.jit
def _leave_clean(sel_ptr, KK, n, T, nr, bm_ptr, WORDS, pre_ptr, PRE: tl.constexpr, HT: tl.constexpr,
                 LOGH: tl.constexpr, RMAX: tl.constexpr, KKP: tl.constexpr, CH: tl.constexpr):
    """End of program n, in one pass over its entries: the bitmap words its entries' P0 set back to
    0, every bucket a dedup round may have written (a valid entry's bucket in each of the nr rounds
    run; 0 when no dedup ran) back to -1, and its pre row reset, so a persistent workspace
    (resolver_workspace.py) is clean at the next call's entry. Runs after a barrier: every read of
    them is done."""
    for c0 in range(0, KKP, CH):
        if c0 < KK:
            i = c0 + tl.arange(0, CH)
            p = tl.load(sel_ptr + n * KK + i, mask=i < KK, other=-1).to(tl.int64)
            word = p >> 5
            tl.store(bm_ptr + n * WORDS + word, tl.zeros([CH], tl.int32), mask=(p >= 0) & (word < WORDS))
            for r in tl.static_range(RMAX):
                if r < nr:
                    h = _hash(p, r, LOGH - r)
                    tl.store(T + 2 * HT - 2 * (HT >> r) + h, tl.full([CH], -1, tl.int64), mask=p >= 0)
    if PRE:
        for j in tl.static_range(3):
            tl.store(pre_ptr + n * 3 + j, 0)


@triton.jit(do_not_specialize=["KK", "TT", "LMAX", "s_dmap", "WORDS"])
def direct_pre_kernel(sel_ptr, slots_ptr, KK, tail_start_ptr, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX,
                      loc_ptr, bm_ptr, WORDS, pre_ptr, CH: tl.constexpr):
    """P0 spread over programs: grid (N, cdiv(KK, CH)); program (n, j) runs `_direct_chunk` on
    entries j*CH .. j*CH+CH-1 of request n and adds its (valid, not direct, distinct direct)
    counts to pre [N, 3] int32 (zeros). The plan kernel then reads them instead of walking the
    request's K*k entries in one program (with an optional map: adaptive)."""
    n = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * CH + tl.arange(0, CH)
    s = tl.load(slots_ptr + n).to(tl.int64)
    ts = tl.load(tail_start_ptr + s).to(tl.int64)
    a, b, d = _direct_chunk(sel_ptr, loc_ptr, KK, n, i, s, ts, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX, 1,
                            bm_ptr, WORDS, CH)
    tl.atomic_add(pre_ptr + n * 3, a, sem="relaxed")
    tl.atomic_add(pre_ptr + n * 3 + 1, b, sem="relaxed")
    tl.atomic_add(pre_ptr + n * 3 + 2, d, sem="relaxed")


@triton.jit
def _hot_scan(sel_ptr, KK, n, T, rep, lf, nr, nlf, out, prot, s, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr,
              s_pos, s_stamp, s_loc, B, now, BP: tl.constexpr, HT: tl.constexpr, LOGH: tl.constexpr,
              RMAX: tl.constexpr, LOGK: tl.constexpr, KKP: tl.constexpr):
    """P3. Each slot looks its position up in the dedup regions (then the leftovers): one load a
    round, the bucket's packed key (a round's winner is its position's representative; a bucket
    not written this call holds -1: `_leave_clean`); hits on non-direct rows: out[uid] = hot_loc,
    prot[slot] = 1, stamp = now. Returns the number of hits."""
    sl = tl.arange(0, BP)
    bm = sl < B
    hp = tl.load(hot_pos_ptr + s * s_pos + sl, mask=bm, other=-1).to(tl.int64)
    act = bm & (hp >= 0)
    uid = tl.full([BP], -1, tl.int32)
    for r in tl.static_range(RMAX):
        if r < nr:
            look = act & (uid < 0)
            kw = tl.load(T + 2 * HT - 2 * (HT >> r) + _hash(hp, r, LOGH - r), mask=look, other=-1)
            uid = tl.where(look & (kw >= 0) & ((kw >> LOGK) == hp), (kw & (KKP - 1)).to(tl.int32), uid)
    j = nlf * 0
    while j < nlf:
        q = tl.load(lf + j)
        uid = tl.where(act & (uid < 0) & (hp == tl.load(sel_ptr + n * KK + q)), q, uid)
        j += 1
    found = uid >= 0
    o = tl.load(out + uid, mask=found, other=0)
    hit = found & (o < 0)
    hl = tl.load(hot_loc_ptr + s * s_loc + sl, mask=hit, other=0).to(tl.int64)
    tl.store(out + uid, hl, mask=hit)
    tl.store(hot_stamp_ptr + s * s_stamp + sl, tl.zeros([BP], tl.int64) + now, mask=hit)
    tl.store(prot + sl, hit.to(tl.int32), mask=bm)
    return tl.sum(hit.to(tl.int32), axis=0)


@triton.jit
def _emit(sel_ptr, loc_ptr, KK, n, rep, out, hflag, KKP: tl.constexpr, CH: tl.constexpr):
    """P5. loc row [KK] in selection order. Returns the host-selected entries."""
    hsel = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    for c0 in range(0, KKP, CH):
        if c0 < KK:
            i = c0 + tl.arange(0, CH)
            im = i < KK
            x = tl.load(sel_ptr + n * KK + i, mask=im, other=-1)
            valid = im & (x >= 0)
            u = tl.load(rep + i, mask=valid, other=0)
            o = tl.load(out + u, mask=valid, other=-1)
            hsel += tl.sum(tl.load(hflag + u, mask=valid, other=0), axis=0)
            tl.store(loc_ptr + n * KK + i, tl.where(valid, o, -1).to(loc_ptr.dtype.element_ty), mask=im)
    return hsel


@triton.jit
def _store_counts(c, nsel, ndir, nhot, nhost, hsel, nover):
    """Counters of one request at c[0:6] (ResolveCounters order)."""
    tl.store(c + 0, nsel.to(tl.int64))
    tl.store(c + 1, ndir.to(tl.int64))
    tl.store(c + 2, nhot.to(tl.int64))
    tl.store(c + 3, nhost.to(tl.int64))
    tl.store(c + 4, hsel.to(tl.int64))
    tl.store(c + 5, nover.to(tl.int64))


@triton.jit(do_not_specialize=["KK", "B", "TT", "HPW", "LMAX", "C", "ps", "has_map", "s_dmap", "WORDS"])
def resolve_plan_kernel(
    sel_ptr, slots_ptr, KK,
    hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B,
    tail_start_ptr, tail_loc_ptr, s_tail, TT,
    table_ptr, s_table, HPW, ps,
    dmap_ptr, s_dmap, LMAX, has_map,
    now_ptr,
    loc_ptr, src_ptr, dst_ptr, copy_n_ptr, cnt_ptr, C,
    scr64_ptr, scr32_ptr, tab_ptr, bm_ptr, WORDS, pre_ptr,
    KKP: tl.constexpr, LOGK: tl.constexpr, PRE: tl.constexpr, BP: tl.constexpr, HT: tl.constexpr, LOGH: tl.constexpr, RMAX: tl.constexpr,
    CH: tl.constexpr, CHB: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr, SC: tl.constexpr,
    SD: tl.constexpr, VSTEPS: tl.constexpr = 4, UPTO: tl.constexpr = 5,
):
    """Grid (N,). sel [N, KK]; state rows indexed by slots[n]; loc [N, KK]; src/dst [N, C] copy plan
    rows (host location, device location) sorted by host location; copy_n [N]; cnt [N, 6]
    (selected, direct, hot, host, host_selected, overflow). scr64 [N, 2*KKP + BP] int64,
    scr32 [N, 3*KKP + BP] int32; tab [N, 2*HT] int64 dedup tables, all -1 at entry; bm [N, WORDS]
    int32 zeros (P0's distinct-row bitmap); pre zeros: all three left so at exit (`_leave_clean`),
    so a persistent workspace stays valid.
    PRE: P0 already ran in `direct_pre_kernel`, its counts in pre [N, 3]; else it runs here.
    UPTO (profiling only, bench/resolver_peer.py): phases after P{UPTO} are compiled out, so the
    outputs are incomplete below 5; the default 5 runs every phase."""
    n = tl.program_id(0).to(tl.int64)
    s = tl.load(slots_ptr + n).to(tl.int64)
    now = tl.load(now_ptr).to(tl.int64)  # a device scalar: a captured step graph replays with the current step
    out = scr64_ptr + n * (2 * KKP + BP)
    mk = out + KKP
    vk = mk + KKP
    T = tab_ptr + n * (2 * HT)
    rep = scr32_ptr + n * (3 * KKP + BP)
    hflag = rep + KKP
    lf = hflag + KKP
    prot = lf + KKP

    c = cnt_ptr + n * 6
    if PRE:
        nval = tl.load(pre_ptr + n * 3)
        nnd = tl.load(pre_ptr + n * 3 + 1)
        ndist = tl.load(pre_ptr + n * 3 + 2)
    else:
        nval, nnd, ndist = _direct_entries(sel_ptr, loc_ptr, KK, n, s, tail_start_ptr, tail_loc_ptr, s_tail, TT,
                                           dmap_ptr, s_dmap, LMAX, has_map, bm_ptr, WORDS, KKP, CH)
    nr = nval * 0  # dedup rounds run (none on the direct exit)
    if nnd == 0:  # P0: every valid entry resolved directly; loc is final
        tl.store(copy_n_ptr + n, ndist * 0)
        _store_counts(c, nval, ndist, nval * 0, nval * 0, nval * 0, nval * 0)
        tl.debug_barrier()
    elif UPTO == 0:
        tl.store(copy_n_ptr + n, ndist * 0)
        tl.debug_barrier()
    else:
        tl.debug_barrier()
        nsel, nr, nlf = _dedup(sel_ptr, KK, n, T, rep, lf, KKP, HT, LOGH, RMAX, LOGK)
        tl.debug_barrier()
        ndir = nsel * 0
        nrest = ndir
        if UPTO >= 2:
            ndir, nrest = _direct(sel_ptr, KK, n, rep, out, hflag, s, tail_start_ptr, tail_loc_ptr, s_tail, TT,
                                  dmap_ptr, s_dmap, LMAX, has_map, KKP, CH)
            tl.debug_barrier()
        nhot = ndir * 0
        if (nrest > 0) & (UPTO >= 3):
            nhot = _hot_scan(sel_ptr, KK, n, T, rep, lf, nr, nlf, out, prot, s, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr,
                             s_pos, s_stamp, s_loc, B, now, BP, HT, LOGH, RMAX, LOGK, KKP)
            tl.debug_barrier()
        nmiss = nrest - nhot
        nhost = nmiss * 0
        if (nmiss > 0) & (UPTO >= 4):
            nhost = tl.minimum(nmiss, (B - nhot).to(tl.int32)).to(tl.int32)
            _compact_misses(sel_ptr, KK, n, rep, out, mk, s, table_ptr, s_table, HPW, ps, KKP, CH)
            _victims(prot, vk, s, hot_stamp_ptr, s_stamp, B, nhost, BP, VSTEPS)
            tl.debug_barrier()
            nsort = nmiss
            if nmiss > SD:
                _keep_smallest(mk, nmiss, nhost, KKP, CH)
                nsort = nhost
            _sort_keys(mk, nsort, SA, SB, SC, SD)
            _assign(sel_ptr, KK, n, out, hflag, mk, vk, s, C, nhost, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr,
                    s_pos, s_stamp, s_loc, src_ptr, dst_ptr, now, KKP, BP, CHB)
            tl.debug_barrier()
        tl.store(copy_n_ptr + n, nhost)
        hsel = nhost * 0
        if UPTO >= 5:
            hsel = _emit(sel_ptr, loc_ptr, KK, n, rep, out, hflag, KKP, CH)
        _store_counts(c, nsel, ndir, nhot, nhost, hsel, nmiss - nhost)
        tl.debug_barrier()
    _leave_clean(sel_ptr, KK, n, T, nr, bm_ptr, WORDS, pre_ptr, PRE, HT, LOGH, RMAX, KKP, CH)
