"""Counting the PyTorch ops code dispatches (the device-free proxy for host time of bench/op_count.py
and bench/drafter_round.py), without side effects on import: bench/op_count.py sets the
interpreter's environment itself, so importing these counters leaves later engines of the same
process on their own kernel settings."""

from __future__ import annotations

import collections
import time

from torch.utils._python_dispatch import TorchDispatchMode

from bench.step_profile import dhisparse_site
from dhisparse.models.graphs import EagerRunner


# ops that make the host wait for the device on CUDA (a value or a size read back), and tensors
# built from host data (torch.tensor(list, device=cuda) copies from pageable memory and syncs)
SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten._unique2", "aten.unique_dim", "aten.masked_select",
            "aten.unique_consecutive", "aten.item"}
HOST_DATA_OPS = {"aten.lift_fresh"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name; ops inside an interpreted Triton launch count once, as the launch,
    and so do a graph's ops replayed through `OneOpRunner`. Syncing ops and host-data tensors are
    also counted by their dhisparse call site."""

    active: "OpCounter | None" = None  # the counter inside its `with` block (OneOpRunner reads it)

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.host_data: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()  # every op by its innermost dhisparse call site
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            name = str(func.overloadpacket)
            self.ops[name] += 1
            self.sites[dhisparse_site()] += 1
            if name in SYNC_OPS:
                self.syncs[f"{name} @ {dhisparse_site()}"] += 1
            elif name in HOST_DATA_OPS:
                self.host_data[dhisparse_site()] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        counter, run = self, InterpretedFunction.run

        def counted(fn_self, *a, **kw):
            if not counter.inside:
                counter.ops["triton_launch"] += 1
                counter.sites[dhisparse_site()] += 1
            counter.inside += 1
            try:
                return run(fn_self, *a, **kw)
            finally:
                counter.inside -= 1

        self._restore = (InterpretedFunction, run)
        InterpretedFunction.run = counted
        OpCounter.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        cls, run = self._restore
        cls.run = run
        OpCounter.active = None
        return super().__exit__(*exc)


class OneOpRunner(EagerRunner):
    """CPU stand-in for a CUDA graph replay: the captured work runs eagerly and the active
    `OpCounter` counts it as one op (`graph.replay`), which is what the host dispatches on the GPU.
    `inside_s` (shared by every instance) sums the wall time spent inside replays, so a step's
    time less it is the host's work around the graphs."""

    inside_s = 0.0

    def capture(self, thunk):
        def replay():
            t = time.perf_counter()
            try:
                return self._counted(thunk)
            finally:
                OneOpRunner.inside_s += time.perf_counter() - t
        return replay

    @staticmethod
    def _counted(thunk):
        c = OpCounter.active
        if c is None or c.inside:
            return thunk()
        c.ops["graph.replay"] += 1
        c.sites[dhisparse_site()] += 1
        c.inside += 1
        try:
            return thunk()
        finally:
            c.inside -= 1
