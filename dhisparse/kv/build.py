"""`build_store`: the KV store a preset names, for every model family.

    resident    GLM-5.x / V3.2: `ResidentKV` over the page arena; DeepSeek-V4: `V4ResidentStore`
    hisparse    host backing + fixed hot cache + resolver: `HierarchicalKV` (V4: over its CSA
                sources' row geometry, wrapped in `V4HierStore`)
    adaptive    hisparse + load-adaptive residency: `AdaptiveKV` (V4: `V4AdaptiveKV`)

Every setting reaches both families the same way (`StoreSettings`): hot-cache rows, host pool,
resolver implementation (Triton on CUDA, PyTorch otherwise), the copy and load streams, the
residency knobs and the verification width that sizes tails and staging.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dhisparse.core.config import ModelConfig
from dhisparse.core.contracts import KVStore
from dhisparse.core.kvformat import KVFormats, check_device
from dhisparse.core.v4_config import V4Config
from dhisparse.kernels.resolver_ref import plan_reference, run_copies
from dhisparse.kv.hier.adaptive import AdaptiveKV
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from dhisparse.kv.memory.arena import KVArena
from dhisparse.kv.memory.host import HostStore
from dhisparse.kv.memory.layout import RowGeometry
from dhisparse.kv.resident.store import ResidentKV
from dhisparse.kv.v4.hier import V4AdaptiveKV, V4HierarchicalKV, V4HierStore, v4_row_geometry
from dhisparse.kv.v4.store import V4ResidentStore, v4_bytes

try:  # Triton is optional on CPU
    from dhisparse.kernels.resolver import plan_triton, run_copies_triton
except ImportError as e:  # pragma: no cover - exercised only where triton is missing
    plan_triton = run_copies_triton = None
    _TRITON_ERROR = str(e)

log = logging.getLogger("dhisparse.kv")

BASE_PRESETS = ("resident", "hisparse", "adaptive")


@dataclass(frozen=True)
class StoreSettings:
    """What a store is built from (EngineConfig.store_settings(); CLI flags in brackets there).

    preset        resident | hisparse | adaptive (speculation is orthogonal: max_queries)
    page_size     token positions per latent page
    hot_cache_rows  B per request and source (None: 2 x index_topk; must be >= index_topk)
    source_hot_cache_rows  one B per KV source / selection group instead (None: hot_cache_rows for each)
    host_pool_bytes host backing bytes (None: 4 x the device pool, capped at half of MemAvailable)
    resolver      auto | torch | triton
    copy_stream   adaptive's backup / repopulation copies: side | compute
    load_stream   admission copies (prefix import, hand-off backup): compute | side
    prefetch_stream  follower layers' copies of a shared selection: compute | side (kv/hier/prefetch.py)
    resolver_copy  a deferred plan's producer copies: separate (plan, then a gather launch) | fused (the
                  plan kernel copies: kv/hier/resolver_step.py's `producer_rows`)
    resolver_lookup  how a plan finds hot-cache hits: scan (the hot cache against the selection) | index
                  (a position -> hot entry table per slot and group, int16: kv/hier/tables.py)
    admission_placement  a prefix-matched admission: auto | import | host (HierarchicalKV._placement)
    staging_mode  verification staging: auto | paper | single (kv/hier/promotion.py)
    reserve_pages, reclaim_order, repopulate_pages, backup_ahead_pages: adaptive residency
    max_running   request slots; max_queries: tokens a request verifies per pass (K_max, 1 = none)
    debug         integrity / selection checks
    kv_cache_dtype  auto | bfloat16 (plain rows of the model dtype) | fp8_e4m3 (FP8 rows in every
                  tier: `core/kvformat.py`)
    """

    preset: str = "resident"
    page_size: int = 16
    hot_cache_rows: int | None = None
    source_hot_cache_rows: tuple[int, ...] | None = None
    host_pool_bytes: int | None = None
    resolver: str = "auto"
    copy_stream: str = "side"
    load_stream: str = "compute"
    prefetch_stream: str = "compute"
    resolver_copy: str = "separate"
    resolver_lookup: str = "scan"
    admission_placement: str = "auto"
    staging_mode: str = "auto"
    reserve_pages: int | None = None  # None: AdaptiveKV.default_reserve
    reclaim_order: str = "remaining"
    repopulate_pages: int = 8
    backup_ahead_pages: int = 32
    decode_pages: str = "optional"  # adaptive: "optional" (ours) or "hot-cache" (the paper's)
    max_running: int = 64
    max_queries: int = 1
    debug: bool = False
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.preset not in BASE_PRESETS:
            raise ValueError(f"preset must be one of {', '.join(BASE_PRESETS)}; got {self.preset!r}")


class BuiltStore(NamedTuple):
    """The store, the page arena it uses (None for V4 resident), its page size and pool pages."""

    store: KVStore
    arena: KVArena | None
    page_bytes: int
    pages: int


class Resolver(NamedTuple):
    """A resolver implementation: plan and copy functions; deferred = the plan can be enqueued
    without a host sync (`plan(..., defer=True)`: the Triton resolver)."""

    plan_fn: object
    copy_fn: object
    deferred: bool


def host_pool_bytes(setting: int | None, device_pool: int) -> int:
    """Host backing bytes: the setting, else 4 x the device pool capped at half of the host's
    available memory."""
    if setting is not None:
        return setting
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    return min(4 * device_pool, avail // 2) if avail else 4 * device_pool


def resolver_for(name: str, device: torch.device) -> Resolver:
    """The resolver `name` (auto | torch | triton) means on `device`: Triton when asked for, or on
    CUDA under "auto"; the PyTorch reference otherwise."""
    if not (name == "triton" or (name == "auto" and device.type == "cuda")):
        return Resolver(plan_reference, run_copies, False)
    if plan_triton is None:
        if name == "triton":
            raise ValueError(f"resolver 'triton' is unavailable here ({_TRITON_ERROR}); use --resolver torch")
        log.warning("Triton resolver unavailable (%s); using the PyTorch resolver", _TRITON_ERROR)
        return Resolver(plan_reference, run_copies, False)
    return Resolver(plan_triton, run_copies_triton, True)


def build_store(s: StoreSettings, mc: ModelConfig | V4Config, pool_bytes: int, device: torch.device,
                dtype: torch.dtype, max_model_len: int) -> BuiltStore:
    """The store of preset `s.preset` for model `mc` in a device pool of `pool_bytes`."""
    check_device(s.kv_cache_dtype, torch.device(device))
    if isinstance(mc, V4Config):
        return _build_v4(s, mc, pool_bytes, device, dtype, max_model_len)
    geometry = RowGeometry.of_model(mc)
    formats = _formats(KVFormats.of_model, s.kv_cache_dtype, mc, dtype)
    page_bytes = KVArena.page_bytes(geometry, s.page_size, formats.latent.nbytes)
    pages = _pages(pool_bytes, page_bytes)
    arena = KVArena(geometry, pages, s.page_size, device, dtype, formats)
    if s.preset == "resident":
        return BuiltStore(ResidentKV(arena, side_loads=s.load_stream == "side"), arena, page_bytes, pages)
    return BuiltStore(_hierarchy(s, arena, geometry, pages * page_bytes, max_model_len, HierarchicalKV, AdaptiveKV, {}),
                      arena, page_bytes, pages)


def _build_v4(s: StoreSettings, mc: V4Config, pool_bytes: int, device: torch.device, dtype: torch.dtype,
              max_model_len: int) -> BuiltStore:
    """V4: a page is `page_size` tokens of a request's whole state (resident) or `page_size`
    compressed rows of every CSA source (hierarchical presets; positions are row ids)."""
    formats = _formats(KVFormats.v4, s.kv_cache_dtype, mc.head_dim, mc.rope_head_dim, mc.index_head_dim, dtype)
    if s.preset == "resident":
        page_bytes = v4_bytes(mc, s.page_size, dtype.itemsize, formats)
        pages = _pages(pool_bytes, page_bytes)
        return BuiltStore(V4ResidentStore(mc, pages * page_bytes, page_bytes, device, dtype, formats), None,
                          page_bytes, pages)
    geometry = v4_row_geometry(mc)
    page_bytes = KVArena.page_bytes(geometry, s.page_size, formats.latent.nbytes)
    pages = _pages(pool_bytes, page_bytes)
    arena = KVArena(geometry, pages, s.page_size, device, dtype, formats)
    kv = _hierarchy(s, arena, geometry, pages * page_bytes, max_model_len // mc.csa_rate + 1,
                    V4HierarchicalKV, V4AdaptiveKV, {"v4": mc})
    return BuiltStore(V4HierStore(mc, kv, device, dtype), arena, page_bytes, pages)


def _hierarchy(s: StoreSettings, arena: KVArena, geometry: RowGeometry, pool_bytes: int, max_len: int,
               hier_cls: type, adaptive_cls: type, extra: dict) -> HierarchicalKV:
    hot = s.hot_cache_rows or 2 * geometry.index_topk
    if hot < geometry.index_topk:
        raise ValueError(f"hot_cache_rows ({hot}) must be >= the model's index_topk ({geometry.index_topk})")
    per = s.source_hot_cache_rows
    groups = len(arena.layout.index_layers)
    if per is not None and (len(per) != groups or min(per) < geometry.index_topk):
        raise ValueError(f"--source-hot-cache-rows needs {groups} budgets (one per KV source), each >= the model's "
                         f"index_topk ({geometry.index_topk}); got {list(per)}")
    host_pages = max(1, host_pool_bytes(s.host_pool_bytes, pool_bytes) // arena.page_nbytes)
    host = HostStore(host_pages, geometry.num_layers, s.page_size, arena.row_width, arena.dtype,
                     pin=arena.device.type == "cuda")
    r = resolver_for(s.resolver, arena.device)
    kw = dict(plan_fn=r.plan_fn, copy_fn=r.copy_fn, deferred=r.deferred, debug=s.debug, max_queries=s.max_queries,
              side_loads=s.load_stream == "side", prefetch=s.prefetch_stream, placement=s.admission_placement,
              fuse_copies=s.resolver_copy == "fused", hot_index=s.resolver_lookup == "index",
              staging_mode=s.staging_mode,
              max_len=max_len, source_hot_rows=per, **extra)
    args = (arena, host, hot, s.max_running)
    if s.preset == "hisparse":
        return hier_cls(*args, **kw)
    return adaptive_cls(*args, **kw, reserve_pages=s.reserve_pages, reclaim_order=s.reclaim_order,
                        repopulate_pages=s.repopulate_pages, backup_ahead_pages=s.backup_ahead_pages,
                        keep_decode_pages=s.decode_pages == "optional",
                        side_stream=s.copy_stream == "side")


def _formats(make, kv_cache_dtype: str, *dims) -> KVFormats:
    """The model's row formats under `--kv-cache-dtype`, or a clear error naming the flag."""
    try:
        return make(kv_cache_dtype, *dims)
    except ValueError as e:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} cannot store this model's rows: {e}") from None


def _pages(pool_bytes: int, page_bytes: int) -> int:
    pages = pool_bytes // page_bytes
    if pages < 1:
        raise ValueError(f"kv_pool_bytes is smaller than one page ({page_bytes} bytes); raise --kv-pool-bytes")
    return pages
