"""`KVArena`: the device memory of the KV pools, one array of equal-sized pages.

A page is typed when it is allocated: a *latent* page holds `page_size` token positions of every
layer's latent row, an *index* page holds `index_page_size` positions of every full layer's index
keys (index rows are narrower, so an index page packs more positions). One pool of pages means
the capacity M of eq. 3 is one number whatever the pages are used for.

  storage [P, page_elems]
  latent view [P, L, page_size, latent_dim]          location = page * page_size + offset
  index  view [P, F, index_page_size, index_dim]     location = page * index_page_size + offset

A layer's row space is `latent[:, layer]` ([P, page_size, latent_dim], strided); locations index
it as (loc // page_size, loc % page_size).
"""

from __future__ import annotations

import torch

from dhisparse.kv.layout import KVLayout
from dhisparse.kv.pool import PagePool
from dhisparse.models.config import ModelConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVArena:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, device: torch.device | str, dtype: torch.dtype) -> None:
        self.cfg, self.page_size, self.device, self.dtype = cfg, page_size, torch.device(device), dtype
        self.layout = KVLayout.from_model(cfg)
        L, d = cfg.num_layers, cfg.latent_dim
        F, di = len(self.layout.index_layers), cfg.index_head_dim
        self.page_elems = L * page_size * d
        self.index_page_size = max(1, self.page_elems // (F * di))
        self.storage = torch.zeros(num_pages, self.page_elems, device=device, dtype=dtype)
        self.latent = self.storage.view(num_pages, L, page_size, d)
        self.index = self.storage[:, : F * self.index_page_size * di].view(num_pages, F, self.index_page_size, di)
        self.index_slot = {layer: j for j, layer in enumerate(self.layout.index_layers)}
        self.pool = PagePool(num_pages, "kv pages")

    @staticmethod
    def page_bytes(cfg: ModelConfig, page_size: int, elem_bytes: int) -> int:
        return cfg.num_layers * page_size * cfg.latent_dim * elem_bytes

    @property
    def page_nbytes(self) -> int:
        return self.page_elems * self.storage.element_size()

    def latent_pages_for(self, n_tokens: int) -> int:
        return cdiv(n_tokens, self.page_size)

    def index_pages_for(self, n_tokens: int) -> int:
        return cdiv(n_tokens, self.index_page_size)

    def latent_rows(self, layer: int) -> torch.Tensor:
        """[P, page_size, latent_dim] row space of `layer`."""
        return self.latent[:, layer]

    def index_rows(self, layer: int) -> torch.Tensor:
        """[P, index_page_size, index_dim] index-key space of full layer `layer`."""
        return self.index[:, self.index_slot[layer]]

    def write_rows(self, lat_loc: torch.Tensor, idx_loc: torch.Tensor) -> "WriteRows":
        """Flat storage rows of latent locations lat_loc [n] in every layer and of index locations
        idx_loc [n] in every index layer, computed once per pass (see `WriteRows`)."""
        L, ps, d = self.latent.shape[1:]
        lat = (lat_loc // ps) * (L * ps) + lat_loc % ps
        lat = lat[None] + (torch.arange(L, device=lat.device) * ps)[:, None]
        idx = None
        F, ips, di = self.index.shape[1:]
        if F and self.page_elems % di == 0:
            base = (idx_loc // ips) * (self.page_elems // di) + idx_loc % ips
            idx = base[None] + (torch.arange(F, device=base.device) * ips)[:, None]
        return WriteRows(self, lat, idx)

    def locations(self, pages: list[int] | torch.Tensor, n: int, per_page: int) -> torch.Tensor:
        """[n] locations of positions 0..n-1 laid out over `pages` with `per_page` rows a page."""
        if isinstance(pages, torch.Tensor):
            t = pages.to(device=self.device, dtype=torch.int64)
        else:  # staged host copy: no device sync (torch.tensor(..., device=cuda) would wait for the stream)
            t = torch.tensor(pages, dtype=torch.int64).to(self.device, non_blocking=True)
        loc = (t[:, None] * per_page + torch.arange(per_page, device=self.device)).reshape(-1)
        return loc[:n]


class WriteRows:
    """One pass's writes as flat rows of the arena storage: one `index_copy_` per layer.

      storage [P, page_elems] viewed as rows of latent_dim:   row = page * (L * ps) + layer * ps + off
      viewed as rows of index_dim (when page_elems % index_dim == 0):
                                                           row = page * (page_elems / iD) + slot * ips + off
    lat [L, n] and idx [F, n] hold those rows for each layer / index slot (idx None: the index
    rows do not tile the page; `scatter_rows` is used instead)."""

    def __init__(self, arena: KVArena, lat: torch.Tensor, idx: torch.Tensor | None) -> None:
        self.arena, self.lat, self.idx = arena, lat, idx
        self.lat_flat = arena.storage.view(-1, arena.latent.shape[-1])
        self.idx_flat = arena.storage.view(-1, arena.index.shape[-1]) if idx is not None else None

    def latent(self, layer: int, values: torch.Tensor) -> None:
        """values [n, latent_dim] -> layer `layer`'s rows at the pass's latent locations."""
        self.lat_flat.index_copy_(0, self.lat[layer], values.to(self.lat_flat.dtype))

    def index(self, layer: int, values: torch.Tensor, loc: torch.Tensor) -> None:
        """values [n, index_dim] -> full layer `layer`'s index rows (loc: the same locations, flat
        in the layer's index space, for the fallback)."""
        if self.idx is None:
            scatter_rows(self.arena.index_rows(layer), loc, values)
        else:
            self.idx_flat.index_copy_(0, self.idx[self.arena.index_slot[layer]], values.to(self.idx_flat.dtype))


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
