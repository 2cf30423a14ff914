"""Build the KV store a preset names: `resident` pages, or the hierarchy (`hisparse`, `adaptive`)
with its host pool, hot cache size, resolver implementation (Triton on CUDA, PyTorch otherwise)
and verification staging when speculation is on."""

from __future__ import annotations

import logging

import torch

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.memory import host_pool_bytes
from dhisparse.kv.hier.adaptive import AdaptiveKV
from dhisparse.kv.memory.arena import KVArena
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from dhisparse.kv.memory.host import HostStore
from dhisparse.kv.resident.store import ResidentKV

log = logging.getLogger("dhisparse.engine")


def build_store(cfg: EngineConfig, arena: KVArena, pool_bytes: int, max_model_len: int):
    mc = arena.cfg
    side_loads = cfg.load_stream == "side"
    if cfg.base_preset == "resident":
        return ResidentKV(arena, side_loads=side_loads)
    hot = cfg.hot_cache_rows or 2 * mc.index_topk
    if hot < mc.index_topk:
        raise ValueError(f"hot_cache_rows ({hot}) must be >= the model's index_topk ({mc.index_topk})")
    host_pages = max(1, host_pool_bytes(cfg.host_pool_bytes, pool_bytes) // arena.page_nbytes)
    host = HostStore(host_pages, mc.num_layers, cfg.page_size, mc.latent_dim, arena.dtype, pin=arena.device.type == "cuda")
    plan_fn = resolver_plan_fn(cfg, arena.device)
    kw = dict(plan_fn=plan_fn, debug=cfg.debug_checks, copy_fn=copy_fn_for(plan_fn),
              max_queries=cfg.speculative_num_draft_tokens if cfg.speculative else 1, side_loads=side_loads)
    args = (arena, host, hot, cfg.max_running_requests)
    if cfg.base_preset == "hisparse":
        return HierarchicalKV(*args, **kw, max_len=max_model_len)
    return AdaptiveKV(*args, **kw, reserve_pages=cfg.admission_reserve_pages, reclaim_order=cfg.reclaim_order,
                      repopulate_pages=cfg.repopulate_pages, backup_ahead_pages=cfg.backup_ahead_pages, max_len=max_model_len,
                      side_stream=cfg.copy_stream == "side")


def resolver_plan_fn(cfg: EngineConfig, device: torch.device):
    """The resolver plan: Triton when asked for, or on CUDA under "auto"; PyTorch otherwise."""
    from dhisparse.kernels.resolver_ref import plan_reference

    if not (cfg.resolver == "triton" or (cfg.resolver == "auto" and device.type == "cuda")):
        return plan_reference
    try:
        from dhisparse.kernels.resolver import plan_triton
    except ImportError as e:
        if cfg.resolver == "triton":
            raise ValueError(f"resolver 'triton' is unavailable here ({e}); use --resolver torch") from None
        log.warning("Triton resolver unavailable (%s); using the PyTorch resolver", e)
        return plan_reference
    return plan_triton


def copy_fn_for(plan_fn):
    from dhisparse.kernels.resolver_ref import plan_reference, run_copies

    if plan_fn is plan_reference:
        return run_copies
    from dhisparse.kernels.resolver import run_copies_triton

    return run_copies_triton
