"""The paper's Table 1 (FP8) beside our measured rows (`memreport.report`).

`paper_comparison` measures the FP8 rows at the paper's contexts (32K = 32,768 and 100K = 100,000 tokens) and sets
them beside the paper's figures; where they differ by more than 5% it lists every component next to the value the
paper's figures imply (`paper_model`: they are reproduced to the printed digits by 576-B latent rows, i.e. 512 + 64
values at one byte each with no scales, 132-B index keys, one 64-row tail page and a staging share of chi = 4
arenas). `PAPER_NOTE` says why the two differ.
"""

from __future__ import annotations

from collections import Counter

import torch

from dhisparse.bench.memreport import GIB, DrafterShape, glm52_config, kv_formats, preset_rows, report
from dhisparse.core.config import ModelConfig
from dhisparse.core.kvformat import KVFormats, RowFormat
from dhisparse.core.rows import cdiv
from dhisparse.kv.memory.arena import KVArena

PAPER_CONTEXTS = {"32K": 32768, "100K": 100000}  # the figures reproduce with 100K = 100,000 tokens (102,400 does not)
PAPER_TABLE1 = {  # GiB per session, GLM-5.3, FP8 KV, k 2048, B 4096 (Table 1; device required, host backup at 100K)
    "resident": {"32K": 1.456, "100K": 4.444},
    "hisparse": {"32K": 0.259, "100K": 0.432},
    "adaptive": {"32K": 0.259, "100K": 0.432},
    "resident+spec": {"32K": 1.481, "100K": 4.469},
    "adaptive+spec": {"32K": 0.319, "100K": 0.492},
}
PAPER_HOST_100K = 4.186
PAPER_LATENT_ROW = 576  # bytes: what the paper's Table 1 figures imply per latent row (512 + 64 values x 1 B)
PAPER_INDEX_ROW = 132   # bytes: 128 e4m3 + 1 fp32 scale (the same as ours)
PAPER_CHI = 4           # staging arenas live together in the paper's layout (section 3.4); ours: the same (paper staging)
COMPONENTS = ("latent_history", "hot_cache", "tail", "index_state", "metadata", "draft_ring", "staging")


def paper_model(preset: str, context: int, cfg: ModelConfig | None = None, page_size: int = 64, hot_rows: int = 4096,
                d: DrafterShape = DrafterShape()) -> dict:
    """The components (GiB) the paper's Table 1 figures decompose into: 576-B latent rows and 132-B
    index keys per page-rounded position, a hot cache of B rows and one tail page per layer, no
    metadata, and on +spec a ring of 12,288 B x R_d rows plus a staging share of chi 4 x K_max x k
    latent rows. These reproduce every printed figure of the table (tests/test_memreport.py)."""
    cfg = cfg or glm52_config()
    from dhisparse.spec.ring import ring_rows

    L, F, k = cfg.num_layers, len(cfg.full_layers), cfg.index_topk
    pos = cdiv(context, page_size) * page_size
    base = preset.removesuffix("+spec")
    c = dict.fromkeys(COMPONENTS, 0.0)
    c["index_state"] = pos * F * PAPER_INDEX_ROW / GIB
    if base == "resident":
        c["latent_history"] = pos * L * PAPER_LATENT_ROW / GIB
    else:
        c["hot_cache"] = cdiv(hot_rows, page_size) * page_size * L * PAPER_LATENT_ROW / GIB
        c["tail"] = page_size * L * PAPER_LATENT_ROW / GIB
    if preset.endswith("+spec"):
        c["draft_ring"] = 2 * d.layers * d.kv_heads * d.head_dim * 2 * ring_rows(d.window, d.page, d.k_max) / GIB
        if base != "resident":
            c["staging"] = PAPER_CHI * d.k_max * k * PAPER_LATENT_ROW / GIB
    c["device_total"] = sum(c[x] for x in COMPONENTS)
    c["host_backup"] = 0.0 if base == "resident" else pos * L * PAPER_LATENT_ROW / GIB
    return c


