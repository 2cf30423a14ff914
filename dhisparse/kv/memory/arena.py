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

from dhisparse.kv.memory.layout import KVLayout, RowGeometry
from dhisparse.kv.memory.pool import PagePool
from dhisparse.core.config import ModelConfig
from dhisparse.core.rows import cdiv, scatter_rows


class KVArena:
    def __init__(self, geometry: RowGeometry | ModelConfig, num_pages: int, page_size: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        """geometry: the rows' geometry (a ModelConfig is read as `RowGeometry.of_model`)."""
        self.cfg = cfg = RowGeometry.of(geometry)
        self.page_size, self.device, self.dtype = page_size, torch.device(device), dtype
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
    def page_bytes(cfg: RowGeometry | ModelConfig, page_size: int, elem_bytes: int) -> int:
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
