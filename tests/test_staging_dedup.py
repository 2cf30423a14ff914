"""Verification staging copies each distinct row once (issue 26's must-show for staging): when a
request's union of K queries overflows its hot cache, a row several queries selected is copied
from host into the staging arena once, and every query that selected it reads that one location.
Checked on both staging paths (the reference's host-side `stage_overflow` and the Triton
resolver's device-side `stage_overflow_deferred`) over real engine rounds, with rows shared
between queries (so a per-entry copy would show). The census counters cannot tell: they count
distinct rows whatever the copies did. Breakage tried: staging one row per selection entry
(unique replaced by the entries themselves) fails here."""

from __future__ import annotations

import pytest
import torch

from dhisparse import SamplingParams
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.engine import Engine
from dhisparse.engine.llm import LLM
from dhisparse.core.rows import SPACE
from dhisparse.kv.hier import resolver_step as step_mod


def _record(monkeypatch, seen: list) -> None:
    ref, dev = step_mod.stage_overflow, step_mod.stage_overflow_deferred

    def stage(plan, sel, slots, kv):
        out = ref(plan, sel, slots, kv)
        if out[1] is not None:
            seen.append((sel.clone(), out[1].loc.clone(), out[1].copy_dst.clone(), None))
        return out

    def stage_dev(plan, sel, slots, kv):
        sp = dev(plan, sel, slots, kv)
        seen.append((sel.clone(), plan.loc.clone(), sp.dst_pad.clone(), sp.copy_n.clone()))
        return sp

    monkeypatch.setattr(step_mod, "stage_overflow", stage)
    monkeypatch.setattr(step_mod, "stage_overflow_deferred", stage_dev)


@pytest.mark.parametrize("resolver", ["torch", "triton"])
def test_staging_copies_each_distinct_row_once(resolver, monkeypatch):
    seen: list = []
    _record(monkeypatch, seen)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ps = [[3 + (7 * i + 5 * j) % 120 for j in range(60 + 23 * i)] for i in range(3)]
    ref = {tuple(p): o.token_ids for p, o in zip(ps, LLM("tiny").generate(ps, sp))}
    llm = LLM.__new__(LLM)
    llm.engine = Engine(EngineConfig(preset="hisparse", resolver=resolver, hot_cache_rows=16, page_size=4,
                                     kv_pool_bytes=1 << 20, max_running_requests=8, speculative_algorithm="oracle",
                                     speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=3.0),
                        oracle_reference=ref)
    assert [o.token_ids for o in llm.generate(ps, sp)] == [ref[tuple(p)] for p in ps]
    shared = copies = 0
    for sel, loc, dst, copy_n in seen:
        staged = (loc >= SPACE) & (sel >= 0)  # staging rows live in row space 1 (SPACE-encoded)
        for i in range(sel.shape[0]):
            rows, where = sel[i][staged[i]], loc[i][staged[i]]
            if rows.numel() == 0:
                continue
            distinct = torch.unique(rows)
            # one location per distinct row, the same for every entry that selected it
            assert torch.unique(torch.stack([rows, where]), dim=1).shape[1] == distinct.numel()
            shared += rows.numel() - distinct.numel()
            copies += distinct.numel()
        if copy_n is not None:  # deferred: the padded plan copies copy_n rows, one per distinct row
            assert int(copy_n.sum()) == sum(torch.unique(sel[i][staged[i]]).numel() for i in range(sel.shape[0]))
        else:  # reference: one copy per distinct row, to distinct arena rows
            assert dst.numel() == torch.unique(dst).numel()
            assert dst.numel() == sum(torch.unique(sel[i][staged[i]]).numel() for i in range(sel.shape[0]))
    assert copies > 0 and shared > 0, (copies, shared)  # staging happened, with rows shared by queries
