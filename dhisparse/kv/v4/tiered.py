"""`TieredRows`: the `RowStore` of the hierarchical V4 presets.

Rows of tiered (source layer, kind) keys - CSA sources' compressed KV rows and index keys - are
written by the pass straight into the row hierarchy (`kv/v4/hier_pass.py`), so this store only
counts them per request (what `V4RequestState` needs for its causality checks and exact
rollback: `truncate` cuts the count, the next pass overwrites the dropped tail rows). Every other
key (HCA rows) is delegated to a `DenseRowStore`: required device state.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from dhisparse.kv.v4.rows import DenseRowStore
from dhisparse.kv.v4.state import StateError


class TieredRows:
    def __init__(self, tiered_layers: set[int], dense: DenseRowStore) -> None:
        self.tiered, self.dense = set(tiered_layers), dense
        self.counts: dict[tuple[Hashable, int, str], int] = {}

    def append(self, rid: Hashable, layer: int, kind: str, rows: torch.Tensor) -> None:
        """Tiered: count rows [n, d] the pass already wrote to the hierarchy; else store them."""
        if layer not in self.tiered:
            return self.dense.append(rid, layer, kind, rows)
        key = (rid, layer, kind)
        self.counts[key] = self.counts.get(key, 0) + int(rows.shape[0])

    def count(self, rid: Hashable, layer: int, kind: str) -> int:
        if layer not in self.tiered:
            return self.dense.count(rid, layer, kind)
        return self.counts.get((rid, layer, kind), 0)

    def set_count(self, rid: Hashable, layer: int, kind: str, n: int) -> None:
        """A tiered key now holds n rows (a prefix import wrote them to the hierarchy)."""
        if layer not in self.tiered:
            raise StateError(f"layer {layer} is not tiered: its rows are stored, not counted")
        self.counts[(rid, layer, kind)] = n

    def read(self, rid: Hashable, layer: int, kind: str) -> torch.Tensor:
        if layer in self.tiered:
            raise StateError(f"rows of tiered source layer {layer} are read through the pass (index_keys / locate)")
        return self.dense.read(rid, layer, kind)

    def truncate(self, rid: Hashable, layer: int, kind: str, n: int) -> None:
        if layer not in self.tiered:
            return self.dense.truncate(rid, layer, kind, n)
        key = (rid, layer, kind)
        if key in self.counts:
            self.counts[key] = min(self.counts[key], n)

    def locate(self, layer: int, kind: str, rids: Sequence[Hashable], req_idx: torch.Tensor, selection: torch.Tensor):
        if layer in self.tiered:
            raise StateError(f"rows of tiered source layer {layer} are located by the pass's resolver")
        return self.dense.locate(layer, kind, rids, req_idx, selection)

    def row_format(self, kind: str):
        """The format of the dense rows (the hierarchy's arena holds the tiered ones in the same)."""
        return self.dense.row_format(kind)

    def drop(self, rid: Hashable) -> None:
        self.dense.drop(rid)
        for key in [k for k in self.counts if k[0] == rid]:
            del self.counts[key]
