"""Per-request device memory, measured from the allocators (the paper's Table 1 rows).

Builds the stores on the `meta` device (no memory is touched), admits one request of the given
context under each preset and sums the pages and metadata it holds, split into latent history
(resident), hot cache, tail, index state and metadata; plus its host backup. `adaptive` is
measured without optional residency, which only uses memory that is spare.

Rows are stored in the format `--kv-cache-dtype` gives (core/kvformat.py, `KVFormats.mla`): the
arenas, host stores and staging are built from it, so every byte count follows the stored row
(GLM-5.2: 1,152-B latent rows and 256-B index keys in bf16; 656-B and 132-B rows in fp8_e4m3).
The drafter's ring (+spec rows) stays in the model dtype: it is the drafter's own K/V, not a KV
tier.

The paper's Table 1 is FP8: `memreport_paper.py` sets our FP8 rows beside it (`paper_comparison`),
and `main` prints both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from dhisparse.core.config import ModelConfig
from dhisparse.core.kvformat import KV_CACHE_DTYPES, KVFormats
from dhisparse.core.v4_config import V4Config
from dhisparse.kv.hier.adaptive import AdaptiveKV
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from dhisparse.kv.memory.arena import KVArena
from dhisparse.kv.memory.host import HostStore
from dhisparse.kv.memory.layout import RowGeometry
from dhisparse.kv.resident.store import ResidentKV
from dhisparse.kv.v4.hier import V4HierarchicalKV, v4_row_geometry

GIB = float(1 << 30)
BOTH = "both"  # --kv-cache-dtype both: the bf16 and the fp8_e4m3 rows, one after the other


def glm52_config(**over) -> ModelConfig:
    """GLM-5.2 KV shape: 78 layers, 21 full indexers (freq 4, offset 3), latent 512 + rope 64, k 2048."""
    d = dict(model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, num_hidden_layers=78, num_attention_heads=64,
             q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
             index_n_heads=32, index_head_dim=128, index_topk=2048, index_topk_freq=4, index_skip_topk_offset=3,
             n_routed_experts=256, num_experts_per_tok=8, max_position_embeddings=1048576)
    d.update(over)
    return ModelConfig.from_hf(d)


def kv_formats(cfg: ModelConfig, kv_cache_dtype: str = "auto", dtype: torch.dtype = torch.bfloat16) -> KVFormats:
    """The stored row formats of `cfg` under `--kv-cache-dtype` (what kv/build.py builds)."""
    return KVFormats.of_model(kv_cache_dtype, cfg, dtype)


@dataclass(frozen=True)
class DrafterShape:
    """The drafter of the speculative rows: 6 layers, K and V of 4 heads x 128 (bf16: 12 allocations
    of 1024 B = 12,288 B per ring row, as in the paper), window W, page p, K_max."""

    layers: int = 6
    kv_heads: int = 4
    head_dim: int = 128
    window: int = 2048
    page: int = 64
    k_max: int = 8


@dataclass(frozen=True)
class MemoryRow:
    """Device bytes one request holds (GiB) and its host backup, for one preset and context."""

    preset: str
    context: int
    latent_history: float
    hot_cache: float
    tail: float
    index_state: float
    metadata: float
    host_backup: float
    draft_ring: float = 0.0
    staging: float = 0.0

    @property
    def device_total(self) -> float:
        return (self.latent_history + self.hot_cache + self.tail + self.index_state + self.metadata
                + self.draft_ring + self.staging)


def _arena(cfg: ModelConfig | RowGeometry, page_size: int, pages: int, dtype: torch.dtype, formats: KVFormats | None = None) -> KVArena:
    """A meta-device arena of `pages` pages; dtype: the model dtype; formats: the stored rows (None: plain)."""
    return KVArena(cfg, pages, page_size, "meta", dtype, formats)


def _host(arena: KVArena, pages: int) -> HostStore:
    """A meta-device host store of the arena's stored rows (width and storage dtype)."""
    return HostStore(pages, arena.cfg.num_layers, arena.page_size, arena.row_width, arena.dtype, pin=False, device="meta")


def staging_bytes_per_slot(cfg: ModelConfig | V4Config, page_size: int, hot_rows: int, dtype: torch.dtype, k_max: int,
                           formats: KVFormats | None = None, staging_mode: str = "auto") -> int:
    """One request slot's share of the verification staging arenas (eq. 11: chi x K_max x k stored
    rows), from a meta-device hierarchy built the way the engine builds it (DeepSeek-V4: its row
    hierarchy over the CSA sources, kv/build.py; `formats` then V4's rows); 0 for K_max = 1."""
    if k_max < 2:
        return 0
    v4 = isinstance(cfg, V4Config)
    arena = _arena(v4_row_geometry(cfg) if v4 else cfg, page_size, 1 << 20, dtype, formats)
    cls, extra = (V4HierarchicalKV, {"v4": cfg}) if v4 else (HierarchicalKV, {})
    kv = cls(arena, _host(arena, 1), hot_rows, max_slots=1, max_queries=k_max, staging_mode=staging_mode, **extra)
    return kv.stage_arenas.numel() * kv.stage.element_size()


