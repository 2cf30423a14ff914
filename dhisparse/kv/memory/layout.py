"""KV sources and the model topology derived from a ModelConfig.

A *KV source* is bytes produced by one layer and read by one or more layers: a row has
`width` elements and packs `m` token positions (m = 1 uncompressed). For GLM-5 every layer
produces its own latent source; `full` layers also produce an index-key source and a selection
that the following `shared` layers consume with their own payload. For DeepSeek-V3.2 every
layer selects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dhisparse.core.config import ModelConfig


@dataclass(frozen=True)
class KVSource:
    """One physical KV source: `kind` is "latent" (attention payload) or "index" (indexer keys)."""

    name: str
    kind: str
    layer: int
    width: int
    m: int = 1


@dataclass(frozen=True)
class LayerPlan:
    """How a layer touches KV: the payload source it reads, whether it selects, whose
    selection it consumes (itself when it selects), and its index source (or -1)."""

    layer: int
    payload: int
    selects: bool
    producer: int
    index: int


class TokenBytes(NamedTuple):
    """Bytes one token adds to the latent sources and to the index sources (all layers)."""

    latent: int
    index: int

    @property
    def total(self) -> int:
        return self.latent + self.index


@dataclass(frozen=True)
class RowGeometry:
    """What the page arena and the hierarchy need to know of a model: its row-producing "layers"
    (GLM / V3.2: the decoder layers; DeepSeek-V4: the CSA sources), the row widths, which
    layers produce index keys and a selection, and the selection size.

    num_layers     arena layers L (every one has a latent row per position)
    latent_dim     elements of one latent row (MLA: kv_lora + rope; V4: head_dim)
    index_head_dim elements of one index key
    index_topk     k, positions one selection holds
    indexer_full   per layer: produces index keys and its own selection (else it reuses the
                   selection of the nearest earlier full layer: GLM `shared`)
    """

    num_layers: int
    latent_dim: int
    index_head_dim: int
    index_topk: int
    indexer_full: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.indexer_full) != self.num_layers or (self.num_layers and not self.indexer_full[0]):
            raise ValueError("indexer_full needs one entry per layer, and layer 0 must be full")

    @classmethod
    def of_model(cls, cfg: ModelConfig) -> "RowGeometry":
        """The geometry of a GLM-5.x / DeepSeek-V3.2 model: one arena layer per decoder layer."""
        return cls(cfg.num_layers, cfg.latent_dim, cfg.index_head_dim, cfg.index_topk, tuple(cfg.indexer_full))

    @classmethod
    def of(cls, geometry: "RowGeometry | ModelConfig") -> "RowGeometry":
        return geometry if isinstance(geometry, RowGeometry) else cls.of_model(geometry)

    def producer_of(self, layer: int) -> int:
        """The layer whose selection `layer` attends with (itself when it is full)."""
        return max(i for i in range(layer + 1) if self.indexer_full[i])


@dataclass(frozen=True)
class KVLayout:
    sources: tuple[KVSource, ...]
    layers: tuple[LayerPlan, ...]

    @classmethod
    def from_model(cls, cfg: "RowGeometry | ModelConfig") -> "KVLayout":
        cfg = RowGeometry.of(cfg)
        sources: list[KVSource] = []
        plans: list[LayerPlan] = []
        for i in range(cfg.num_layers):
            sources.append(KVSource(f"latent.{i}", "latent", i, cfg.latent_dim))
            payload = len(sources) - 1
            index = -1
            if cfg.indexer_full[i]:
                sources.append(KVSource(f"index.{i}", "index", i, cfg.index_head_dim))
                index = len(sources) - 1
            plans.append(LayerPlan(i, payload, cfg.indexer_full[i], cfg.producer_of(i), index))
        return cls(tuple(sources), tuple(plans))

    @property
    def latent_sources(self) -> list[KVSource]:
        return [s for s in self.sources if s.kind == "latent"]

    @property
    def index_sources(self) -> list[KVSource]:
        return [s for s in self.sources if s.kind == "index"]

    @property
    def index_layers(self) -> tuple[int, ...]:
        """Layers with an index source, in order; position in this tuple = index slot."""
        return tuple(s.layer for s in self.index_sources)

    def followers(self, producer: int) -> tuple[int, ...]:
        """Layers (other than producer) that attend with producer's selection."""
        return tuple(p.layer for p in self.layers if p.producer == producer and p.layer != producer)

    def token_bytes(self, elem_bytes: int) -> TokenBytes:
        lat = sum(s.width for s in self.latent_sources) * elem_bytes
        idx = sum(s.width for s in self.index_sources) * elem_bytes
        return TokenBytes(lat, idx)
