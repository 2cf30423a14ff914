"""Exact-size pinned host pools (kv/memory/pinned.py), on CPU with a recording stand-in for cudart.

The GPU half (a registered pool is pinned, copies asynchronously and reads zero-copy) is in
tests/test_uva.py."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dhisparse.kv.memory import pinned
from dhisparse.kv.memory.host import HostStore


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister; `fail` makes registration return an error."""

    def __init__(self, fail: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size))
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        assert flags == pinned.PORTABLE_MAPPED
        assert ptr not in self.registered
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, self.registered.pop(ptr)))
        return 0


@pytest.fixture
def rt(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    monkeypatch.setattr(pinned, "_REGS", [])
    yield fake
    gc.collect()
    pinned.release_idle()


def registers(fake: FakeCudart) -> list[int]:
    return [size for kind, _, size in fake.calls if kind == "register"]


def test_pins_exactly_the_bytes_asked_for(rt):
    t = pinned.pinned_zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert registers(rt) == [3 * 5 * 7 * 2]  # no power-of-two rounding
    assert t.data_ptr() == rt.calls[0][1] and t.data_ptr() % pinned.PAGE == 0
    assert bool((t == 0).all())
    assert pinned.registered_bytes() == (210, 0)


def test_a_freed_pool_is_reused_zeroed_and_not_pinned_again(rt):
    t = pinned.pinned_zeros((64, 16), torch.float32)
    ptr = t.data_ptr()
    t.fill_(3.0)
    view = t[5:9]  # a view keeps the registration busy
    del t
    gc.collect()
    assert pinned.registered_bytes() == (4096, 0)
    del view
    gc.collect()
    assert pinned.registered_bytes() == (0, 4096)
    u = pinned.pinned_zeros((32, 16), torch.float32)  # smaller: fits the idle registration
    assert u.data_ptr() == ptr and bool((u == 0).all())
    assert registers(rt) == [4096]


def test_a_larger_pool_releases_idle_registrations_first(rt):
    t = pinned.pinned_zeros((1000,), torch.uint8)
    del t
    gc.collect()
    pinned.pinned_zeros((5000,), torch.uint8)
    kinds = [k for k, _, _ in rt.calls]
    assert kinds == ["register", "unregister", "register"]
    assert list(rt.registered.values()) == [5000]


def test_live_pools_never_share_a_registration(rt):
    a = pinned.pinned_zeros((100,), torch.uint8)
    b = pinned.pinned_zeros((100,), torch.uint8)
    assert a.data_ptr() != b.data_ptr()
    a.fill_(1)
    assert int(b.sum()) == 0
    assert registers(rt) == [100, 100]


def test_refused_registration_falls_back_to_torch(monkeypatch):
    fake = FakeCudart(fail=True)
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    monkeypatch.setattr(pinned, "_REGS", [])
    calls = []
    monkeypatch.setattr(pinned, "_torch_pinned", lambda shape, dtype: calls.append(shape) or torch.zeros(shape, dtype=dtype))
    t = pinned.pinned_zeros((4, 4), torch.float32)
    assert t.shape == (4, 4) and calls == [(4, 4)]
    assert pinned.registered_bytes() == (0, 0)


def test_without_cuda_a_plain_tensor():
    if torch.cuda.is_available():
        pytest.skip("CPU-only path")
    t = pinned.pinned_zeros((2, 3), torch.float32)
    assert t.shape == (2, 3) and not t.is_pinned()


def test_host_store_pins_its_exact_size(rt):
    store = HostStore(7, 3, 4, 8, torch.bfloat16, pin=True)
    assert registers(rt) == [7 * 3 * 4 * 8 * 2]
    assert store.rows.shape == (7, 3, 4, 8)
    assert store.page_nbytes == 3 * 4 * 8 * 2


@settings(max_examples=10, deadline=None)  # each free runs gc.collect() (slow late in the suite): keep it short
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), min_size=1, max_size=16))
def test_registrations_follow_live_pools(ops):
    """Any sequence of allocations (size in KiB) and frees: live pools never overlap, each live
    pool sits in its own busy registration, and a registration is made only when no idle one fits."""
    fake = FakeCudart()
    saved = pinned._cudart, pinned._REGS
    pinned._cudart, pinned._REGS = (lambda: fake), []
    try:
        live: list[torch.Tensor] = []
        for alloc, kib in ops:
            if alloc or not live:
                idle_fits = any(not r.busy and r.nbytes >= kib * 1024 for r in pinned._REGS)
                before = len(registers(fake))
                live.append(pinned.pinned_zeros((kib * 1024,), torch.uint8))
                assert bool((live[-1] == 0).all())
                assert len(registers(fake)) == before + (0 if idle_fits else 1)
                live[-1].fill_(len(live))
            else:
                live.pop(kib % len(live))
                gc.collect()
            spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in live)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
            busy = [r for r in pinned._REGS if r.busy]
            assert len(busy) == len(live)
            assert {t.data_ptr() for t in live} == {r.ptr for r in busy}
            assert set(fake.registered) == {r.ptr for r in pinned._REGS}
    finally:
        del live
        gc.collect()
        pinned.release_idle()
        pinned._cudart, pinned._REGS = saved
