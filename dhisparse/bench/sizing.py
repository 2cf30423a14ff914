"""The serving benchmark's pools (bench/gpu_serving.py): KV pool, request slots and host pool from
the stores' own page formulas, for GLM-5.x / V3.2 and DeepSeek-V4 models.

    pool   `--resident-fit` full histories under `resident`, plus the pages the engine itself
           holds for its life (the whole-step graphs' scratch page, `StepGraphs.SCRATCH_PAGES`;
           a DeepSeek-V4 engine builds no step graphs and holds none)
    slots  min(admit_factor x resident_fit, the hierarchy's steady-state device slots: pool // the
           pages a request holds for its whole life, the host pool's histories)
    host   the prefix's complete pages once (every request borrows them: kv/hier/prefix_pages.py)
           plus each request's own pages (HostStore.admit reserves the rest of its history)

GLM: one page size for every preset (`KVArena.page_bytes` of the `--kv-cache-dtype` row format),
the hierarchy's required pages = hot cache + tail + index pages (`HierarchicalKV.required_pages`).
DeepSeek-V4 (`v41-scaled`, `v41-faithful`): the presets divide one byte count into different
pages, read from the stores kv/build.py builds, built here on the meta device:
  resident   a page is `page_size` tokens of a request's whole state (`v4_bytes`: sliding windows,
             compressor tails, every compressed row and index key); `V4ResidentStore.pages_for`
  hierarchy  a page is `page_size` compressed rows of every CSA source (rows, not tokens: row w
             exists once (w+1) m tokens are committed); `_V4Rows.required_pages` = hot cache +
             tail + the sources' index keys + the untiered state (windows, tails, HCA rows);
             host pages are row pages too. Its device slots leave one admission's prompt
             workspace free (`v4_sizing`): measured against the engine in tests/test_gpu_serving_v4.py.

`adaptive` can hold one session fewer than the slots when the pool is full: its admission keeps
the reserve M_res free (`AdaptiveKV.default_reserve`), for GLM and DeepSeek-V4 alike.
"""

from __future__ import annotations

import argparse
import math

import torch

from dhisparse.core.kvformat import KVFormats
from dhisparse.core.v4_config import V4Config
from dhisparse.engine.step_graphs import StepGraphs
from dhisparse.kv.build import BuiltStore, StoreSettings, build_store
from dhisparse.kv.memory.arena import KVArena

GIB = float(1 << 30)
PROBE_POOL_BYTES = 1 << 30  # the meta-device stores' pool: room for one slot's staging at any page size
V4_MODELS = ("v41-scaled", "v41-faithful")


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0


FAITHFUL_OVERRIDABLE = ("glm5-faithful", "v41-faithful")  # models whose geometry --layers / --overrides change


def model_config(name: str, layers: int | None = None, overrides: dict | None = None):
    """The config of a built-in random model, no weights built: GLM / V3.2 (`builtin_config`) or
    DeepSeek-V4; `layers` / `overrides` change a faithful model's geometry (v41-faithful's small ones,
    models/v4_faithful.py; glm5-faithful's, models/faithful.py: e.g. fewer routed experts to fit an H100)."""
    from dhisparse.models.faithful import FAITHFUL_CONFIGS, faithful_config
    from dhisparse.models.registry import builtin_config
    from dhisparse.models.v4_faithful import v41_faithful_config
    from dhisparse.models.v4_scaled import v41_scaled_config

    if name == "v41-faithful":
        return v41_faithful_config(layers, overrides)
    if name in FAITHFUL_CONFIGS and (layers is not None or overrides):
        return faithful_config(name, layers, overrides)
    if layers is not None or overrides:
        raise ValueError(f"--layers / --overrides are for the faithful models ({', '.join(FAITHFUL_OVERRIDABLE)}), "
                         f"not {name!r}")
    return v41_scaled_config() if name == "v41-scaled" else builtin_config(name)