def resident_row(cfg: ModelConfig, context: int, page_size: int, dtype: torch.dtype,
                 formats: KVFormats | None = None) -> MemoryRow:
    arena = _arena(cfg, page_size, 1 << 20, dtype, formats)
    kv = ResidentKV(arena)
    kv.admit("r", context)
    kv.ensure("r", context)
    pb = arena.page_nbytes
    meta = (len(kv.latent_tables["r"]) + len(kv.index_tables["r"])) * 4  # int32 block tables
    return MemoryRow("resident", context, len(kv.latent_tables["r"]) * pb / GIB, 0, 0,
                     len(kv.index_tables["r"]) * pb / GIB, meta / GIB, 0.0)


def ring_gib(d: DrafterShape, dtype: torch.dtype) -> float:
    """One request slot's draft KV ring, measured from a DraftKVRing built on the meta device
    (in the model dtype whatever the KV cache's row format: the drafter's own K/V)."""
    from dhisparse.spec.ring import DraftKVRing, ring_rows

    ring = DraftKVRing(d.layers, 1, ring_rows(d.window, d.page, d.k_max), d.kv_heads, d.head_dim, dtype, "meta")
    return ring.bytes_per_slot() / GIB


def spec_row(row: MemoryRow, cfg: ModelConfig, page_size: int, hot_rows: int, dtype: torch.dtype, d: DrafterShape,
             formats: KVFormats | None = None) -> MemoryRow:
    """`row` plus the speculative required state: the drafter's ring and, on hierarchical presets,
    the request slot's share of the verification staging arenas (eq. 11 with chi of them, as the
    paper counts: `--staging-mode paper`; the engine's default single staging holds one, a chi-th
    of this; staged rows are stored rows, so their bytes follow the row format)."""
    staging = 0.0
    if row.preset != "resident":
        arena = _arena(cfg, page_size, 1 << 20, dtype, formats)
        kv = HierarchicalKV(arena, _host(arena, 1), hot_rows, max_slots=1, max_queries=d.k_max, staging_mode="paper")
        staging = kv.stage_arenas.numel() * kv.stage.element_size() / GIB
        tail = kv.tail_pages * arena.page_nbytes / GIB
        row = replace(row, tail=tail)
    return replace(row, preset=row.preset + "+spec", draft_ring=ring_gib(d, dtype), staging=staging)


def hisparse_row(cfg: ModelConfig, context: int, page_size: int, hot_rows: int, dtype: torch.dtype, preset: str = "hisparse",
                 formats: KVFormats | None = None) -> MemoryRow:
    arena = _arena(cfg, page_size, 1 << 20, dtype, formats)
    host = _host(arena, 1 << 16)
    cls = AdaptiveKV if preset == "adaptive" else HierarchicalKV
    kv = cls(arena, host, hot_rows, max_slots=1)
    kv.admit("r", context, prompt_len=0)
    kv.resident.ensure_index("r", context)
    host.ensure("r", context)
    st, pb = kv.reqs["r"], arena.page_nbytes
    slot_meta = sum(t[0].numel() * t.element_size() for t in (kv.hot_pos, kv.hot_stamp, kv.hot_loc, kv.tail_loc, kv.tail_start))
    tables = (len(kv.resident.index_tables["r"]) + len(host.tables["r"])) * 4
    return MemoryRow(preset, context, 0, len(st.hot_pages) * pb / GIB, len(st.tail_pages) * pb / GIB,
                     len(kv.resident.index_tables["r"]) * pb / GIB, (slot_meta + tables) / GIB,
                     len(host.tables["r"]) * host.page_nbytes / GIB)


def preset_rows(cfg: ModelConfig, contexts, page_size: int, hot_rows: int, dtype: torch.dtype, formats: KVFormats,
          d: DrafterShape) -> list[MemoryRow]:
    out = []
    for n in contexts:
        res = resident_row(cfg, n, page_size, dtype, formats)
        ada = hisparse_row(cfg, n, page_size, hot_rows, dtype, "adaptive", formats)
        out += [res, hisparse_row(cfg, n, page_size, hot_rows, dtype, formats=formats), ada,
                spec_row(res, cfg, page_size, hot_rows, dtype, d, formats), spec_row(ada, cfg, page_size, hot_rows, dtype, d, formats)]
    return out


