"""Fused Triton resolver plan kernel: one program per request (grid = N).

Each program works over the union of its request's K*k selections (paper §3.2, eq. 5-6) in phases
separated by CTA barriers, with a small per-program scratch in global memory (L2 resident):

  P1 dedup   sort (position, index) keys; first-of-run marks a distinct row; uid = rank of its run;
             upos[uid] = position (ascending), uidx[i] = uid of selection entry i
  P2 direct  tail (p >= tail_start) or optional map (direct_loc[p] >= 0) -> out[uid]
  P3 hot     every hot slot binary-searches its position in upos; a hit on a not-yet-direct row
             sets out[uid] = hot_loc, protects the slot and refreshes its stamp
  P4 misses  sorted by host location; victims = unprotected slots sorted by (stamp, slot id);
             the r-th miss takes the r-th victim; copy plan row r of this request
  P5 output  loc[i] = out[uidx[i]] in selection order, -1 where the selection is -1; counters

P3 runs only when some row is not direct, P4 only when some row missed, so the cost of a call
depends on K*k and B, never on the history length. Hot positions must be unique per slot row and
slots unique within a call (each request owns its slot row), as in the reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

BIG = tl.constexpr(9223372036854775807)  # int64 max: sorts after every real key


@triton.jit
def _dedup(sel_ptr, KK, skey, upos, uidx, n, KKP: tl.constexpr, CH: tl.constexpr):
    """P1. sel row [KK] -> upos [U] ascending distinct positions, uidx [KK] uid per entry. Returns U."""
    i = tl.arange(0, KKP)
    x = tl.load(sel_ptr + n * KK + i, mask=i < KK, other=-1).to(tl.int64)
    valid = x >= 0
    key = tl.sort(tl.where(valid, x * KKP + i, BIG))
    tl.store(skey + i, key)
    nvalid = tl.sum(valid.to(tl.int32), axis=0)
    tl.debug_barrier()
    carry = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    for c0 in range(0, KKP, CH):
        if c0 < nvalid:
            j = c0 + tl.arange(0, CH)
            jm = j < nvalid
            k = tl.load(skey + j, mask=jm, other=0)
            kp = tl.load(skey + j - 1, mask=jm & (j > 0), other=0)
            p = k // KKP
            first = jm & ((j == 0) | (p != kp // KKP))
            f32 = first.to(tl.int32)
            uid = carry + tl.cumsum(f32, axis=0) - 1
            carry += tl.sum(f32, axis=0)
            tl.store(uidx + (k % KKP), uid, mask=jm)
            tl.store(upos + uid, p.to(tl.int32), mask=first)
    return carry


@triton.jit
def _direct(upos, out, hflag, U, s, tail_start_ptr, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap, LMAX,
            has_map, KKP: tl.constexpr, CH: tl.constexpr):
    """P2. out[uid] = tail or optional-map location (raw tail value, -1 when not direct).
    Returns (direct rows, remaining rows)."""
    ts = tl.load(tail_start_ptr + s).to(tl.int64)
    ndir = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    nrest = ndir
    for c0 in range(0, KKP, CH):
        if c0 < U:
            u = c0 + tl.arange(0, CH)
            um = u < U
            p = tl.load(upos + u, mask=um, other=0).to(tl.int64)
            in_tail = p >= ts
            t = p - ts
            tv = tl.load(tail_loc_ptr + s * s_tail + t, mask=um & in_tail & (t < TT), other=-1).to(tl.int64)
            dv = tl.load(dmap_ptr + s * s_dmap + p, mask=um & (~in_tail) & (p < LMAX) & (has_map != 0),
                         other=-1).to(tl.int64)
            dv = tl.where(dv >= 0, dv, -1)
            o = tl.where(in_tail, tv, dv)
            done = um & (o >= 0)
            ndir += tl.sum(done.to(tl.int32), axis=0)
            nrest += tl.sum((um & (o < 0)).to(tl.int32), axis=0)
            tl.store(out + u, o, mask=um)
            tl.store(hflag + u, tl.zeros([CH], tl.int32), mask=um)
    return ndir, nrest


@triton.jit
def _hot_scan(upos, out, prot, U, s, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, B, now,
              KKP: tl.constexpr, BP: tl.constexpr, LOGK: tl.constexpr, CHB: tl.constexpr):
    """P3. Each slot looks its position up in upos [U]; hits on non-direct rows: out[uid] = hot_loc,
    prot[slot] = 1, stamp = now. Returns the number of hits."""
    nhot = tl.sum(tl.zeros([CHB], tl.int32), axis=0)
    for b0 in range(0, BP, CHB):
        if b0 < B:
            b = b0 + tl.arange(0, CHB)
            bm = b < B
            hp = tl.load(hot_pos_ptr + s * s_pos + b, mask=bm, other=-1).to(tl.int64)
            lo = tl.zeros([CHB], tl.int32)
            for step in tl.static_range(LOGK):
                cand = lo + (KKP >> (step + 1))
                v = tl.load(upos + cand - 1, mask=cand <= U, other=2147483647).to(tl.int64)
                lo = tl.where(v < hp, cand, lo)
            inb = bm & (hp >= 0) & (lo < U)
            found = tl.load(upos + lo, mask=inb, other=-1).to(tl.int64)
            o = tl.load(out + lo, mask=inb, other=0)
            hit = inb & (found == hp) & (o < 0)
            hl = tl.load(hot_loc_ptr + s * s_loc + b, mask=hit, other=0).to(tl.int64)
            tl.store(out + lo, hl, mask=hit)
            tl.store(hot_stamp_ptr + s * s_stamp + b, (tl.zeros([CHB], tl.int64) + now), mask=hit)
            tl.store(prot + b, hit.to(tl.int32), mask=bm)
            nhot += tl.sum(hit.to(tl.int32), axis=0)
    return nhot


@triton.jit
def _victims(prot, vict, s, hot_stamp_ptr, s_stamp, B, ncand, BP: tl.constexpr):
    """P4a. vict[r] = r-th unprotected slot by (stamp, slot id), r < ncand."""
    b = tl.arange(0, BP)
    bm = b < B
    pr = tl.load(prot + b, mask=bm, other=1)
    stv = tl.load(hot_stamp_ptr + s * s_stamp + b, mask=bm, other=0).to(tl.int64)
    vkey = tl.sort(tl.where(bm & (pr == 0), (stv + 1) * BP + b, BIG))
    tl.store(vict + b, (vkey % BP).to(tl.int32), mask=b < ncand)


@triton.jit
def _misses(upos, out, hflag, vict, U, nhost, s, n, C, table_ptr, s_table, HPW, ps,
            hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, src_ptr, dst_ptr, now,
            KKP: tl.constexpr):
    """P4b. Misses sorted by host location; miss r < nhost takes vict[r]: copy plan row r."""
    u = tl.arange(0, KKP)
    um = u < U
    o = tl.load(out + u, mask=um, other=0)
    miss = um & (o < 0)
    p = tl.load(upos + u, mask=miss, other=0).to(tl.int64)
    page = p // ps
    hpg = tl.load(table_ptr + s * s_table + page, mask=miss & (page < HPW), other=-1).to(tl.int64)
    mkey = tl.sort(tl.where(miss, (hpg * ps + p % ps) * KKP + u, BIG))
    take = u < nhost
    j = tl.where(take, mkey % KKP, 0)
    hloc = mkey // KKP
    v = tl.load(vict + u, mask=take, other=0).to(tl.int64)
    lv = tl.load(hot_loc_ptr + s * s_loc + v, mask=take, other=0).to(tl.int64)
    pj = tl.load(upos + j, mask=take, other=0)
    tl.store(out + j, lv, mask=take)
    tl.store(hflag + j, tl.full([KKP], 1, tl.int32), mask=take)
    tl.store(hot_pos_ptr + s * s_pos + v, pj.to(hot_pos_ptr.dtype.element_ty), mask=take)
    tl.store(hot_stamp_ptr + s * s_stamp + v, (tl.zeros([KKP], tl.int64) + now), mask=take)
    tl.store(src_ptr + n * C + u, hloc, mask=take)
    tl.store(dst_ptr + n * C + u, lv, mask=take)


@triton.jit
def _emit(sel_ptr, loc_ptr, KK, n, uidx, out, hflag, KKP: tl.constexpr, CH: tl.constexpr):
    """P5. loc row [KK] in selection order. Returns (selected entries, host-selected entries)."""
    nsel = tl.sum(tl.zeros([CH], tl.int32), axis=0)
    hsel = nsel
    for c0 in range(0, KKP, CH):
        if c0 < KK:
            i = c0 + tl.arange(0, CH)
            im = i < KK
            x = tl.load(sel_ptr + n * KK + i, mask=im, other=-1)
            valid = im & (x >= 0)
            uid = tl.load(uidx + i, mask=valid, other=0)
            o = tl.load(out + uid, mask=valid, other=-1)
            hf = tl.load(hflag + uid, mask=valid, other=0)
            tl.store(loc_ptr + n * KK + i, tl.where(valid, o, -1).to(loc_ptr.dtype.element_ty), mask=im)
            nsel += tl.sum(valid.to(tl.int32), axis=0)
            hsel += tl.sum(hf, axis=0)
    return nsel, hsel


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
    KKP: tl.constexpr, BP: tl.constexpr, LOGK: tl.constexpr, CH: tl.constexpr, CHB: tl.constexpr,
):
    """Grid (N,). sel [N, KK]; state rows indexed by slots[n]; loc [N, KK]; src/dst [N, C] copy plan
    rows (host location, device location) sorted by host location; copy_n [N]; cnt [N, 6]
    (selected, direct, hot, host, host_selected, overflow). scr64 [N, KKP], scr32 [N, 3*KKP + 2*BP]."""
    n = tl.program_id(0).to(tl.int64)
    s = tl.load(slots_ptr + n).to(tl.int64)
    now = now.to(tl.int64)
    skey = scr64_ptr + n * KKP
    out = skey  # the sorted keys are dead once P1 ends: reuse the row for out [KKP] int64
    upos = scr32_ptr + n * (3 * KKP + 2 * BP)
    uidx = upos + KKP
    hflag = uidx + KKP
    prot = hflag + KKP
    vict = prot + BP

    U = _dedup(sel_ptr, KK, skey, upos, uidx, n, KKP, CH)
    tl.debug_barrier()
    ndir, nrest = _direct(upos, out, hflag, U, s, tail_start_ptr, tail_loc_ptr, s_tail, TT, dmap_ptr, s_dmap,
                          LMAX, has_map, KKP, CH)
    tl.debug_barrier()
    nhot = ndir * 0
    if nrest > 0:
        nhot = _hot_scan(upos, out, prot, U, s, hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc,
                         B, now, KKP, BP, LOGK, CHB)
        tl.debug_barrier()
    nmiss = nrest - nhot
    nhost = nmiss * 0
    if nmiss > 0:
        ncand = (B - nhot).to(tl.int32)
        nhost = tl.minimum(nmiss, ncand).to(tl.int32)
        _victims(prot, vict, s, hot_stamp_ptr, s_stamp, B, ncand, BP)
        tl.debug_barrier()
        _misses(upos, out, hflag, vict, U, nhost, s, n, C, table_ptr, s_table, HPW, ps,
                hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s_pos, s_stamp, s_loc, src_ptr, dst_ptr, now, KKP)
        tl.debug_barrier()
    tl.store(copy_n_ptr + n, nhost)
    nsel, hsel = _emit(sel_ptr, loc_ptr, KK, n, uidx, out, hflag, KKP, CH)
    c = cnt_ptr + n * 6
    tl.store(c + 0, nsel.to(tl.int64))
    tl.store(c + 1, ndir.to(tl.int64))
    tl.store(c + 2, nhot.to(tl.int64))
    tl.store(c + 3, nhost.to(tl.int64))
    tl.store(c + 4, hsel.to(tl.int64))
    tl.store(c + 5, (nmiss - nhost).to(tl.int64))
