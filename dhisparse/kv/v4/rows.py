"""Where DeepSeek-V4's emitted compressed rows live: the `RowStore` protocol and a dense store.

A V4 layer with a compressor emits one row per complete window of m tokens:

    kind "kv"     compressed KV rows      [n_rows, head_dim]        (CSA and HCA layers)
    kind "index"  compressed index keys   [n_rows, index_head_dim]  (CSA layers, the indexer's)

Rows are append-only per (request, layer, kind) and only ever cut from the end (rollback of a
rejected draft). Attention never sees the whole store: it asks `locate(selection)` for the rows a
selection of row ids picks, exactly like `KVContext.locate` for latent rows, so the hierarchy can
later serve compressed rows from its tiers behind the same call:

    selection [T, k]  row ids w of each token's own request (-1 = none)
        -> rows [P, per_page, d] (a paged row space), loc [T, k] flat locations (-1 where -1)
           rows[loc // per_page, loc % per_page] is row selection[t, i] of token t's request

The indexer scores every index key of a request, so `read(.., "index")` returns them all (they
are small: 128 values per m tokens).

Under `--kv-cache-dtype fp8_e4m3` rows are stored in their FP8 format (core/kvformat.py: 584-B
compressed rows, 132-B index keys), encoded once on `append`; `read` decodes, `locate` returns the
stored rows and `row_format(kind)` says how to read them.
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence

import torch

from dhisparse.core.kvformat import KVFormats, RowFormat

KINDS = ("kv", "index")


class RowStore(Protocol):
    """Compressed rows of all requests; `rid` is the request's key (any hashable)."""

    def append(self, rid: Hashable, layer: int, kind: str, rows: torch.Tensor) -> None:
        """Append rows [n, d] after the existing ones."""
        ...

    def count(self, rid: Hashable, layer: int, kind: str) -> int:
        ...

    def read(self, rid: Hashable, layer: int, kind: str) -> torch.Tensor:
        """All rows [count, d] of one request (index keys for scoring; tests)."""
        ...

    def truncate(self, rid: Hashable, layer: int, kind: str, n: int) -> None:
        """Keep the first n rows (rollback)."""
        ...

    def locate(
        self, layer: int, kind: str, rids: Sequence[Hashable], req_idx: torch.Tensor, selection: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """selection [T, k] row ids of request rids[req_idx[t]] -> (rows [P, per_page, d], loc [T, k])."""
        ...

    def drop(self, rid: Hashable) -> None:
        ...

    def row_format(self, kind: str) -> RowFormat | None:
        """How `locate` returns rows of `kind` (None: plain model-dtype rows)."""
        ...


class DenseRowStore:
    """One growing tensor per (request, layer, kind); `locate` concatenates the batch's requests
    into a single page. The reference store (tests, parity), not a memory-efficient one."""

    def __init__(self, widths: dict[str, int], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 formats: KVFormats | None = None):
        """widths: model values per row of each kind; formats: FP8 formats of "kv" (latent) and
        "index" rows (None: plain rows of `dtype`)."""
        self.widths, self.device, self.dtype = dict(widths), torch.device(device), dtype
        self.formats = {k: RowFormat.plain(w, dtype) for k, w in self.widths.items()}
        if formats is not None:
            self.formats.update({"kv": formats.latent, "index": formats.index})
        self.rows: dict[tuple[Hashable, int, str], torch.Tensor] = {}

    def _empty(self, kind: str) -> torch.Tensor:
        f = self.formats[kind]
        return torch.empty(0, f.width, device=self.device, dtype=f.storage_dtype)

    def row_format(self, kind: str) -> RowFormat | None:
        f = self.formats[kind]
        return f if f.fp8 else None

    def append(self, rid: Hashable, layer: int, kind: str, rows: torch.Tensor) -> None:
        """rows [n, d] model values, encoded in the kind's format."""
        if rows.shape[-1] != self.widths[kind]:
            raise ValueError(f"{kind} rows of layer {layer}: width {rows.shape[-1]} != {self.widths[kind]}")
        key = (rid, layer, kind)
        self.rows[key] = torch.cat([self.rows.get(key, self._empty(kind)), self.formats[kind].encode(rows)])

    def count(self, rid: Hashable, layer: int, kind: str) -> int:
        t = self.rows.get((rid, layer, kind))
        return 0 if t is None else int(t.shape[0])

    def stored(self, rid: Hashable, layer: int, kind: str) -> torch.Tensor:
        """All rows [count, W] of one request as stored (FP8 bytes or plain rows): what a prefix exports."""
        return self.rows.get((rid, layer, kind), self._empty(kind))

    def put_stored(self, rid: Hashable, layer: int, kind: str, rows: torch.Tensor) -> None:
        """A request's rows [n, W], already in the kind's stored format (a prefix import: bytes unchanged)."""
        f = self.formats[kind]
        if rows.dtype != f.storage_dtype or rows.shape[1:] != (f.width,):
            raise ValueError(f"stored {kind} rows of layer {layer}: {rows.dtype} x {tuple(rows.shape[1:])}, the store "
                             f"keeps {f.storage_dtype} x ({f.width},) (another --kv-cache-dtype?)")
        self.rows[(rid, layer, kind)] = rows.to(self.device, non_blocking=True)

    def read(self, rid: Hashable, layer: int, kind: str) -> torch.Tensor:
        """All rows [count, d] of one request, decoded."""
        return self.formats[kind].decode(self.rows.get((rid, layer, kind), self._empty(kind)))

    def truncate(self, rid: Hashable, layer: int, kind: str, n: int) -> None:
        key = (rid, layer, kind)
        if key in self.rows:
            self.rows[key] = self.rows[key][:n]

    def locate(
        self, layer: int, kind: str, rids: Sequence[Hashable], req_idx: torch.Tensor, selection: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.rows.get((r, layer, kind), self._empty(kind)) for r in rids]  # stored rows
        sizes = torch.tensor([0] + [p.shape[0] for p in parts[:-1]], dtype=torch.int64, device=selection.device)
        loc = sizes.cumsum(0)[req_idx][:, None] + selection
        return torch.cat(parts)[None], torch.where(selection >= 0, loc, torch.full_like(loc, -1))

    def drop(self, rid: Hashable) -> None:
        for key in [k for k in self.rows if k[0] == rid]:
            del self.rows[key]
