"""`LatentRing`: the MTP drafter's window-bounded KV ring of MLA latent rows (eq. 9-10).

The MTP layer attends like a target layer: its cache row at position p is one MLA latent
[kv_lora_rank + qk_rope_head_dim] (normalized c_kv | roped k_pe), shared by every head, so a ring
slot holds R_d such rows (no separate V, unlike `DraftKVRing`'s K / V pairs). Slots, rows and
addresses come from `spec/ring.py` (`RingAllocator`, `phi(i, t) = i * R_d + t mod R_d`), and every
row carries its position tag, so a read of a row that no longer holds the asked position raises
(invariant I6).
"""

from __future__ import annotations

import torch

from dhisparse.spec.ring import RingAllocator


class LatentRing:
    """rows [slots * R_d, width] in the drafter's dtype; tags [slots * R_d] int64 (-1 = empty)."""

    def __init__(self, num_slots: int, rows_per_slot: int, width: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.alloc = RingAllocator(num_slots, rows_per_slot)
        self.rows = torch.zeros(self.alloc.total_rows, width, dtype=dtype, device=device)
        self.tags = torch.full((self.alloc.total_rows,), -1, dtype=torch.int64, device=device)

    def device_bytes(self) -> int:
        """Device bytes of the whole ring (every slot's rows and position tags)."""
        return self.rows.numel() * self.rows.element_size() + self.tags.numel() * self.tags.element_size()

    def bytes_per_slot(self) -> int:
        """Device bytes one request slot holds: its R_d latent rows and their position tags."""
        per_row = self.rows.shape[1] * self.rows.element_size() + self.tags.element_size()
        return per_row * self.alloc.rows_per_slot

    def admit(self, owner: object) -> int:
        slot = self.alloc.alloc(owner)
        span = self.alloc.slot_range(slot)
        self.tags[span.start:span.stop] = -1
        return slot

    def release(self, owner: object) -> None:
        self.alloc.free(owner)

    def write(self, slot: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """positions [n] int64, rows [n, width]; at most R_d positions per call."""
        if positions.numel() > self.alloc.rows_per_slot:
            raise ValueError(f"MTP ring: {positions.numel()} positions in one write exceed R_d={self.alloc.rows_per_slot}")
        pos = positions.to(self.tags.device)
        at = self.alloc.rows(slot, pos)
        self.rows[at] = rows.to(self.rows.dtype)
        self.tags[at] = pos

    def read_batch(self, slots: list[int], positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """positions [N, L] int64 (padding anywhere valid is False) -> rows [N, L, width]; padded
        entries hold arbitrary rows. Raises if a valid entry's row was overwritten (I6)."""
        dev = self.tags.device
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)[:, None]
        pos, ok = positions.to(dev), valid.to(dev)
        at = slot_t * self.alloc.rows_per_slot + torch.remainder(pos, self.alloc.rows_per_slot)
        if not bool(((self.tags[at] == pos) | ~ok).all()):
            raise RuntimeError("MTP ring: a read position is no longer live (window larger than R_d?)")
        return self.rows[at]
