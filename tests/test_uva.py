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
