"""Normalized model configuration for the DSA families.

`ModelConfig.from_hf(d)` turns a Hugging Face `config.json` dict into one frozen config. It accepts
the transformers 5.x keys (`rope_parameters`, `indexer_types`, `mlp_layer_types`) and the legacy /
upstream ones (`rope_theta` + `rope_scaling`, `first_k_dense_replace`, `index_topk_freq`,
`index_skip_topk_offset`, `index_topk_pattern`, `indexer_rope_interleave`, `num_experts`).
Per-layer plans are derived the same way transformers' `__post_init__` derives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

SUPPORTED_ARCHITECTURES = ("glm_moe_dsa", "deepseek_v32")

# transformers' defaults for keys a config.json may omit (where they differ from the generic ones below)
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": dict(intermediate_size=18432, moe_intermediate_size=2048, n_shared_experts=1, n_group=8,
                         topk_group=4, routed_scaling_factor=2.5, rms_norm_eps=1e-6, max_position_embeddings=163840),
    "glm_moe_dsa": dict(intermediate_size=12288, moe_intermediate_size=2048, n_shared_experts=1, qk_nope_head_dim=192,
                        v_head_dim=256, index_n_heads=32, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
                        max_position_embeddings=202752),
}


class ConfigError(ValueError):
    """A config.json that we cannot serve; the message names the key and the fix."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (default or YaRN).

    `attention_factor` scales cos/sin (HF semantics); `softmax_mscale` multiplies the MLA softmax
    scale (DeepSeek's `mscale_all_dim` correction, squared when applied).
    """

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "RopeConfig":
        params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ConfigError("config.json: 'rope_parameters' / 'rope_scaling' must be an object")
        theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "yarn"):
            raise ConfigError(
                f"config.json: rope type {rope_type!r} is not supported; use 'default' or 'yarn'"
            )
        if rope_type == "default":
            return cls(theta=float(theta))
        return cls(
            theta=float(theta),
            rope_type="yarn",
            factor=float(params.get("factor", 1.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", d.get("max_position_embeddings", 4096))
            ),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """One normalized, frozen description of a GLM-5.x / DeepSeek-V3.2 DSA model.

    Per-layer tuples have length `num_layers`: `indexer_full[i]` is True where layer i runs its own
    indexer (GLM `full`; every layer on DeepSeek-V3.2) and False where it reuses the previous full
    layer's top-k (GLM `shared`); `mlp_moe[i]` is True for MoE layers.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_full: tuple[bool, ...]
    indexer_rope_interleave: bool
    mlp_moe: tuple[bool, ...]
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 0
    fp8_block_size: tuple[int, int] | None = None
    fp8_activation_scheme: str = "dynamic"  # quantization_config.activation_scheme (DeepSeek-V3 / GLM-5 FP8: dynamic)
    torch_dtype: str = "float32"

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA row: normalized c_kv followed by roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, f in enumerate(self.indexer_full) if f)

    def producer_of(self, layer: int) -> int:
        """The layer whose indexer selection `layer` attends with (itself when it is full)."""
        for i in range(layer, -1, -1):
            if self.indexer_full[i]:
                return i
        raise ConfigError(f"layer {layer} is 'shared' but no earlier layer is 'full'")

    def with_updates(self, **kw: Any) -> "ModelConfig":
        return replace(self, **kw)

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        """Normalize a config.json dict (transformers 5.x or legacy/upstream keys)."""
        arch = d.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"config.json: model_type {arch!r} is not supported; dhisparse serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        d = {**HF_DEFAULTS[arch], **d}
        try:
            n_layers = int(d["num_hidden_layers"])
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
        except KeyError as e:  # pragma: no cover - message path
            raise ConfigError(f"config.json: missing required key {e.args[0]!r}") from None
        indexer_full = _indexer_schedule(arch, d, n_layers)
        mlp_moe = _mlp_schedule(d, n_layers)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        qcfg = d.get("quantization_config") or {}
        fp8_block, scheme = None, "dynamic"
        if qcfg:
            if qcfg.get("quant_method") not in ("fp8", None):
                raise ConfigError(
                    f"config.json: quantization {qcfg.get('quant_method')!r} is not supported; "
                    "only block-scaled fp8 checkpoints (dequantized at load) are"
                )
            fp8_block = tuple(qcfg.get("weight_block_size", (128, 128)))
            scheme = str(qcfg.get("activation_scheme", "dynamic"))
        default_interleave = arch == "glm_moe_dsa"
        cfg = cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size", 4 * hidden)),
            num_layers=n_layers,
            num_heads=heads,
            q_lora_rank=int(_require(d, "q_lora_rank")),
            kv_lora_rank=int(d.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(d.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(d.get("qk_rope_head_dim", 64)),
            v_head_dim=int(d.get("v_head_dim", 128)),
            index_n_heads=int(d.get("index_n_heads", 64)),
            index_head_dim=int(d.get("index_head_dim", 128)),
            index_topk=int(d.get("index_topk", 2048)),
            indexer_full=indexer_full,
            indexer_rope_interleave=bool(d.get("indexer_rope_interleave", default_interleave))
            if arch == "glm_moe_dsa"
            else False,
            mlp_moe=mlp_moe,
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
            n_routed_experts=int(d.get("n_routed_experts", d.get("num_experts", 0)) or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 0) or 0),
            n_shared_experts=int(d.get("n_shared_experts", 0) or 0),
            n_group=int(d.get("n_group", 1) or 1),
            topk_group=int(d.get("topk_group", 1) or 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(d),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=d.get("pad_token_id"),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 0) or 0),
            fp8_block_size=fp8_block,
            fp8_activation_scheme=scheme,
            torch_dtype=str(d.get("dtype", d.get("torch_dtype", "float32")) or "float32"),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ConfigError naming the key when the config cannot describe a servable model."""
        if not self.indexer_full or not self.indexer_full[0]:
            raise ConfigError("config.json: 'indexer_types' must start with 'full' (layer 0 needs an indexer)")
        if len(self.indexer_full) != self.num_layers or len(self.mlp_moe) != self.num_layers:
            raise ConfigError("config.json: per-layer lists must have num_hidden_layers entries")
        if self.index_topk < 1:
            raise ConfigError("config.json: 'index_topk' must be >= 1")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError("config.json: 'qk_rope_head_dim' must be even and <= 'index_head_dim'")
        if any(self.mlp_moe):
            if self.n_routed_experts < 1 or self.num_experts_per_tok < 1:
                raise ConfigError("config.json: MoE layers need 'n_routed_experts' and 'num_experts_per_tok'")
            if self.n_routed_experts % self.n_group:
                raise ConfigError("config.json: 'n_routed_experts' must be divisible by 'n_group'")


def _require(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ConfigError(f"config.json: {key!r} is required for {d.get('model_type')}")
    return d[key]


def _indexer_schedule(arch: str, d: dict[str, Any], n: int) -> tuple[bool, ...]:
    """`full` layers, by HF precedence: indexer_types > index_topk_pattern > freq/offset."""
    if arch == "deepseek_v32":
        return (True,) * n
    types = d.get("indexer_types")
    if types is None:
        pattern = d.get("index_topk_pattern")
        if pattern is not None:
            try:
                types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
            except KeyError:
                raise ConfigError("config.json: 'index_topk_pattern' may only contain 'F' and 'S'") from None
        else:
            freq = max(int(d.get("index_topk_freq", 1) or 1), 1)
            offset = int(d.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"config.json: 'indexer_types' has {len(types)} entries for {n} layers")
    bad = [t for t in types if t not in ("full", "shared")]
    if bad:
        raise ConfigError(f"config.json: 'indexer_types' entries must be 'full' or 'shared', got {bad[0]!r}")
    return tuple(t == "full" for t in types)


def _mlp_schedule(d: dict[str, Any], n: int) -> tuple[bool, ...]:
    types = d.get("mlp_layer_types")
    if types is None:
        k = min(int(d.get("first_k_dense_replace", 3)), n)
        types = ["dense"] * k + ["sparse"] * (n - k)
    if len(types) != n:
        raise ConfigError(f"config.json: 'mlp_layer_types' has {len(types)} entries for {n} layers")
    return tuple(t == "sparse" for t in types)
