"""The hierarchy's device-side tables against the host page tables they stand for: the slot tables
(`kv/memory/slot_tables.py`: host pages and index pages, synced incrementally), `index_locations` and
`decode_locations`, through prefill, decode and slot reuse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.core.rows import table_locations

GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)
PROMPTS = [[3 + (7 * i + 5 * j + i * j) % 110 for j in range(9 + 11 * i)] for i in range(5)]


def expected_decode_row(kv, st, n: int, W: int, direct: bool) -> list[int]:
    """lat_of row of a decoding request, written out position by position."""
    tail = kv.tail_loc[st.slot].tolist()
    row = [-1] * W
    for p in range(W):
        if st.tail_start <= p < n:
            row[p] = tail[p - st.tail_start]
        elif p < st.tail_start and direct:
            row[p] = int(kv.opt_loc[st.slot, p])
    return row


def watch(llm: LLM) -> list[int]:
    """Check every pass's tables against the host page tables; returns the slots passes used."""
    kv, used = llm.engine.store, []
    orig = kv.context

    def context(batch, reqs):
        ctx = orig(batch, reqs)
        ips, W = kv.arena.index_page_size, max(batch.lens)
        for req in reqs:
            table = kv.resident.index_tables[req]
            assert kv.idx_pages[kv.reqs[req].slot, : len(table)].tolist() == table
        want = table_locations([kv.resident.index_tables[q] for q in reqs], batch.lens, ips, kv.device)
        assert torch.equal(ctx.idx_of, torch.nn.functional.pad(want, (0, W - want.shape[1]), value=-1))
        for r in ctx.decode_rows:
            st = kv.reqs[reqs[r]]
            assert ctx.lat_of[r].tolist() == expected_decode_row(kv, st, batch.lens[r], W, ctx.all_direct)
        for r, req in enumerate(reqs):
            if r not in ctx.decode_rows:  # prefilling: its workspace rows, as under resident
                n = batch.lens[r]
                lat = table_locations([kv.resident.latent_tables[req]], [n], kv.page_size, kv.device)[0]
                assert torch.equal(ctx.lat_of[r, :n], lat[:n]) and bool((ctx.lat_of[r, n:] == -1).all())
        used.extend(kv.reqs[q].slot for q in reqs)
        return ctx

    kv.context = context
    return used


@pytest.mark.parametrize("preset", ["hisparse", "adaptive"])
def test_device_tables_mirror_the_host_tables_across_slot_reuse(preset):
    ref = [o.token_ids for o in LLM("tiny", page_size=4).generate(PROMPTS, GREEDY)]
    llm = LLM("tiny", preset=preset, page_size=4, hot_cache_rows=16, max_running_requests=2, max_num_batched_tokens=24)
    used = watch(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert len(set(used)) == 2 and len(PROMPTS) > 2  # five requests through two slots: slots were reused


def test_a_reused_slot_gets_its_new_owner_pages(monkeypatch):
    """Mutation check of the free-time reset: without it a reused slot keeps the old owner's pages."""
    from dhisparse.kv.hier.hierarchy import HierarchicalKV

    orig_free = HierarchicalKV.free

    def free_without_reset(self, req):
        slot = self.reqs[req].slot if req in self.reqs else None
        saved = (self.index_pages.known[slot], self.index_pages.t[slot].clone()) if slot is not None else None
        orig_free(self, req)
        if slot is not None:  # undo the reset: the row keeps the old owner's pages
            self.index_pages.known[slot] = saved[0]
            self.index_pages.t[slot] = saved[1]

    monkeypatch.setattr(HierarchicalKV, "free", free_without_reset)
    llm = LLM("tiny", preset="hisparse", page_size=4, hot_cache_rows=16, max_running_requests=2, max_num_batched_tokens=24)
    watch(llm)
    with pytest.raises(AssertionError):
        llm.generate(PROMPTS, GREEDY)


def test_host_table_mirrors_the_host_pages():
    """The resolver's host table (a SlotTable too) holds each decoding request's host pages."""
    llm = LLM("tiny", preset="hisparse", page_size=4, hot_cache_rows=16, max_running_requests=2, max_num_batched_tokens=24)
    kv, seen = llm.engine.store, []
    orig = kv.context

    def context(batch, reqs):
        for req in reqs:
            if req in kv.host.tables and kv.reqs[req].decoding:
                pages = kv.host.tables[req]
                assert kv.host_table[kv.reqs[req].slot, : len(pages)].tolist() == pages
                seen.append(len(pages))
        return orig(batch, reqs)

    kv.context = context
    llm.generate(PROMPTS, GREEDY)
    assert seen and max(seen) > 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.booleans()), max_size=40))
def test_slot_table_rows_follow_their_lists(ops):
    """Any sequence of appends (slot, n pages) and frees: after each sync every slot's row starts
    with its list and holds -1 after it; a freed slot's row is all -1."""
    from dhisparse.kv.memory.slot_tables import SlotTable

    table, lists, page = SlotTable(4, "cpu"), {s: [] for s in range(4)}, 100
    for slot, n, free in ops:
        if free:
            table.reset(slot)
            lists[slot] = []
            assert bool((table.t[slot] == -1).all())
            continue
        lists[slot] += list(range(page, page + n))
        page += n
        table.sync(lists.items())
        for s, pages in lists.items():
            row = table.t[s].tolist()
            assert row[: len(pages)] == pages and all(x == -1 for x in row[len(pages):])
    lens = torch.tensor([len(lists[s]) * 2 for s in range(4)])
    loc = table.locations(torch.arange(4), lens, 12, 2)
    for s in range(4):
        want = [lists[s][p // 2] * 2 + p % 2 if p < lens[s] else -1 for p in range(12)]
        assert loc[s].tolist() == want
