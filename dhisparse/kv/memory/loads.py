"""Background loads: the page copies a request waits for before its next chunk runs (a prefix
import host -> device at admission, the hand-off backup device -> host when its prompt is done).

`StreamLoads` (`--load-stream side`) runs them on a side stream, so the running batch keeps
decoding while a new request's KV moves (what a decode node sees of a prefill/decode handoff: the
KV arrives by DMA beside the decode kernels) and the request waits for its copies instead.
`SyncLoads` (the default) runs them in stream order on the compute stream: each 32K admission
stops the batch for ~0.1 s of PCIe copies, but the request runs in the same step. At 32K C18 on
the H200, where memory lets one admission through at a time, stream order gave more output
(bench/results/gpu_serving_32k_c18_load*_s9c_h200.json).

    compute  ──k──k──[issue]──k──k──k──k──k──k──k──    the request runs again after `done`
    side              └wait─copy─copy─…─copy─[done]

Contract (I3 for loads): a request with a pending load is `loading`; the scheduler does not run it,
and nothing else reads or writes the pages being copied until the load is done. The side stream
waits for the compute stream at issue, so the copies see every row written before and no earlier
reader of a reused page is still running. `on_done` callbacks (freeing the pages a hand-off read)
run on the host once the load's event has fired. A request retired while loading is `settle`d:
the compute stream waits for its loads, so pages it frees are reused only after the copies.

`SyncLoads` (CPU, or `load_stream=compute`) copies at issue and is never loading. `StreamLoads`
uses the residency copies' stream plumbing (`copies.Streams`).
"""

from __future__ import annotations

from typing import Callable

import torch

from dhisparse.kv.memory.copies import CudaStreams, Streams

Copies = Callable[[], None]


class SyncLoads:
    """Copies run at issue on the current stream; nothing is ever pending."""

    def run(self, req: object, copies: Copies, on_done: Callable[[], None] | None = None) -> None:
        copies()
        if on_done is not None:
            on_done()

    def loading(self, req: object) -> bool:
        return False

    def poll(self) -> None:
        """Nothing pending."""

    def settle(self, req: object) -> None:
        """Nothing pending."""

    @property
    def pending(self) -> int:
        return 0


class StreamLoads:
    """Copies on a side stream; a request is `loading` until its loads' events fired.

    `streams` is the residency copies' `Streams` (kv/memory/copies.py): `CudaStreams` by default, a fake
    whose events fire late in tests."""

    def __init__(self, device: torch.device | None = None, streams: Streams | None = None) -> None:
        self.streams = streams if streams is not None else CudaStreams(device)
        self._pending: dict[object, list[tuple[object, Callable[[], None] | None]]] = {}

    def run(self, req: object, copies: Copies, on_done: Callable[[], None] | None = None) -> None:
        """Issue `copies` (a function enqueuing asynchronous copies) on the side stream after
        everything issued so far on the compute stream; `on_done` runs once they completed."""
        ev = self.streams.on_side(self.streams.fence(), copies)
        self._pending.setdefault(req, []).append((ev, on_done))

    def loading(self, req: object) -> bool:
        """Whether req still has a load in flight (finishing those that completed)."""
        if req not in self._pending:
            return False
        self._finish(req, force=False)
        return req in self._pending

    def poll(self) -> None:
        """Finish every completed load (run its `on_done`)."""
        for req in list(self._pending):
            self._finish(req, force=False)

    def settle(self, req: object) -> None:
        """req is being retired: order the compute stream after its loads and finish them all."""
        self._finish(req, force=True)

    def _finish(self, req: object, force: bool) -> None:
        left = []
        for ev, on_done in self._pending.pop(req, []):
            if force:
                self.streams.wait(ev)
            elif not self.streams.finished(ev):
                left.append((ev, on_done))
                continue
            if on_done is not None:
                on_done()
        if left:
            self._pending[req] = left

    @property
    def pending(self) -> int:
        """Requests with a load in flight."""
        return len(self._pending)


def make_loads(device: torch.device, side: bool = True) -> SyncLoads | StreamLoads:
    """Side-stream loads on CUDA (unless `side` is off), in-order ones elsewhere."""
    return StreamLoads(device) if device.type == "cuda" and side else SyncLoads()