def _how(comp: str, r: dict, cfg: ModelConfig, page_size: int, hot_rows: int, paper: bool) -> str:
    """How one component's bytes arise (ours from the arena's pages; the paper's from its rows)."""
    L, F, n = cfg.num_layers, len(cfg.full_layers), r["context"]
    W, Wi = (PAPER_LATENT_ROW, PAPER_INDEX_ROW) if paper else (r["latent_row_bytes"], r["index_row_bytes"])
    pb = L * page_size * W
    ips = KVArena.keys_per_index_page(pb, F, Wi, 1)  # bytes: itemsize 1
    if comp == "latent_history":
        return f"{cdiv(n, page_size)} pages x {page_size} positions x {L} layers x {W} B"
    if comp == "hot_cache":
        return f"{cdiv(hot_rows, page_size) * page_size} rows x {L} layers x {W} B"
    if comp == "tail":
        if paper:
            return f"1 page x {page_size} rows x {L} layers x {W} B"
        t = round(r["tail"] * GIB / pb)
        return f"{t} pages (1 + ceil(max_queries / page)) x {page_size} rows x {L} layers x {W} B"
    if comp == "index_state":
        if paper:
            return f"{cdiv(n, page_size) * page_size} positions x {F} index layers x {Wi} B"
        return (f"{cdiv(n, ips)} index pages of {ips} positions x {F} layers x {Wi} B (a page is {pb} B; "
                "positions round up to whole index pages)")
    if comp == "metadata":
        return "none (excluded)" if paper else "slot tables (hot_pos, hot_stamp int64 [G, B], locations) + int32 page tables"
    if comp == "draft_ring":
        return "12,288 B x R_d 2176 rows (model dtype)"
    if comp == "staging":
        chi = max(Counter(cfg.producer_of(layer) for layer in range(cfg.num_layers)).values())
        return (f"chi {PAPER_CHI} x K_max 8 x k {cfg.index_topk} x {W} B" if paper
                else f"chi {chi} x K_max 8 x k {cfg.index_topk} x {W} B (one arena per layer of a selection group)")
    return ""


def paper_comparison(page_size: int = 64, hot_rows: int = 4096, dtype=torch.bfloat16, tolerance: float = 0.05) -> list[dict]:
    """Our FP8 rows at the paper's contexts beside Table 1. Every entry carries one line per
    component (ours, the paper's implied value, how each arises, the delta) and
    `ours_at_paper_row_bytes`, the same allocations re-measured with 576-B latent rows; `over_5pct`
    marks the entries off by more than `tolerance`."""
    cfg = glm52_config()
    ours = {(r["preset"], r["context"]): r for r in report(tuple(PAPER_CONTEXTS.values()), page_size, hot_rows, dtype, "fp8_e4m3")}
    # the paper's row width in our allocators: a plain 576-byte latent row and our 132-B index key
    alt_fmt = KVFormats(RowFormat.plain(cfg.latent_dim, torch.uint8), kv_formats(cfg, "fp8_e4m3", dtype).index)
    alt = {(r.preset, r.context): r for r in preset_rows(cfg, PAPER_CONTEXTS.values(), page_size, hot_rows, dtype, alt_fmt, DrafterShape())}
    entries = [(p, label, "device_total", v) for p, vals in PAPER_TABLE1.items() for label, v in vals.items()]
    entries += [(p, "100K", "host_backup", PAPER_HOST_100K) for p in ("hisparse", "adaptive", "adaptive+spec")]
    out = []
    for preset, label, what, paper in entries:
        n = PAPER_CONTEXTS[label]
        r, pm = ours[(preset, n)], paper_model(preset, n, cfg, page_size, hot_rows)
        a = alt[(preset, n)]
        a_val = a.device_total if what == "device_total" else a.host_backup
        e = dict(preset=preset, context=label, tokens=n, quantity=what, ours_gib=round(r[what], 4), paper_gib=paper,
                 diff_pct=round(100 * (r[what] / paper - 1), 1), paper_model_gib=round(pm[what], 4),
                 ours_at_paper_row_bytes_gib=round(a_val, 4),
                 ours_at_paper_row_bytes_diff_pct=round(100 * (a_val / paper - 1), 1),
                 over_5pct=abs(r[what] / paper - 1) > tolerance)
        comps = COMPONENTS if what == "device_total" else ("host_backup",)
        lines = []  # every entry, also those within 5% (the +spec rows are, by two differences that cancel)
        for comp in comps:
            if abs(r[comp]) < 1e-4 and abs(pm[comp]) < 1e-4:  # absent, or a few KB of int32 block tables
                continue
            how_o = (f"{cdiv(n, page_size)} host pages x {page_size} rows x {cfg.num_layers} layers x {r['latent_row_bytes']} B"
                     if comp == "host_backup" else _how(comp, r, cfg, page_size, hot_rows, False))
            how_p = (f"{cdiv(n, page_size) * page_size} positions x {cfg.num_layers} layers x {PAPER_LATENT_ROW} B"
                     if comp == "host_backup" else _how(comp, r, cfg, page_size, hot_rows, True))
            lines.append(f"{comp}: ours {r[comp]:.4f} GiB ({how_o}); paper-implied {pm[comp]:.4f} GiB ({how_p}); "
                         f"{r[comp] - pm[comp]:+.4f} GiB")
        e["explanation"] = lines
        out.append(e)
    return out


