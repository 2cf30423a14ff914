"""Launching a Triton kernel through its compiled handle: the host cost of a call without the JIT's dispatch.

`JITFunction.__getitem__(grid)(...)` binds every argument, computes its specialization (alignment of
each pointer, divisibility of each integer), hashes a cache key, looks the compiled kernel up and
checks its globals, on every call: tens of microseconds for a kernel of ~40 arguments, paid per
call outside CUDA graphs. A `CompiledLaunch` pays that once per specialization and afterwards calls
the compiled kernel's launcher directly (the plan/run split of FlashInfer's wrappers: the compiled
object is held, not looked up), with tensors passed as their addresses: the launcher takes an int as
it is, where a tensor costs it a `data_ptr` call and a cuPointerGetAttribute driver call each (on
the H200 host ~1 us a pointer: about half of a ~45-us launch of the resolver's 21 pointers).

That is only sound when the specialization is a function of what the key holds. The kernel must
not specialize on argument values: every integer argument listed in `do_not_specialize` and every
pointer in `do_not_specialize_on_alignment` (checked at construction), so the compiled variant is
fixed by the constexprs, num_warps, the device and the dtypes of the tensor arguments: the key (an
integer past 32 bits is refused by the compiled launcher and goes through the JIT). Under
TRITON_INTERPRET (CPU tests) and on the first call of a key it launches through the JIT as usual.
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
from triton import knobs

__all__ = ["BoundLaunch", "CompiledLaunch", "jit_unspecialized", "loose_params"]


def jit_unspecialized(fn):
    """`triton.jit` with no value specialization: every non-constexpr parameter in
    `do_not_specialize` and `do_not_specialize_on_alignment` (what `CompiledLaunch` requires)."""
    names = [n for n, p in inspect.signature(fn).parameters.items() if "constexpr" not in str(p.annotation)]
    return triton.jit(do_not_specialize=names, do_not_specialize_on_alignment=names)(fn)


try:
    from torch._C import _cuda_getCurrentRawStream as _raw_stream  # what Triton's own dispatch uses
except ImportError:  # pragma: no cover
    def _raw_stream(dev: int) -> int:
        return torch.cuda.current_stream(dev).cuda_stream


def _hook(h):
    """A launch hook, or None when it is an empty chain (Triton 3.6 keeps an empty `HookChain` in place
    of None: the launcher would call it, and build the launch metadata for it, on every launch)."""
    return None if h is None or getattr(h, "calls", None) == [] else h


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def loose_params(kernel) -> list[str]:
    """Names of a JIT kernel's runtime parameters that specialize on their values."""
    return [p.name for p in kernel.params if not p.is_constexpr
            and not (p.do_not_specialize and p.do_not_specialize_on_alignment)]


