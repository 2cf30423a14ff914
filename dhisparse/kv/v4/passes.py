"""`V4Pass`: the view of the V4 streaming state that one model pass works through.

The pass runs over a flattened `ForwardBatch` (request r owns tokens query_start[r]:query_start[r+1],
positions states[r].length ..). Each layer calls, in order:

1. `window(layer, kv)`: stores this pass's post-RoPE KV rows in the requests' window tails and
   returns the sliding-window row space (last W positions per token, self included);
2. `feed(layer, kind, raw)`: appends raw compressor inputs [kv | gate] and returns, per request,
   the raw slices of the windows this pass completes (`PendingWindows`);
   `append_rows(layer, kind, req, rows)` stores the rows the module pooled from them;
3. `index_keys(layer, req)` (CSA) and `locate(layer, "kv", selection)`: the compressed rows;
   `layer` is the *source* layer (`V4Config.source_of`); a "reuse" layer calls `reuse(source)`
   and gets the latest row space `locate` returned for that source in this pass (same rows, same
   locations, no second lookup).

`finish()` advances every request by its token count (and auto-commits). `V4Cache` owns the
RowStore, hands out request states and begins passes.

Window row space of request r (W = 4 shown), new tokens at positions L.. L+S-1:

    held tail:  [ L-3  L-2  L-1 ] ++ new: [ L  L+1  ... ]     = src_r, base_r = L-3
    token at p sees positions p-3 .. p  ->  loc = offset_r + (pos - base_r), -1 where pos < base_r
"""

from __future__ import annotations

from typing import Hashable, NamedTuple

import torch

from dhisparse.core.batch import ForwardBatch
from dhisparse.core.kvformat import KVFormats, RowFormat
from dhisparse.kv.v4.rows import DenseRowStore, RowStore
from dhisparse.kv.v4.state import StateError, V4RequestState
from dhisparse.core.v4_config import V4Config


class LocatedRows(NamedTuple):
    """rows [P, per_page, W] (or a tuple of row spaces, SPACE-encoded locations) and loc [T, k]
    flat locations into it (-1 = no row): what attention reads for a window or a selection; fmt:
    the rows' RowFormat (core/kvformat.py; None: plain rows of width d)."""

    rows: torch.Tensor
    loc: torch.Tensor
    fmt: RowFormat | None = None


class PendingWindows(NamedTuple):
    """Windows first .. first+count-1 of batch row `req`, complete after this pass.

    raw [(count + prev) * m, width] = raw [kv | gate] inputs of the windows in order; when `prev`
    the slice starts one window earlier (window first-1, whose Ca half CSA row `first` pools).
    """

    req: int
    first: int
    count: int
    raw: torch.Tensor
    prev: bool


