"""The plan kernel's registers-only path: a request whose K*k entries fit one block (KKP <= 2,048: a decode
step's one query of top-k 2,048, or a narrow verification round) keeps them in registers from P1 to P5.

Same phases and results as the chunked path in resolver_kernel.py, with fewer dependent memory rounds:

  P1  sel loaded once; the claims written; each entry's direct location and its host page (the copy
      plan's source, needed only if it misses) loaded in the same round, neither waiting for the other;
      DISTINCT (one top-k query a request: no position twice) skips the claims' read-back and every
      entry is its own representative
  P3  the hot slots' lookups read sel and the direct locations through `tl.gather` from P1's registers
      (shared memory) instead of from global memory
  P4  the misses come from the entries' registers and one coalesced read of out (P3's hits)
  P5  loc from the representatives held in registers
DISTINCT writes loc where each entry is resolved (P1 direct and -1, P3 hits, P4d misses) and P4a reads
the misses from loc: `out` is not used and P5's dependent read of it is gone.

MAP (the state keeps `hot_entry`, the inverse of hot_pos): P3 is a lookup instead of a scan. P1 loads
each entry's hot entry h = hot_entry[s, p] in the same round as its direct location and host page; a
not-direct representative with h >= 0 is a hit: its location is gathered from the hot rows' registers
(hl[h]), its stamp refreshed, and flag h set in the request's hit row (`hitf`, cleared by the program
before P1, read back after a barrier: the protected slots for P4b). No claim table is written or
read under DISTINCT (and under dedup only the claims' own round), so none of P3's scattered reads of
the claim table at every hot position, which were most of the plan's memory traffic, remain.

Entry i of request n: p [KKP] positions, u [KKP] representatives (uids), o [KKP] direct locations
(-1: not direct), hpg [KKP] host pages (-1 where unmapped; read for direct entries too, unused there).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dhisparse.kernels.resolver_common import (_clear_hits, _direct_loc, _hits, _hot_rows, _mark_hits,
                                               _read_hits, _store_counts)
from dhisparse.kernels.resolver_evict import _pair_misses


@triton.jit
def _entries_one(sel_ptr, loc_ptr, KK, n, pv, LCAP, out, hflag, s, tail_start_ptr, tail_loc_ptr, s_tail, TT,
                 dmap_ptr, s_dmap, LMAX, has_map, table_ptr, s_table, HPW, hmap_ptr, s_hmap, ps: tl.constexpr,
                 KKP: tl.constexpr, DISTINCT: tl.constexpr, MAP: tl.constexpr):
    """P1. Returns (valid entries, valid not direct, direct rows, not-direct rows, p, u, o, hpg, h):
    h [KKP] the hot entry of each position (MAP; -1 none, and all -1 without MAP). With MAP the
    locations (loc, out) are written by `_hot_lookup_one` once the hits are known, not here."""
    i = tl.arange(0, KKP)
    im = i < KK
    p = tl.load(sel_ptr + n * KK + i, mask=im, other=-1).to(tl.int64)
    valid = p >= 0
    inr = valid & (p < LCAP)
    if (not DISTINCT) | (not MAP):  # the claims: dedup's, or the hot scan's lookups
        tl.store(pv + p, i.to(pv.dtype.element_ty), mask=inr)
    h = tl.full([KKP], -1, tl.int32)
    if MAP:  # issued with the direct locations and host pages: all three wait only for p and s
        h = tl.load(hmap_ptr + s * s_hmap + p, mask=inr, other=-1).to(tl.int32)
    ts = tl.load(tail_start_ptr + s).to(tl.int64)
    o = _direct_loc(p, valid, s, ts, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX, has_map)
    page = p // ps
    # not masked by o: the host page's load then waits only for p and s, not for the direct locations
    # (a direct entry's page is read and never used: only misses, never direct, key by it)
    hpg = tl.load(table_ptr + s * s_table + page, mask=valid & (page < HPW), other=-1).to(tl.int64)
    if DISTINCT:
        u = i
    else:
        tl.debug_barrier()
        u = tl.where(inr, tl.load(pv + p, mask=inr, other=0).to(tl.int32), i)
    is_rep = valid & (u == i)
    # the four counts in one reduction: 16 bits each (K*k < 2^16)
    acc = tl.sum(valid.to(tl.int64) + ((valid & (o < 0)).to(tl.int64) << 16)
                 + ((is_rep & (o >= 0)).to(tl.int64) << 32) + ((is_rep & (o < 0)).to(tl.int64) << 48), axis=0)
    if not DISTINCT:  # P5 reads out and counts host-selected entries through the flags (DISTINCT: loc)
        if not MAP:
            tl.store(out + i, o, mask=is_rep)
        tl.store(hflag + i, tl.zeros([KKP], tl.int32), mask=is_rep)
    if (not DISTINCT) | (not MAP):
        tl.store(loc_ptr + n * KK + i, tl.where(valid, o, -1).to(loc_ptr.dtype.element_ty), mask=im)
    return ((acc & 0xFFFF).to(tl.int32), ((acc >> 16) & 0xFFFF).to(tl.int32), ((acc >> 32) & 0xFFFF).to(tl.int32),
            ((acc >> 48) & 0xFFFF).to(tl.int32), p, u, o, hpg, h)


@triton.jit
def _hot_lookup_one(loc_row, KK, out, s, hot_stamp_ptr, s_stamp, hrow, bm, hl, now, p, u, o, h,
                    KKP: tl.constexpr, BP: tl.constexpr, DISTINCT: tl.constexpr):
    """P3 with MAP: every not-direct representative whose position has a hot entry h is a hit. Its
    location hl[h] (gathered from the hot rows' registers) and every other resolved-so-far location
    (direct, or -1) are written once (loc_row with DISTINCT, else out), its entry's stamp is
    refreshed and its flag set in hrow [BP] (int8, cleared before P1). Returns (hits, hit mask [BP]:
    the protected slots, read back from hrow after a barrier)."""
    i = tl.arange(0, KKP)
    valid = p >= 0
    he, hc, lh = _hits(h, valid & (u == i) & (o < 0), hl)
    res = tl.where(o >= 0, o, tl.where(he, lh, -1))
    if DISTINCT:
        tl.store(loc_row + i, tl.where(valid, res, -1).to(loc_row.dtype.element_ty), mask=i < KK)
    else:
        tl.store(out + i, res, mask=valid & (u == i))
    _mark_hits(he, hc, s, hot_stamp_ptr, s_stamp, hrow, now, KKP)
    tl.debug_barrier()
    return tl.sum(he.to(tl.int32), axis=0), _read_hits(hrow, bm, BP)


@triton.jit
def _hot_scan_one(pv, LCAP, KK, out, s, hot_stamp_ptr, s_stamp, bm, hp, hl, now, p, o, loc_row,
                  BP: tl.constexpr, DISTINCT: tl.constexpr):
    """P3 (resolver_kernel's `_hot_scan`) with sel and the direct locations read from registers p, o,
    packed as (p << 1) | direct in int32 so one gather through shared memory brings both (a found
    entry was claimed, so its p < LCAP <= 2^30: `resolver_args.state_args` refuses more). A hit's location
    goes to out[u], or with DISTINCT straight to loc_row[u] (u is the entry). Returns (hits, hit
    mask [BP])."""
    sl = tl.arange(0, BP)
    ok = bm & (hp >= 0) & (hp < LCAP)
    u = tl.load(pv + hp, mask=ok, other=-1).to(tl.int32)
    found = ok & (u >= 0) & (u < KK)
    uc = tl.where(found, u, 0)
    q = tl.gather((p.to(tl.int32) << 1) | (o >= 0).to(tl.int32), uc, 0)  # padding (p -1) unpacks to -1: never hot
    hit = found & ((q >> 1) == hp) & ((q & 1) == 0)
    if DISTINCT:
        tl.store(loc_row + u, hl.to(loc_row.dtype.element_ty), mask=hit)
    else:
        tl.store(out + u, hl, mask=hit)
    tl.store(hot_stamp_ptr + s * s_stamp + sl, tl.zeros([BP], tl.int64) + now, mask=hit)
    return tl.sum(hit.to(tl.int32), axis=0), hit


@triton.jit
def _missing(p, u, res, KKP: tl.constexpr):
    """[KKP] the representatives P1 / P3 left unresolved, read from res (out, or the loc row with
    DISTINCT; < 0: not resolved)."""
    i = tl.arange(0, KKP)
    rep = (p >= 0) & (u == i)
    return rep & (tl.load(res + i, mask=rep, other=0) < 0)


@triton.jit
def _compact_one(mk, miss, p, hpg, ps: tl.constexpr, KKP: tl.constexpr):
    """P4a. mk[r] = host_location * KKP + uid for every missing distinct row (miss [KKP]), in uid order."""
    i = tl.arange(0, KKP)
    r = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    tl.store(mk + r, (hpg * ps + p % ps) * KKP + i, mask=miss)


@triton.jit
def _emit_one(loc_ptr, KK, n, out, hflag, p, u, KKP: tl.constexpr):
    """P5 (not DISTINCT: DISTINCT wrote loc where each entry was resolved). loc row [KK] in selection
    order from the representatives u. Returns the host-selected entries (the flags of their rows)."""
    i = tl.arange(0, KKP)
    im = i < KK
    valid = im & (p >= 0)
    o = tl.load(out + u, mask=valid, other=-1)
    tl.store(loc_ptr + n * KK + i, tl.where(valid, o, -1).to(loc_ptr.dtype.element_ty), mask=im)
    return tl.sum(tl.load(hflag + u, mask=valid, other=0), axis=0)


@triton.jit
def _plan_one(sel_ptr, KK, n, s, now, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B,
              tail_start_ptr, tail_loc_ptr, s_tail, TT, table_ptr, s_table, HPW, ps: tl.constexpr, dmap_ptr, s_dmap, LMAX,
              has_map, loc_ptr, src_ptr, dst_ptr, copy_n_ptr, c, C, out, mk, vk, hflag, pv, LCAP, hmap_ptr, s_hmap,
              hrow, KKP: tl.constexpr, BP: tl.constexpr, CHB: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr,
              SC: tl.constexpr, SD: tl.constexpr, VSTEPS: tl.constexpr, UPTO: tl.constexpr,
              DISTINCT: tl.constexpr, MAP: tl.constexpr, HOSTORD: tl.constexpr):
    """P1-P5 of request n (slot s) in registers; the scratch rows out / mk / vk / hflag, the claim
    row pv and (MAP) the hit row hrow [BP] int8 are request n's. Returns the rows it planned to copy
    (copy_n[n])."""
    bm, hp, hs, hl = _hot_rows(hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s, s_pos, s_stamp, s_loc, B, BP)
    if MAP:  # any contents at entry: cleared before P1, and ordered before P3's flags by the barrier
        _clear_hits(hrow, BP)
        tl.debug_barrier()
    nsel, nnd, ndir, nrest, p, u, o, hpg, h = _entries_one(
        sel_ptr, loc_ptr, KK, n, pv, LCAP, out, hflag, s, tail_start_ptr, tail_loc_ptr, s_tail, TT, dmap_ptr,
        s_dmap, LMAX, has_map, table_ptr, s_table, HPW, hmap_ptr, s_hmap, ps, KKP, DISTINCT, MAP)
    planned = nnd * 0
    loc_row = loc_ptr + n * KK
    if (nnd == 0) | (UPTO < 30):  # every valid entry resolved directly: loc is final
        if DISTINCT & MAP:  # P1 left loc to the lookup
            i = tl.arange(0, KKP)
            tl.store(loc_row + i, tl.where(p >= 0, o, -1).to(loc_row.dtype.element_ty), mask=i < KK)
        tl.store(copy_n_ptr + n, nnd * 0)
        _store_counts(c, nsel, ndir, nnd * 0, nnd * 0, nnd * 0, nnd * 0)
    else:
        if MAP:
            nhot, hit = _hot_lookup_one(loc_row, KK, out, s, hot_stamp_ptr, s_stamp, hrow, bm, hl, now, p, u, o, h,
                                        KKP, BP, DISTINCT)
        else:
            tl.debug_barrier()
            nhot, hit = _hot_scan_one(pv, LCAP, KK, out, s, hot_stamp_ptr, s_stamp, bm, hp, hl, now, p, o, loc_row,
                                      BP, DISTINCT)
        tl.debug_barrier()
        nmiss = nrest - nhot
        nhost = nmiss * 0
        if (nmiss > 0) & (UPTO >= 41):
            nhost = tl.minimum(nmiss, (B - nhot).to(tl.int32)).to(tl.int32)
            if MAP:  # the misses are known in registers: not direct, no hot entry
                i = tl.arange(0, KKP)
                miss = (p >= 0) & (u == i) & (o < 0) & (h < 0)
            elif DISTINCT:
                miss = _missing(p, u, loc_row, KKP)
            else:
                miss = _missing(p, u, out, KKP)
            _compact_one(mk, miss, p, hpg, ps, KKP)
            _pair_misses(sel_ptr, KK, n, out, hflag, mk, vk, s, nmiss, nhost, bm, hit, hs, hot_pos_ptr,
                         hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, src_ptr, dst_ptr, C, now, loc_row,
                         hmap_ptr, s_hmap, KKP, BP, KKP, CHB, SA, SB, SC, SD, VSTEPS, UPTO, DISTINCT, MAP,
                         HOSTORD)
        tl.store(copy_n_ptr + n, nhost)
        hsel = nhost
        if (UPTO >= 50) & (not DISTINCT):  # DISTINCT: loc is final and every copied row one entry
            hsel = _emit_one(loc_ptr, KK, n, out, hflag, p, u, KKP)
        _store_counts(c, nsel, ndir, nhot, nhost, hsel, nmiss - nhost)
        planned = nhost
    return planned
