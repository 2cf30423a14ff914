"""Parts both plan paths share (resolver_kernel.py's chunked one, resolver_one.py's registers-only one):
a position's direct location, a slot's hot rows as registers, the hot_entry lookup's hits (MAP), a
request's counters, the fused copy."""

from __future__ import annotations

import triton
import triton.language as tl

from dhisparse.kernels.gather import copy_row_block


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
def _hot_rows(hot_pos_ptr, hot_stamp_ptr, hot_loc_ptr, s, s_pos, s_stamp, s_loc, B, BP: tl.constexpr):
    """Slot s's hot-cache rows as registers [BP]: (in range, positions int32, stamps int64, device
    locations int32), -1 / 0 past B. They depend only on s, so the plan issues them before P1.
    Positions and device row locations are < 2^31 (the kernel's contract): int32 halves their
    registers, which at B 8,192 and 32 warps is what keeps them from spilling."""
    sl = tl.arange(0, BP)
    bm = sl < B
    hp = tl.load(hot_pos_ptr + s * s_pos + sl, mask=bm, other=-1).to(tl.int32)
    hs = tl.load(hot_stamp_ptr + s * s_stamp + sl, mask=bm, other=0).to(tl.int64)
    hl = tl.load(hot_loc_ptr + s * s_loc + sl, mask=bm, other=0).to(tl.int32)
    return bm, hp, hs, hl


@triton.jit
def _clear_hits(hrow, BP: tl.constexpr):
    """MAP: the request's hit row hrow [BP] int8 zeroed (any contents at entry). Call before the
    entries' lookup, with a barrier between (other threads set the flags)."""
    tl.store(hrow + tl.arange(0, BP), tl.zeros([BP], tl.int8))


@triton.jit
def _hits(h, cand, hl):
    """MAP: entries cand (not-direct representatives) whose position has a hot entry h >= 0 are hits.
    Returns (hit mask he, their entries hc (0 elsewhere), each hit's hot location hl[h] as int64,
    gathered from the hot rows' registers hl [BP])."""
    he = cand & (h >= 0)
    hc = tl.where(he, h, 0)
    return he, hc, tl.gather(hl, hc, 0).to(tl.int64)


@triton.jit
def _mark_hits(he, hc, s, hot_stamp_ptr, s_stamp, hrow, now, N: tl.constexpr):
    """MAP: each hit entry hc [N] (where he) gets its stamp refreshed and its flag set in hrow."""
    tl.store(hot_stamp_ptr + s * s_stamp + hc, tl.zeros([N], tl.int64) + now, mask=he)
    tl.store(hrow + hc, tl.full([N], 1, tl.int8), mask=he)


@triton.jit
def _read_hits(hrow, bm, BP: tl.constexpr):
    """MAP: the protected slots [BP] (after a barrier behind `_mark_hits`)."""
    return bm & (tl.load(hrow + tl.arange(0, BP), mask=bm, other=0) != 0)


@triton.jit
def _store_counts(c, nsel, ndir, nhot, nhost, hsel, nover):
    """Counters of one request at c[0:6] (ResolveCounters order)."""
    tl.store(c + 0, nsel.to(tl.int64))
    tl.store(c + 1, ndir.to(tl.int64))
    tl.store(c + 2, nhot.to(tl.int64))
    tl.store(c + 3, nhost.to(tl.int64))
    tl.store(c + 4, hsel.to(tl.int64))
    tl.store(c + 5, nover.to(tl.int64))


@triton.jit
def _copy_planned(src_row, dst_row, nhost, crs, crd, CG, chp, chs0, chsl, chs1, cdp, cds0, cdsl, cds1,
                  CPW: tl.constexpr, CCW: tl.constexpr, CVEC: tl.constexpr, CR: tl.constexpr):
    """P6, the fused copy (`plan_triton(copy=...)`): the request's copy-plan rows 0 .. nhost-1
    (src_row / dst_row: its row of src_pad / dst_pad, written by P4) copied host -> device in each
    of the CG layers of the target pair, CR rows at a time. Each row chunk's indices are read once
    for every layer."""
    tl.debug_barrier()  # P4's copy-plan stores, made by other threads of this program, are visible
    r0 = nhost * 0
    while r0 < nhost:
        r = r0 + tl.arange(0, CR)
        rm = r < nhost
        si = tl.load(src_row + r, mask=rm, other=0).to(tl.int64)
        di = tl.load(dst_row + r, mask=rm, other=0).to(tl.int64)
        g = (CG * 0).to(tl.int64)
        while g < CG:
            copy_row_block(crs, crd, si, di, rm, g, chp, chs0, chsl, chs1, cdp, cds0, cdsl, cds1, CPW, CCW, CVEC)
            g += 1
        r0 += CR
