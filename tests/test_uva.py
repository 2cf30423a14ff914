"""Zero-copy view cache (kernels/uva.py): a view is cached while its pinned storage lives and
dropped with it -- the cache must never keep an engine's host pool alive."""

import gc

import pytest
import torch

from dhisparse.kernels import uva


@pytest.fixture
def fake_wrap(monkeypatch):
    made = []

    def wrap(ptr, nbytes, device):
        made.append(ptr)
        return torch.empty(0, dtype=torch.uint8)

    monkeypatch.setattr(uva, "_wrap_cupy", wrap)
    uva.clear_cache()
    yield made
    uva.clear_cache()


def test_view_cached_while_storage_lives_and_dropped_after(fake_wrap):
    t = torch.zeros(1024)
    key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), 0)
    a = uva._storage_view(t.untyped_storage(), 0)
    gc.collect()  # the storage object is the tensor's (preserved), so the entry survives a collection
    b = uva._storage_view(t[10:].untyped_storage(), 0)
    assert a is b and len(fake_wrap) == 1 and key in uva._CACHE
    del t, a, b
    gc.collect()
    assert key not in uva._CACHE


def test_many_storages_do_not_accumulate(fake_wrap):
    for _ in range(20):
        uva._storage_view(torch.zeros(64).untyped_storage(), 0)
    gc.collect()
    assert len(uva._CACHE) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
def test_pinned_view_reads_host_bytes_and_is_released():
    uva.clear_cache()
    t = torch.arange(4096, dtype=torch.float32).pin_memory()
    v = uva.host_view(t[7:100])
    assert v.is_cuda and torch.equal(v.cpu(), t[7:100])
    del t, v
    gc.collect()
    assert len(uva._CACHE) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cudaHostRegister)")
def test_exact_size_pinned_pool_is_pinned_copies_and_reads_zero_copy():
    """A pool from kv/memory/pinned.py behaves as a torch pinned tensor: is_pinned, asynchronous copies
    both ways, and a zero-copy view that reads and writes the same bytes."""
    from dhisparse.kv.memory import pinned

    uva.clear_cache()
    rows = pinned.pinned_zeros((37, 3, 16, 24), torch.bfloat16)  # not a power of two in bytes
    assert rows.is_pinned() and pinned.registered_bytes()[0] >= rows.numel() * 2
    src = torch.randn(37, 3, 16, 24, device="cuda").to(torch.bfloat16)
    rows.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(rows, src.cpu())
    v = uva.host_view(rows[:, 1])
    assert v.is_cuda and torch.equal(v, src[:, 1])
    idx = torch.randperm(37, device="cuda")[:11]
    assert torch.equal(v[idx], src[idx, 1])  # device-side gather over PCIe
    v[3].fill_(1.5)
    torch.cuda.synchronize()
    assert bool((rows[3, 1] == 1.5).all())
    back = torch.empty_like(src)
    back.copy_(rows, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back.cpu(), rows)
    ptr = rows.data_ptr()
    del rows, v
    gc.collect()
    again = pinned.pinned_zeros((30, 3, 16, 24), torch.bfloat16)  # reuses the idle registration, zeroed
    assert again.data_ptr() == ptr and again.is_pinned() and int(again.float().abs().sum()) == 0
    del again
    gc.collect()
    assert pinned.release_idle() > 0
