"""Copy engines for the residency manager's page copies (backup device -> host, populate host -> device).

`SyncCopyEngine` performs a copy when it is issued (on CPU; on CUDA as an asynchronous copy on the
compute stream, so every later kernel is ordered after it) and reports it done at the next `poll`.

`StreamCopyEngine` moves the copies off the compute stream (CUDA). Issued copies are staged and
launched together at the next `poll` (or `flush`): one event recorded on the compute stream then
(so the batch sees every row written before its copies were issued, and no earlier reader of a
reused page is still running), the batch's copies on a side stream after it, and one completion
event for the batch. A copy reports done only once its batch's event has fired. Batches complete
in any order; the manager publishes a populated page or retires a backed-up one only after that
(I3), so the compute stream never waits for a copy it does not need:

    compute  ──k──k──k──[ev]──k──k──k──k──k──k──k──k──   (publish / retire after done fires)
    side                 └wait─copy─copy─...─copy─[done]

Staging matters under memory pressure: the residency manager backs up dozens of pages per step,
and a fence, a stream switch and two events per page cost the host ~0.1 ms each on the H200
(3.9 ms per step at 8K C36 in `step_profile_serving_c36_h200.json`); per batch they are paid once.
Staging is safe because the pages involved do not change meanwhile: a page being backed up is
immutable history, and a page being populated is read or written by nothing until it is published.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch

CopyFn = Callable[[str, object, int, int], None]  # (kind, req, page index, device page)
CopyItem = tuple[str, object, int, int]  # (kind, req, page index, device page): one issued copy
CopyManyFn = Callable[[list[CopyItem]], None]  # a batch of copies at once (may merge them)


class PageRun(NamedTuple):
    """`count` consecutive device pages from `device` and host pages from `host`, one copy."""

    kind: str
    host: int
    device: int
    count: int


def page_runs(pairs: list[tuple[str, int, int]]) -> list[PageRun]:
    """(kind, host page, device page) copies -> runs where both page numbers advance together, so
    each run is one contiguous copy. Every input pair is in exactly one run (pages of one batch
    are distinct, so the order of copies inside a batch does not matter).

        device  7 8 9   12        host  40 41 42   5      ->  runs (40, 7, 3), (5, 12, 1)
    """
    runs: list[PageRun] = []
    for kind, h, d in sorted(pairs, key=lambda x: (x[0], x[2])):
        last = runs[-1] if runs else None
        if last and last.kind == kind and d == last.device + last.count and h == last.host + last.count:
            runs[-1] = last._replace(count=last.count + 1)
        else:
            runs.append(PageRun(kind, h, d, 1))
    return runs


class Done(NamedTuple):
    """A finished copy: kind ('backup' | 'populate'), request, page index within the request."""

    kind: str
    req: object
    index: int


class SyncCopyEngine:
    """Copies at issue; done at the next poll, in issue order."""

    def __init__(self, copy: CopyFn) -> None:
        self.copy = copy
        self.pending: list[Done] = []

    def issue(self, kind: str, req: object, index: int, page: int) -> None:
        self.copy(kind, req, index, page)
        self.pending.append(Done(kind, req, index))

    def poll(self) -> list[Done]:
        done, self.pending = self.pending, []
        return done

    def in_flight(self) -> int:
        return len(self.pending)


class Streams(Protocol):
    """What StreamCopyEngine needs from the device (torch.cuda in production, a fake in tests)."""

    def fence(self) -> object:
        """An event recorded now on the compute stream."""

    def on_side(self, after: object, fn: Callable[[], None]) -> object:
        """Run fn's copies on the side stream after `after`; return their completion event."""

    def finished(self, event: object) -> bool:
        """Whether the event has fired (never blocks)."""

    def wait(self, event: object) -> None:
        """Order the compute stream's later work after the event (the host does not block)."""


class CudaStreams:
    """Streams over torch.cuda: one side stream per engine. "The compute stream" is the current
    stream when `fence` / `wait` run (the default stream eagerly, the capture stream inside a CUDA
    graph capture: kv/hier/prefetch.py issues its copies there)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)

    @property
    def compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def fence(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.compute)
        return ev

    def on_side(self, after: torch.cuda.Event, fn: Callable[[], None]) -> torch.cuda.Event:
        self.side.wait_event(after)
        with torch.cuda.stream(self.side):
            fn()
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def finished(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def wait(self, event: torch.cuda.Event) -> None:
        self.compute.wait_event(event)


class StreamCopyEngine:
    """Copies on a side stream, launched in batches; each done when its batch's event fires
    (batches in any order)."""

    def __init__(self, copy: CopyFn, streams: Streams, copy_many: CopyManyFn | None = None) -> None:
        """copy_many: runs a launched batch at once (e.g. merging adjacent pages); default: `copy`
        per item."""
        self.copy, self.streams = copy, streams
        self.copy_many = copy_many or (lambda items: [copy(*item) for item in items])
        self.staged: list[tuple[Done, int]] = []  # issued, not launched yet: (copy, device page)
        self.pending: list[tuple[Done, object]] = []  # launched: (copy, its batch's event)

    def issue(self, kind: str, req: object, index: int, page: int) -> None:
        self.staged.append((Done(kind, req, index), page))

    def flush(self) -> None:
        """Launch every staged copy: one fence, the copies on the side stream, one event."""
        if not self.staged:
            return
        batch, self.staged = self.staged, []
        after = self.streams.fence()
        event = self.streams.on_side(after, lambda: self.copy_many([(*d, page) for d, page in batch]))
        self.pending.extend((d, event) for d, _ in batch)

    def poll(self) -> list[Done]:
        """Launch what is staged, then report (once each) the copies whose batch has finished."""
        self.flush()
        done, still, fired = [], [], {}
        for d, ev in self.pending:
            key = id(ev)
            if key not in fired:
                fired[key] = self.streams.finished(ev)  # one query per batch
            (done if fired[key] else still).append((d, ev))
        self.pending = still
        return [d for d, _ in done]

    def in_flight(self) -> int:
        return len(self.staged) + len(self.pending)


def copy_engine_for(device: torch.device, copy: CopyFn, side_stream: bool = True, copy_many: CopyManyFn | None = None):
    """StreamCopyEngine on CUDA (unless side_stream is False), SyncCopyEngine otherwise."""
    if device.type == "cuda" and side_stream:
        return StreamCopyEngine(copy, CudaStreams(device), copy_many)
    return SyncCopyEngine(copy)
