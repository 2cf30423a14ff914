"""Draft KV ring: eq. 9 sizing, eq. 10 addressing and invariant I6."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse.spec.ring import DraftKVRing, RingAllocator, RingFull, ring_rows


def test_ring_rows_formula():
    assert ring_rows(2048, 64, 8) == 2176  # the paper's GLM-5.3 / DFlash2 setting
    assert ring_rows(2048, 64, 6) == 2176 and ring_rows(2048, 64, 4) == 2176 and ring_rows(2048, 64, 1) == 2112
    assert ring_rows(8, 4, 4) == 16
    assert ring_rows(1, 1, 1) == 2
    with pytest.raises(ValueError, match="window"):
        ring_rows(0, 64, 8)


def test_allocator_slots_and_reuse():
    alloc = RingAllocator(3, 16)
    slots = [alloc.alloc(f"r{i}") for i in range(3)]
    assert sorted(slots) == [0, 1, 2] and alloc.alloc("r1") == slots[1]
    with pytest.raises(RingFull, match="max_requests"):
        alloc.alloc("r3")
    alloc.free("r1")
    assert alloc.alloc("r3") == slots[1]
    alloc.check_integrity()
    assert alloc.slot_range(2) == range(32, 48) and alloc.phi(2, 17) == 33


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(1, 300), page=st.integers(1, 64), k_max=st.integers(1, 16),
    slots=st.integers(1, 6), start=st.integers(0, 10**6), data=st.data(),
)
def test_i6_live_positions_never_share_a_row(window, page, k_max, slots, start, data):
    r_d = ring_rows(window, page, k_max)
    alloc = RingAllocator(slots, r_d)
    slot = data.draw(st.integers(0, slots - 1))
    t1 = start + data.draw(st.integers(0, 5 * r_d))
    gap = data.draw(st.integers(1, window + k_max - 1 + page - 1))  # live span: window + block (+ alignment)
    t2 = t1 + gap
    assert alloc.phi(slot, t1) != alloc.phi(slot, t2)
    for s in range(slots):  # disjoint ranges: every position of slot s stays inside its own range
        assert alloc.phi(s, t1) in alloc.slot_range(s) and alloc.phi(s, t2) in alloc.slot_range(s)
    other = data.draw(st.integers(0, slots - 1))
    if other != slot:
        assert alloc.phi(slot, t1) != alloc.phi(other, data.draw(st.integers(0, 10**6)))


@settings(max_examples=60, deadline=None)
@given(window=st.integers(2, 24), page=st.integers(1, 8), k_max=st.integers(2, 8),
       commits=st.lists(st.integers(1, 8), min_size=1, max_size=40))
def test_ring_window_reads_stay_live_through_wraparound(window, page, k_max, commits):
    """Two requests write interleaved commits; the last W positions of each always read back."""
    ring = DraftKVRing(1, 2, ring_rows(window, page, k_max), kv_heads=1, head_dim=2)
    slots = {r: ring.admit(r) for r in ("a", "b")}
    n = {"a": 0, "b": 0}
    for i, c in enumerate(commits):
        r = "ab"[i % 2]
        pos = torch.arange(n[r], n[r] + min(c, k_max))
        val = torch.stack([pos.float(), torch.full_like(pos.float(), slots[r])], -1)[:, None, :]
        ring.write(slots[r], 0, pos, val, val)
        n[r] += pos.numel()
        for q, s in slots.items():
            span = torch.arange(max(0, n[q] - window), n[q])
            k, _ = ring.read(s, 0, span)
            assert torch.equal(k[:, 0, 0], span.float()) and bool((k[:, 0, 1] == s).all())


def test_ring_read_of_overwritten_position_raises():
    ring = DraftKVRing(1, 1, ring_rows(4, 1, 1), kv_heads=1, head_dim=2)  # R_d = 5
    slot = ring.admit("a")
    pos = torch.arange(0, 5)
    ring.write(slot, 0, pos, torch.zeros(5, 1, 2), torch.zeros(5, 1, 2))
    ring.write(slot, 0, torch.tensor([5]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    with pytest.raises(RuntimeError, match="no longer live"):
        ring.read(slot, 0, torch.tensor([0]))
    assert ring.bytes_per_slot() == 2 * 5 * 2 * 4
