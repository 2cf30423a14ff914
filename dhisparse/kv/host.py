"""Host backing store: every immutable latent row of every request has a host copy (I1).

Host rows live in a host arena of pages `[HP, L, page_size, latent_dim]` (pinned at its exact
size when CUDA is available, a plain tensor on CPU: same code path). Index keys never go to host (the indexer
scores the whole history on device).

  host table of request r: [h0, h1, ...]   position t -> host location h[t // ps] * ps + t % ps
"""

from __future__ import annotations

import torch

from dhisparse.kv.arena import cdiv
from dhisparse.kv.pinned import pinned_zeros
from dhisparse.kv.pool import PagePool


class HostStore:
    def __init__(self, num_pages: int, num_layers: int, page_size: int, width: int, dtype: torch.dtype, pin: bool, device: str = "cpu") -> None:
        self.page_size = page_size
        shape = (num_pages, num_layers, page_size, width)
        # pinned at its exact size (kv/pinned.py): torch's pinned allocator would round up to 2^n
        self.rows = pinned_zeros(shape, dtype) if pin else torch.zeros(shape, dtype=dtype, device=device)
        self.pool = PagePool(num_pages, "host pages")
        self.tables: dict[object, list[int]] = {}

    @property
    def page_nbytes(self) -> int:
        return self.rows[0].numel() * self.rows.element_size()

    def layer_rows(self, layer: int) -> torch.Tensor:
        """[HP, page_size, width] host row space of `layer`."""
        return self.rows[:, layer]

    def admit(self, req: object, max_tokens_total: int) -> bool:
        if not self.pool.reserve(req, cdiv(max_tokens_total, self.page_size)):
            return False
        self.tables[req] = []
        return True

    def ensure(self, req: object, n_tokens: int) -> None:
        table = self.tables[req]
        need = cdiv(n_tokens, self.page_size) - len(table)
        if need > 0:
            table.extend(self.pool.alloc(req, need))

    def free(self, req: object) -> None:
        self.pool.release(req)
        self.tables.pop(req, None)

    def locations(self, req: object, start: int, end: int) -> torch.Tensor:
        """[end - start] host locations of positions start..end-1 (pages must exist)."""
        ps = self.page_size
        pos = torch.arange(start, end)
        table = torch.tensor(self.tables[req], dtype=torch.int64)
        return table[pos // ps] * ps + pos % ps

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        for req, table in self.tables.items():
            assert sorted(self.pool.owned_by(req)) == sorted(table), f"host table of {req!r} disagrees with its pool"
