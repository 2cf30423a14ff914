"""Fused Triton resolver plan kernel: one program per request (grid = N), after an optional P0 pre-pass.

Each program works over the union of its request's K*k selections (paper §3.2, eq. 5-6) in phases
separated by CTA barriers, with a per-program scratch in global memory (L1/L2 resident). When the
entries fit one block (K*k <= 2,048: KKP <= CH) the program keeps them in registers from P1 to P5
(`resolver_one.py`, with `DISTINCT` skipping the claims' read-back); the chunked path here serves
larger unions. Both read the slot's hot rows into registers before P1 (`resolver_common._hot_rows`).

Distinct rows are found through a position-indexed claim table `pv` [N, LCAP] (int16 / int32, one
entry per history position of the request's row): every valid entry i writes i at pv[p], and after
a barrier reads pv[p] back; all entries of one position read the same winner, their representative
(uid). It is a perfect hash (no collisions, no rounds) and is never cleared: an entry only reads a
cell its own position's entries wrote this call, and a hot slot's lookup of pv[hot_pos] is accepted
only when the uid it reads is an entry of this call holding that very position (sel[u] == hot_pos),
which stale contents from an earlier call can never satisfy. Positions >= LCAP (out of contract:
I1 bounds them by the host table's reach plus the tail) are their own representatives.

  P1 entries  claim pv, read the representatives back (rep [KK]), each row's direct location (tail
              p >= tail_start, or optional map direct_loc[p] >= 0) -> out[uid], loc written
              speculatively in selection order; counts of valid / not-direct / direct rows
  P3 hot      every hot slot looks its position up in pv (checked against sel); a hit on a
              not-direct row sets out[uid] = hot_loc, protects the slot and refreshes its stamp
  P4 misses   keys (host location, uid) compacted in uid order and (miss order "host") sorted;
              victims = the LRU-oldest unprotected slots by (stamp, slot id), listed in slot order;
              the r-th miss takes the r-th victim (copy plan row r)  [resolver_evict]
  P5 output   loc[i] = out[rep[i]] in selection order, -1 where the selection is -1; counters

Direct fast path (paper §3.2: "a lookup skips the hot-cache scan only when every selected row
resolves through a ready mapping or the tail"): if every valid entry resolved directly in P1, the
program exits with loc as P1 wrote it: no hot scan, eviction or copy plan (copy_n = 0, hot-cache
state untouched, as the reference leaves it). With an optional map (adaptive) P0 runs first as
`direct_pre_kernel`, one program per chunk of CH entries: each directly resolved entry sets its
position's bit in the request's row of a bitmap with an atomic OR, an entry whose bit was not yet
set counts a new distinct row, and the per-request counts land in `pre`; a request whose entries
all resolved exits at once, the others run P1-P5. The bitmap has two halves and a parity word
(resolver_workspace.py): P0 sets bits in the half the parity names and its programs zero the other
half between them, and the last of them to finish flips the parity; the plan kernel (grid (N, 1))
resets the `pre` row it read. A persistent workspace stays valid without a pass that re-reads the
entries to clear bits.

Cost depends on K*k, B and the misses, never on the history length (pv is touched only at selected
and hot positions). Hot positions must be unique per slot row, slots unique within a call, host
locations distinct (as the reference assumes), positions and hot-cache device locations < 2^31.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dhisparse.kernels.launch import jit_unspecialized
from dhisparse.kernels.resolver_common import (_clear_hits, _copy_planned, _direct_loc, _hits, _hot_rows,
                                               _mark_hits, _read_hits, _store_counts)
from dhisparse.kernels.resolver_evict import _compact_misses, _pair_misses
from dhisparse.kernels.resolver_one import _plan_one


@triton.jit
def _entries(sel_ptr, loc_ptr, KK, n, pv, LCAP, rep, out, hflag, s, tail_start_ptr, tail_loc_ptr, s_tail, TT,
             dmap_ptr, s_dmap, LMAX, has_map, hmap_ptr, s_hmap, hrow, hl, hot_stamp_ptr, s_stamp, now,
             KKP: tl.constexpr, CH: tl.constexpr, MAP: tl.constexpr):
    """P1 over request n's K*k entries, in chunks of CH. Pass 1 claims pv[p] = i; a barrier; pass 2
    reads each entry's representative u back into rep (-1 for padding), writes out[u] = direct
    location (-1: not direct) and hflag[u] = 0 for representatives, and loc (speculatively: final
    when every row is direct). MAP: pass 2 also looks each representative up in hot_entry; a
    not-direct one with an entry is a hit (out[u] = its hot location hl[entry], the entry's stamp
    refreshed, its flag set in hrow), so P3 does not scan. Returns (valid entries, valid entries not
    direct, direct rows, not-direct rows, hits)."""
    for c0 in range(0, KKP, CH):
        if c0 < KK:
            i = c0 + tl.arange(0, CH)
            p = tl.load(sel_ptr + n * KK + i, mask=i < KK, other=-1).to(tl.int64)
            tl.store(pv + p, i.to(pv.dtype.element_ty), mask=(p >= 0) & (p < LCAP))
    tl.debug_barrier()
    ts = tl.load(tail_start_ptr + s).to(tl.int64)
    acc = tl.sum(tl.zeros([CH], tl.int64), axis=0)
    nhot = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    for c0 in range(0, KKP, CH):
        if c0 < KK:
            i = c0 + tl.arange(0, CH)
            im = i < KK
            p = tl.load(sel_ptr + n * KK + i, mask=im, other=-1).to(tl.int64)
            valid = p >= 0
            inr = valid & (p < LCAP)
            u = tl.where(inr, tl.load(pv + p, mask=inr, other=0).to(tl.int32), i)
            is_rep = valid & (u == i)
            o = _direct_loc(p, valid, s, ts, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX, has_map)
            # the four counts in one reduction: 16 bits each (K*k < 2^16)
            acc += tl.sum(valid.to(tl.int64) + ((valid & (o < 0)).to(tl.int64) << 16)
                          + ((is_rep & (o >= 0)).to(tl.int64) << 32) + ((is_rep & (o < 0)).to(tl.int64) << 48), axis=0)
            tl.store(rep + i, tl.where(valid, u, -1), mask=im)
            if MAP:
                h = tl.load(hmap_ptr + s * s_hmap + p, mask=is_rep & (p < LCAP), other=-1).to(tl.int32)
                he, hc, lh = _hits(h, is_rep & (o < 0), hl)
                tl.store(out + i, tl.where(he, lh, o), mask=is_rep)
                _mark_hits(he, hc, s, hot_stamp_ptr, s_stamp, hrow, now, CH)
                nhot += tl.sum(he.to(tl.int32), axis=0)
            else:
                tl.store(out + i, o, mask=is_rep)
            tl.store(hflag + i, tl.zeros([CH], tl.int32), mask=is_rep)
            tl.store(loc_ptr + n * KK + i, tl.where(valid, o, -1).to(loc_ptr.dtype.element_ty), mask=im)
    nval = (acc & 0xFFFF).to(tl.int32)
    nnd = ((acc >> 16) & 0xFFFF).to(tl.int32)
    ndir = ((acc >> 32) & 0xFFFF).to(tl.int32)
    nrest = ((acc >> 48) & 0xFFFF).to(tl.int32)
    return nval, nnd, ndir, nrest, nhot


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


@jit_unspecialized
def direct_pre_kernel(sel_ptr, slots_ptr, KK, tail_start_ptr, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX,
                      loc_ptr, bm_ptr, WORDS, HALF, pre_ptr, NPROG, CH: tl.constexpr):
    """P0 spread over programs: grid (N, cdiv(KK, CH)); program (n, j) runs `_direct_chunk` on
    entries j*CH .. j*CH+CH-1 of request n and adds its (valid, not direct, distinct direct)
    counts to pre [N, 3] int32 (zeros). The plan kernel then reads them instead of walking the
    request's K*k entries in one program (with an optional map: adaptive). bm [2*HALF + 2]: the
    bits go to row n of the half that the parity word bm[2*HALF] names (N*WORDS <= HALF words), the
    programs (NPROG = N * cdiv(KK, CH) of them) zero the other half between them (the next call's),
    and the last of them to arrive (the count at bm[2*HALF + 1]) flips the parity: every program has
    read it by then (see resolver_workspace.py)."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    i = j * CH + tl.arange(0, CH)
    par = tl.load(bm_ptr + 2 * HALF).to(tl.int64)
    s = tl.load(slots_ptr + n).to(tl.int64)
    ts = tl.load(tail_start_ptr + s).to(tl.int64)
    a, b, d = _direct_chunk(sel_ptr, loc_ptr, KK, n, i, s, ts, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX, 1,
                            bm_ptr + par * HALF, WORDS, CH)
    tl.atomic_add(pre_ptr + n * 3, a, sem="relaxed")
    tl.atomic_add(pre_ptr + n * 3 + 1, b, sem="relaxed")
    tl.atomic_add(pre_ptr + n * 3 + 2, d, sem="relaxed")
    _clear_share(bm_ptr + (1 - par) * HALF, HALF, n * tl.cdiv(KK, CH) + j, NPROG, CH)
    # acq_rel: this program's parity read and bitmap traffic come before its arrival
    if tl.atomic_add(bm_ptr + 2 * HALF + 1, 1, sem="acq_rel") == NPROG - 1:
        tl.store(bm_ptr + 2 * HALF + 1, 0)
        tl.store(bm_ptr + 2 * HALF, (1 - par).to(tl.int32))


@triton.jit
def _clear_share(half_ptr, HALF, q, nprog, CH: tl.constexpr):
    """Program q of nprog zeroes its contiguous share of the HALF words at half_ptr."""
    per = (HALF + nprog - 1) // nprog
    w0 = q.to(tl.int64) * per
    hi = tl.minimum(w0 + per, HALF)
    while w0 < hi:
        w = w0 + tl.arange(0, CH)
        tl.store(half_ptr + w, tl.zeros([CH], tl.int32), mask=w < hi)
        w0 += CH


@triton.jit
def _hot_scan(sel_ptr, KK, n, pv, LCAP, out, s, hot_stamp_ptr, s_stamp, bm, hp, hl, now, BP: tl.constexpr):
    """P3. Each slot (positions hp, locations hl [BP], in range bm) reads pv at its position; the uid
    u read is this call's representative of that position only if 0 <= u < KK and sel[n, u] is the
    slot's position (anything else is a stale cell: the position is not selected). Hits on
    non-direct rows: out[uid] = hot_loc, stamp = now. Returns (hits, hit mask [BP]: the protected
    slots)."""
    sl = tl.arange(0, BP)
    ok = bm & (hp >= 0) & (hp < LCAP)
    u = tl.load(pv + hp, mask=ok, other=-1).to(tl.int32)
    found = ok & (u >= 0) & (u < KK)
    q = tl.load(sel_ptr + n * KK + u, mask=found, other=-1).to(tl.int64)  # these two loads depend
    o = tl.load(out + u, mask=found, other=0)                              # on u only: issued together
    hit = found & (q == hp) & (o < 0)
    tl.store(out + u, hl, mask=hit)
    tl.store(hot_stamp_ptr + s * s_stamp + sl, tl.zeros([BP], tl.int64) + now, mask=hit)
    return tl.sum(hit.to(tl.int32), axis=0), hit


@triton.jit
def _emit(sel_ptr, loc_ptr, KK, n, rep, out, hflag, KKP: tl.constexpr, CH: tl.constexpr):
    """P5. loc row [KK] in selection order. Returns the host-selected entries."""
    hsel = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    for c0 in range(0, KKP, CH):
        if c0 < KK:
            i = c0 + tl.arange(0, CH)
            im = i < KK
            u = tl.load(rep + i, mask=im, other=-1)
            valid = im & (u >= 0)
            o = tl.load(out + u, mask=valid, other=-1)
            hsel += tl.sum(tl.load(hflag + u, mask=valid, other=0), axis=0)
            tl.store(loc_ptr + n * KK + i, tl.where(valid, o, -1).to(loc_ptr.dtype.element_ty), mask=im)
    return hsel


@jit_unspecialized
def resolve_plan_kernel(
    sel_ptr, slots_ptr, KK,
    hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B,
    tail_start_ptr, tail_loc_ptr, s_tail, TT,
    table_ptr, s_table, HPW,
    dmap_ptr, s_dmap, LMAX, has_map,
    now_ptr,
    loc_ptr, src_ptr, dst_ptr, copy_n_ptr, cnt_ptr, C,
    scr64_ptr, scr32_ptr, pv_ptr, LCAP, pre_ptr,
    crs_ptr, crd_ptr, CG, chp, chs0, chsl, chs1, cdp, cds0, cdsl, cds1,
    hmap_ptr, s_hmap, hitf_ptr,
    PS: tl.constexpr, KKP: tl.constexpr, PRE: tl.constexpr, BP: tl.constexpr, CH: tl.constexpr,
    CHB: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr, SC: tl.constexpr, SD: tl.constexpr,
    VSTEPS: tl.constexpr = 4, UPTO: tl.constexpr = 50, DISTINCT: tl.constexpr = 0,
    COPY: tl.constexpr = 0, CPW: tl.constexpr = 1, CCW: tl.constexpr = 1, CVEC: tl.constexpr = 1,
    CR: tl.constexpr = 1, MAP: tl.constexpr = 0, HOSTORD: tl.constexpr = 1,
):
    """Grid (N, 1). sel [N, KK]; state rows indexed by slots[n]; loc [N, KK]; src/dst [N, C] copy plan
    rows (host location, device location) in the miss order (HOSTORD: by host location; 0: by entry,
    for distinct selections only, see `resolver_ref.miss_order_for`); copy_n [N]; cnt [N, 6]
    (selected, direct, hot, host, host_selected, overflow). scr64 [N, 2*KKP + BP] int64,
    scr32 [N, 2*KKP] int32, pv [N, LCAP] int16 / int32: any contents at entry (P1's claims);
    pre [N, 3] int32 (with PRE): P0's counts, zeros at entry and left so.
    PRE: P0 already ran in `direct_pre_kernel`, its counts in pre [N, 3].
    DISTINCT: no request's entries repeat a position (plan_triton(distinct=True)); used by the
    registers-only path only (K*k <= CH), which then skips the claims' read-back.
    It also writes loc where each entry resolves (P1, P3, P4d), so P5 does not run.
    MAP (the state keeps `hot_entry` [S, HMW] int16, the inverse of hot_pos, row stride s_hmap): both
    paths find hits by looking each representative's position up in it (resolver_one.py's
    `_hot_lookup_one`, the chunked `_entries`) instead of scanning the hot rows, and keep it in step
    with hot_pos (P4d). hitf [N, BP] int8: the lookup's hit flags (any contents at entry).
    COPY (`plan_triton(copy=...)`): P6 copies each request's planned rows (copy-plan rows 0 .. copy_n-1)
    from the host rows crs to the device rows crd (layered [pages, CG, rows_per_page, CPW units], the
    strides (chp, chs0, chsl, chs1) and (cdp, cds0, cdsl, cds1) as `gather_rows_kernel` takes them) in
    the same program, CR rows of CCW-unit column blocks at a time: one launch plans and copies.
    UPTO (profiling only, bench/resolver_peer.py; resolver.PHASE_STOPS): phases after the stop are
    compiled out (0: none, 10: P1, 30: P3, 41: P4a-b, 43: P4c, 45: P4), so the outputs are
    incomplete below 50; the default 50 runs every phase."""
    n = tl.program_id(0).to(tl.int64)
    # grid (N, 1); the test on axis 1 is not needed, but ptxas spills less with the plan under a branch
    # (bench/compile_sm90.py --regs: 32 warps, H 8,192, K 1: 64 / 76 B against 84 / 104 B without it)
    j = tl.program_id(1)
    if j == 0:
        _plan_request(sel_ptr, slots_ptr, KK, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B,
                      tail_start_ptr, tail_loc_ptr, s_tail, TT, table_ptr, s_table, HPW, PS, dmap_ptr, s_dmap, LMAX,
                      has_map, now_ptr, loc_ptr, src_ptr, dst_ptr, copy_n_ptr, cnt_ptr, C, scr64_ptr, scr32_ptr,
                      pv_ptr, LCAP, pre_ptr, crs_ptr, crd_ptr, CG, chp, chs0, chsl, chs1, cdp, cds0, cdsl, cds1, n,
                      hmap_ptr, s_hmap, hitf_ptr, KKP, PRE, BP, CH, CHB, SA, SB, SC, SD, VSTEPS, UPTO, DISTINCT,
                      COPY, CPW, CCW, CVEC, CR, MAP, HOSTORD)


@triton.jit
def _plan_request(sel_ptr, slots_ptr, KK, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B,
                  tail_start_ptr, tail_loc_ptr, s_tail, TT, table_ptr, s_table, HPW, ps: tl.constexpr, dmap_ptr, s_dmap, LMAX,
                  has_map, now_ptr, loc_ptr, src_ptr, dst_ptr, copy_n_ptr, cnt_ptr, C, scr64_ptr, scr32_ptr,
                  pv_ptr, LCAP, pre_ptr, crs_ptr, crd_ptr, CG, chp, chs0, chsl, chs1, cdp, cds0, cdsl, cds1, n,
                  hmap_ptr, s_hmap, hitf_ptr, KKP: tl.constexpr, PRE: tl.constexpr, BP: tl.constexpr,
                  CH: tl.constexpr, CHB: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr, SC: tl.constexpr,
                  SD: tl.constexpr, VSTEPS: tl.constexpr, UPTO: tl.constexpr, DISTINCT: tl.constexpr,
                  COPY: tl.constexpr, CPW: tl.constexpr, CCW: tl.constexpr, CVEC: tl.constexpr, CR: tl.constexpr,
                  MAP: tl.constexpr, HOSTORD: tl.constexpr):
    """Request n's plan (program (n, 0)): P0's exit or P1-P5, then (COPY) P6's copy of its planned rows."""
    s = tl.load(slots_ptr + n).to(tl.int64)
    now = tl.load(now_ptr).to(tl.int64)  # a device scalar: a captured step graph replays with the current step
    out = scr64_ptr + n * (2 * KKP + BP)
    mk = out + KKP
    vk = mk + KKP
    rep = scr32_ptr + n * (2 * KKP)
    hflag = rep + KKP
    pv = pv_ptr + n * LCAP
    c = cnt_ptr + n * 6
    nnd = 1
    if PRE:
        nnd = tl.load(pre_ptr + n * 3 + 1)
        if nnd == 0:  # P0: every valid entry resolved directly; loc is final
            tl.store(copy_n_ptr + n, nnd * 0)
            _store_counts(c, tl.load(pre_ptr + n * 3), tl.load(pre_ptr + n * 3 + 2), nnd * 0, nnd * 0, nnd * 0,
                          nnd * 0)
        tl.debug_barrier()
        for jj in tl.static_range(3):
            tl.store(pre_ptr + n * 3 + jj, 0)
    if UPTO == 0:
        tl.store(copy_n_ptr + n, nnd * 0)
        nnd = 0
    nhost = nnd * 0
    if nnd != 0:
        if KKP <= CH:  # one block of entries: kept in registers (resolver_one.py)
            nhost = _plan_one(sel_ptr, KK, n, s, now, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B,
                      tail_start_ptr, tail_loc_ptr, s_tail, TT, table_ptr, s_table, HPW, ps, dmap_ptr, s_dmap, LMAX,
                      has_map, loc_ptr, src_ptr, dst_ptr, copy_n_ptr, c, C, out, mk, vk, hflag, pv, LCAP,
                      hmap_ptr, s_hmap, hitf_ptr + n * BP, KKP, BP, CHB, SA, SB, SC, SD, VSTEPS, UPTO, DISTINCT,
                      MAP, HOSTORD)
        else:
            nhost = _plan_chunked(sel_ptr, KK, n, s, now, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B,
                          tail_start_ptr, tail_loc_ptr, s_tail, TT, table_ptr, s_table, HPW, ps, dmap_ptr, s_dmap,
                          LMAX, has_map, loc_ptr, src_ptr, dst_ptr, copy_n_ptr, c, C, out, mk, vk, rep, hflag, pv,
                          LCAP, hmap_ptr, s_hmap, hitf_ptr + n * BP, KKP, BP, CH, CHB, SA, SB, SC, SD, VSTEPS, UPTO,
                          MAP, HOSTORD)
    if COPY:
        if UPTO >= 50:
            _copy_planned(src_ptr + n * C, dst_ptr + n * C, nhost, crs_ptr, crd_ptr, CG, chp, chs0, chsl, chs1,
                          cdp, cds0, cdsl, cds1, CPW, CCW, CVEC, CR)


@triton.jit
def _plan_chunked(sel_ptr, KK, n, s, now, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B,
                  tail_start_ptr, tail_loc_ptr, s_tail, TT, table_ptr, s_table, HPW, ps: tl.constexpr, dmap_ptr, s_dmap, LMAX,
                  has_map, loc_ptr, src_ptr, dst_ptr, copy_n_ptr, c, C, out, mk, vk, rep, hflag, pv, LCAP,
                  hmap_ptr, s_hmap, hrow, KKP: tl.constexpr, BP: tl.constexpr, CH: tl.constexpr, CHB: tl.constexpr,
                  SA: tl.constexpr, SB: tl.constexpr, SC: tl.constexpr, SD: tl.constexpr, VSTEPS: tl.constexpr,
                  UPTO: tl.constexpr, MAP: tl.constexpr, HOSTORD: tl.constexpr):
    """P1-P5 of request n (slot s) over chunks of CH entries through the scratch rows (K*k > CH).
    MAP: hits are looked up in P1 (`_entries`) and protected through the hit row hrow [BP] int8 instead of
    P3's scan. Returns the rows it planned to copy (copy_n[n])."""
    # the hot rows depend only on s: their loads overlap P1's
    bm, hp, hs, hl = _hot_rows(hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s, s_pos, s_stamp, s_loc, B, BP)
    if MAP:  # any contents at entry: cleared here, ordered before P1's flags by its claims' barrier
        _clear_hits(hrow, BP)
    nsel, nnd, ndir, nrest, nhot = _entries(sel_ptr, loc_ptr, KK, n, pv, LCAP, rep, out, hflag, s, tail_start_ptr,
                                            tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX, has_map, hmap_ptr,
                                            s_hmap, hrow, hl, hot_stamp_ptr, s_stamp, now, KKP, CH, MAP)
    planned = nnd * 0
    if (nnd == 0) | (UPTO < 30):  # every valid entry resolved directly: loc is final
        tl.store(copy_n_ptr + n, nnd * 0)
        _store_counts(c, nsel, ndir, nnd * 0, nnd * 0, nnd * 0, nnd * 0)
    else:
        tl.debug_barrier()
        if MAP:
            hit = _read_hits(hrow, bm, BP)
        else:
            nhot, hit = _hot_scan(sel_ptr, KK, n, pv, LCAP, out, s, hot_stamp_ptr, s_stamp, bm, hp, hl, now, BP)
        tl.debug_barrier()
        nmiss = nrest - nhot
        nhost = nmiss * 0
        if (nmiss > 0) & (UPTO >= 41):
            nhost = tl.minimum(nmiss, (B - nhot).to(tl.int32)).to(tl.int32)
            _compact_misses(sel_ptr, KK, n, rep, out, mk, s, table_ptr, s_table, HPW, ps, KKP, CH)
            _pair_misses(sel_ptr, KK, n, out, hflag, mk, vk, s, nmiss, nhost, bm, hit, hs, hot_pos_ptr,
                         hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, src_ptr, dst_ptr, C, now,
                         loc_ptr + n * KK, hmap_ptr, s_hmap, KKP, BP, CH, CHB, SA, SB, SC, SD, VSTEPS, UPTO, 0, MAP,
                         HOSTORD)
        tl.store(copy_n_ptr + n, nhost)
        hsel = nhost * 0
        if UPTO >= 50:
            hsel = _emit(sel_ptr, loc_ptr, KK, n, rep, out, hflag, KKP, CH)
        _store_counts(c, nsel, ndir, nhot, nhost, hsel, nmiss - nhost)
        planned = nhost
    return planned
