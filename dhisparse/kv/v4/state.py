"""Per-request streaming state of DeepSeek-V4 attention, kept outside the modules.

Per request and layer a `V4RequestState` holds three `TokenTail`s (recent rows by position):

    window   post-RoPE KV rows [*, head_dim]                      every layer (sliding branch)
    kv_raw   raw main-compressor inputs [*, 2w] = [kv | gate]     CSA / HCA layers (w = 2d CSA, d HCA)
    idx_raw  raw indexer-compressor inputs [*, 2w]                CSA layers (w = 2 * index_head_dim)

and its emitted compressed rows live in a `RowStore` (`kv/v4/rows.py`) shared by all requests.
Compressor windows (m = 4 shown) and what the tails keep after `commit(c)`:

    position  0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 14
    window      w = 0    |   w = 1    |   w = 2    | partial: no row yet, seen via the window
    row w exists once (w+1)*m <= length; query t may use row w iff (w+1)*m <= t+1
    CSA row w pools [Ca of window w-1 | Cb of window w]; HCA row w pools window w only
    kv_raw / idx_raw keep positions >= (c//m - 1)*m (CSA) or (c//m)*m (HCA); window keeps >= c-W+1

So `rollback(p)` for any committed <= p <= length is exact without recomputation: the tails are cut
to p, rows to p // m, and the streaming buffer (< m tokens) and CSA overlap (the Ca half of the
last complete window) are re-read from the raw tail. `snapshot()` / `restore()` give the same by
reference (tail tensors are never written in place). With `auto_commit` (the default, no
speculation) every pass commits its tokens, so the tails stay O(W + 2m) rows per layer.
`adopt(n, layers)` starts a fresh state at n committed tokens from an imported prefix's tails
(kv/v4/prefix.py): the only way to enter a state above position 0 without running the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable, NamedTuple, Sequence

import torch

from dhisparse.kv.v4.rows import RowStore
from dhisparse.core.v4_config import CSA, SLIDING, V4Config


class StateError(ValueError):
    """An operation the streaming state cannot do exactly (positions out of order, stale snapshot)."""


@dataclass
class TokenTail:
    """rows [n, w] holding positions [start, start + n)."""

    start: int
    rows: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + int(self.rows.shape[0])

    def append(self, pos: int, x: torch.Tensor) -> None:
        if pos != self.end:
            raise StateError(f"tail ends at position {self.end}, cannot append at {pos}")
        self.rows = torch.cat([self.rows, x.to(self.rows.dtype)])

    def span(self, a: int, b: int) -> torch.Tensor:
        """rows of positions [a, b); they must still be held."""
        if a < self.start or b > self.end:
            raise StateError(f"positions [{a}, {b}) not held (tail holds [{self.start}, {self.end}))")
        return self.rows[a - self.start : b - self.start]

    def trim(self, keep_from: int) -> None:
        keep_from = min(max(keep_from, self.start), self.end)
        self.rows, self.start = self.rows[keep_from - self.start :], keep_from

    def truncate(self, end: int) -> None:
        if end < self.start:
            raise StateError(f"cannot cut the tail to position {end}: it starts at {self.start}")
        self.rows = self.rows[: max(0, end - self.start)]


@dataclass
class LayerState:
    """window always; kv_raw on CSA / HCA layers; idx_raw on CSA layers. m = compress rate (0 = none)."""

    window: TokenTail
    m: int = 0
    overlap: bool = False
    kv_raw: TokenTail | None = None
    idx_raw: TokenTail | None = None

    def raws(self) -> list[tuple[str, TokenTail]]:
        return [(k, t) for k, t in (("kv", self.kv_raw), ("index", self.idx_raw)) if t is not None]

    def copy(self) -> "LayerState":
        tail = lambda t: None if t is None else TokenTail(t.start, t.rows)  # noqa: E731
        return replace(self, window=tail(self.window), kv_raw=tail(self.kv_raw), idx_raw=tail(self.idx_raw))


class CompressorView(NamedTuple):
    """The streaming state in transformers' cache terms, read from the raw tail (no position_bias):
    buffer_kv / buffer_gate [length % m, width] tokens of the open window; overlap_kv / overlap_gate
    [m, width / 2] the Ca half of the last complete window (CSA with >= 1 row; else None)."""

    buffer_kv: torch.Tensor
    buffer_gate: torch.Tensor
    overlap_kv: torch.Tensor | None
    overlap_gate: torch.Tensor | None


@dataclass(frozen=True)
class V4Snapshot:
    """A restorable copy (by reference) of one request's state."""

    length: int
    committed: int
    layers: tuple[LayerState, ...]
    counts: dict[tuple[int, str], int]
    seq: int