PAPER_NOTE = ("The paper's Table 1 figures are reproduced to every printed digit by 576-B latent rows "
              "(512 + 64 values at one byte each: no fp32 scales, rope not in bf16), 132-B index keys, a 64-row tail "
              "page, no metadata and a chi = 4 staging share; our FP8 latent row is the 656-B fp8_ds_mla row "
              "(512 e4m3 + 4 fp32 scales + 64 bf16 rope), the one the paper's own Table 3 uses (3.7 payload "
              "layers x 656 B = 2.4 KB per missed GLM selection) and its 184 MB hot cache does not (4096 x 78 x 576 B). "
              "Every latent byte (resident history, hot cache, tail, host backup) is therefore 656/576 = 1.139x the "
              "paper's: +13% on resident and the host backup, +7 to +11% on hisparse / adaptive, where the index keys "
              "(132 B on both sides) dilute it. Measured by our allocators at 576-B rows (ours_at_paper_row_bytes) the "
              "non-spec rows land within 2%: the rest is our tail of 2 pages (1 + ceil(max_queries / p)) against "
              "the paper's 1, 1.4 MB of slot metadata (hot_pos / hot_stamp int64 [21, 4096]) and index positions "
              "rounded up to whole 1181-position index pages. The +spec rows are within 5% at 656 B only because two "
              "differences cancel: our staging share is one arena (chi 1: 8 x 2048 x 656 B = 0.010 GiB) against the "
              "paper's four (4 x 8 x 2048 x 576 B = 0.035 GiB), -0.025 GiB, against the +0.03 GiB of wider rows.")


def print_comparison(cmp: list[dict]) -> None:
    print("\nagainst the paper's Table 1 (FP8; 32K = 32,768, 100K = 100,000 tokens; GiB per session; components "
          "listed where ours or ours@576B is off by more than 5%):")
    print(f"{'preset':14} {'ctx':>5} {'quantity':>12} {'ours':>7} {'paper':>7} {'diff':>7} {'paper-model':>11} "
          f"{'ours@576B':>9} {'diff':>6}")
    for e in cmp:
        print(f"{e['preset']:14} {e['context']:>5} {e['quantity']:>12} {e['ours_gib']:>7.3f} {e['paper_gib']:>7.3f} "
              f"{e['diff_pct']:>+6.1f}% {e['paper_model_gib']:>11.3f} {e['ours_at_paper_row_bytes_gib']:>9.3f} "
              f"{e['ours_at_paper_row_bytes_diff_pct']:>+5.1f}%")
        if e["over_5pct"] or abs(e["ours_at_paper_row_bytes_diff_pct"]) > 5:
            for line in e["explanation"]:
                print(f"    {line}")
    print("\n" + PAPER_NOTE)
