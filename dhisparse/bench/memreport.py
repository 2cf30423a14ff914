"""Per-request device memory, measured from the allocators (the paper's Table 1 rows).

Builds the stores on the `meta` device (no memory is touched), admits one request of the given
context under each preset and sums the pages and metadata it holds, split into latent history
(resident), hot cache, tail, index state and metadata; plus its host backup. `adaptive` is
measured without optional residency, which only uses memory that is spare.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dhisparse.kv.adaptive import AdaptiveKV
from dhisparse.kv.arena import KVArena
from dhisparse.kv.hierarchy import HierarchicalKV
from dhisparse.kv.host import HostStore
from dhisparse.kv.resident import ResidentKV
from dhisparse.models.config import ModelConfig

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

    @property
    def device_total(self) -> float:
        return self.latent_history + self.hot_cache + self.tail + self.index_state + self.metadata


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
    cfg = glm52_config()
    rows = []
    for n in contexts:
        for r in (resident_row(cfg, n, page_size, dtype), hisparse_row(cfg, n, page_size, hot_rows, dtype),
                  hisparse_row(cfg, n, page_size, hot_rows, dtype, preset="adaptive")):
            rows.append(asdict(r) | {"device_total": r.device_total})
    return rows


def main() -> None:  # pragma: no cover - CLI glue
    import json
    import platform
    import sys
    from datetime import datetime, timezone

    rows = report()
    print(f"{'preset':10} {'context':>8} {'device GiB':>11} {'history':>8} {'hot':>7} {'tail':>7} {'index':>7} {'meta':>9} {'host GiB':>9}")
    for r in rows:
        print(f"{r['preset']:10} {r['context']:>8} {r['device_total']:>11.3f} {r['latent_history']:>8.3f} {r['hot_cache']:>7.3f} {r['tail']:>7.3f} "
              f"{r['index_state']:>7.3f} {r['metadata']:>9.5f} {r['host_backup']:>9.3f}")
    if len(sys.argv) > 1:
        meta = {"command": "python -m dhisparse.bench.memreport " + " ".join(sys.argv[1:]), "machine": platform.node(),
                "date": datetime.now(timezone.utc).isoformat(), "dtype": "bfloat16 (1152-B latent rows, 256-B index rows)",
                "config": "GLM-5.2 KV shape, page 64, B 4096", "rows": rows}
        with open(sys.argv[1], "w") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
