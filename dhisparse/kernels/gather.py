"""Fused row gather-copy: dst_rows[dst[n, r]] = src_rows[src[n, r]] for r < count[n].

Rows are the last dimension of paged row spaces [pages, rows_per_page, W] (any W, any dtype, same
dtype on both sides), or of layered ones [pages, G, rows_per_page, W] where every one of the G
layers copies the same rows (a layer group shares one selection: one launch serves the group).
Rows are moved in the widest integer unit the row size and strides allow (8 B for 656-B and
1152-B rows) and vector hints let 16-B loads issue. Grid (P, N, G) with P programs a (request, layer)
bounded by GATHER_PROGRAMS in all: each steps through its request's rows P*R at a time, so a launch
costs the same whether a plan's capacity is 32 rows or 2,048, and programs past a request's count
exit at once.
On CUDA a CPU source must be pinned: it is read zero-copy through `host_view` (UVA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dhisparse.kernels.uva import host_view

GATHER_PROGRAMS = 1024  # programs a gather launch aims at (H200: 132 SMs x 8 four-warp programs)
_UNITS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _block(ptr, base, c0, rm, W: tl.constexpr, CW: tl.constexpr, VEC: tl.constexpr):
    """(pointers [R, CW], mask) of column block c0 of rows at unit offsets base [R]."""
    cols = tl.max_contiguous(tl.multiple_of(c0 + tl.arange(0, CW), VEC), VEC)
    return ptr + base[:, None] + cols[None, :], rm[:, None] & (cols[None, :] < W)


@triton.jit
def copy_row_block(src_ptr, dst_ptr, si, di, rm, g, hp, hs0, hsl, hs1, dp, ds0, dsl, ds1,
                   W: tl.constexpr, CW: tl.constexpr, VEC: tl.constexpr):
    """Rows si -> di (flat row indices [R] int64: page * rows_per_page + row; mask rm [R]) of layer g
    of a layered row-space pair, W units a row in column blocks of CW. Shared by the gather kernel and
    the resolver plan kernel's fused copy (resolver_kernel.py, P6).
    Up to four column blocks (rows to 2 KB in 8-B units) are all loaded before any is stored: a store
    may alias a later load, so interleaved they would cost one host round trip (~1-2 us over PCIe)
    per block instead of one a row chunk; callers size R by `RowCopy.width_in_flight` to hold them."""
    sb = tl.multiple_of((si // hp) * hs0 + g * hsl + (si % hp) * hs1, VEC)
    db = tl.multiple_of((di // dp) * ds0 + g * dsl + (di % dp) * ds1, VEC)
    NB: tl.constexpr = (W + CW - 1) // CW
    if NB <= 4:
        p0, m0 = _block(src_ptr, sb, 0, rm, W, CW, VEC)
        v0 = tl.load(p0, mask=m0)
        if NB >= 2:
            p1, m1 = _block(src_ptr, sb, CW, rm, W, CW, VEC)
            v1 = tl.load(p1, mask=m1)
        if NB >= 3:
            p2, m2 = _block(src_ptr, sb, 2 * CW, rm, W, CW, VEC)
            v2 = tl.load(p2, mask=m2)
        if NB >= 4:
            p3, m3 = _block(src_ptr, sb, 3 * CW, rm, W, CW, VEC)
            v3 = tl.load(p3, mask=m3)
        q0, _ = _block(dst_ptr, db, 0, rm, W, CW, VEC)  # the same columns: the loads' masks
        tl.store(q0, v0, mask=m0)
        if NB >= 2:
            q1, _ = _block(dst_ptr, db, CW, rm, W, CW, VEC)
            tl.store(q1, v1, mask=m1)
        if NB >= 3:
            q2, _ = _block(dst_ptr, db, 2 * CW, rm, W, CW, VEC)
            tl.store(q2, v2, mask=m2)
        if NB >= 4:
            q3, _ = _block(dst_ptr, db, 3 * CW, rm, W, CW, VEC)
            tl.store(q3, v3, mask=m3)
    else:
        for c0 in tl.static_range(0, W, CW):
            ps, m = _block(src_ptr, sb, c0, rm, W, CW, VEC)
            pd, _ = _block(dst_ptr, db, c0, rm, W, CW, VEC)
            tl.store(pd, tl.load(ps, mask=m), mask=m)


@triton.jit(do_not_specialize=["C"])
def gather_rows_kernel(src_ptr, dst_ptr, sidx_ptr, didx_ptr, cnt_ptr, C,
                       hp, hs0, hsl, hs1, dp, ds0, dsl, ds1,
                       W: tl.constexpr, R: tl.constexpr, CW: tl.constexpr, VEC: tl.constexpr):
    """Program (pid, n, g) of grid (P, N, G) copies rows pid*R .. pid*R+R-1, then the same R rows
    P*R further on, and so on below count[n], of request n's plan (src/dst idx [N, C]) in layer g of
    the row spaces. P is bounded (`gather_programs`), not C / R: a plan's capacity C is min(K*k, B)
    rows a request while a steady-state step copies a few, and programs with nothing to copy still
    cost the launch their scheduling (issue 33)."""
    pid = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    g = tl.program_id(2).to(tl.int64)
    step = tl.num_programs(0) * R
    cnt = tl.load(cnt_ptr + n).to(tl.int32)
    r0 = pid * R
    while r0 < cnt:
        r = r0 + tl.arange(0, R)
        rm = r < cnt
        si = tl.load(sidx_ptr + n * C + r, mask=rm, other=0).to(tl.int64)
        di = tl.load(didx_ptr + n * C + r, mask=rm, other=0).to(tl.int64)
        copy_row_block(src_ptr, dst_ptr, si, di, rm, g, hp, hs0, hsl, hs1, dp, ds0, dsl, ds1, W, CW, VEC)
        r0 += step


def _unit(t: torch.Tensor) -> int:
    """Widest unit (bytes) dividing the row size, the page/row strides and the base address."""
    es = t.element_size()
    for ub, _ in _UNITS:
        if ub < es:
            break
        if (t.shape[-1] * es) % ub == 0 and all(s * es % ub == 0 for s in t.stride()[:-1]) \
                and t.data_ptr() % ub == 0:
            return ub
    return es


def _as_units(t: torch.Tensor, ub: int) -> torch.Tensor:
    if ub == t.element_size():
        return t
    return t.view(dict(_UNITS)[ub])


def _vec(t: torch.Tensor, ub: int) -> int:
    """Elements per 16-B vector when the row size, strides and base allow it, else 1."""
    for v in (16 // ub, 8 // ub, 4 // ub, 2 // ub, 1):
        if v >= 1 and t.shape[-1] % v == 0 and all(s % v == 0 for s in t.stride()[:-1]) \
                and t.data_ptr() % (v * ub) == 0:
            return v
    return 1


_LAYOUTS: dict[tuple, tuple] = {}


def _layered(t: torch.Tensor) -> torch.Tensor:
    """[R, W] -> [R, 1, 1, W]; [P, ps, W] -> [P, 1, ps, W]; [P, G, ps, W] as it is."""
    if t.dim() == 2:
        return t[:, None, None]
    if t.dim() == 3:
        return t.unsqueeze(1)
    if t.dim() == 4:
        return t
    raise ValueError(f"row spaces are [rows, W], [pages, ps, W] or [pages, G, ps, W]; got shape {tuple(t.shape)}")


def _layout(src_rows: torch.Tensor, dst_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(source view, destination view in copy units, vector width, column block) of a row-space
    pair. The probing (unit, vector width) and a pinned source's zero-copy view are cached by
    address and layout -- the same pairs recur every layer of every step. The cache holds no
    owning reference: device tensors are re-viewed per call, and zero-copy views never own."""
    key = (src_rows.data_ptr(), src_rows.shape, src_rows.stride(), src_rows.dtype, src_rows.device,
           dst_rows.data_ptr(), dst_rows.shape, dst_rows.stride(), dst_rows.device)
    src_rows, dst_rows = _layered(src_rows), _layered(dst_rows)
    hit = _LAYOUTS.get(key)
    if hit is None:
        uva = host_view(src_rows) if dst_rows.is_cuda and not src_rows.is_cuda else None
        probe = uva if uva is not None else src_rows
        ub = min(_unit(probe), _unit(dst_rows))
        s_view = _as_units(uva, ub) if uva is not None else None
        vec = min(_vec(_as_units(probe, ub), ub), _vec(_as_units(dst_rows, ub), ub))
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        _LAYOUTS[key] = hit = (s_view, ub, vec, min(triton.next_power_of_2(src_rows.shape[-1]), 64))
    s_view, ub, vec, cw = hit
    s = s_view if s_view is not None else _as_units(src_rows, ub)
    return s, _as_units(dst_rows, ub), vec, cw


