"""Where a step's host time sits relative to the device: exclusive host time per phase of
`engine.step()`, so the part the device waits for can be told from the part that overlaps it.

    step i:   schedule  expand  launch | verify  after_step  sample | blocked | append  commit  series
              \\____ device idle ____/  \\__ device runs step i ___/  (tolist)  \\___ device idle ___/

    schedule    admission and chunking (Scheduler.schedule)
    expand      drafting: decode chunks become verification chunks (SpecRuntime.expand)
    launch      batch build, KV context, graph load and replay (Engine._forward)
    verify      acceptance of the drafts, less its wait for the logits (Engine._verify)
    after_step  the KV store's bookkeeping and copy launches (store.after_step)
    sample      logits and sampler launches (Engine._sample, less the wait and the appends)
    blocked     waiting for device values (Tensor.tolist / item)
    append      tokens through the stop checks and reports (Engine._append_tokens)
    commit      the drafter's commit (Engine._commit, less the appends)
    series      the time series sample (Series.observe)
    other       the rest of `step()`

`before_launch` (schedule + expand + launch) and `after_sync` (append + commit + series + other)
are on the critical path when steps run back to back; the overlapped phases are not.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

BEFORE = ("schedule", "expand", "launch")
OVERLAP = ("verify", "after_step", "sample")
AFTER = ("append", "commit", "series", "other")


class PhaseClock:
    """Installs exclusive-time wrappers on one engine's step phases (and on Tensor.tolist / item
    as `blocked`) while entered; `totals` holds seconds per phase."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open phase: [start, time spent in nested phases]

    def _wrap(self, name: str, fn):
        def wrapper(*a, **k):
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*a, **k)
            finally:
                start, nested = self._stack.pop()
                spent = time.perf_counter() - start
                self.totals[name] += spent - nested
                if self._stack:
                    self._stack[-1][1] += spent

        return wrapper

    def __enter__(self) -> "PhaseClock":
        e = self.engine
        self._targets = [(e.scheduler, "schedule", "schedule"), (e, "_forward", "launch"), (e.store, "after_step", "after_step"),
                         (e, "_verify", "verify"), (e, "_sample", "sample"), (e, "_append_tokens", "append"),
                         (e, "_commit", "commit"), (e.series, "observe", "series"), (e, "_step", "other")]
        if e.spec is not None:
            self._targets.append((e.spec, "expand", "expand"))
        for obj, attr, name in self._targets:
            setattr(obj, attr, self._wrap(name, getattr(obj, attr)))
        self._saved = torch.Tensor.tolist, torch.Tensor.item
        torch.Tensor.tolist = self._wrap("blocked", self._saved[0])
        torch.Tensor.item = self._wrap("blocked", self._saved[1])
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr, _ in self._targets:
            delattr(obj, attr)  # the class method shows through again
        torch.Tensor.tolist, torch.Tensor.item = self._saved


def phase_steps(engine, steps: int, sync) -> dict[str, float]:
    """Run `steps` steps under a PhaseClock (device synchronised between steps, as the timed
    steps are); ms per step for every phase, plus the before_launch / overlap / after_sync sums."""
    with PhaseClock(engine) as clock:
        for _ in range(steps):
            sync()
            engine.step()
        sync()
    ms = {k: 1e3 * v / steps for k, v in clock.totals.items()}
    out = {k: ms.get(k, 0.0) for k in (*BEFORE, *OVERLAP, "blocked", *AFTER)}
    out["before_launch"] = sum(out[k] for k in BEFORE)
    out["overlap"] = sum(out[k] for k in OVERLAP)
    out["after_sync"] = sum(out[k] for k in AFTER)
    return out
