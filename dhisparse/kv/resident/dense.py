"""`DenseKV`: the simplest KVContext, one growing contiguous tensor per request and layer.

No paging, no tiers: the reference the paged and hierarchical stores are tested against, and
the store used by parity tests against transformers.
"""

from __future__ import annotations

import torch

from dhisparse.core.batch import ForwardBatch, IndexTable, KVContext
from dhisparse.core.config import ModelConfig
from dhisparse.core.kvformat import KVFormats, RowFormat


class DenseKV(KVContext):
    """Holds latent rows [L_r, W] and index keys [L_r, Wi] per (request slot, layer): plain rows
    of `dtype` (W = latent_dim), or with `formats` rows encoded in those formats (FP8: the I2 row
    checker then compares the bytes a paged store holds)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 formats: KVFormats | None = None) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.formats = formats or KVFormats.plain(cfg.latent_dim, cfg.index_head_dim, dtype)
        self.latent: dict[tuple[int, int], torch.Tensor] = {}
        self.index: dict[tuple[int, int], torch.Tensor] = {}
        self.slots: list[int] = []
        self.batch: ForwardBatch | None = None

    def begin(self, batch: ForwardBatch, slots: list[int]) -> "DenseKV":
        """Bind the next pass: batch row r belongs to request slot slots[r]."""
        self.batch, self.slots = batch, slots
        return self

    def row_formats(self) -> KVFormats | None:
        return self.formats if self.formats.fp8 else None

    def _append(self, store: dict, layer: int, rows: torch.Tensor, fmt: RowFormat) -> None:
        rows = fmt.encode(rows)
        b = self.batch
        for r in range(b.num_reqs):
            a, e = b.query_start[r], b.query_start[r + 1]
            key = (self.slots[r], layer)
            old = store.get(key, rows.new_empty(0, rows.shape[1]))
            start = int(b.positions[a]) if e > a else old.shape[0]
            if start > old.shape[0]:
                raise ValueError(f"request slot {self.slots[r]}: pass starts at {start}, cache holds {old.shape[0]}")
            old = old[:start]  # rows past `start` were uncommitted (rejected drafts): overwritten
            store[key] = torch.cat([old, rows[a:e]])

    def store(self, layer: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        self._append(self.latent, layer, latent, self.formats.latent)
        if index_key is not None:
            self._append(self.index, layer, index_key, self.formats.index)

    def index_keys(self, layer: int, req: int) -> torch.Tensor:
        return self.formats.index.decode(self.index[(self.slots[req], layer)])

    def index_table(self, layer: int) -> IndexTable:
        """The requests' index keys concatenated into one page [1, sum L_r, iD]."""
        parts = [self.index.get((s, layer)) for s in self.slots]
        f = self.formats.index
        width, sdt = f.width, f.storage_dtype
        parts = [p if p is not None else torch.empty(0, width, dtype=sdt, device=self.device) for p in parts]
        lens = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64, device=self.device)
        starts = lens.cumsum(0) - lens
        pos = torch.arange(max(int(lens.max()) if len(parts) else 0, 1), device=self.device)
        locs = torch.where(pos[None, :] < lens[:, None], starts[:, None] + pos[None, :], torch.full_like(pos, -1)[None, :])
        rows = torch.cat(parts) if parts else torch.empty(0, width, dtype=sdt, device=self.device)
        return IndexTable(rows[None], locs, lens, f if f.fp8 else None)

    def locate(self, layer: int, selection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.latent[(s, layer)] for s in self.slots]
        offsets = torch.tensor([0] + [p.shape[0] for p in parts[:-1]], device=selection.device).cumsum(0)
        rows = torch.cat(parts)
        loc = offsets[self.batch.req_idx][:, None] + selection
        return rows[None], torch.where(selection >= 0, loc, torch.full_like(loc, -1))

    def drop(self, slot: int) -> None:
        for store in (self.latent, self.index):
            for key in [k for k in store if k[0] == slot]:
                del store[key]
