"""Verification staging's arenas (eq. 11), built once with the store: where the union rows of a
verification round that find no hot-cache victim are copied (kv/hier/staging.py fills them,
kv/hier/promotion.py copies paper staging's promoted rows back from them).

    single  chi = 1: layers run one after another, so the next layer reuses the arena after the
            previous layer's attention; every layer stages its own rows again
    paper   chi = the most layers of one selection group (4 for GLM-5's groups, 1 for V3.2):
            the group's producer stages every layer of the group at once, layer l of the group
            into arena l - producer; the arenas stay live until the group's promoted rows are
            copied back to the hot cache (`promotion.flush`), then the next group reuses them

A required allocation living in the pool's own pages (taken first from a fresh pool, so they are
consecutive): its bytes are counted once and allocated once.

    pool pages   | staging: p0 p1 ... (permanent, consecutive) | every other page ... |
    stage_arenas [1, chi, slots * K_max * k, W]  a view of p0 ..'s storage
    stage_loc    [slots, K_max * k]              SPACE + each slot's rows (the same in every arena)
"""

from __future__ import annotations

import torch

from dhisparse.core.rows import SPACE, cdiv, next_pow2

STAGING_MODES = ("auto", "paper", "single")  # verification staging (`build`, kv/hier/promotion.py)


def staging_mode(mode: str, paper_ok: bool = True) -> str:
    """`staging_mode` resolved: "auto" is "single" (on the H200, adaptive+spec at 8K C18, paper
    staging ran 0.76x single's throughput: docs/benchmarks.md, nineteenth round). paper_ok: the
    store's `STAGING_PAPER` (False for DeepSeek-V4's row hierarchy)."""
    if mode not in STAGING_MODES:
        raise ValueError(f"staging_mode must be one of {STAGING_MODES}, got {mode!r}")
    if mode == "paper" and not paper_ok:
        raise ValueError("staging_mode 'paper' (chi arenas with promotion) is not available for this model's "
                         "row hierarchy (DeepSeek-V4 restages per source); use 'single' or 'auto'")
    if mode == "auto":
        return "single"
    return mode


def build(kv, slots: int, max_queries: int, mode: str) -> None:
    """kv's staging settings (after `tables.build_groups`): staging_mode, the stamp scale of paper
    staging's ranks (rank_span, stamp_scale: stamps are now * KS^2 + rank, promotion.py), each
    layer's arena (arena_of: its place in its group under paper, else the one arena) and, when
    K_max > 1, the arenas themselves (`build_arenas`); stage, stage_loc, stage_arenas stay None
    without staging."""
    kv.stage = kv.stage_loc = kv.stage_arenas = None
    kv.staging_mode = staging_mode(mode, kv.STAGING_PAPER)
    paper = kv.staging_mode == "paper"
    ks = next_pow2(max_queries) if paper else 1
    kv.rank_span, kv.stamp_scale = ks, ks * ks
    kv.arena_of = {l: l - kv.groups[g] if paper else 0 for l, g in kv.group_of.items()}
    if max_queries > 1:
        build_arenas(kv, slots, max_queries)


def build_arenas(kv, slots: int, max_queries: int) -> None:
    """chi arenas of K_max * k rows per request slot (module docstring): stage_arenas
    [1, chi, slots * K_max * k, W], stage = arena 0, stage_loc [slots, K_max * k]."""
    a = kv.arena
    if kv.staging_mode == "paper" and any(sp is None for sp in kv.group_span):
        raise ValueError("staging_mode 'paper' needs every selection group's layers consecutive")
    chi = max(kv.arena_of.values(), default=0) + 1
    per_slot = max_queries * a.cfg.index_topk
    n = chi * slots * per_slot * a.row_width  # storage elements
    pages = kv.pool.alloc_permanent("staging", cdiv(n, a.page_elems))
    kv.stage_arenas = page_run(a.storage, pages)[:n].view(1, chi, slots * per_slot, a.row_width)
    kv.stage = kv.stage_arenas[:, 0]
    base = torch.arange(slots * per_slot, dtype=torch.int64, device=kv.device).view(slots, per_slot)
    kv.stage_loc = SPACE + base


def page_run(storage: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """The flat storage [len(pages) * page_elems] of consecutive `pages` of an arena's storage
    [P, page_elems] (a view: no copy, no new allocation)."""
    if pages != list(range(pages[0], pages[0] + len(pages))):
        raise RuntimeError(f"staging needs consecutive pages, got {pages[:4]}...: build it before other allocations")
    return storage[pages[0] : pages[0] + len(pages)].reshape(-1)


def check(kv) -> None:
    """The arenas are their permanent pages' storage, and those pages hold every arena's bytes."""
    if kv.stage is None:
        return
    pages = kv.pool.owned_by("staging")
    assert len(pages) * kv.arena.page_nbytes >= kv.stage_arenas.numel() * kv.stage.element_size()
    assert kv.stage.data_ptr() == kv.arena.storage[min(pages)].data_ptr(), "staging is not its pages' storage"
