"""The draft KV ring (paper §3.4, eq. 9-10) and an unbounded reference store.

A drafter that reads at most W committed positions plus a block of at most K_max needs, with
page alignment (p rows per page), a ring of

    R_d = ceil((W + p - 1 + K_max) / p) * p        rows per request slot            (eq. 9)

and draft position t of the request in slot i lives at physical row

    phi(i, t) = i * R_d + (t mod R_d)                                               (eq. 10)

Two live positions of one request differ by less than R_d, so they never share a row, and slots
occupy disjoint ranges [i*R_d, (i+1)*R_d) (invariant I6). The allocation is independent of the
target's context length. `DraftKVRing` keeps, per draft layer, K and V tensors
[slots * R_d, kv_heads, head_dim] plus a position tag per row, so every read checks that the
row still holds the position asked for. `DenseDraftKV` is the unbounded reference (tests).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


STALE = "draft ring: a read position is no longer live (window larger than R_d?)"


class RingFull(RuntimeError):
    """Every ring slot is taken; raise the drafter's max_requests or admit fewer requests."""


def ring_rows(window: int, page: int, k_max: int) -> int:
    """R_d of eq. 9: ceil((W + p - 1 + K_max) / p) * p. W 2048, p 64, K_max 8 -> 2176."""
    for name, v in (("window", window), ("page", page), ("k_max", k_max)):
        if v < 1:
            raise ValueError(f"ring_rows: {name} must be >= 1, got {v}")
    return math.ceil((window + page - 1 + k_max) / page) * page


class RingAllocator:
    """Hands each request one slot i with the row range [i*R_d, (i+1)*R_d)."""

    def __init__(self, num_slots: int, rows_per_slot: int) -> None:
        if num_slots < 1 or rows_per_slot < 1:
            raise ValueError(f"RingAllocator needs num_slots >= 1 and rows_per_slot >= 1, got {num_slots}, {rows_per_slot}")
        self.num_slots, self.rows_per_slot = num_slots, rows_per_slot
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._slot: dict[object, int] = {}

    @property
    def total_rows(self) -> int:
        return self.num_slots * self.rows_per_slot

    def alloc(self, owner: object) -> int:
        """The owner's slot (allocated on first call)."""
        if owner in self._slot:
            return self._slot[owner]
        if not self._free:
            raise RingFull(f"draft KV ring: all {self.num_slots} slots are in use; raise max_requests")
        self._slot[owner] = slot = self._free.pop()
        return slot

    def free(self, owner: object) -> None:
        slot = self._slot.pop(owner, None)
        if slot is not None:
            self._free.append(slot)

    def slot_of(self, owner: object) -> int:
        if owner not in self._slot:
            raise KeyError(f"draft KV ring: request {owner!r} has no slot; admit it first")
        return self._slot[owner]

    def slot_range(self, slot: int) -> range:
        return range(slot * self.rows_per_slot, (slot + 1) * self.rows_per_slot)

    def phi(self, slot: int, t: int) -> int:
        """Physical row of draft position t in slot `slot` (eq. 10)."""
        return slot * self.rows_per_slot + t % self.rows_per_slot

    def rows(self, slot: int, positions: torch.Tensor) -> torch.Tensor:
        """positions [n] int64 -> rows [n] int64 (eq. 10, vectorised)."""
        return slot * self.rows_per_slot + torch.remainder(positions, self.rows_per_slot)

    def rows_batch(self, slots: list[int], positions: list[torch.Tensor]) -> torch.Tensor:
        """`rows` of positions[i] in slots[i] for every i, concatenated, in one pass."""
        pos = torch.cat(positions)
        # each position's slot offset as a host list, copied non-blocking: no stream sync (a pageable
        # `torch.tensor(..., device=cuda)` waits for the queue) and no CPU repeat_interleave, which forks
        # torch's thread pool for a few dozen rows (1.9-3.6 ms a round on the H100 host, session 45)
        first = torch.tensor([s * self.rows_per_slot for s, p in zip(slots, positions) for _ in range(p.numel())],
                             dtype=torch.int64).to(pos.device, non_blocking=True)
        return first + torch.remainder(pos, self.rows_per_slot)

    def check_integrity(self) -> None:
        used = set(self._slot.values())
        assert len(used) == len(self._slot), "draft ring: a slot is owned twice"
        assert not used & set(self._free), "draft ring: a slot is free and owned"
        assert len(used) + len(self._free) == self.num_slots, "draft ring: slots lost"


