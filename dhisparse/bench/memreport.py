"""Per-request device memory, measured from the allocators (the paper's Table 1 rows).

Builds the stores on the `meta` device (no memory is touched), admits one request of the given
context under each preset and sums the pages and metadata it holds, split into latent history
(resident), hot cache, tail, index state and metadata; plus its host backup. `adaptive` is
measured without optional residency, which only uses memory that is spare.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from dhisparse.kv.hier.adaptive import AdaptiveKV
from dhisparse.kv.memory.arena import KVArena
from dhisparse.kv.hier.hierarchy import HierarchicalKV
from dhisparse.kv.memory.host import HostStore
from dhisparse.kv.resident.store import ResidentKV
from dhisparse.core.config import ModelConfig

GIB = float(1 << 30)


def glm52_config(**over) -> ModelConfig:
    """GLM-5.2 KV shape: 78 layers, 21 full indexers (freq 4, offset 3), latent 512 + rope 64, k 2048."""
    d = dict(model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, num_hidden_layers=78, num_attention_heads=64,
             q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
             index_n_heads=32, index_head_dim=128, index_topk=2048, index_topk_freq=4, index_skip_topk_offset=3,
             n_routed_experts=256, num_experts_per_tok=8, max_position_embeddings=1048576)
    d.update(over)
    return ModelConfig.from_hf(d)


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


def _arena(cfg: ModelConfig, page_size: int, pages: int, dtype: torch.dtype) -> KVArena:
    return KVArena(cfg, pages, page_size, "meta", dtype)


def resident_row(cfg: ModelConfig, context: int, page_size: int, dtype: torch.dtype) -> MemoryRow:
    arena = _arena(cfg, page_size, 1 << 20, dtype)
    kv = ResidentKV(arena)
    kv.admit("r", context)
    kv.ensure("r", context)
    pb = arena.page_nbytes
    meta = (len(kv.latent_tables["r"]) + len(kv.index_tables["r"])) * 4  # int32 block tables
    return MemoryRow("resident", context, len(kv.latent_tables["r"]) * pb / GIB, 0, 0,
                     len(kv.index_tables["r"]) * pb / GIB, meta / GIB, 0.0)


def ring_gib(d: DrafterShape, dtype: torch.dtype) -> float:
    """One request slot's draft KV ring, measured from a DraftKVRing built on the meta device."""
    from dhisparse.spec.ring import DraftKVRing, ring_rows

    ring = DraftKVRing(d.layers, 1, ring_rows(d.window, d.page, d.k_max), d.kv_heads, d.head_dim, dtype, "meta")
    return ring.bytes_per_slot() / GIB


def spec_row(row: MemoryRow, cfg: ModelConfig, page_size: int, hot_rows: int, dtype: torch.dtype, d: DrafterShape) -> MemoryRow:
    """`row` plus the speculative required state: the drafter's ring and, on hierarchical presets,
    the request slot's share of the verification staging arena (eq. 11, chi = 1)."""
    staging = 0.0
    if row.preset != "resident":
        arena = _arena(cfg, page_size, 1 << 20, dtype)
        host = HostStore(1, cfg.num_layers, page_size, cfg.latent_dim, dtype, pin=False, device="meta")
        kv = HierarchicalKV(arena, host, hot_rows, max_slots=1, max_queries=d.k_max)
        staging = kv.stage.numel() * kv.stage.element_size() / GIB
        tail = kv.tail_pages * arena.page_nbytes / GIB
        row = replace(row, tail=tail)
    return replace(row, preset=row.preset + "+spec", draft_ring=ring_gib(d, dtype), staging=staging)


def hisparse_row(cfg: ModelConfig, context: int, page_size: int, hot_rows: int, dtype: torch.dtype, preset: str = "hisparse") -> MemoryRow:
    arena = _arena(cfg, page_size, 1 << 20, dtype)
    host = HostStore(1 << 16, cfg.num_layers, page_size, cfg.latent_dim, dtype, pin=False, device="meta")
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


def report(contexts=(32 * 1024, 100 * 1024), page_size: int = 64, hot_rows: int = 4096, dtype=torch.bfloat16) -> list[dict]:
    cfg, d = glm52_config(), DrafterShape()
    rows = []
    for n in contexts:
        res, ada = resident_row(cfg, n, page_size, dtype), hisparse_row(cfg, n, page_size, hot_rows, dtype, preset="adaptive")
        for r in (res, hisparse_row(cfg, n, page_size, hot_rows, dtype), ada,
                  spec_row(res, cfg, page_size, hot_rows, dtype, d), spec_row(ada, cfg, page_size, hot_rows, dtype, d)):
            rows.append(asdict(r) | {"device_total": r.device_total})
    return rows


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
    return p


def main(argv: list[str] | None = None) -> int:
    import json
    import platform
    import sys
    from datetime import datetime, timezone

    ns = build_parser().parse_args(argv)
    try:
        contexts = tuple(int(c) for c in ns.contexts.split(",") if c.strip())
    except ValueError:
        print(f"error: --contexts must be comma-separated whole numbers; got {ns.contexts!r}", file=sys.stderr)
        return 2
    if not contexts or min(contexts) < 1 or ns.page_size < 1 or ns.hot_rows < 1:
        print("error: --contexts, --page-size and --hot-rows must be positive", file=sys.stderr)
        return 2
    rows = report(contexts, ns.page_size, ns.hot_rows)
    print(f"{'preset':14} {'context':>8} {'device GiB':>11} {'history':>8} {'hot':>7} {'tail':>7} {'index':>7} {'meta':>9} "
          f"{'ring':>7} {'staging':>8} {'host GiB':>9}")
    for r in rows:
        print(f"{r['preset']:14} {r['context']:>8} {r['device_total']:>11.3f} {r['latent_history']:>8.3f} {r['hot_cache']:>7.3f} "
              f"{r['tail']:>7.3f} {r['index_state']:>7.3f} {r['metadata']:>9.5f} {r['draft_ring']:>7.4f} {r['staging']:>8.4f} "
              f"{r['host_backup']:>9.3f}")
    if ns.out:
        args = sys.argv[1:] if argv is None else list(argv)
        meta = {"command": "python -m dhisparse.bench.memreport " + " ".join(args), "machine": platform.node(),
                "date": datetime.now(timezone.utc).isoformat(), "dtype": "bfloat16 (1152-B latent rows, 256-B index rows)",
                "config": f"GLM-5.2 KV shape, page {ns.page_size}, B {ns.hot_rows}; +spec: 6-layer drafter (12 x 1024-B "
                          "K/V per ring row), W 2048, p 64, K_max 8",
                "rows": rows}
        with open(ns.out, "w") as f:
            json.dump(meta, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
