"""Layer-wise prefetch of a selection group's follower layers on a side stream (HiSparse's).

A GLM-5.x selection group is a producer layer (it runs the indexer and the resolver) and the
follower layers that reuse its selection. Every layer of the group misses the same rows, so the
producer's plan (victim slots, host rows) serves them all; only the row spaces differ.

  prefetch "compute" (today's default): the producer launches one layered copy of every layer of
      the group on the compute stream, before its own attention; nothing overlaps.
  prefetch "side": the producer copies its own layer's rows on the compute stream, then issues each
      follower's copy on a side stream after a fence (the plan is ready), recording one event per
      follower; follower layer l's attention waits for its own event only (`wait`), so its copy
      runs under the compute of layers producer .. l-1.

      compute  | plan | copy P | attn P | ffn P | ... | wait(l1) attn l1 | ... | wait(l2) attn l2 |
      side             \\_________ copy l1 ________/ copy l2 _____________/

Why this is safe: the fence orders the side copies after every earlier compute-stream op (the
previous pass's reads of the same hot-cache slots included); nothing reads follower l's victim
rows before l itself runs in this pass (a layer reads only its own row space); every follower
waits for its event before its attention, so a step graph's side-stream branch joins back into
the capture stream within the pass; the plan's tensors stay alive until that wait. Events left
from a pass that failed part-way are waited on before the next prefetch (`issue`).
"""

from __future__ import annotations

from typing import Callable

import torch

from dhisparse.kv.memory.copies import CudaStreams, Streams

PREFETCH_STREAMS = ("compute", "side")


class LayerPrefetch:
    """Follower copies on a side stream, one event per follower layer.

    streams: the `Streams` of kv/memory/copies.py (`CudaStreams`; a fake in tests)."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        self.pending: dict[int, object] = {}  # follower layer -> completion event of its copy
        self.issued = 0  # follower copies issued on the side stream (a counter for tests and stats)

    def issue(self, copies: dict[int, Callable[[], None]]) -> None:
        """Run each follower layer's copy (layer -> a function launching it) on the side stream
        after a fence on the compute stream."""
        self.drain()
        after = self.streams.fence()
        for layer, fn in copies.items():
            self.pending[layer] = self.streams.on_side(after, fn)
        self.issued += len(copies)

    def wait(self, layer: int) -> None:
        """Order the compute stream's next work (layer `layer`'s attention) after its copy."""
        ev = self.pending.pop(layer, None)
        if ev is not None:
            self.streams.wait(ev)

    def drain(self) -> None:
        """Wait for every copy still pending (left by a pass that did not reach its followers)."""
        for layer in list(self.pending):
            self.wait(layer)


def make_prefetch(device: torch.device, mode: str) -> LayerPrefetch | None:
    """The prefetcher of `--prefetch-stream mode` on `device`: None for "compute" or off CUDA
    (one layered copy by the producer, as before)."""
    if mode not in PREFETCH_STREAMS:
        raise ValueError(f"prefetch_stream must be one of {PREFETCH_STREAMS}, got {mode!r}")
    if mode == "compute" or device.type != "cuda":
        return None
    return LayerPrefetch(CudaStreams(device))
