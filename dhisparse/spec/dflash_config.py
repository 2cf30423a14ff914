"""`DFlashConfig`: shape of a DFlash-style block drafter, its config.json form and start-up checks.

config.json (public DFlash layout: a Qwen3-style decoder config plus a `dflash_config` object):

    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    intermediate_size, vocab_size, rms_norm_eps, rope_theta | rope_parameters.rope_theta,
    num_target_layers (optional), sliding_window + use_sliding_window (optional, = W),
    dflash_config: {block_size, mask_token_id, target_layer_ids}

`block_size`, `mask_token_id` and `target_layer_ids` are also accepted at the top level.
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        self.validate()

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
            "is_causal": False,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.sliding_window is not None:
            d.update(sliding_window=self.sliding_window, use_sliding_window=True)
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
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
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
        )