class ContextKV(Protocol):
    """Per-request storage of a drafter's context K/V, per draft layer."""

    def admit(self, owner: object) -> int: ...
    def release(self, owner: object) -> None: ...
    def write(self, slot: int, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def write_batch(self, slots: list[int], layer: int, positions: list[torch.Tensor], k: torch.Tensor,
                    v: torch.Tensor) -> None: ...
    def write_layers(self, slots: list[int], positions: list[torch.Tensor],
                     kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None: ...
    def read(self, slot: int, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def read_layers(self, slots: list[int], positions: torch.Tensor,
                    valid: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]: ...


class DraftKVRing:
    """Window ring: per draft layer K and V [slots * R_d, kv_heads, head_dim] (2 * layers tensors)."""

    def __init__(self, num_layers: int, num_slots: int, rows_per_slot: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.alloc = RingAllocator(num_slots, rows_per_slot)
        shape = (self.alloc.total_rows, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.tags = torch.full((num_layers, self.alloc.total_rows), -1, dtype=torch.int64, device=device)

    def device_bytes(self) -> int:
        """Device bytes of the whole ring (every slot, K, V and position tags)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v) + self.tags.numel() * self.tags.element_size()

    def bytes_per_slot(self) -> int:
        """Device bytes one request slot holds across all draft layers' K and V."""
        per_row = sum(t[0].numel() * t.element_size() for t in self.k + self.v)
        return per_row * self.alloc.rows_per_slot

    def admit(self, owner: object) -> int:
        slot = self.alloc.alloc(owner)
        span = self.alloc.slot_range(slot)
        self.tags[:, span.start:span.stop] = -1
        return slot

    def release(self, owner: object) -> None:
        self.alloc.free(owner)

    def write(self, slot: int, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """positions [n] int64; k, v [n, kv_heads, head_dim]. At most R_d positions per call."""
        self.write_batch([slot], layer, [positions], k, v)

    def write_batch(self, slots: list[int], layer: int, positions: list[torch.Tensor], k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """`write` of several slots at once: positions[i] [n_i] go to slots[i]; k, v [sum n_i, kv_heads,
        head_dim] in that order (one indexed store per tensor). At most R_d positions a slot."""
        rows, pos = self._rows_for(slots, positions)
        self.k[layer][rows] = k.to(self.k[layer].dtype)
        self.v[layer][rows] = v.to(self.v[layer].dtype)
        self.tags[layer][rows] = pos

    def write_layers(self, slots: list[int], positions: list[torch.Tensor],
                     kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """`write_batch` of every draft layer at once: kv[layer] = (k, v) [sum n_i, kv_heads, head_dim].
        The rows are computed once on the host and copied over once; one tag store for all layers."""
        rows, pos = self._rows_for(slots, positions)
        for layer, (k, v) in enumerate(kv):
            self.k[layer][rows] = k.to(self.k[layer].dtype)
            self.v[layer][rows] = v.to(self.v[layer].dtype)
        self.tags[:len(kv), rows] = pos

    def _rows_for(self, slots: list[int], positions: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, positions) [sum n_i] on the ring's device for positions[i] of slots[i] (eq. 10),
        computed where the positions are (the host, from the drafter) and moved in one copy each."""
        for pos in positions:
            if pos.numel() > self.alloc.rows_per_slot:
                raise ValueError(f"draft ring: {pos.numel()} positions in one write exceed R_d={self.alloc.rows_per_slot}")
        if len(positions) == 1:
            pos, rows = positions[0], self.alloc.rows(slots[0], positions[0])
        else:
            pos, rows = torch.cat(positions), self.alloc.rows_batch(slots, positions)
        dev = self.tags.device
        return rows.to(dev), pos.to(dev)

    def read(self, slot: int, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] -> (k, v) [n, kv_heads, head_dim]; raises if a row was overwritten (I6)."""
        rows = self.alloc.rows(slot, positions.to(self.tags.device))
        if not torch.equal(self.tags[layer][rows], positions.to(self.tags.device)):
            raise RuntimeError(STALE)
        return self.k[layer][rows], self.v[layer][rows]

    def rows_of(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """slots [N] int64, positions [N, L] int64 (one device) -> physical rows [N, L] (eq. 10)."""
        return slots[:, None] * self.alloc.rows_per_slot + torch.remainder(positions, self.alloc.rows_per_slot)

    def stale(self, rows: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """A device bool scalar, no host sync: does any valid entry's row hold another position in
        some layer (I6 broken: a window larger than R_d)? rows / positions / valid [N, L]. One check
        for every layer (layers are written together), read once a round by the drafter."""
        return ((self.tags[:, rows] != positions[None]) & valid[None]).any()

    def read_layers(self, slots: list[int], positions: torch.Tensor,
                    valid: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Every draft layer's K/V at positions [N, L] int64 of slots [N] (padding anywhere valid
        [N, L] is False; host or device tensors) -> `window` of them on the ring's device."""
        dev = self.tags.device
        return self.window(torch.tensor(slots, dtype=torch.int64, device=dev), positions.to(dev), valid.to(dev))

    def window(self, slots: torch.Tensor, positions: torch.Tensor,
               valid: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """slots [N], positions / valid [N, L] on the ring's device -> ([(k, v) [N, L, kv_heads, d]
        per layer], stale: a device bool scalar not yet read, see `stale`). Padded entries hold
        arbitrary rows. One gather a tensor, no host sync: a CUDA graph can capture it
        (spec/dflash_graphs.py)."""
        rows = self.rows_of(slots, positions)
        return [(k[rows], v[rows]) for k, v in zip(self.k, self.v)], self.stale(rows, positions, valid)


class DenseDraftKV:
    """Unbounded reference store: every position ever written stays readable (no ring)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._slots: dict[object, int] = {}
        self._data: dict[int, list[dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}

    def device_bytes(self) -> int:
        """Bytes of every stored row (it grows with the histories: a test reference)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for layers in self._data.values() for rows in layers for k, v in rows.values())

    def admit(self, owner: object) -> int:
        if owner not in self._slots:
            slot = max(self._slots.values(), default=-1) + 1
            self._slots[owner] = slot
            self._data[slot] = [dict() for _ in range(self.num_layers)]
        return self._slots[owner]

    def release(self, owner: object) -> None:
        slot = self._slots.pop(owner, None)
        self._data.pop(slot, None)

    def write(self, slot: int, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        store = self._data[slot][layer]
        for i, t in enumerate(positions.tolist()):
            store[t] = (k[i].clone(), v[i].clone())

    def write_batch(self, slots: list[int], layer: int, positions: list[torch.Tensor], k: torch.Tensor,
                    v: torch.Tensor) -> None:
        a = 0
        for slot, pos in zip(slots, positions):
            self.write(slot, layer, pos, k[a : a + pos.numel()], v[a : a + pos.numel()])
            a += pos.numel()

    def write_layers(self, slots: list[int], positions: list[torch.Tensor],
                     kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in enumerate(kv):
            self.write_batch(slots, layer, positions, k, v)

    def read(self, slot: int, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        store = self._data[slot][layer]
        pairs = [store[t] for t in positions.tolist()]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def read_layers(self, slots: list[int], positions: torch.Tensor,
                    valid: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Same contract as DraftKVRing.read_layers; a position never written raises KeyError here."""
        return [self.read_batch(slots, l, positions, valid) for l in range(self.num_layers)], torch.tensor(False)

    def read_batch(self, slots: list[int], layer: int, positions: torch.Tensor,
                   valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of `read_layers` (padded entries are zeros here; a missing position raises
        KeyError)."""
        k0, _ = next(row for s in slots for row in self._data[s][layer].values())
        k = torch.zeros(positions.shape + k0.shape, dtype=k0.dtype, device=k0.device)
        v = torch.zeros_like(k)
        for i, slot in enumerate(slots):
            keep = valid[i].nonzero()[:, 0]
            if keep.numel():
                k[i, keep], v[i, keep] = self.read(slot, layer, positions[i, keep])
        return k, v