def report(contexts=(32 * 1024, 100 * 1024), page_size: int = 64, hot_rows: int = 4096, dtype=torch.bfloat16,
           kv_cache_dtype: str = "auto") -> list[dict]:
    """The rows of every preset at every context, in the row format of `kv_cache_dtype`."""
    cfg, d = glm52_config(), DrafterShape()
    formats = kv_formats(cfg, kv_cache_dtype, dtype)
    tag = dict(kv_cache_dtype=kv_cache_dtype, latent_row_bytes=formats.latent.nbytes, index_row_bytes=formats.index.nbytes)
    return [asdict(r) | {"device_total": r.device_total} | tag
            for r in preset_rows(cfg, contexts, page_size, hot_rows, dtype, formats, d)]


def build_parser():
    import argparse

    p = argparse.ArgumentParser(prog="python -m dhisparse.bench.memreport",
                                description="Per-request device memory of each preset for a GLM-5.2-shaped KV "
                                            "(the paper's Table 1 rows), computed on the meta device: a table on "
                                            "stdout, and the rows as JSON with --out.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=None, help="also write the rows, command, machine and date as JSON here "
                   "(the shipped result is bench/results/memreport_glm52.json)")
    p.add_argument("--contexts", default="32768,102400", help="comma-separated context lengths in tokens")
    p.add_argument("--page-size", type=int, default=64, help="token positions per KV page")
    p.add_argument("--hot-rows", type=int, default=4096, help="hot-cache rows B per request")
    p.add_argument("--kv-cache-dtype", default="auto", choices=(*KV_CACHE_DTYPES, BOTH),
                   help="stored row format (auto / bfloat16: 1152-B latent rows, 256-B index keys; fp8_e4m3: 656 B "
                        "and 132 B); 'both' prints the bf16 and the fp8_e4m3 rows. With fp8_e4m3 (or both) the "
                        "output also sets the FP8 rows beside the paper's Table 1")
    return p


def _print_rows(rows: list[dict]) -> None:
    print(f"{'preset':14} {'context':>8} {'device GiB':>11} {'history':>8} {'hot':>7} {'tail':>7} {'index':>7} {'meta':>9} "
          f"{'ring':>7} {'staging':>8} {'host GiB':>9}")
    for r in rows:
        print(f"{r['preset']:14} {r['context']:>8} {r['device_total']:>11.3f} {r['latent_history']:>8.3f} {r['hot_cache']:>7.3f} "
              f"{r['tail']:>7.3f} {r['index_state']:>7.3f} {r['metadata']:>9.5f} {r['draft_ring']:>7.4f} {r['staging']:>8.4f} "
              f"{r['host_backup']:>9.3f}")


def main(argv: list[str] | None = None) -> int:
    import json
    import platform
    import sys
    from datetime import datetime, timezone

    from dhisparse.bench.results import source_commit

    ns = build_parser().parse_args(argv)
    try:
        contexts = tuple(int(c) for c in ns.contexts.split(",") if c.strip())
    except ValueError:
        print(f"error: --contexts must be comma-separated whole numbers; got {ns.contexts!r}", file=sys.stderr)
        return 2
    if not contexts or min(contexts) < 1 or ns.page_size < 1 or ns.hot_rows < 1:
        print("error: --contexts, --page-size and --hot-rows must be positive", file=sys.stderr)
        return 2
    dtypes = ("bfloat16", "fp8_e4m3") if ns.kv_cache_dtype == BOTH else (ns.kv_cache_dtype,)
    rows: list[dict] = []
    for kd in dtypes:
        part = report(contexts, ns.page_size, ns.hot_rows, kv_cache_dtype=kd)
        if len(dtypes) > 1 or kd == "fp8_e4m3":
            print(f"kv_cache_dtype {kd}: {part[0]['latent_row_bytes']}-B latent rows, {part[0]['index_row_bytes']}-B index keys")
        _print_rows(part)
        rows += part
    from dhisparse.bench.memreport_paper import PAPER_NOTE, paper_comparison, print_comparison

    cmp = paper_comparison(ns.page_size, ns.hot_rows) if "fp8_e4m3" in dtypes else None
    if cmp is not None:
        print_comparison(cmp)
    if ns.out:
        args = sys.argv[1:] if argv is None else list(argv)
        fmt = {kd: kv_formats(glm52_config(), kd) for kd in dtypes}
        meta = {"command": "python -m dhisparse.bench.memreport " + " ".join(args), "machine": "CPU, meta-device sizing",
                "host": platform.node(), "date": datetime.now(timezone.utc).isoformat(), "commit": source_commit(),
                "kv_cache_dtype": ns.kv_cache_dtype,
                "dtype": "; ".join(f"{kd}: {f.latent.nbytes}-B latent rows, {f.index.nbytes}-B index rows" for kd, f in fmt.items()),
                "config": f"GLM-5.2 KV shape, page {ns.page_size}, B {ns.hot_rows}; +spec: 6-layer drafter (12 x 1024-B "
                          "K/V per ring row, model dtype), W 2048, p 64, K_max 8",
                "rows": rows}
        if cmp is not None:
            meta |= {"paper_table1": cmp, "paper_note": PAPER_NOTE}
        with open(ns.out, "w") as f:
            json.dump(meta, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
