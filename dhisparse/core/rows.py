"""Row-space vocabulary shared by kernels, stores and layers.

A *row space* is a paged tensor [P, per_page, W]: flat location l names row rows[l // per_page,
l % per_page]. A location over several spaces (a layer's pages and the verification staging arena)
is `space * SPACE + flat`. These helpers build, gather and scatter such locations in plain PyTorch.
"""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def row_bytes(rows: torch.Tensor) -> int:
    """Bytes of one row of a [pages, rows_per_page, W] row space."""
    return rows.shape[-1] * rows.element_size()


SPACE = 1 << 40  # location = space * SPACE + flat location inside that row space


def table_locations(tables: list[list[int]], lens: list[int], per_page: int, device) -> torch.Tensor:
    """[N, max(lens)] locations of positions 0..lens[r]-1 laid out over each request's page table
    (per_page rows a page), -1 past each length: one tensor build for the whole batch."""
    width = max(max(lens, default=1), 1)
    n_pages = max(max((len(t) for t in tables), default=1), 1)
    rows = [t + [0] * (n_pages - len(t)) for t in tables] or [[0]]
    packed = torch.tensor([x for r in rows for x in r] + (lens or [0]), dtype=torch.int64)
    packed = packed.to(device, non_blocking=True)  # one staged host copy, no device sync
    pages, lens_t = packed[: len(rows) * n_pages].view(len(rows), n_pages), packed[len(rows) * n_pages :, None]
    pos = torch.arange(width, device=device)
    idx = (pos // per_page).clamp(max=n_pages - 1)
    loc = pages[:, idx] * per_page + pos % per_page
    return torch.where(pos[None, :] < lens_t, loc, torch.full_like(loc, -1))[: len(tables)]


def gather_rows(rows: torch.Tensor | tuple[torch.Tensor, ...], loc: torch.Tensor) -> torch.Tensor:
    """rows [P, per_page, W] indexed by flat locations loc [...] (>= 0) -> [..., W].

    rows may also be a tuple of row spaces (e.g. a layer's pages and the verification staging
    arena); then loc // SPACE picks the space and loc % SPACE the row inside it."""
    if isinstance(rows, torch.Tensor):
        per = rows.shape[1]
        return rows[loc // per, loc % per]
    space, local = loc // SPACE, loc % SPACE
    out = rows[0].new_empty(*loc.shape, rows[0].shape[-1])
    for i, r in enumerate(rows):
        m = space == i
        if bool(m.any()):
            out[m] = gather_rows(r, local[m])
    return out


def scatter_rows(rows: torch.Tensor, loc: torch.Tensor, values: torch.Tensor) -> None:
    """rows[loc] = values for flat locations loc [n]; values [n, W]."""
    per = rows.shape[1]
    rows[loc // per, loc % per] = values.to(rows.dtype)
