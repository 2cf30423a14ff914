"""DeepSeek-V4 prepared prefixes: a request's whole streaming state after its prompt, exported
once (`Engine.prepare_prefix`) and imported by later requests whose prompt starts with it.

A GLM prefix is rows by position (kv/memory/prefix_store.py `StoredPrefix`), so any cut n <= len
of it is exact. A V4 state is not rows by position: compressed row w pools a whole window of m
tokens, the compressors stream the open window (and CSA's overlap half) from raw tails, and the
sliding window keeps the last W rows. A `V4Prefix` is that state at the prefix's end n:

    token_ids  (n,)
    layers[i]  `LayerTails`: window [n - w0, head_dim] of positions w0 .. n-1, w0 = max(0, n - W + 1);
               kv_raw / idx_raw [n - r0, 2w] of positions r0 .. n-1, r0 = (n // m - overlap) * m
               (None where layer i has no compressor of that kind): model-dtype host tensors
    rows       {(layer, kind): [n // m, width]} compressed rows a `DenseRowStore` held, in their
               stored format (`row_format(kind)`: FP8 bytes under fp8_e4m3, moved, never decoded
               and re-encoded); resident: every source layer; hierarchical: the untiered (HCA) ones
    tiered     hierarchical presets: the CSA sources' rows in row units, a `StoredPrefix` of the
               row arena (latent [G, R, head_dim-row], index [G, R, index-row], R = n // m, stored
               bytes) imported as whole pages into the row hierarchy, whose complete pages
               importers borrow as shared host pages (kv/hier/prefix_pages.py); None for resident
    features   the drafter's hidden features of the last positions (as `StoredPrefix.features`)

The n rule (`import_len`): a state cannot be rewound below its committed position, so a prefix is
imported only whole (n == len(token_ids)). `PrefixStore.match` offers len(prompt) - 1 rows when the
prompt IS the prefix (its last token must run for logits): then nothing is imported and the whole
prompt is prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from dhisparse.kv.memory.prefix_store import StoredPrefix
from dhisparse.kv.v4.rows import DenseRowStore
from dhisparse.kv.v4.state import LayerState, TokenTail, V4RequestState


@dataclass(frozen=True)
class LayerTails:
    """One layer's tails at the prefix end: window rows from window_start; kv_raw / idx_raw
    (None: no such compressor) from raw_start. Host tensors."""

    window_start: int
    window: torch.Tensor
    raw_start: int = 0
    kv_raw: torch.Tensor | None = None
    idx_raw: torch.Tensor | None = None


@dataclass(frozen=True)
class V4Prefix:
    """A prepared DeepSeek-V4 prefix (module docstring)."""

    token_ids: tuple[int, ...]
    layers: tuple[LayerTails, ...]
    rows: dict = field(default_factory=dict)  # (layer, kind) -> [n // m, width] stored rows
    tiered: StoredPrefix | None = None
    features: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        ts = [t for l in self.layers for t in (l.window, l.kv_raw, l.idx_raw) if t is not None]
        ts += list(self.rows.values())
        own = sum(t.numel() * t.element_size() for t in ts)
        return own + (self.tiered.nbytes if self.tiered is not None else 0)


def import_len(item, n: int) -> int:
    """Positions of a matched V4 prefix to import: all of them (n == its length), else 0."""
    return n if item is not None and n == len(item.token_ids) else 0


def row_matcher(match: Callable[[Hashable], tuple], m: int) -> Callable[[Hashable], tuple]:
    """The engine's matcher (req -> (item, positions)) as the row hierarchy's: req -> (the item's
    row-unit `tiered` prefix, rows it imports) under `import_len`, or (None, 0)."""

    def rows(req: Hashable) -> tuple:
        item, n = match(req)
        n = import_len(item, n)
        return (item.tiered, n // m) if n else (None, 0)

    return rows


def row_token_ids(token_ids: Sequence[int], m: int) -> tuple[tuple[int, ...], ...]:
    """The `token_ids` of a prefix's row-unit `StoredPrefix` (one entry per compressed row, so
    PrefixPages counts rows): entry w = the tokens of window w, the last one also the partial
    window's. Equal iff the prefixes' tokens are equal (a prefix prepared again)."""
    R = len(token_ids) // m
    ids = tuple(token_ids)
    return tuple(ids[w * m : (w + 1) * m if w < R - 1 else len(ids)] for w in range(R))


def host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of t (pinned when `pin`), never a view of device or state memory."""
    out = t.detach().to("cpu", copy=True)
    return out.pin_memory() if pin else out


def export_tails(state: V4RequestState, pin: bool) -> tuple[LayerTails, ...]:
    """Host copies of what each layer needs to resume at state.length (`keep_from`)."""
    n, out = state.length, []
    for i, st in enumerate(state.layers):
        w, r = state.keep_from(i, n)
        raw = {k: host(t.span(r, n), pin) for k, t in st.raws()}
        out.append(LayerTails(w, host(st.window.span(w, n), pin), r, raw.get("kv"), raw.get("index")))
    return tuple(out)


def export_rows(state: V4RequestState, dense: DenseRowStore, skip: set[int], pin: bool) -> dict:
    """{(layer, kind): stored rows [count, width]} of every compressed (layer, kind) of state
    outside `skip` (tiered source layers), as the dense store holds them."""
    out = {}
    for i, st in enumerate(state.layers):
        if i in skip:
            continue
        for kind, _ in st.raws():
            out[(i, kind)] = host(dense.stored(state.rid, i, kind), pin)
    return out


def put_rows(dense: DenseRowStore, rid: Hashable, rows: dict) -> None:
    """An item's stored rows into a fresh request's dense store (bytes unchanged)."""
    for (layer, kind), t in rows.items():
        dense.put_stored(rid, layer, kind, t)


def adopt_tails(state: V4RequestState, item: V4Prefix, device: torch.device) -> None:
    """state (fresh, its rows already in the store) <- the item's tails at len(item.token_ids)."""
    layers = []
    for mine, t in zip(state.layers, item.layers):
        tail = lambda start, rows: None if rows is None else TokenTail(start, rows.to(device, mine.window.rows.dtype))  # noqa: E731
        layers.append(LayerState(tail(t.window_start, t.window), mine.m, mine.overlap,
                                 tail(t.raw_start, t.kv_raw), tail(t.raw_start, t.idx_raw)))
    state.adopt(len(item.token_ids), layers)