class V4RequestState:
    """Streaming state of one request. `length` = tokens consumed by every layer."""

    def __init__(self, cfg: V4Config, rid: Hashable, store: RowStore, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, auto_commit: bool = True) -> None:
        self.cfg, self.rid, self.store, self.auto_commit = cfg, rid, store, auto_commit
        self.length = self.committed = 0
        self._seq, self._cuts = 0, []  # cuts: (seq, position) of every rollback / restore
        empty = lambda w: TokenTail(0, torch.empty(0, w, device=device, dtype=dtype))  # noqa: E731
        self.layers: list[LayerState] = []
        for i, t in enumerate(cfg.layer_types):
            st = LayerState(empty(cfg.head_dim), cfg.compress_rate(i), t == CSA)
            if t != SLIDING and cfg.produces_rows(i):  # reindex / reuse layers read another layer's rows
                mult = 2 if t == CSA else 1
                st.kv_raw = empty(2 * mult * cfg.head_dim)
                st.idx_raw = empty(4 * cfg.index_head_dim) if t == CSA else None
            self.layers.append(st)

    # ---- queries -------------------------------------------------------------------------------
    def rows(self, layer: int, kind: str = "kv") -> int:
        return self.store.count(self.rid, layer, kind)

    def compressor_view(self, layer: int, kind: str = "kv") -> CompressorView:
        st = self.layers[layer]
        tail = st.kv_raw if kind == "kv" else st.idx_raw
        if tail is None:
            raise StateError(f"layer {layer} has no {kind!r} compressor")
        width, m, n = tail.rows.shape[1] // 2, st.m, self.length
        buf = tail.span(n - n % m, n)
        ov = tail.span((n // m - 1) * m, n // m * m) if st.overlap and n >= m else None
        half = width // 2
        return CompressorView(buf[:, :width], buf[:, width:], None if ov is None else ov[:, :half],
                              None if ov is None else ov[:, width : width + half])

    def keep_from(self, layer: int, pos: int) -> tuple[int, int]:
        """(window, raw) first positions that must be held to resume (or roll back) at `pos`."""
        st = self.layers[layer]
        w = max(0, pos - self.cfg.sliding_window + 1)
        if st.m == 0:
            return w, pos
        return w, max(0, (pos // st.m - (1 if st.overlap else 0)) * st.m)

    # ---- commit / rollback ---------------------------------------------------------------------
    def advance(self, n: int) -> None:
        """Called by the pass after every layer consumed n new tokens."""
        self.length += n
        self._seq += 1
        if self.auto_commit:
            self.commit()

    def commit(self, pos: int | None = None) -> None:
        """Declare positions < pos final (default: everything); drops history no rollback needs."""
        pos = self.length if pos is None else pos
        if not self.committed <= pos <= self.length:
            raise StateError(f"commit({pos}) outside [{self.committed}, {self.length}]")
        self.committed = pos
        for i, st in enumerate(self.layers):
            w, r = self.keep_from(i, pos)
            st.window.trim(w)
            for _, tail in st.raws():
                tail.trim(r)

    def rollback(self, pos: int) -> None:
        """Forget tokens at positions >= pos (committed <= pos <= length), exactly."""
        if not self.committed <= pos <= self.length:
            raise StateError(f"rollback({pos}) outside [committed {self.committed}, length {self.length}]")
        for i, st in enumerate(self.layers):
            st.window.truncate(pos)
            for kind, tail in st.raws():
                tail.truncate(pos)
                self.store.truncate(self.rid, i, kind, pos // st.m)
        self._cut(pos)

    def snapshot(self) -> V4Snapshot:
        counts = {(i, k): self.rows(i, k) for i, st in enumerate(self.layers) for k, _ in st.raws()}
        return V4Snapshot(self.length, self.committed, tuple(s.copy() for s in self.layers), counts, self._seq)

    def restore(self, snap: V4Snapshot) -> None:
        """Return to `snap` exactly; fails if rows it needs were cut (rollback below it) since."""
        if any(seq > snap.seq and pos < snap.length for seq, pos in self._cuts):
            raise StateError("snapshot is stale: the state was rolled back below its length after it was taken")
        for (i, kind), n in snap.counts.items():
            if self.rows(i, kind) < n:
                raise StateError(f"layer {i} {kind} rows were dropped below the snapshot ({n})")
            self.store.truncate(self.rid, i, kind, n)
        self.layers = [s.copy() for s in snap.layers]
        self.length, self.committed = snap.length, snap.committed
        self._cut(snap.length)

    def adopt(self, length: int, layers: Sequence[LayerState]) -> None:
        """Start this fresh state at `length` committed tokens (an imported prefix: kv/v4/prefix.py).

        layers[i]: layer i's tails, ending at `length` and holding at least what `keep_from(i,
        length)` needs (window from max(0, length - W + 1), raws from (length // m - overlap) * m),
        with this state's kinds and widths; the store must already hold length // m rows of every
        (layer, kind) this state compresses. Anything else raises StateError, so an inconsistent
        import is refused, never run. The tails are taken by reference (never written in place)."""
        if self.length or self._seq:
            raise StateError(f"adopt needs a fresh state; this one holds {self.length} tokens")
        if len(layers) != len(self.layers):
            raise StateError(f"{len(layers)} imported layers for a state of {len(self.layers)}")
        for i, (mine, new) in enumerate(zip(self.layers, layers)):
            w, r = self.keep_from(i, length)
            self._check_tail(i, "window", mine.window, new.window, w, length)
            if [k for k, _ in mine.raws()] != [k for k, _ in new.raws()]:
                raise StateError(f"layer {i}: imported compressor tails {[k for k, _ in new.raws()]} != "
                                 f"{[k for k, _ in mine.raws()]}")
            for (kind, a), (_, b) in zip(mine.raws(), new.raws()):
                self._check_tail(i, kind, a, b, r, length)
                if self.rows(i, kind) != length // mine.m:
                    raise StateError(f"layer {i} {kind}: the store holds {self.rows(i, kind)} rows, "
                                     f"{length} tokens need {length // mine.m}")
        self.layers = [s.copy() for s in layers]
        self.length = self.committed = length

    @staticmethod
    def _check_tail(layer: int, name: str, mine: TokenTail, new: TokenTail, first: int, end: int) -> None:
        if new.start > first or new.end != end or new.rows.shape[1:] != mine.rows.shape[1:]:
            raise StateError(f"layer {layer} {name}: imported tail holds [{new.start}, {new.end}) x "
                             f"{tuple(new.rows.shape[1:])}, resuming at {end} needs [{first}, {end}) x "
                             f"{tuple(mine.rows.shape[1:])}")

    def release(self) -> None:
        self.store.drop(self.rid)

    def _cut(self, pos: int) -> None:
        self._seq += 1
        self.length = min(self.length, pos)
        self._cuts.append((self._seq, pos))
