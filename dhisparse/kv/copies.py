"""Copy engines for the residency manager's page copies (backup device -> host, populate host -> device).

`SyncCopyEngine` performs a copy when it is issued (on CPU; on CUDA as an asynchronous copy on the
compute stream, so every later kernel is ordered after it) and reports it done at the next `poll`.

`StreamCopyEngine` moves the copies off the compute stream (CUDA): each copy runs on a side
stream after an event recorded on the compute stream at issue (so it sees every row written
before, and no earlier reader of a reused page is still running), and reports done only once its
own completion event has fired. Copies complete in any order; the manager publishes a populated
page or retires a backed-up one only after that (I3), so the compute stream never waits for a
copy it does not need:

    compute  ──k──k──k──[ev]──k──k──k──k──k──k──k──k──   (publish / retire after done fires)
    side                 └wait─copy─copy─[done]
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch

CopyFn = Callable[[str, object, int, int], None]  # (kind, req, page index, device page)


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


class CudaStreams:
    """Streams over torch.cuda: one side stream per engine."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)

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


class StreamCopyEngine:
    """Copies on a side stream; each done when its completion event fires (any order)."""

    def __init__(self, copy: CopyFn, streams: Streams) -> None:
        self.copy, self.streams = copy, streams
        self.pending: list[tuple[Done, object]] = []

    def issue(self, kind: str, req: object, index: int, page: int) -> None:
        after = self.streams.fence()
        event = self.streams.on_side(after, lambda: self.copy(kind, req, index, page))
        self.pending.append((Done(kind, req, index), event))

    def poll(self) -> list[Done]:
        done, still = [], []
        for d, ev in self.pending:  # one query per copy: each is reported exactly once
            (done if self.streams.finished(ev) else still).append((d, ev))
        self.pending = still
        return [d for d, _ in done]

    def in_flight(self) -> int:
        return len(self.pending)


def copy_engine_for(device: torch.device, copy: CopyFn, side_stream: bool = True):
    """StreamCopyEngine on CUDA (unless side_stream is False), SyncCopyEngine otherwise."""
    if device.type == "cuda" and side_stream:
        return StreamCopyEngine(copy, CudaStreams(device))
    return SyncCopyEngine(copy)
