"""Host pools pinned at their exact size (`cudaHostRegister` on an ordinary allocation).

torch's pinned allocator (`pin_memory=True`) rounds every block up to a power of two: a 50 GiB
host pool pins 64 GiB and a 96 GiB one 128 GiB, which either wastes host memory or fails outright
on a machine that has the 96 GiB but not the 128. Here the pool is a plain page-aligned allocation
that CUDA then page-locks and maps (portable, mapped), so it pins what was asked for and no more.
The result is a CPU tensor that `is_pinned()`, copies asynchronously and has a device-visible
address for zero-copy reads (`kernels/uva.host_view`), exactly like a torch pinned tensor.

Pinning costs about a second per GiB, so, like torch's host allocator, a registration outlives its
pool: when the pool's tensor is gone the registration goes idle and the next pool that fits in it
reuses it (zeroed again); `release_idle()` unregisters and frees idle ones. Where registration is
not possible (no CUDA, or the driver refuses) `pinned_zeros` falls back to `pin_memory=True`.

    registration  | pad | pool bytes (handed out) ............................... | unused |
                  ^ page-aligned start
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger("dhisparse.kv")

PAGE = 4096
PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


@dataclass
class Registration:
    """One registered allocation. `base` owns the bytes; `busy` while a pool tensor uses them."""

    base: np.ndarray
    ptr: int
    nbytes: int
    busy: bool = field(default=False)


_LOCK = threading.RLock()  # re-entrant: a finalizer can run (GC) while the lock is held
_REGS: list[Registration] = []


def _cudart():
    """torch's CUDA runtime bindings (cudaHostRegister / cudaHostUnregister), or None."""
    if not torch.cuda.is_available():
        return None
    try:
        return torch.cuda.cudart()
    except Exception:  # noqa: BLE001 - a build without the bindings: fall back
        return None


def _register(rt, nbytes: int) -> Registration:
    base = np.zeros(nbytes + PAGE, dtype=np.uint8)  # calloc: fresh zero pages, untouched until pinned
    off = -base.ctypes.data % PAGE
    ptr = base.ctypes.data + off
    rc = rt.cudaHostRegister(ptr, nbytes, PORTABLE_MAPPED)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(rc)}")
    return Registration(base, ptr, nbytes)


def _unregister(rt, reg: Registration) -> None:
    rc = rt.cudaHostUnregister(reg.ptr)
    if int(rc) != 0:
        log.warning("cudaHostUnregister failed with CUDA error %d", int(rc))


def _release(reg: Registration) -> None:
    """Finalizer of a pool's byte view: its registration goes idle (kept for the next pool)."""
    with _LOCK:
        reg.busy = False


def _take(rt, nbytes: int) -> tuple[Registration, bool]:
    """An idle registration that holds nbytes (reused: True), else a new one; idle ones too small
    are released first so host memory is not held twice."""
    with _LOCK:
        fits = [r for r in _REGS if not r.busy and r.nbytes >= nbytes]
        if fits:
            reg = min(fits, key=lambda r: r.nbytes)
            reg.busy = True
            return reg, True
    release_idle()
    reg = _register(rt, nbytes)
    reg.busy = True
    with _LOCK:
        _REGS.append(reg)
    return reg, False


def _bytes_view(reg: Registration, nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 CPU tensor over the registration; the registration goes idle when the last
    tensor sharing these bytes is freed."""
    off = reg.ptr - reg.base.ctypes.data
    view = reg.base[off : off + nbytes]
    weakref.finalize(view, _release, reg)
    return torch.from_numpy(view)


def _torch_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=True)


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeroed CPU tensor of `shape` / `dtype`, page-locked at exactly its size (see the module
    docstring); falls back to torch's power-of-two pinned allocator where registration fails."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    rt = _cudart()
    if rt is None or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, pin_memory=rt is not None)
    try:
        reg, reused = _take(rt, nbytes)
    except (RuntimeError, MemoryError) as e:
        log.warning("exact-size pinning unavailable (%s); using torch's pinned allocator", e)
        return _torch_pinned(shape, dtype)
    flat = _bytes_view(reg, nbytes)
    if reused:
        flat.zero_()
    return flat.view(dtype).view(shape)


def release_idle() -> int:
    """Unregister and free every idle registration; returns the bytes released."""
    rt = _cudart()
    with _LOCK:
        idle = [r for r in _REGS if not r.busy]
        _REGS[:] = [r for r in _REGS if r.busy]
    for reg in idle:
        if rt is not None:
            _unregister(rt, reg)
    return sum(r.nbytes for r in idle)


def registered_bytes() -> tuple[int, int]:
    """(bytes registered in use, bytes registered idle)."""
    with _LOCK:
        return sum(r.nbytes for r in _REGS if r.busy), sum(r.nbytes for r in _REGS if not r.busy)