def model_dtype(ns) -> torch.dtype:
    return torch.bfloat16 if ns.dtype in (None, "auto") else getattr(torch, ns.dtype)


def kv_formats(ns, cfg) -> KVFormats:
    """The stored row formats the engine builds for `--kv-cache-dtype` (kv/build.py)."""
    if isinstance(cfg, V4Config):
        return KVFormats.v4(ns.kv_cache_dtype, cfg.head_dim, cfg.rope_head_dim, cfg.index_head_dim, model_dtype(ns))
    return KVFormats.of_model(ns.kv_cache_dtype, cfg, model_dtype(ns))


def sizing(ns, cfg) -> dict:
    """KV pool, slots and host pool (module docstring) for rows of `--kv-cache-dtype`."""
    return v4_sizing(ns, cfg) if isinstance(cfg, V4Config) else glm_sizing(ns, cfg)


def glm_sizing(ns, cfg) -> dict:
    """GLM-5.x / V3.2: a page is page_size x layers x the stored row's bytes, for every preset."""
    ps = ns.page_size
    formats = kv_formats(ns, cfg)
    arena = KVArena(cfg, 1, ps, "meta", model_dtype(ns), formats)
    page_bytes = KVArena.page_bytes(cfg, ps, formats.latent.nbytes)
    assert page_bytes == arena.page_nbytes, (page_bytes, arena.page_nbytes)
    total = ns.input_len + 8 + ns.output_len  # prefix + suffix (< 8 tokens) + output cap
    resident = arena.latent_pages_for(total) + arena.index_pages_for(total)  # ResidentKV.pages_for
    B = ns.hot_cache_rows or 2 * cfg.index_topk
    tail = 1 + math.ceil(ns.spec_width / ps)  # HierarchicalKV.tail_pages at K_max
    hier = B // ps + tail + arena.index_pages_for(total)  # HierarchicalKV.required_pages
    # + the page an engine with whole-step graphs keeps for padding (StepGraphs.SCRATCH_PAGES): without
    # it `resident` would hold resident_fit - 1 histories
    pool_pages = ns.resident_fit * resident + StepGraphs.SCRATCH_PAGES
    shared = ns.input_len // ps * page_bytes
    host_per_req = (math.ceil(total / ps) - ns.input_len // ps) * page_bytes
    return dict(kv_cache_dtype=ns.kv_cache_dtype, latent_row_bytes=formats.latent.nbytes,
                index_row_bytes=formats.index.nbytes, page_bytes=page_bytes, tokens_per_request=total, resident_pages_per_request=resident,
                hierarchy_required_pages_per_request=hier, hierarchy_admission_transient_pages=arena.latent_pages_for(ns.input_len + 8),
                hot_cache_rows=B, kv_pool_pages=pool_pages, kv_pool_bytes=pool_pages * page_bytes,
                resident_fit=ns.resident_fit, **host_and_slots(ns, pool_pages // hier, shared, host_per_req))


def host_and_slots(ns, device_slots: int, shared: int, host_per_req: int) -> dict:
    """The host pool and max_running_requests: the pool holds the shared prefix once and each slot's
    own pages, `--host-pool-gib` or what min(target, device slots) need (<= 80% of MemAvailable:
    pinned at its exact size, kv/memory/pinned.py), and at least one whole history (never_fits)."""
    target = int(ns.admit_factor * ns.resident_fit)
    host_cap_bytes = int(0.8 * mem_available()) or 1 << 40
    want = shared + min(target, device_slots) * host_per_req
    host_bytes = int(ns.host_pool_gib * GIB) if ns.host_pool_gib else min(want, host_cap_bytes)
    host_slots = max(0, host_bytes - shared) // host_per_req
    slots = max(1, min(target, device_slots, host_slots))
    host_bytes = max(host_bytes, shared + host_per_req)
    return dict(hierarchy_device_slots=device_slots, slot_target=target, host_bytes_per_request=host_per_req,
                host_shared_prefix_bytes=shared, host_pool_bytes=host_bytes,
                host_slots=max(0, host_bytes - shared) // host_per_req,
                host_mem_available=mem_available(), max_running_requests=slots)


def probe_store(ns, cfg, preset: str, total: int) -> BuiltStore:
    """The store of `preset` as kv/build.py builds it for an engine of these settings (tails and
    staging at K_max = --spec-width, as the +spec presets'), on the meta device: one host page."""
    s = StoreSettings(preset=preset, page_size=ns.page_size, hot_cache_rows=ns.hot_cache_rows, host_pool_bytes=1,
                      max_running=1, max_queries=ns.spec_width, kv_cache_dtype=ns.kv_cache_dtype)
    return build_store(s, cfg, PROBE_POOL_BYTES, torch.device("meta"), model_dtype(ns), total + 8)


def scratch_pages(built: BuiltStore) -> int:
    """Pool pages an engine over `built` holds for its life: StepGraphs.for_engine's scratch page,
    taken only where the store has an arena and step-graph contexts (never for DeepSeek-V4)."""
    return StepGraphs.SCRATCH_PAGES if built.arena is not None and built.store.graph_context() is not None else 0


def v4_sizing(ns, cfg: V4Config) -> dict:
    """DeepSeek-V4: resident pages and the row hierarchy's pages read from the stores (module
    docstring); the pool is resident_fit resident histories in bytes, the hierarchy's slots are
    its pages of that pool, less one admission's prompt workspace, // a request's required pages:
    a V4 prefix is imported whole into the workspace (no host-first admission, `_V4Rows.HOST_FIRST`),
    so the last session admitted needs its workspace beside the others' required pages."""
    total = ns.input_len + 8 + ns.output_len
    res, hier = probe_store(ns, cfg, "resident", total), probe_store(ns, cfg, "hisparse", total)
    resident = res.store.pages_for(total)  # V4ResidentStore.pages_for
    rows, prefix_rows = hier.store.rows(total), hier.store.rows(ns.input_len)
    required = hier.store.kv.required_pages(rows)  # _V4Rows.required_pages (rows)
    scratch = scratch_pages(res) * res.page_bytes + scratch_pages(hier) * hier.page_bytes
    pool_bytes = ns.resident_fit * resident * res.page_bytes + scratch
    hier_pages = pool_bytes // hier.page_bytes
    transient = hier.store.pages_for(total, ns.input_len + 8) - required  # the prompt's workspace
    f, ps = hier.arena.formats, ns.page_size
    shared = prefix_rows // ps * hier.page_bytes  # the prefix's complete row pages, borrowed
    host_per_req = (hier.arena.latent_pages_for(rows) - prefix_rows // ps) * hier.page_bytes
    return dict(model_family="deepseek_v4", kv_cache_dtype=ns.kv_cache_dtype, latent_row_bytes=f.latent.nbytes,
                index_row_bytes=f.index.nbytes, page_bytes=hier.page_bytes, resident_page_bytes=res.page_bytes,
                tokens_per_request=total, rows_per_request=rows, resident_pages_per_request=resident,
                resident_bytes_per_request=resident * res.page_bytes,
                hierarchy_required_pages_per_request=required,
                hierarchy_state_pages_per_request=hier.store.kv.state_pages(rows),
                hierarchy_admission_transient_pages=transient,
                hot_cache_rows=hier.store.kv.B, kv_pool_pages=ns.resident_fit * resident, hierarchy_pool_pages=hier_pages,
                scratch_bytes=scratch, admission_workspace_bytes=transient * hier.page_bytes, kv_pool_bytes=pool_bytes,
                resident_fit=ns.resident_fit,
                **host_and_slots(ns, max(0, hier_pages - transient) // required, shared, host_per_req))


def resident_fit_for(ns, cfg, pool_bytes: int) -> int:
    """The full histories under `resident` a pool of `pool_bytes` holds beside the engine's own
    pages (at least 1): `--resident-fit` for a pool given in bytes."""
    sz = sizing(argparse.Namespace(**{**vars(ns), "resident_fit": 1}), cfg)
    return max(1, (pool_bytes - scratch_bytes(sz)) // resident_bytes(sz))


def resident_bytes(sz: dict) -> int:
    """Device bytes of one full history under `resident`."""
    return sz.get("resident_bytes_per_request", sz["resident_pages_per_request"] * sz["page_bytes"])


def scratch_bytes(sz: dict) -> int:
    """Pool bytes the engine holds for its life (GLM: the step graphs' scratch page)."""
    return sz.get("scratch_bytes", StepGraphs.SCRATCH_PAGES * sz["page_bytes"])


def charge(sz: dict, weights: int, ring: int, stage: int) -> dict:
    """The +spec presets' pool and slots when speculation is charged for its memory (gpu_serving's
    `spec_charge`): drafter weights W, ring R a slot outside the pool, staging X a slot inside it,
    beside each session's required pages H:

        slots      S = min(target, host slots, (pool - W - scratch - workspace) // (H + X + R))
        its pool   pool - W - S * R          (so pool + W + S * R = the others' pool)

    (workspace: DeepSeek-V4's one admission workspace, `v4_sizing`; 0 for GLM)
    """
    session = sz["hierarchy_required_pages_per_request"] * sz["page_bytes"]
    usable = sz["kv_pool_bytes"] - weights - scratch_bytes(sz) - sz.get("admission_workspace_bytes", 0)
    slots = min(sz["slot_target"], sz["host_slots"], usable // (session + stage + ring))
    if slots < 1 or usable - slots * ring < sz["page_bytes"]:
        raise SystemExit(f"--charge-spec-memory: speculation does not fit the {sz['kv_pool_bytes']} B pool (drafter "
                         f"weights {weights} B; a slot needs {session} B of pages + {stage} B of staging + {ring} B of "
                         "ring); raise --resident-fit or shrink the drafter's window")
    return dict(drafter_weight_bytes=weights, drafter_ring_bytes_per_slot=ring, staging_bytes_per_slot=stage,
                kv_pool_bytes=sz["kv_pool_bytes"] - weights - slots * ring, max_running_requests=slots,
                uncharged_max_running_requests=sz["max_running_requests"])


def describe(sz: dict) -> str:
    """The [sizing] line gpu_serving prints."""
    pages = (f"resident {sz['resident_pages_per_request']} pages/request, hierarchy "
             f"{sz['hierarchy_required_pages_per_request']} (+{sz['hierarchy_admission_transient_pages']} at admission); "
             f"pool {sz['kv_pool_pages']} pages = {sz['kv_pool_bytes'] / GIB:.1f} GiB")
    if sz.get("model_family") == "deepseek_v4":  # two page sizes in one pool
        pages = (f"resident page {sz['resident_page_bytes'] / 2**20:.2f} MiB x {sz['resident_pages_per_request']} a "
                 f"request, hierarchy {sz['hierarchy_required_pages_per_request']} row pages (+"
                 f"{sz['hierarchy_admission_transient_pages']} at admission); pool {sz['kv_pool_bytes'] / GIB:.2f} GiB = "
                 f"{sz['kv_pool_pages']} resident / {sz['hierarchy_pool_pages']} row pages")
    return (f"{sz['kv_cache_dtype']} rows ({sz['latent_row_bytes']}-B latent, {sz['index_row_bytes']}-B index); "
            f"page {sz['page_bytes'] / 2**20:.2f} MiB; {pages}; slots: target {sz['slot_target']}, "
            f"device {sz['hierarchy_device_slots']}, host {sz['host_slots']} -> max_running_requests "
            f"{sz['max_running_requests']}; host pool {sz['host_pool_bytes'] / GIB:.1f} GiB")