class V4Pass:
    def __init__(self, batch: ForwardBatch, states: list[V4RequestState], store: RowStore) -> None:
        if len(states) != batch.num_reqs:
            raise StateError(f"{len(states)} states for a batch of {batch.num_reqs} requests")
        if any(s.store is not store for s in states):
            raise StateError("every request state of a pass must keep its rows in the pass's RowStore")
        self.batch, self.states, self.store = batch, states, store
        self.last: dict[int, LocatedRows] = {}  # source layer -> latest located selection (reuse)
        self.rids = [s.rid for s in states]
        self.spans = [(batch.query_start[r], batch.query_start[r + 1]) for r in range(batch.num_reqs)]
        for r, (a, b) in enumerate(self.spans):
            if b > a and int(batch.positions[a]) != states[r].length:
                raise StateError(
                    f"request {states[r].rid!r}: pass starts at position {int(batch.positions[a])}, "
                    f"state holds {states[r].length} tokens"
                )

    def window(self, layer: int, kv: torch.Tensor) -> LocatedRows:
        """kv [T, D] post-RoPE rows of this pass -> LocatedRows(rows [1, sum src_r, D], loc [T, W])."""
        W = self.states[0].cfg.sliding_window if self.states else 1
        parts, base, offset, n = [], [], [], 0
        for r, (a, b) in enumerate(self.spans):
            st, tail = self.states[r], self.states[r].layers[layer].window
            lo = max(0, st.length - (W - 1))
            held = tail.span(lo, st.length)
            parts += [held, kv[a:b].to(held.dtype)]
            base.append(lo)
            offset.append(n)
            n += held.shape[0] + (b - a)
            tail.append(st.length, kv[a:b])
        dev = kv.device
        req = self.batch.req_idx
        base_t = torch.tensor(base, dtype=torch.int64, device=dev)[req]
        off_t = torch.tensor(offset, dtype=torch.int64, device=dev)[req]
        pos = self.batch.positions[:, None] - (W - 1) + torch.arange(W, device=dev)[None, :]
        loc = torch.where(pos >= base_t[:, None], off_t[:, None] + pos - base_t[:, None], torch.full_like(pos, -1))
        rows = torch.cat(parts) if parts else kv.new_empty(0, kv.shape[-1])
        return LocatedRows(rows[None], loc)

    def feed(self, layer: int, kind: str, raw: torch.Tensor) -> list[PendingWindows]:
        """raw [T, width] compressor inputs -> windows completed in this pass, per request."""
        out = []
        for r, (a, b) in enumerate(self.spans):
            st = self.states[r]
            ls = st.layers[layer]
            tail = ls.kv_raw if kind == "kv" else ls.idx_raw
            tail.append(st.length, raw[a:b])
            n0, n1 = st.length // ls.m, (st.length + b - a) // ls.m
            if st.rows(layer, kind) != n0:
                raise StateError(f"layer {layer} {kind}: store holds {st.rows(layer, kind)} rows, expected {n0}")
            if n1 > n0:
                prev = ls.overlap and n0 > 0
                out.append(PendingWindows(r, n0, n1 - n0, tail.span((n0 - prev) * ls.m, n1 * ls.m), prev))
        return out

    def append_rows(self, layer: int, kind: str, req: int, rows: torch.Tensor) -> None:
        self.store.append(self.rids[req], layer, kind, rows)

    def row_counts(self, layer: int, kind: str) -> list[int]:
        """Rows held per batch row (after this pass's emissions)."""
        return [self.store.count(rid, layer, kind) for rid in self.rids]

    def index_keys(self, layer: int, req: int) -> torch.Tensor:
        """[n_rows, index_head_dim] index keys of batch row `req`."""
        return self.store.read(self.rids[req], layer, "index")

    def locate(self, layer: int, kind: str, selection: torch.Tensor) -> LocatedRows:
        """selection [T, k] compressed row ids (-1 = none) -> LocatedRows."""
        rows, loc = self.store.locate(layer, kind, self.rids, self.batch.req_idx, selection)
        self.last[layer] = LocatedRows(rows, loc, self.store.row_format(kind))
        return self.last[layer]

    def reuse(self, source: int) -> LocatedRows:
        """The latest LocatedRows `locate` returned for `source` in this pass (a "reuse" layer's input)."""
        if source not in self.last:
            raise StateError(f"no selection was located on source layer {source} before its reuse consumer")
        return self.last[source]

    def finish(self) -> None:
        for r, (a, b) in enumerate(self.spans):
            self.states[r].advance(b - a)


class V4Cache:
    """Owns a RowStore and hands out request states; `begin(batch, states)` starts a pass."""

    def __init__(self, cfg: V4Config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 store: RowStore | None = None, formats: KVFormats | None = None) -> None:
        """formats: the compressed rows' formats of the default dense store (None: plain)."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.store = store or DenseRowStore({"kv": cfg.head_dim, "index": cfg.index_head_dim}, device, dtype, formats)

    def new_request(self, rid: Hashable, auto_commit: bool = True) -> V4RequestState:
        return V4RequestState(self.cfg, rid, self.store, self.device, self.dtype, auto_commit)

    def begin(self, batch: ForwardBatch, states: list[V4RequestState]) -> "V4Pass":
        """Start a pass: batch row r belongs to states[r]."""
        return V4Pass(batch, states, self.store)
