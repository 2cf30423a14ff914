"""`DFlashConfig`: shape of a DFlash-style block drafter, its config.json form and start-up checks.

config.json (the public DFlash layout of the `dflash` package: a Qwen3-style decoder config plus a
`dflash_config` object):

    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    intermediate_size, vocab_size, rms_norm_eps, rope_theta | rope_parameters.rope_theta,
    attention_bias, num_target_layers (optional),
    layer_types ("full_attention" | "sliding_attention" per layer), sliding_window, is_causal,
    dflash_config: {block_size, mask_token_id, target_layer_ids, output_multiplier,
                    final_logit_softcapping, input_embedding_scale,
                    DFlash2: conv_kernel_size, conv_group_size, selector_rank, selector_top_k}

Keys of `dflash_config` are also accepted at the top level. Attention per layer, as the reference
reads it: a sliding layer sees keys with q - k < sliding_window (and, when not causal, k - q <
sliding_window); a layer is causal when `is_causal` says so, else exactly when it is a sliding one;
a full, non-causal layer sees the whole context and the whole block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class DFlashConfigError(ValueError):
    """A drafter config / checkpoint that cannot serve this target; names the key and the fix."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Target layers to condition on: the middle one for a 1-layer drafter, else evenly spaced
    from layer 1 to layer L-3 (clamped into range for very shallow targets)."""
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError("default_target_layer_ids needs >= 1 target and draft layer")
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    lo, hi = min(1, num_target_layers - 1), max(min(1, num_target_layers - 1), num_target_layers - 3)
    step = (hi - lo) / (num_draft_layers - 1)
    return tuple(int(round(lo + i * step)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    """Drafter shape. hidden_size and vocab_size must equal the target's (the drafter embeds with the
    target's table and decodes with its LM head); fc maps len(target_layer_ids) * hidden -> hidden."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = True
    num_target_layers: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # None: every layer sliding if sliding_window, else full
    is_causal: bool | None = None
    attention_bias: bool = False
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    conv_kernel_size: int | None = None  # DFlash2: grouped dynamic causal convolutions ...
    conv_group_size: int | None = None
    selector_rank: int | None = None  # ... and the candidate selector
    selector_top_k: int | None = None
    dspark_markov_rank: int | None = None  # DSpark: the sequential head (spec/dspark_head.py)
    dspark_markov_gated: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # ---- per-layer attention -------------------------------------------------------------------
    def layer_window(self, layer: int) -> int | None:
        """The layer's sliding window (None: it sees every position; a sliding layer saved without
        a window, as Qwen3Config writes one when use_sliding_window is false, has none either)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_causal(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention" if self.is_causal is None else self.is_causal

    @property
    def context_window(self) -> int | None:
        """Committed positions before the block any layer may read (None: all of them)."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return None if any(w is None for w in windows) else max(windows)

    @property
    def is_dflash2(self) -> bool:
        return self.conv_kernel_size is not None

    @property
    def is_dspark(self) -> bool:
        return self.dspark_markov_rank is not None

    def validate(self) -> None:
        pos = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
        for name in pos:
            if getattr(self, name) < 1:
                raise DFlashConfigError(f"drafter config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise DFlashConfigError(
                f"drafter config: num_attention_heads {self.num_heads} must be a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise DFlashConfigError(f"drafter config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.block_size < 2:
            raise DFlashConfigError(f"drafter config: block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise DFlashConfigError(
                f"drafter config: target_layer_ids must be non-empty layer indices >= 0, got {self.target_layer_ids}"
            )
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {"full_attention", "sliding_attention"}:
            raise DFlashConfigError(f"drafter config: layer_types must give 'full_attention' or 'sliding_attention' "
                                    f"for each of the {self.num_layers} layers, got {list(self.layer_types)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise DFlashConfigError(f"drafter config: sliding_window must be >= 1, got {self.sliding_window}")
        d2 = (self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k)
        if any(v is not None for v in d2):
            if any(v is None or v < 1 for v in d2):
                raise DFlashConfigError("drafter config: a DFlash2 drafter needs conv_kernel_size, conv_group_size, "
                                        f"selector_rank and selector_top_k >= 1, got {d2}")
            if self.hidden_size % self.conv_group_size:
                raise DFlashConfigError(f"drafter config: conv_group_size {self.conv_group_size} must divide "
                                        f"hidden_size {self.hidden_size}")
        if self.dspark_markov_rank is not None and self.dspark_markov_rank < 1:
            raise DFlashConfigError(f"drafter config: dspark_markov_rank must be >= 1, got {self.dspark_markov_rank}")
        if self.is_dspark and self.is_dflash2:
            raise DFlashConfigError("drafter config: a drafter has a DSpark sequential head or a DFlash2 selector, not both")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DFlashConfigError(
                f"drafter config: mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )

    def check_target(self, vocab_size: int, hidden_size: int, num_layers: int) -> None:
        """Start-up checks against the target model; raise DFlashConfigError naming the mismatch."""
        if self.vocab_size != vocab_size:
            raise DFlashConfigError(
                f"drafter vocab_size {self.vocab_size} does not match the target's {vocab_size}; "
                "the drafter decodes with the target's LM head, so use a drafter trained for this target"
            )
        if self.hidden_size != hidden_size:
            raise DFlashConfigError(
                f"drafter hidden_size {self.hidden_size} does not match the target's {hidden_size}; "
                "the drafter shares the target's embeddings and LM head, so use a drafter trained for this target"
            )
        bad = [i for i in self.target_layer_ids if i >= num_layers]
        if bad:
            raise DFlashConfigError(
                f"drafter target_layer_ids {list(self.target_layer_ids)} include {bad}, out of range for a "
                f"target with {num_layers} layers (valid: 0..{num_layers - 1})"
            )
        if self.num_target_layers is not None and self.num_target_layers != num_layers:
            raise DFlashConfigError(
                f"drafter was trained for a target with num_target_layers={self.num_target_layers}, "
                f"this target has {num_layers}; use a drafter trained for this target"
            )

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    # ---- config.json ---------------------------------------------------------------------------
    def to_hf(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": self.attention_bias,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "output_multiplier": self.output_multiplier,
                "input_embedding_scale": self.input_embedding_scale,
            },
        }
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        if self.final_logit_softcapping is not None:
            d["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        if self.is_dflash2:
            d["architectures"] = ["DFlash2DraftModel"]
            d["dflash_config"].update(conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size,
                                      selector_rank=self.selector_rank, selector_top_k=self.selector_top_k)
        if self.is_dspark:
            d["architectures"] = ["DSparkDraftModel"]
            d["dflash_config"].update(dspark_markov_rank=self.dspark_markov_rank,
                                      dspark_markov_gated=self.dspark_markov_gated)
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        return d

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "DFlashConfig":
        extra = d.get("dflash_config") or {}

        def pick(key: str, default: Any = None) -> Any:
            value = extra.get(key, d.get(key, default))
            if value is None:
                raise DFlashConfigError(f"drafter config.json: missing {key!r} (top level or in 'dflash_config')")
            return value

        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            layers = int(d["num_hidden_layers"])
        except KeyError as e:
            raise DFlashConfigError(f"drafter config.json: missing required key {e.args[0]!r}") from None
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        types = d.get("layer_types")
        window = d.get("sliding_window")
        if types is None:  # Qwen3Config without layer_types: sliding only with use_sliding_window
            window = window if d.get("use_sliding_window") else None
        elif "sliding_attention" not in types:
            window = None

        def opt(key: str, kind: type):
            value = extra.get(key, d.get(key))
            return None if value is None else kind(value)

        return cls(
            num_layers=layers, hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(pick("intermediate_size")),
            vocab_size=int(pick("vocab_size")),
            target_layer_ids=tuple(pick("target_layer_ids")),
            block_size=int(pick("block_size")),
            mask_token_id=int(pick("mask_token_id")),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            qk_norm=bool(d.get("qk_norm", True)),
            num_target_layers=d.get("num_target_layers"),
            sliding_window=int(window) if window else None,
            layer_types=tuple(types) if types is not None else None,
            is_causal=None if d.get("is_causal") is None else bool(d["is_causal"]),
            attention_bias=bool(d.get("attention_bias", False)),
            output_multiplier=float(opt("output_multiplier", float) or 1.0),
            final_logit_softcapping=opt("final_logit_softcapping", float) or None,
            input_embedding_scale=float(opt("input_embedding_scale", float) or 1.0),
            conv_kernel_size=opt("conv_kernel_size", int), conv_group_size=opt("conv_group_size", int),
            selector_rank=opt("selector_rank", int), selector_top_k=opt("selector_top_k", int),
            dspark_markov_rank=opt("dspark_markov_rank", int),
            dspark_markov_gated=bool(opt("dspark_markov_gated", bool) or False),
        )