@dataclass(frozen=True)
class RowCopy:
    """A row-space pair prepared for a copy kernel: `src` / `dst` layered views [pages, G, rows_per_page,
    W] in copy units (a pinned host source as its zero-copy CUDA view), `strides` the kernel's
    (hp, hs0, hsl, hs1, dp, ds0, dsl, ds1), and the constexprs W (units a row), CW (column block)
    and VEC (units a 16-B vector)."""

    src: torch.Tensor
    dst: torch.Tensor
    strides: tuple[int, ...]
    W: int
    CW: int
    VEC: int

    @property
    def layers(self) -> int:
        """G: the layers every row is copied in."""
        return self.src.shape[1]

    @property
    def width_in_flight(self) -> int:
        """`in_flight_units` of this pair's rows."""
        return in_flight_units(self.W, self.CW)


def in_flight_units(W: int, CW: int) -> int:
    """Units of a W-unit row that `copy_row_block` loads before it stores: the whole row's column blocks
    (CW each) when they are four or fewer, else one block at a time."""
    nb = -(-W // CW)
    return CW * (nb if nb <= 4 else 1)


def gather_rows_per_prog(in_flight: int) -> int:
    """R of the gather kernel: about 1,024 units in flight a program (8 a thread of 4 warps), rounded up
    to whole rows of `in_flight` units, at most 16."""
    return min(16, triton.next_power_of_2(triton.cdiv(1024, in_flight)))


def row_copy(src_rows: torch.Tensor, dst_rows: torch.Tensor) -> RowCopy:
    """Check and prepare src_rows [HP, hp, W] -> dst_rows [P, dp, W] (same dtype, unit last stride),
    or layered [HP, G, hp, W] / [P, G, dp, W] (same G), for `gather_rows_kernel` or the resolver plan
    kernel's fused copy."""
    if src_rows.dtype != dst_rows.dtype or src_rows.shape[-1] != dst_rows.shape[-1]:
        raise ValueError("source and destination rows must share dtype and width")
    if src_rows.stride(-1) != 1 or dst_rows.stride(-1) != 1:
        raise ValueError("row spaces need a contiguous last dimension")
    s, d, vec, cw = _layout(src_rows, dst_rows)
    if s.shape[1] != d.shape[1]:
        raise ValueError(f"layered row spaces need the same layer count, got {s.shape[1]} and {d.shape[1]}")
    return RowCopy(s, d, (s.shape[2], s.stride(0), s.stride(1), s.stride(2),
                          d.shape[2], d.stride(0), d.stride(1), d.stride(2)), s.shape[-1], cw, vec)


def gather_programs(C: int, R: int, N: int, G: int) -> int:
    """Programs a (request, layer) of the gather grid: enough for GATHER_PROGRAMS in all, at most
    cdiv(C, R) (a request's whole capacity in one pass), at least one."""
    return max(1, min(triton.cdiv(C, R), triton.cdiv(GATHER_PROGRAMS, N * G)))


def gather_rows_padded(src_rows: torch.Tensor, dst_rows: torch.Tensor, src_idx: torch.Tensor,
                       dst_idx: torch.Tensor, count: torch.Tensor, *, rows_per_prog: int | None = None,
                       num_warps: int = 4) -> None:
    """src_rows [HP, hp, W], dst_rows [P, dp, W] (same dtype, unit last stride), or layered
    [HP, G, hp, W] / [P, G, dp, W] (same G: every layer copies the same rows); src_idx, dst_idx
    [N, C] flat row indices (page * rows_per_page + row); count [N] rows to copy per request."""
    gather_rows(row_copy(src_rows, dst_rows), src_idx, dst_idx, count, rows_per_prog=rows_per_prog,
                num_warps=num_warps)


def gather_rows(rc: RowCopy, src_idx: torch.Tensor, dst_idx: torch.Tensor, count: torch.Tensor, *,
                rows_per_prog: int | None = None, num_warps: int = 4) -> None:
    """`gather_rows_padded` into a prepared row-space pair `rc` (`row_copy`: a caller that copies into
    the same pair every call prepares it once)."""
    if not (src_idx.is_contiguous() and dst_idx.is_contiguous()):
        raise ValueError("src_idx and dst_idx must be contiguous [N, C] (the kernel steps rows by C)")
    N, C = src_idx.shape
    if N == 0 or C == 0:
        return
    R = rows_per_prog or gather_rows_per_prog(rc.width_in_flight)
    grid = (gather_programs(C, R, N, rc.layers), N, rc.layers)
    gather_rows_kernel[grid](rc.src, rc.dst, src_idx, dst_idx, count, C, *rc.strides,
                             W=rc.W, R=R, CW=rc.CW, VEC=rc.VEC, num_warps=num_warps)
