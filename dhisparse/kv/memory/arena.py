"""`KVArena`: the device memory of the KV pools, one array of equal-sized pages.

A page is typed when it is allocated: a *latent* page holds `page_size` token positions of every
layer's latent row, an *index* page holds `index_page_size` positions of every full layer's index
keys (index rows are narrower, so an index page packs more positions). One pool of pages means
the capacity M of eq. 3 is one number whatever the pages are used for.

  storage [P, page_elems]
  latent view [P, L, page_size, W]                   location = page * page_size + offset
  index  view [P, F, index_page_size, Wi]            location = page * index_page_size + offset

W / Wi are the stored widths of a latent row and an index key (`formats`, core/kvformat.py): the
model's latent_dim / index_head_dim for plain rows; 656 / 132 bytes for FP8 rows at GLM-5's shape
(the storage is then uint8). Rows are encoded once, when written (`WriteRows`); every reader either
copies the bytes or decodes them with the same format.

A layer's row space is `latent[:, layer]` ([P, page_size, W], strided); locations index it as
(loc // page_size, loc % page_size).

FP8 index keys are split within a page slot, as SGLang's and DeepSeek's indexer caches keep them:
the ips keys' e4m3 values first (128 B each, 16-B aligned: the indexer kernel reads them with
vector loads), then their fp32 scales. ips is rounded down so every slot starts 16-B aligned
(`keys_per_index_page`). A key is still 132 B of the page (`formats.index.width`).

  index region of page p, slot f  [ips * Wi bytes]
  | key 0 values | key 1 values | ... | key ips-1 values | scale 0 | scale 1 | ... | scale ips-1 |
  0              D              2D                      ips*D     ips*D+4                  ips*Wi
"""

from __future__ import annotations

import math

import torch

from dhisparse.kv.memory.layout import KVLayout, RowGeometry
from dhisparse.kv.memory.pool import PagePool
from dhisparse.core.config import ModelConfig
from dhisparse.core.kvformat import KVFormats
from dhisparse.core.rows import cdiv, gather_rows, scatter_rows


