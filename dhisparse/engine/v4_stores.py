"""Build the KV store of a DeepSeek-V4 model for a preset: `resident` (`V4ResidentStore`) or the
row hierarchy of its CSA compressed rows (`hisparse` / `adaptive`, `kv/v4/hier.py`) with the
same hot-cache, host-pool, resolver and staging settings as the GLM presets."""

from __future__ import annotations

from typing import NamedTuple

import torch

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.memory import host_pool_bytes
from dhisparse.engine.stores import copy_fn_for, resolver_plan_fn
from dhisparse.kv.memory.arena import KVArena
from dhisparse.kv.memory.host import HostStore
from dhisparse.kv.v4.hier import V4AdaptiveKV, V4HierarchicalKV, V4HierStore, v4_row_geometry
from dhisparse.kv.v4.store import V4ResidentStore, v4_bytes
from dhisparse.core.v4_config import V4Config


class V4Store(NamedTuple):
    """The store, its page size in bytes and its pool size in pages."""

    store: object
    page_bytes: int
    pages: int


def build_v4_store(cfg: EngineConfig, mc: V4Config, pool_bytes: int, device: torch.device, dtype: torch.dtype,
                   max_model_len: int) -> V4Store:
    """pool_bytes: the KV pool's capacity; a page is `page_size` tokens of a request's whole V4
    state (resident) or `page_size` compressed rows of every CSA source (hierarchical presets)."""
    if cfg.base_preset == "resident":
        page_bytes = v4_bytes(mc, cfg.page_size, dtype.itemsize)
        pages = _pages(pool_bytes, page_bytes)
        return V4Store(V4ResidentStore(mc, pages * page_bytes, page_bytes, device, dtype), page_bytes, pages)
    rows_cfg = v4_row_geometry(mc)
    page_bytes = KVArena.page_bytes(rows_cfg, cfg.page_size, dtype.itemsize)
    pages = _pages(pool_bytes, page_bytes)
    arena = KVArena(rows_cfg, pages, cfg.page_size, device, dtype)
    hot = cfg.hot_cache_rows or 2 * mc.index_topk
    if hot < mc.index_topk:
        raise ValueError(f"hot_cache_rows ({hot}) must be >= the model's index_topk ({mc.index_topk})")
    host_pages = max(1, host_pool_bytes(cfg.host_pool_bytes, pages * page_bytes) // arena.page_nbytes)
    host = HostStore(host_pages, rows_cfg.num_layers, cfg.page_size, mc.head_dim, dtype, pin=device.type == "cuda")
    plan_fn = resolver_plan_fn(cfg, device)
    kw = dict(plan_fn=plan_fn, debug=cfg.debug_checks, copy_fn=copy_fn_for(plan_fn), v4=mc,
              max_queries=cfg.speculative_num_draft_tokens if cfg.speculative else 1)
    args = (arena, host, hot, cfg.max_running_requests)
    if cfg.base_preset == "hisparse":
        kv = V4HierarchicalKV(*args, **kw)
    else:
        kv = V4AdaptiveKV(*args, **kw, reserve_pages=cfg.admission_reserve_pages, reclaim_order=cfg.reclaim_order,
                          repopulate_pages=cfg.repopulate_pages, backup_ahead_pages=cfg.backup_ahead_pages, max_len=max_model_len // mc.csa_rate + 1)
    return V4Store(V4HierStore(mc, kv, device, dtype), page_bytes, pages)


def _pages(pool_bytes: int, page_bytes: int) -> int:
    pages = pool_bytes // page_bytes
    if pages < 1:
        raise ValueError(f"kv_pool_bytes is smaller than one page ({page_bytes} bytes); raise --kv-pool-bytes")
    return pages
