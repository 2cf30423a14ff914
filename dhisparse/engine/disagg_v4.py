"""A DeepSeek-V4 request's prompt state on the wire (prefill/decode disaggregation, engine/disagg.py).

A V4 prompt is not rows by position: the prefill engine exports the request's whole streaming
state at its prompt's end, exactly as a prepared prefix (kv/v4/prefix.py `V4Prefix`), and the
decode engine imports it whole (`import_len`: n == len(prompt)), then decodes from position n.
On the wire that item is a list of named tensors plus a picklable `V4Shape` in the `Header`:

    window:<i>         [n - w0, head_dim]   layer i's sliding-window rows from w0 (model dtype)
    kv_raw:<i>         [n - r0, 2w]         its KV compressor's raw tail from r0 (if it has one)
    idx_raw:<i>        [n - r0, 2w]         its indexer compressor's raw tail (CSA layers)
    rows:<l>:<kind>    [n // m, width]      compressed rows as stored (FP8 584-B / 132-B rows
                                            under fp8_e4m3): every source (resident), HCA (tiered)
    tiered:latent      [G, R, row]          hierarchical presets: the CSA sources' rows, R = n // m
    tiered:index       [G, R, index-row]    and their index keys, both as stored
    feature:<l>        [f, hidden]          drafter features of the last positions

    V4Shape            per layer (w0, r0); the tiered prefix's row-unit token ids (or None)

The decode side's item marks `tiered` as a whole prompt (`StoredPrefix.whole_prompt`), so the row
hierarchy admits it as an arrival (kv/hier/arrival.py: this request alone, handed off at once)
and never shares it as a prefix's host pages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dhisparse.core.kvformat import KVFormats
from dhisparse.core.v4_config import V4Config
from dhisparse.kv.memory.prefix_store import StoredPrefix
from dhisparse.kv.v4.prefix import LayerTails, V4Prefix


@dataclass(frozen=True)
class V4Shape:
    """What the tensors do not say: starts[i] = (window_start, raw_start) of layer i; tiered_ids:
    the row-unit token ids of `tiered` (kv/v4/prefix.py `row_token_ids`), None for resident."""

    starts: tuple[tuple[int, int], ...]
    tiered_ids: tuple[tuple[int, ...], ...] | None = None


def whole_state(item: V4Prefix) -> V4Prefix:
    """An exported V4 prompt state as one request's whole prompt (its `tiered` rows an arrival)."""
    if item.tiered is None:
        return item
    return dataclasses.replace(item, tiered=StoredPrefix(item.tiered.token_ids, item.tiered.latent,
                                                         item.tiered.index, whole_prompt=True))


def v4_shape(item: V4Prefix) -> V4Shape:
    tiered = None if item.tiered is None else item.tiered.token_ids
    return V4Shape(tuple((t.window_start, t.raw_start) for t in item.layers), tiered)


def v4_tensors(item: V4Prefix) -> list[tuple[str, torch.Tensor]]:
    """item's tensors in wire order (module docstring): layers, stored rows, tiered rows, features."""
    out = []
    for i, t in enumerate(item.layers):
        out.append((f"window:{i}", t.window))
        out += [(f"{name}:{i}", raw) for name, raw in (("kv_raw", t.kv_raw), ("idx_raw", t.idx_raw)) if raw is not None]
    out += [(f"rows:{layer}:{kind}", item.rows[(layer, kind)]) for layer, kind in sorted(item.rows)]
    if item.tiered is not None:
        out += [("tiered:latent", item.tiered.latent), ("tiered:index", item.tiered.index)]
    return out + [(f"feature:{l}", item.features[l]) for l in sorted(item.features)]


def v4_prefix_of(token_ids: tuple[int, ...], shape: V4Shape, named: dict[str, torch.Tensor]) -> V4Prefix:
    """The decode side's item of a received V4 hand-over: named host tensors (`v4_tensors`'
    names) -> a whole-prompt `V4Prefix` (`whole_state`)."""
    layers = tuple(LayerTails(w0, named[f"window:{i}"], r0, named.get(f"kv_raw:{i}"), named.get(f"idx_raw:{i}"))
                   for i, (w0, r0) in enumerate(shape.starts))
    rows, feats = {}, {}
    for name, t in named.items():
        kind, _, key = name.partition(":")
        if kind == "rows":
            layer, _, k = key.partition(":")
            rows[(int(layer), k)] = t
        elif kind == "feature":
            feats[int(key)] = t
    tiered = None if shape.tiered_ids is None else StoredPrefix(shape.tiered_ids, named["tiered:latent"],
                                                                named["tiered:index"], whole_prompt=True)
    return V4Prefix(tuple(token_ids), layers, rows, tiered, feats)


def check_v4_rows(item: V4Prefix, cfg: V4Config, kv_cache_dtype: str, dtype: torch.dtype) -> None:
    """Raise ValueError unless item's state is in this engine's formats: windows and raw tails
    [*, head_dim] / [*, 2w] of `dtype`, compressed rows and tiered rows in the stored formats of
    `kv_cache_dtype` (per-role hosts may differ in flags; the bytes are imported as they are)."""
    f = KVFormats.v4(kv_cache_dtype, cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim, dtype)
    want = {"kv": (f.latent.storage_dtype, f.latent.width), "index": (f.index.storage_dtype, f.index.width)}
    got = {(k, (t.dtype, t.shape[-1])) for (_, k), t in item.rows.items()}
    if item.tiered is not None:
        got |= {("kv", (item.tiered.latent.dtype, item.tiered.latent.shape[-1])),
                ("index", (item.tiered.index.dtype, item.tiered.index.shape[-1]))}
    bad = sorted((k, g) for k, g in got if g != want[k])
    tails = {t.window.dtype for t in item.layers} | {r.dtype for t in item.layers for r in (t.kv_raw, t.idx_raw)
                                                      if r is not None}
    if bad or tails != {dtype} or len(item.layers) != cfg.num_layers:
        raise ValueError(f"the prefill rank's V4 state (rows {bad or 'ok'}, tails {sorted(map(str, tails))}, "
                         f"{len(item.layers)} layers) is not this decode rank's ({want}, {dtype}, {cfg.num_layers} "
                         "layers): every rank needs the same model, --dtype and --kv-cache-dtype")
