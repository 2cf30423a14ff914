"""Cross-layer KV sources of DeepSeek-V4.1-style models (our config extension of `deepseek_v4`).

Two optional per-layer config.json keys (lists of `num_hidden_layers` entries) name, for every
CSA layer, the compressed KV source it reads and how it selects rows of it:

    kv_source_layer_ids  [int]   the CSA layer whose compressed rows and index keys layer i reads
                                 (= i: the layer produces its own source)
    selection_types      [str]   "full"    produces a source (compressor + indexer) and selects
                                           from it; requires kv_source_layer_ids[i] == i
                                 "reindex" runs its own indexer query over the shared source's
                                           index keys and selects anew (no compressor)
                                 "reuse"   attends with the latest selection made on its source
                                           (no compressor, no indexer, no resolver call)

Sliding-only and HCA layers always read their own state: their entries must be i and "full".
A shared source must be an earlier "full" CSA layer (which selects on it first, so a "reuse"
layer always has a selection to consume: the latest of its source's full / reindex layers). Both keys absent = every CSA layer is its own Full source,
which is transformers' DeepSeek-V4 exactly; `selection_types` absent alone = "full" where
kv_source_layer_ids[i] == i and "reindex" elsewhere.

    layer:        0 SWA   1 CSA full   2 CSA reuse(1)   3 HCA   4 CSA reindex(1)   5 CSA reuse(1)
    source rows:          produced     read 1's rows            read 1's rows      read 1's rows
    selection:            own top-k    = layer 1's              own top-k          = layer 4's
"""

from __future__ import annotations

from typing import Any, NamedTuple

from dhisparse.core.config import ConfigError

FULL, REINDEX, REUSE = "full", "reindex", "reuse"
SELECTION_TYPES = (FULL, REINDEX, REUSE)


class LayerSources(NamedTuple):
    """Per-layer source ids and selection types (tuples of num_layers entries)."""

    kv_source: tuple[int, ...]
    selection: tuple[str, ...]


def parse_sources(d: dict[str, Any], types: tuple[str, ...], csa: str) -> LayerSources:
    """Read kv_source_layer_ids / selection_types from a config dict and validate them against
    the layer types; ConfigError names the key and the fix."""
    n = len(types)
    src = d.get("kv_source_layer_ids")
    sel = d.get("selection_types")
    src = tuple(range(n)) if src is None else _int_list(src, n)
    if sel is None:
        sel = tuple(FULL if s == i else REINDEX for i, s in enumerate(src))
    sel = _str_list(sel, n)
    check_sources(LayerSources(src, sel), types, csa)
    return LayerSources(src, sel)


def _int_list(v: Any, n: int) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or len(v) != n or not all(isinstance(x, int) for x in v):
        raise ConfigError(f"config.json: 'kv_source_layer_ids' must be a list of {n} layer ids "
                          f"(one per hidden layer), got {v!r}")
    return tuple(int(x) for x in v)


def _str_list(v: Any, n: int) -> tuple[str, ...]:
    if not isinstance(v, (list, tuple)) or len(v) != n:
        raise ConfigError(f"config.json: 'selection_types' must be a list of {n} entries from {SELECTION_TYPES}, got {v!r}")
    bad = [x for x in v if x not in SELECTION_TYPES]
    if bad:
        raise ConfigError(f"config.json: 'selection_types' entries must be one of {SELECTION_TYPES}; got {bad[0]!r}")
    return tuple(v)


def check_sources(s: LayerSources, types: tuple[str, ...], csa: str) -> None:
    """Validate a source assignment; the error names the key, the layer and the fix."""
    for i, (src, kind) in enumerate(zip(s.kv_source, s.selection)):
        if types[i] != csa:
            if src != i or kind != FULL:
                raise ConfigError(f"config.json: layer {i} is {types[i]!r}: 'kv_source_layer_ids'[{i}] must be {i} "
                                  f"and 'selection_types'[{i}] 'full' (only CSA layers share sources)")
            continue
        if kind == FULL:
            if src != i:
                raise ConfigError(f"config.json: 'selection_types'[{i}] is 'full' (produces a source), so "
                                  f"'kv_source_layer_ids'[{i}] must be {i}, got {src}; use 'reindex' or 'reuse' to share")
            continue
        if not 0 <= src < i or types[src] != csa or s.selection[src] != FULL:
            raise ConfigError(f"config.json: 'kv_source_layer_ids'[{i}] = {src}: a {kind!r} layer must read an "
                              "earlier CSA layer whose 'selection_types' entry is 'full'")
