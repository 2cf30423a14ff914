"""`Census`: the resolver's counters (selected / direct / hot / host rows, bytes moved, calls),
accumulated over calls without a host sync per call (engine stats and benchmarks read them)."""

from __future__ import annotations

import torch

from dhisparse.kernels.resolver_ref import ResolveCounters


class Census:
    """Resolver counters accumulated over calls (ResolveCounters' fields plus bytes_moved, calls,
    direct_calls: calls resolved wholly by the direct path, with no hot-cache scan).

    `add` takes host counters (reference resolver); `add_device` takes the Triton plan's device
    counters without synchronising: they accumulate on the device and are folded into the
    host totals the first time a field is read (one sync per read, not per call).

    `in_place` (set while a whole-step CUDA graph is captured, see `engine.step_graphs`): a
    device call adds into one persistent accumulator `_acc` [len(FIELDS) + 1] (the last entry
    counts calls) with ops the graph records, so every replay counts its calls; the Python list
    of pending tensors would hold only the capture's own outputs."""

    FIELDS = ResolveCounters._fields + ("bytes_moved", "direct_calls")
    PROMO_FIELDS = ("promoted", "copyback_bytes")  # paper staging (kv/hier/promotion.py)
    REDUCE_EVERY = 256

    def __init__(self) -> None:
        self._tot = dict.fromkeys(self.FIELDS + self.PROMO_FIELDS, 0)
        self._dev: torch.Tensor | None = None  # [len(FIELDS)] int64 on the device, not yet folded
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (counts [6], bytes) per call
        self._acc: torch.Tensor | None = None  # [len(FIELDS) + 1] int64 device accumulator (in_place calls)
        self.in_place = False
        self.calls = 0
        self._promo: torch.Tensor | None = None  # [2] int64 device: promoted rows, copy-back bytes

    def add_promoted(self, rows: torch.Tensor, nbytes: torch.Tensor) -> None:
        """Paper staging's promotions (kv/hier/promotion.py): 0-d device tensors, added in place
        into one persistent accumulator (a step graph records the add)."""
        if self._promo is None:
            with torch.inference_mode(False):  # a normal tensor: it is read and zeroed outside the forward
                self._promo = torch.zeros(2, dtype=torch.int64, device=rows.device)
        self._promo.add_(torch.stack([rows, nbytes.to(torch.int64)]))

    def add(self, c: ResolveCounters, nbytes: int, calls: int = 1, direct_calls: int = 0) -> None:
        """Host counters of `calls` calls (summed), `direct_calls` of them wholly direct."""
        for k in ResolveCounters._fields:
            self._tot[k] += getattr(c, k)
        self._tot["bytes_moved"] += nbytes
        self._tot["direct_calls"] += direct_calls
        self.calls += calls

    def add_device(self, counts: torch.Tensor, nbytes: torch.Tensor) -> None:
        """counts [6] int64 device tensor in ResolveCounters order; nbytes: 0-d device tensor.
        Kept as is (no op dispatched); reduced on the device every REDUCE_EVERY calls. In place
        (`in_place`): added to `_acc` by device ops."""
        if self.in_place:
            acc = self.accumulator(counts.device)
            direct = (counts[2] + counts[3] == 0).reshape(1).to(torch.int64)
            acc.add_(torch.cat([counts, nbytes.reshape(1).to(torch.int64), direct, self._one]))
            return
        self._pending.append((counts, nbytes))
        self.calls += 1
        if len(self._pending) >= self.REDUCE_EVERY:
            self._reduce()

    def accumulator(self, device) -> torch.Tensor:
        """The persistent in-place accumulator (allocated once; its address is fixed for graphs)."""
        if self._acc is None:
            self._acc = torch.zeros(len(self.FIELDS) + 1, dtype=torch.int64, device=device)
            self._one = torch.ones(1, dtype=torch.int64, device=device)  # the calls increment
        return self._acc

    def _reduce(self) -> None:
        """Pending device counters -> one device vector (no sync)."""
        c = torch.stack([p[0] for p in self._pending])  # [M, 6]
        b = torch.stack([p[1].reshape(()).to(torch.int64) for p in self._pending])
        direct_calls = (c[:, 2] + c[:, 3] == 0).sum()  # no row from the hot cache or host: wholly direct
        vec = torch.cat([c.sum(0), b.sum().reshape(1), direct_calls.reshape(1)])
        self._dev = vec if self._dev is None else self._dev + vec
        self._pending = []

    def copy(self) -> "Census":
        """A snapshot of the totals (folds pending device counters: one sync)."""
        out = Census()
        self._fold()
        out._tot, out.calls = dict(self._tot), self.calls
        return out

    def _fold_promo(self) -> None:
        if self._promo is not None:
            for k, v in zip(self.PROMO_FIELDS, self._promo.tolist()):
                self._tot[k] += int(v)
            self._promo.zero_()

    def minus(self, base: "Census") -> "Census":
        """Counters accumulated since the snapshot `base`."""
        out = self.copy()
        for k in self.FIELDS + self.PROMO_FIELDS:
            out._tot[k] -= base._tot[k]
        out.calls -= base.calls
        return out

    def _fold(self) -> None:
        self._fold_promo()
        if self._pending:
            self._reduce()
        if self._dev is not None:
            for k, v in zip(self.FIELDS, self._dev.tolist()):
                self._tot[k] += int(v)
            self._dev = None
        if self._acc is not None:
            vals = self._acc.tolist()
            for k, v in zip(self.FIELDS, vals):
                self._tot[k] += int(v)
            self.calls += int(vals[-1])
            self._acc.zero_()


def _census_field(name: str) -> property:
    def get(self: Census) -> int:
        self._fold()
        return self._tot[name]

    def put(self: Census, value: int) -> None:
        self._fold()
        self._tot[name] = value

    return property(get, put)


for _name in Census.FIELDS + Census.PROMO_FIELDS:
    setattr(Census, _name, _census_field(_name))
