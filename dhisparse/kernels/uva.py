"""Zero-copy (UVA) views of pinned host memory for Triton.

Pinned host tensors already have device-visible addresses under unified virtual addressing, but
Triton refuses CPU tensors. `host_view(t)` returns a CUDA tensor aliasing the same bytes (same
shape, strides, dtype); kernels reading it fetch over PCIe with SM-issued loads (docs/design.md §5).

Two routes, first that works: CuPy `UnownedMemory` + `MemoryPointer` + `torch.from_dlpack`, then
torch's `_construct_storage_from_data_pointer`. One view of each pinned storage is cached while
that storage lives: the view does NOT own the host memory (a cached owning view kept every engine's
host pool pinned after the engine was gone), and a finalizer on the storage drops the entry. A
caller keeps the pinned tensor alive while kernels it launched read the view.
"""

from __future__ import annotations

import weakref

import torch

_CACHE: dict[tuple[int, int, int], torch.Tensor] = {}
_MAX_CACHED = 512


def _wrap_cupy(ptr: int, nbytes: int, device: int) -> torch.Tensor:
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, nbytes, None, device_id=device)
    arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.from_dlpack(arr)


def _wrap_torch(ptr: int, nbytes: int, device: int) -> torch.Tensor:
    storage = torch._C._construct_storage_from_data_pointer(ptr, torch.device("cuda", device), nbytes)
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, 0, (nbytes,), (1,))


def _forget(key: tuple[int, int, int], base: torch.Tensor) -> None:
    """Finalizer of a pinned storage: drop its view (unless the key was re-used meanwhile)."""
    if _CACHE.get(key) is base:
        del _CACHE[key]


def _storage_view(storage: torch.UntypedStorage, device: int) -> torch.Tensor:
    """[nbytes] uint8 CUDA tensor over a pinned host storage (cached)."""
    key = (storage.data_ptr(), storage.nbytes(), device)
    base = _CACHE.get(key)
    if base is None:
        err = None
        for wrap in (_wrap_cupy, _wrap_torch):
            try:
                base = wrap(storage.data_ptr(), storage.nbytes(), device)
                break
            except Exception as e:  # noqa: BLE001 - try the next route
                err = e
        if base is None:
            raise RuntimeError(f"cannot map pinned host memory for zero-copy reads: {err}")
        if len(_CACHE) >= _MAX_CACHED:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = base
        weakref.finalize(storage, _forget, key, base)
    return base


def host_view(t: torch.Tensor, device: int | None = None) -> torch.Tensor:
    """CUDA tensor aliasing pinned host tensor t [any shape] (zero-copy). CUDA tensors pass through."""
    if t.is_cuda:
        return t
    if not t.is_pinned():
        raise ValueError("host_view needs a pinned tensor (torch.empty(..., pin_memory=True))")
    dev = torch.cuda.current_device() if device is None else device
    base = _storage_view(t.untyped_storage(), dev)
    out = torch.empty(0, dtype=t.dtype, device=base.device)
    return out.set_(base.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def clear_cache() -> None:
    """Drop cached views (releases their hold on the pinned storages)."""
    _CACHE.clear()
