"""Device mirrors of per-request page lists, indexed by request slot.

The hierarchy keeps two page lists per request on the host (its host pages and its index pages);
kernels and replayed step graphs read them as `[S, width]` int64 device tables. A list only grows
while its request lives, so a sync sends only the entries added since the last one, for every
slot of a pass in one staged copy (no device sync): O(new pages) host work a step instead of
re-sending whole tables.

    table[slot]   | synced entries (known[slot]) | entries added since | stale or -1 ... |

A freed slot's row is reset to -1, so its next owner never reads the previous owner's pages. A
list longer than the table reallocates it at twice the size: the address changes, which is why
step graphs key on `fingerprint()`.
"""

from __future__ import annotations

from typing import Iterable

import torch


class SlotTable:
    """[S, width] int64 device table of page lists (-1: no page), synced incrementally."""

    def __init__(self, slots: int, device: torch.device | str, width: int = 1) -> None:
        self.device = device
        self.t = torch.full((slots, max(1, width)), -1, dtype=torch.int64, device=device)
        self.known = [0] * slots  # entries of each row that mirror the slot's list

    def sync(self, lists: Iterable[tuple[int, list[int]]]) -> None:
        """Bring the rows of (slot, page list) pairs up to date (entries past `known` only)."""
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        for slot, pages in lists:
            k = self.known[slot]
            if len(pages) > k:
                rows.extend([slot] * (len(pages) - k))
                cols.extend(range(k, len(pages)))
                vals.extend(pages[k:])
                self.known[slot] = len(pages)
        if not vals:
            return
        if max(cols) >= self.t.shape[1]:  # a list outgrew the table: reallocate
            grown = torch.full((self.t.shape[0], 2 * (max(cols) + 1)), -1, dtype=torch.int64, device=self.device)
            grown[:, : self.t.shape[1]] = self.t
            self.t = grown
        packed = torch.tensor([rows, cols, vals], dtype=torch.int64).to(self.device, non_blocking=True)
        self.t[packed[0], packed[1]] = packed[2]

    def reset(self, slot: int) -> None:
        """The slot was freed: its row holds no pages until the next owner syncs."""
        self.known[slot] = 0
        self.t[slot] = -1

    def fingerprint(self) -> tuple:
        """What a captured graph bakes in: the table's address and shape."""
        return (self.t.data_ptr(), tuple(self.t.shape))

    def locations(self, slots_t: torch.Tensor, lens_t: torch.Tensor, W: int, per_page: int) -> torch.Tensor:
        """[N, W] row locations of positions 0..W-1 of the lists in slots `slots_t` [N] (per_page
        rows a page; -1 at and past lens_t [N]): device ops only, so a step graph computes them in
        the graph.

            position p  ->  table[slot, p // per_page] * per_page + p % per_page
        """
        pos = torch.arange(W, device=self.device)
        col = (pos // per_page).clamp(max=self.t.shape[1] - 1)
        loc = self.t[slots_t][:, col] * per_page + pos % per_page
        return torch.where(pos[None, :] < lens_t[:, None], loc, -1)