class CompiledLaunch:
    """`CompiledLaunch(kernel)(grid, args, consts, num_warps)` = `kernel[grid](*args, **consts,
    num_warps=num_warps)`, after the first call of a specialization without the JIT's dispatch.

    args: the kernel's non-constexpr parameters in order: tensors and Python ints (exactly `int`:
    anything else is taken for a tensor); consts: every constexpr parameter without a default, by
    name (defaults are filled in). The held path's Python costs ~7 us for 36 arguments on the CI-sized
    CPU (the loop below: one pass, no isinstance)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict[tuple, tuple] = {}
        self._interp = _interpreted()
        if self._interp:
            return
        loose = loose_params(kernel)
        if loose:
            raise ValueError(f"{kernel.fn.__name__}: arguments {loose} specialize on their values; "
                             "list them in do_not_specialize and do_not_specialize_on_alignment")
        params = kernel.params
        self._order = [p.name for p in params]
        self._nrt = sum(not p.is_constexpr for p in params)
        if any(p.is_constexpr for p in params[: self._nrt]):
            raise ValueError(f"{kernel.fn.__name__}: constexpr parameters must come after the runtime ones")
        self._defaults = {p.name: p.default for p in params if p.is_constexpr and p.has_default}

    def _marshal(self, args: tuple, consts: dict, num_warps: int) -> tuple[list, tuple]:
        """(the launcher's values, the compiled-variant key) of a call: one pass, tensors become their
        addresses (the launcher takes an int as it is; a tensor costs it a cuPointerGetAttribute driver
        call each) and key by dtype and CUDA-ness (a CPU tensor keys apart: its first call goes through
        the JIT, which refuses it); ints pass as they are."""
        vals, sig = [], []
        for a in args:
            if a.__class__ is not int:  # a tensor (or a subclass)
                vals.append(a.data_ptr())
                sig.append(a.dtype if a.is_cuda else None)
            else:
                vals.append(a)
        return vals, (torch.cuda.current_device(), num_warps, tuple(consts.values()), tuple(consts), tuple(sig))

    def __call__(self, grid: tuple[int, ...], args: tuple, consts: dict, num_warps: int) -> None:
        if self._interp:
            self.kernel[grid](*args, **consts, num_warps=num_warps)
            return
        if len(args) != self._nrt:
            raise TypeError(f"{self.kernel.fn.__name__} takes {self._nrt} runtime arguments, got {len(args)}")
        vals, key = self._marshal(args, consts, num_warps)
        hit = self._compiled.get(key)
        if hit is None:  # compile (or find) through the JIT, launching this call
            k = self.kernel[grid](*args, **consts, num_warps=num_warps)
            full = self._defaults | consts
            self._compiled[key] = (k, tuple(full[name] for name in self._order[self._nrt:]))
            return
        k, tail = hit
        try:
            _run(k, grid, _raw_stream(key[0]), vals + list(tail))
        except OverflowError:  # an int argument past 32 bits: the JIT compiles (and launches) its i64 variant
            self.kernel[grid](*args, **consts, num_warps=num_warps)

    def bind(self, args: tuple, consts: dict, num_warps: int, live: tuple[int, ...]) -> "BoundLaunch | None":
        """This call's launch with its arguments held (`BoundLaunch`): the ones at positions `live`
        (tensors) are given per launch, every other argument stays as it is now -- for a caller that
        launches one specialization many times with mostly the same tensors (a store's resolver
        state and workspace). None under TRITON_INTERPRET or before the variant is compiled (call
        once first). The held tensors must stay alive and in place (no `set_` / `resize_`) for the
        binding's life: the caller keys it on their identity."""
        if self._interp or len(args) != self._nrt:
            return None
        vals, key = self._marshal(args, consts, num_warps)
        hit = self._compiled.get(key)
        if hit is None:
            return None
        if any(args[i].__class__ is int for i in live):
            raise TypeError(f"{self.kernel.fn.__name__}: live arguments must be tensors, got ints at {list(live)}")
        return BoundLaunch(hit[0], vals + list(hit[1]), live, tuple(args[i].dtype for i in live), key[0])


def _run(k, grid: tuple[int, ...], stream: int, vals: list) -> None:
    """The compiled kernel's launcher on `vals` (runtime values, then the constexprs)."""
    g1, g2 = (grid[1] if len(grid) > 1 else 1), (grid[2] if len(grid) > 2 else 1)
    enter, leave = _hook(knobs.runtime.launch_enter_hook), _hook(knobs.runtime.launch_exit_hook)
    meta = k.launch_metadata((grid[0], g1, g2), stream, *vals) if enter is not None else None
    k.run(grid[0], g1, g2, stream, k.function, k.packed_metadata, meta, enter, leave, *vals)


class BoundLaunch:
    """`CompiledLaunch.bind`'s result: `bound(grid, *tensors)` launches the held compiled variant
    with the bound arguments, the tensors at the live positions replaced by `tensors` (in order, of
    the dtypes they were bound with: another dtype is refused, it would need another variant).
    Its Python is the live tensors' addresses and the launcher call: no per-argument marshalling of
    the held ones and no key. Not thread-safe (the values list is reused)."""

    __slots__ = ("_k", "_vals", "_live", "_dtypes", "_dev")

    def __init__(self, k, vals: list, live: tuple[int, ...], dtypes: tuple, dev: int):
        self._k, self._vals, self._live, self._dtypes, self._dev = k, vals, live, dtypes, dev

    def __call__(self, grid: tuple[int, ...], *tensors) -> None:
        vals = self._vals
        for i, d, t in zip(self._live, self._dtypes, tensors):
            if t.dtype is not d:
                raise TypeError(f"bound launch: argument {i} must be {d}, got {t.dtype}")
            vals[i] = t.data_ptr()
        _run(self._k, grid, _raw_stream(self._dev), vals)
