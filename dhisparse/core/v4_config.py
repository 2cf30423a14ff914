"""Normalized configuration of DeepSeek-V4 (`model_type: "deepseek_v4"`).

`V4Config.from_hf(d)` accepts transformers 5.x keys and the upstream (DeepSeek release) keys:

    per-layer attention   layer_types ["sliding_attention" | "compressed_sparse_attention" |
                          "heavily_compressed_attention"]  >  compress_ratios [0 | 4 | 128 ...]
                          (upstream, may carry a trailing MTP entry)  >  the V4-Pro default
    compression rates     compress_rates {type: m}, compress_rate_csa / compress_rate_hca
    per-layer MoE         mlp_layer_types ["hash_moe" | "moe"]  >  num_hash_layers (default 3)
    partial RoPE          partial_rotary_factor  >  qk_rope_head_dim / head_dim  >  64 / 512
    RoPE                  rope_parameters {"main": {...}, "compress": {...}} (nested, HF-saved), or
                          a flat rope_parameters / rope_scaling (YaRN) + rope_theta + compress_rope_theta

    cross-layer sources   kv_source_layer_ids [int], selection_types ["full" | "reindex" | "reuse"]
                          (our DeepSeek-V4.1-style extension, `core/v4_sources.py`; absent =
                          every CSA layer is its own Full source = transformers' V4)

Semantics follow transformers' `DeepseekV4Config.__post_init__`: the sliding-only layers use the
"main" rope (rope_theta, never scaled); CSA / HCA layers, their compressors and the CSA indexer use
the "compress" rope (compress_rope_theta, plus YaRN when given, with attention_factor forced to 1.0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dhisparse.core.config import ConfigError, RopeConfig
from dhisparse.core.v4_sources import FULL, REUSE, LayerSources, check_sources, parse_sources

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
DEFAULT_RATES = {CSA: 4, HCA: 128}
UPSTREAM_RATIO = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class V4Config:
    """One frozen description of a DeepSeek-V4 model. Per-layer tuples have `num_layers` entries."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    mlp_hash: tuple[bool, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_main: RopeConfig = RopeConfig(theta=10000.0)
    rope_compress: RopeConfig = RopeConfig(theta=160000.0)
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 0
    fp8_activation_scheme: str = "dynamic"  # quantization_config.activation_scheme (DeepSeek-V4 FP8: dynamic)
    torch_dtype: str = "float32"
    architecture: str = "deepseek_v4"
    kv_source_layer_ids: tuple[int, ...] = ()  # () = every layer its own source (see v4_sources)
    selection_types: tuple[str, ...] = ()

    # ---- per-layer helpers ---------------------------------------------------------------------
    def compress_rate(self, layer: int) -> int:
        """Tokens per compressed row of `layer`: 0 (sliding only), csa_rate or hca_rate."""
        t = self.layer_types[layer]
        return 0 if t == SLIDING else (self.csa_rate if t == CSA else self.hca_rate)

    def has_indexer(self, layer: int) -> bool:
        return self.layer_types[layer] == CSA

    def source_of(self, layer: int) -> int:
        """The layer whose compressed rows / index keys `layer` reads (itself when it produces them)."""
        return self.kv_source_layer_ids[layer] if self.kv_source_layer_ids else layer

    def selection_type(self, layer: int) -> str:
        """"full" (own source + selection), "reindex" (new selection on a shared source), "reuse"."""
        return self.selection_types[layer] if self.selection_types else FULL

    def produces_rows(self, layer: int) -> bool:
        """True for layers with a compressor of their own (HCA, and CSA layers of type "full")."""
        return self.compress_rate(layer) > 0 and self.selection_type(layer) == FULL

    @property
    def csa_sources(self) -> tuple[int, ...]:
        """Physical CSA sources (their producing layers), in layer order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == CSA and self.selection_type(i) == FULL)

    @property
    def selecting_layers(self) -> tuple[int, ...]:
        """CSA layers that compute a selection (full + reindex): one resolver call each per pass."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == CSA and self.selection_type(i) != REUSE)

    def rope_of(self, layer: int) -> str:
        """"main" for sliding-only layers, "compress" for CSA / HCA layers."""
        return "main" if self.layer_types[layer] == SLIDING else "compress"

    def with_updates(self, **kw: Any) -> "V4Config":
        return replace(self, **kw)

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "V4Config":
        """Normalize a config.json dict (transformers 5.x or upstream keys); ConfigError names the key."""
        if d.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ConfigError(f"config.json: model_type {d.get('model_type')!r} is not 'deepseek_v4'")
        n = int(_get(d, "num_hidden_layers", 43))
        head_dim = int(_get(d, "head_dim", 512))
        rope_dim = _rope_dim(d, head_dim)
        csa_rate, hca_rate, types = _attention_schedule(d, n)
        main, compress = _ropes(d, head_dim, rope_dim)
        eos = d.get("eos_token_id", 1)
        cfg = cls(
            vocab_size=int(_get(d, "vocab_size", 129280)),
            hidden_size=int(_get(d, "hidden_size", 4096)),
            num_layers=n,
            num_heads=int(_get(d, "num_attention_heads", 64)),
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            q_lora_rank=int(_get(d, "q_lora_rank", 1024)),
            o_groups=int(_get(d, "o_groups", 8)),
            o_lora_rank=int(_get(d, "o_lora_rank", 1024)),
            sliding_window=int(_get(d, "sliding_window", 128)),
            layer_types=types,
            csa_rate=csa_rate,
            hca_rate=hca_rate,
            index_n_heads=int(_get(d, "index_n_heads", 64)),
            index_head_dim=int(_get(d, "index_head_dim", 128)),
            index_topk=int(_get(d, "index_topk", 512)),
            mlp_hash=_mlp_schedule(d, n),
            n_routed_experts=int(_get(d, "n_routed_experts", 256)),
            num_experts_per_tok=int(_get(d, "num_experts_per_tok", 6)),
            moe_intermediate_size=int(_get(d, "moe_intermediate_size", 2048)),
            n_shared_experts=int(_get(d, "n_shared_experts", 1)),
            scoring_func=str(_get(d, "scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(_get(d, "routed_scaling_factor", 1.5)),
            swiglu_limit=float(_get(d, "swiglu_limit", 10.0)),
            hc_mult=int(_get(d, "hc_mult", 4)),
            hc_sinkhorn_iters=int(_get(d, "hc_sinkhorn_iters", 20)),
            hc_eps=float(_get(d, "hc_eps", 1e-6)),
            rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
            rope_main=main,
            rope_compress=compress,
            max_position_embeddings=int(_get(d, "max_position_embeddings", 1048576)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id", 0),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            pad_token_id=d.get("pad_token_id"),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 1) or 0),
            fp8_activation_scheme=str((d.get("quantization_config") or {}).get("activation_scheme", "dynamic")),
            torch_dtype=str(d.get("dtype", d.get("torch_dtype", "float32")) or "float32"),
        )
        if d.get("kv_source_layer_ids") is not None or d.get("selection_types") is not None:
            src = parse_sources(d, types, CSA)
            cfg = replace(cfg, kv_source_layer_ids=src.kv_source, selection_types=src.selection)
        cfg.validate(d)
        return cfg

    def validate(self, d: dict[str, Any] | None = None) -> None:
        """Raise ConfigError naming the key when the config cannot describe a servable V4 model."""
        d = d or {}
        if int(d.get("num_key_value_heads", 1)) != 1:
            raise ConfigError("config.json: 'num_key_value_heads' must be 1 for deepseek_v4 (shared K=V MQA)")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim):
            raise ConfigError(
                "config.json: 'partial_rotary_factor' / 'qk_rope_head_dim' must give an even rope dim "
                f"<= head_dim and index_head_dim (got {self.rope_head_dim})"
            )
        if self.num_heads % self.o_groups:
            raise ConfigError(f"config.json: 'o_groups' ({self.o_groups}) must divide 'num_attention_heads'")
        if self.scoring_func not in SCORING:
            raise ConfigError(f"config.json: 'scoring_func' {self.scoring_func!r} is not one of {SCORING}")
        if self.n_shared_experts != 1:
            raise ConfigError("config.json: 'n_shared_experts' must be 1 for deepseek_v4 (one shared expert)")
        if self.sliding_window < 1 or self.index_topk < 1:
            raise ConfigError("config.json: 'sliding_window' and 'index_topk' must be >= 1")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("config.json: 'num_experts_per_tok' exceeds 'n_routed_experts'")
        if self.csa_rate < 1 or self.hca_rate < 1:
            raise ConfigError("config.json: 'compress_rates' must be >= 1")
        if self.kv_source_layer_ids or self.selection_types:
            src = LayerSources(self.kv_source_layer_ids or tuple(range(self.num_layers)),
                               self.selection_types or (FULL,) * self.num_layers)
            if len(src.kv_source) != self.num_layers or len(src.selection) != self.num_layers:
                raise ConfigError("config.json: 'kv_source_layer_ids' and 'selection_types' need one entry per layer")
            check_sources(src, self.layer_types, CSA)


def _get(d: dict[str, Any], key: str, default: Any) -> Any:
    v = d.get(key, default)
    if v is None:
        v = default
    if isinstance(v, (dict, list)) or (not isinstance(v, (int, float, str, bool))):
        raise ConfigError(f"config.json: {key!r} must be a scalar, got {type(v).__name__}")
    return v


def _rope_dim(d: dict[str, Any], head_dim: int) -> int:
    prf = d.get("partial_rotary_factor")
    if prf is not None:
        return int(head_dim * float(prf))
    if d.get("qk_rope_head_dim") is not None:
        return int(d["qk_rope_head_dim"])
    return int(head_dim * 64 / 512)


def _attention_schedule(d: dict[str, Any], n: int) -> tuple[int, int, tuple[str, ...]]:
    """(csa_rate, hca_rate, layer_types) by HF precedence; compress_ratios may carry MTP entries."""
    rates = d.get("compress_rates") or {}
    if not isinstance(rates, dict) or set(rates) - {CSA, HCA}:
        raise ConfigError(f"config.json: 'compress_rates' must map {CSA!r} / {HCA!r} to ints, got {rates!r}")
    rates = {**DEFAULT_RATES, **rates}
    for key, name in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if d.get(key) is not None:
            rates[name] = int(d[key])
    types = d.get("layer_types")
    if types is None and d.get("compress_ratios") is not None:
        ratios = list(d["compress_ratios"])
        bad = [r for r in ratios[:n] if r not in UPSTREAM_RATIO]
        if bad:
            raise ConfigError(f"config.json: 'compress_ratios' entries must be 0, 4 or 128; got {bad[0]!r}")
        if len(ratios) < n:
            raise ConfigError(f"config.json: 'compress_ratios' has {len(ratios)} entries for {n} layers")
        types = [UPSTREAM_RATIO[r] for r in ratios[:n]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types)[:n]
    if len(types) != n:
        raise ConfigError(f"config.json: 'layer_types' has {len(types)} entries for {n} layers")
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise ConfigError(f"config.json: 'layer_types' entries must be one of {LAYER_TYPES}; got {bad[0]!r}")
    return int(rates[CSA]), int(rates[HCA]), tuple(types)


def _mlp_schedule(d: dict[str, Any], n: int) -> tuple[bool, ...]:
    types = d.get("mlp_layer_types")
    if types is None:
        k = int(_get(d, "num_hash_layers", 3))
        types = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
    types = list(types)[:n]
    if len(types) != n:
        raise ConfigError(f"config.json: 'mlp_layer_types' has {len(types)} entries for {n} layers")
    bad = [t for t in types if t not in MLP_TYPES]
    if bad:
        raise ConfigError(f"config.json: 'mlp_layer_types' entries must be one of {MLP_TYPES}; got {bad[0]!r}")
    return tuple(t == "hash_moe" for t in types)


def _rope(params: dict[str, Any], d: dict[str, Any], key: str) -> RopeConfig:
    try:
        rc = RopeConfig.from_hf({"rope_parameters": params,
                                 "max_position_embeddings": d.get("max_position_embeddings")})
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"config.json: {key!r}: {e}") from None
    return replace(rc, truncate=True)  # transformers reads `truncate` from the nested dict: always True


def _ropes(d: dict[str, Any], head_dim: int, rope_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) RopeConfigs: nested HF form as is, else flat YaRN applied to compress only."""
    rp = d.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise ConfigError("config.json: 'rope_parameters' must be an object")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return _rope(rp["main"], d, "rope_parameters.main"), _rope(rp["compress"], d, "rope_parameters.compress")
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")} or dict(d.get("rope_scaling") or {})
    theta = float(d.get("rope_theta") or 10000.0)
    main = {"rope_type": "default", "rope_theta": theta}
    compress = {**flat, "rope_theta": float(d.get("compress_rope_theta") or 160000.0)}
    compress.setdefault("rope_type", compress.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    key = "rope_parameters" if rp else "rope_scaling"
    return _rope(main, d, "rope_theta"), _rope(compress, d, key)