class KVArena:
    def __init__(self, geometry: RowGeometry | ModelConfig, num_pages: int, page_size: int, device: torch.device | str,
                 dtype: torch.dtype, formats: KVFormats | None = None) -> None:
        """geometry: the rows' geometry (a ModelConfig is read as `RowGeometry.of_model`); dtype:
        the model dtype; formats: the stored row formats (None: plain rows of `dtype`). The
        arena's `dtype` is the storage dtype (uint8 for FP8 rows)."""
        self.cfg = cfg = RowGeometry.of(geometry)
        self.formats = formats or KVFormats.plain(cfg.latent_dim, cfg.index_head_dim, dtype)
        if (self.formats.latent.dim, self.formats.index.dim) != (cfg.latent_dim, cfg.index_head_dim):
            raise ValueError(f"row formats are for dims {(self.formats.latent.dim, self.formats.index.dim)}, "
                             f"the geometry's are {(cfg.latent_dim, cfg.index_head_dim)}")
        dtype = self.formats.storage_dtype
        self.page_size, self.device, self.dtype = page_size, torch.device(device), dtype
        self.layout = KVLayout.from_model(cfg)
        L, d = cfg.num_layers, self.formats.latent.width
        F, di = len(self.layout.index_layers), self.formats.index.width
        self.page_elems = L * page_size * d
        self.index_page_size = self.keys_per_index_page(self.page_elems, F, di, self.formats.storage_dtype.itemsize)
        self.storage = torch.zeros(num_pages, self.page_elems, device=device, dtype=dtype)
        self.latent = self.storage.view(num_pages, L, page_size, d)
        ips = self.index_page_size
        self.index_pages = self.storage[:, : F * ips * di].view(num_pages, F, ips * di)  # whole index regions
        self.index_split = self.formats.index.quantized if self.formats.index.fp8 else 0  # D, or 0: row layout
        if self.index_split:
            D = self.index_split
            self._index_vals = self.index_pages[..., : ips * D].view(num_pages, F, ips, D)
            self._index_scales = self.index_pages[..., ips * D :].view(num_pages, F, ips, di - D)
        else:
            self.index = self.index_pages.view(num_pages, F, ips, di)
        self.index_slot = {layer: j for j, layer in enumerate(self.layout.index_layers)}
        self.pool = PagePool(num_pages, "kv pages")

    @staticmethod
    def keys_per_index_page(page_elems: int, slots: int, key_width: int, itemsize: int) -> int:
        """ips: index keys per page slot, the most that fit with every slot starting 16-B aligned
        (ips * key_width * itemsize a multiple of 16 where the page holds more than one such
        group). A misaligned slot costs the indexer kernel its vector loads: at GLM-5's shape FP8
        keys (132 B) gave ips 1181, so slots 1, 3, ... started off 16 B and scoring ran ~10x slower
        than bf16 on the H200 (step_profile, 100K C21, session 17)."""
        n = max(1, page_elems // (slots * key_width))
        unit = 16 // math.gcd(16, key_width * itemsize)  # keys per 16-B-aligned group
        return n - n % unit if n >= unit else n

    @staticmethod
    def page_bytes(cfg: RowGeometry | ModelConfig, page_size: int, row_bytes: int) -> int:
        """Bytes of one page: page_size latent rows of `row_bytes` (`RowFormat.nbytes`) per layer."""
        return cfg.num_layers * page_size * row_bytes

    @property
    def row_width(self) -> int:
        """W: stored elements of one latent row."""
        return self.formats.latent.width

    @property
    def page_nbytes(self) -> int:
        return self.page_elems * self.storage.element_size()

    def latent_pages_for(self, n_tokens: int) -> int:
        return cdiv(n_tokens, self.page_size)

    def index_pages_for(self, n_tokens: int) -> int:
        return cdiv(n_tokens, self.index_page_size)

    def latent_rows(self, layer: int) -> torch.Tensor:
        """[P, page_size, W] row space of `layer` (stored rows: `formats.latent`)."""
        return self.latent[:, layer]

    def index_spaces(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Index-key spaces of full layer `layer`: (keys [P, ips, Wi], None) for row-layout keys,
        (values [P, ips, D], scales [P, ips, Wi - D]) for split FP8 keys (module docstring)."""
        j = self.index_slot[layer]
        if self.index_split:
            return self._index_vals[:, j], self._index_scales[:, j]
        return self.index[:, j], None

    def read_index(self, layer: int, loc: torch.Tensor) -> torch.Tensor:
        """Stored keys [n, Wi] (`formats.index` rows, whatever the page layout) at locations loc [n]."""
        vals, scales = self.index_spaces(layer)
        if scales is None:
            return gather_rows(vals, loc)
        return torch.cat([gather_rows(vals, loc), gather_rows(scales, loc)], dim=-1)

    def write_index(self, layer: int, loc: torch.Tensor, rows: torch.Tensor) -> None:
        """Stored keys rows [n, Wi] (already encoded) -> locations loc [n] of layer `layer`."""
        vals, scales = self.index_spaces(layer)
        if scales is None:
            return scatter_rows(vals, loc, rows)
        scatter_rows(vals, loc, rows[:, : self.index_split])
        scatter_rows(scales, loc, rows[:, self.index_split :])

    def write_rows(self, lat_loc: torch.Tensor, idx_loc: torch.Tensor) -> "WriteRows":
        """Flat storage rows of latent locations lat_loc [n] in every layer and of index locations
        idx_loc [n] in every index layer, computed once per pass (see `WriteRows`)."""
        L, ps, d = self.latent.shape[1:]
        lat = (lat_loc // ps) * (L * ps) + lat_loc % ps
        lat = lat[None] + (torch.arange(L, device=lat.device) * ps)[:, None]
        idx = None
        F, ips, di = len(self.layout.index_layers), self.index_page_size, self.formats.index.width
        if F and not self.index_split and self.page_elems % di == 0:
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

      storage [P, page_elems] viewed as rows of W:        row = page * (L * ps) + layer * ps + off
      viewed as rows of Wi (row-layout keys, when page_elems % Wi == 0; else `write_index`):
                                                           row = page * (page_elems / iD) + slot * ips + off
    lat [L, n] and idx [F, n] hold those rows for each layer / index slot (idx None: the index
    rows do not tile the page; `scatter_rows` is used instead)."""

    def __init__(self, arena: KVArena, lat: torch.Tensor, idx: torch.Tensor | None) -> None:
        self.arena, self.lat, self.idx = arena, lat, idx
        self.lat_flat = arena.storage.view(-1, arena.latent.shape[-1])
        self.idx_flat = arena.storage.view(-1, arena.formats.index.width) if idx is not None else None

    def latent(self, layer: int, values: torch.Tensor) -> None:
        """values [n, latent_dim] -> layer `layer`'s rows at the pass's latent locations (encoded)."""
        self.lat_flat.index_copy_(0, self.lat[layer], self.arena.formats.latent.encode(values))

    def index(self, layer: int, values: torch.Tensor, loc: torch.Tensor) -> None:
        """values [n, index_dim] -> full layer `layer`'s index rows, encoded (loc: the same
        locations, flat in the layer's index space, for the fallback)."""
        rows = self.arena.formats.index.encode(values)
        if self.idx is None:
            self.arena.write_index(layer, loc, rows)
        else:
            self.idx_flat.index_copy_(0, self.idx[self.arena.index_slot[layer]], rows)
