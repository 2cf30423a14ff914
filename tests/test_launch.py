"""CompiledLaunch: a Triton kernel called through its compiled handle after the first call.

On CPU (TRITON_INTERPRET) it passes straight through to the JIT; the value-specialization check, the
held path's argument marshalling (with a stand-in compiled kernel) and,
on CUDA, repeat launches through the held handle (other tensors, another dtype: a new key) are
tested here. The resolver's exactness tests run its kernels through it on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from dhisparse.kernels.launch import CompiledLaunch, jit_unspecialized, loose_params  # noqa: E402


def _axpy(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, tl.load(y_ptr + i, mask=m) + a * tl.load(x_ptr + i, mask=m), mask=m)


axpy = jit_unspecialized(_axpy)


def test_value_specialized_parameters_are_named():
    """A kernel whose runtime parameters specialize on their values (the JIT's default) is refused,
    by name; one that lists them all in both lists is accepted."""
    plain = JITFunction(_axpy)
    assert loose_params(plain) == ["x_ptr", "y_ptr", "n", "a"]
    names = ["x_ptr", "y_ptr", "n", "a"]
    assert loose_params(JITFunction(_axpy, do_not_specialize=names)) == names  # alignment still specialized
    assert loose_params(JITFunction(_axpy, do_not_specialize=names, do_not_specialize_on_alignment=names[:3])) == ["a"]
    assert loose_params(JITFunction(_axpy, do_not_specialize=names, do_not_specialize_on_alignment=names)) == []
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="x_ptr"):
            CompiledLaunch(plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_repeat_launches_match_the_jit(dtype):
    """Calls after the first (through the held handle, misaligned views among them) compute what
    the JIT computes; a new dtype compiles a new variant."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    launch = CompiledLaunch(axpy)
    for n, off, a in ((37, 0, 2), (100, 1, 3), (5, 3, -1), (0, 0, 1)):
        x = torch.arange(n + off, device=dev).to(dtype)[off:]
        y = torch.ones(n + off, device=dev, dtype=dtype)[off:]
        want = y + a * x
        launch((triton.cdiv(max(n, 1), 16),), (x, y, n, a), {"BLOCK": 16}, 4)
        assert torch.equal(y, want), (n, off)
    if dev == "cuda":
        assert len(launch._compiled) == 1


class _Held:
    """A stand-in compiled kernel: records what the held path hands its launcher."""

    function, packed_metadata = "fn", "meta"

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def launch_metadata(self, grid, stream, *vals):  # only with a registered hook
        return ("meta", grid)

    def run(self, *a):
        if self.fail:
            raise self.fail
        self.calls.append(a)


def _held_launch(monkeypatch, held):
    """A CompiledLaunch of _axpy on the held path without a GPU: the device, stream and the JIT's
    first call stubbed, the key's compiled kernel seeded with `held`."""
    import dhisparse.kernels.launch as L

    names = ["x_ptr", "y_ptr", "n", "a"]
    monkeypatch.setattr(L, "_interpreted", lambda: False)
    monkeypatch.setattr(L, "_raw_stream", lambda dev: 77)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launch = L.CompiledLaunch(JITFunction(_axpy, do_not_specialize=names, do_not_specialize_on_alignment=names))
    jit = []
    monkeypatch.setattr(launch, "kernel", type("J", (), {"__getitem__": lambda self, g: lambda *a, **k: jit.append(a),
                                                         "fn": _axpy})())
    x, y = torch.zeros(4), torch.zeros(4, dtype=torch.int64)
    launch._compiled[(0, 4, (16,), ("BLOCK",), (None, None))] = (held, (16,))
    return launch, x, y, jit


def test_the_held_path_passes_addresses_and_constexprs(monkeypatch):
    """Tensors reach the launcher as their addresses, ints as they are, then the constexprs; an
    empty hook chain goes as None (no launch metadata built)."""
    held = _Held()
    launch, x, y, jit = _held_launch(monkeypatch, held)
    launch((3,), (x, y, 5, 2), {"BLOCK": 16}, 4)
    (call,) = held.calls
    assert call[:4] == (3, 1, 1, 77) and call[4:9] == ("fn", "meta", None, None, None)
    assert call[9:] == (x.data_ptr(), y.data_ptr(), 5, 2, 16) and not jit


def test_the_held_path_hands_a_wide_int_to_the_jit(monkeypatch):
    """An int the compiled variant cannot take (the launcher's OverflowError) goes through the JIT."""
    launch, x, y, jit = _held_launch(monkeypatch, _Held(fail=OverflowError("signed integer is greater than maximum")))
    launch((3,), (x, y, 2**40, 2), {"BLOCK": 16}, 4)
    assert len(jit) == 1 and jit[0][2] == 2**40


def test_a_bound_launch_passes_the_live_tensors_and_keeps_the_rest(monkeypatch):
    """`bind` holds a compiled call's values: each bound launch replaces only the live positions
    (by the tensors' addresses) and hands the launcher what the held path would for the same
    arguments; another dtype at a live position, an int there, or an uncompiled key are refused."""
    held = _Held()
    launch, x, y, jit = _held_launch(monkeypatch, held)
    assert launch.bind((x, y, 5, 2), {"BLOCK": 32}, 4, live=(1,)) is None  # not compiled: no binding
    bound = launch.bind((x, y, 5, 2), {"BLOCK": 16}, 4, live=(1,))
    y2 = torch.ones(4, dtype=torch.int64)
    bound((3,), y2)
    launch((3,), (x, y2, 5, 2), {"BLOCK": 16}, 4)
    assert held.calls[0] == held.calls[1] and held.calls[0][10] == y2.data_ptr()
    assert held.calls[0][9] == x.data_ptr() and held.calls[0][11:] == (5, 2, 16)
    with pytest.raises(TypeError, match="int64"):
        bound((3,), torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="live"):
        launch.bind((x, y, 5, 2), {"BLOCK": 16}, 4, live=(2,))
    assert not jit


def test_bind_is_off_under_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU interpreter only")
    x = torch.zeros(4)
    assert CompiledLaunch(axpy).bind((x, x, 4, 1), {"BLOCK": 16}, 4, live=(0,)) is None
