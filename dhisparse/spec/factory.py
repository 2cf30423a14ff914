"""Build the drafter and width policy a `SpecConfig` describes (engine start-up)."""

from __future__ import annotations

from dataclasses import replace

from dhisparse.spec.config import DEFAULT_WINDOW, SpecConfig, SpecConfigError
from dhisparse.spec.dflash import DFlashDrafter, target_parts
from dhisparse.spec.dflash_config import DFlashConfig, default_target_layer_ids
from dhisparse.spec.drafter import Drafter
from dhisparse.spec.dspark import DSparkDrafter, VerifyCost
from dhisparse.spec.mtp import build_mtp
from dhisparse.spec.ngram import NgramDrafter
from dhisparse.spec.oracle import CostedOracle, OracleDrafter, Reference, corrupt_rate_for_tokens_per_round
from dhisparse.spec.policy import StaticWidthSchedule


RANDOM_MARKOV_RANK = 32  # DSpark's head rank for random weights
RANDOM_SELECTOR = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=32, selector_top_k=8)  # DFlash2's


def random_dflash_config(target, block_size: int, num_layers: int = 2, kind: str = "dflash") -> DFlashConfig:
    """A small drafter shaped for `target` (hidden / vocab / layer ids), for random weights; kind
    "dspark" adds the sequential head, "dflash2" the convolutions and the candidate selector."""
    tcfg = target_parts(target)[2]
    heads = max(1, tcfg.num_heads)
    extra: dict = {}
    if kind == "dspark":
        extra = dict(dspark_markov_rank=RANDOM_MARKOV_RANK, dspark_markov_gated=True)
    elif kind == "dflash2":
        group = RANDOM_SELECTOR["conv_group_size"] if tcfg.hidden_size % RANDOM_SELECTOR["conv_group_size"] == 0 else 1
        extra = dict(RANDOM_SELECTOR, conv_group_size=group)
    return DFlashConfig(**extra,
        num_layers=num_layers, hidden_size=tcfg.hidden_size, num_heads=heads, num_kv_heads=heads,
        head_dim=max(2, (tcfg.hidden_size // heads) // 2 * 2), intermediate_size=2 * tcfg.hidden_size,
        vocab_size=tcfg.vocab_size, target_layer_ids=default_target_layer_ids(tcfg.num_layers, num_layers),
        block_size=block_size, mask_token_id=tcfg.pad_token_id or 0, rms_norm_eps=tcfg.rms_norm_eps,
        sliding_window=DEFAULT_WINDOW, is_causal=False,
    )


def build_dflash(cfg: SpecConfig, target, max_requests: int = 64) -> DFlashDrafter:
    """Checkpoint at cfg.draft_model_path, else seeded random weights (block = cfg.block)."""
    kw = dict(window=cfg.draft_window_size, page=cfg.page_size, k_max=cfg.num_draft_tokens, max_requests=max_requests,
              max_context=cfg.max_context)
    if cfg.draft_model_path:
        drafter = DFlashDrafter.load(cfg.draft_model_path, target, **kw)
        cfg.check_block(drafter.cfg.block_size)
        _check_kind(cfg.algorithm, drafter.cfg)
        return drafter
    return DFlashDrafter.random(random_dflash_config(target, cfg.block, kind=cfg.algorithm), target, seed=cfg.seed, **kw)


def _check_kind(algorithm: str, dcfg: DFlashConfig) -> None:
    """A checkpoint must have the parts its algorithm names (no part is made up for it)."""
    if algorithm == "dspark" and not dcfg.is_dspark:
        raise SpecConfigError("--speculative-algorithm dspark: the drafter checkpoint has no DSpark sequential head "
                              "(dspark_markov_rank and sequential_head.* tensors); use --speculative-algorithm dflash")
    if algorithm == "dflash2" and not dcfg.is_dflash2:
        raise SpecConfigError("--speculative-algorithm dflash2: the drafter checkpoint is not a DFlash2 drafter (no "
                              "conv_* / selector_* in dflash_config); use --speculative-algorithm dflash")


def build_drafter(cfg: SpecConfig, target, *, reference: Reference | None = None, max_requests: int = 64,
                  cost: VerifyCost | None = None) -> Drafter:
    """The drafter for cfg.algorithm. `reference` is required for the oracle; `cost` for dspark
    (default: a linear prior until the engine measures)."""
    if cfg.algorithm == "ngram":
        return NgramDrafter(cfg.ngram_min_n, cfg.ngram_max_n)
    if cfg.algorithm == "oracle":
        if reference is None:
            raise SpecConfigError("--speculative-algorithm oracle needs a reference run (prompt -> target output ids)")
        rate = cfg.oracle_corrupt_rate or 0.0
        if cfg.oracle_tokens_per_round is not None:
            rate = corrupt_rate_for_tokens_per_round(cfg.oracle_tokens_per_round, cfg.width_for_oracle)
        oracle = OracleDrafter(reference, target_parts(target)[2].vocab_size, rate, cfg.seed)
        if cfg.oracle_drafter is None:
            return oracle
        inner = replace(cfg, algorithm=cfg.oracle_drafter, oracle_drafter=None, oracle_tokens_per_round=None,
                        oracle_corrupt_rate=None)
        return CostedOracle(build_drafter(inner, target, max_requests=max_requests, cost=cost), oracle)
    if cfg.algorithm == "mtp":
        return build_mtp(cfg, target, max_requests)
    drafter = build_dflash(cfg, target, max_requests)
    return DSparkDrafter(drafter, cost or VerifyCost()) if cfg.algorithm == "dspark" else drafter


def static_schedule(cfg: SpecConfig) -> StaticWidthSchedule:
    return StaticWidthSchedule(cfg.static_schedule, cfg.static_default_width)
