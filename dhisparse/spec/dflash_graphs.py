"""CUDA graphs of the DFlash drafter's block pass, one per request bucket (`BlockGraphs`), and of
its context projection, one per row bucket (`IngestGraphs`).

Eagerly, a DFlash2 round of six layers dispatches ~1,000 PyTorch ops whatever the batch (CPU count,
bench/drafter_round.py): ~10 ms of host time a round at ~10 us an op, which the GPU waits through.
A round whose every request has a full window (W committed positions) has fixed shapes for a given
request count, so the part from the ring's window to the block's hidden states replays from a
graph; the LM head, the candidate selector (or DSpark's head) and sampling stay eager (a few dozen
ops; sampling draws from per-request generators).

    requests N -> bucket Nb = smallest bucket >= N (the buckets of models/graphs.py below the limit,
                  then the limit itself: min(max_requests, ring slots)); N above it: eager.
                  Every bucket is captured when the graphs are made, as SGLang captures its
                  batch sizes at start: no round pays a capture, and the graphs' memory is
                  taken before the engine sizes its KV pool from what is free.
    static in  [4, Nb] int64: anchor, committed count n, ring slot, real (1) / padding (0)
    graph      positions p = n - W .. n - 1 [Nb, W]; rows = slot * R_d + p mod R_d (eq. 10)
               per draft layer (k, v) = ring[rows]; stale = any real row's tag != p (I6, no sync)
               x = embed([anchor, mask, ...]) * scale; hidden = block_hidden(x, n .. n+B-1, ctx)
    static out hidden [Nb, B, H], stale []: read as hidden[:N] before the next replay

Padding rows (N..Nb-1) take slot 0, n = W and token 0 as anchor: their reads are finite ring rows,
their outputs are never read, and `stale` ignores them. The pass is the eager one
(`DFlashDrafter._block`) over the same inputs, so tests replay it with `EagerRunner` on CPU and
compare the drafts with the eager path's.

A round's commits project the accepted positions' target features into every draft layer's context
K/V (`DFlashModel.context_kv`: fc, norm, RoPE, each layer's k / v projections and k norm: ~60 ops,
~2.5 ms of host time a round on the H100 host at glm5-faithful's DFlash2 shape, session 45), which
the GPU waits through after the verification's sync. `IngestGraphs` replays it per row bucket:

    rows n -> bucket nb (DEFAULT_BUCKETS below the limit, then the limit: min(INGEST_MAX_ROWS,
              max_requests x block size)); n above it (a prefill's observe): eager
    static in  features [limit, F*H] (model dtype), positions [limit] int64; bucket nb's graph
               reads their first nb rows (one buffer for every bucket)
    static out per draft layer (k, v) [nb, kvh, d]: read as [:n] before the next replay

Rows n..nb-1 hold an earlier round's (or the capture's zero) rows: finite, projected, never read.
The ring writes stay eager (one indexed store a tensor, `DraftKVRing.write_layers`).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from dhisparse.models.graphs import DEFAULT_BUCKETS, Runner
from dhisparse.spec.ring import DraftKVRing

Block = Callable[[torch.Tensor, torch.Tensor, list, torch.Tensor, torch.Tensor], torch.Tensor]
Project = Callable[[torch.Tensor, torch.Tensor], list]
INGEST_MAX_ROWS = 512  # the largest row bucket of the context projection's graphs


class BlockGraphs:
    """Per-bucket replays of `block(anchors [N], n [N], ctx, valid [N, W], ctx_pos [N, W])` -> hidden
    [N, B, H] over a ring window of `window` positions (module docstring)."""

    def __init__(self, block: Block, ring: DraftKVRing, window: int, runner: Runner, max_requests: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.block, self.ring, self.window, self.runner = block, ring, window, runner
        top = max(1, min(max_requests, ring.alloc.num_slots))  # no round has more requests than ring slots
        self.buckets = tuple(b for b in buckets if b < top) + (top,)
        self.device = ring.tags.device
        self._inputs: dict[int, torch.Tensor] = {}  # Nb -> [4, Nb] int64 on the device
        self._replays: dict[int, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {}
        self.replayed = self.eager = 0
        self.capture_s = 0.0
        self._warm()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None) if n > 0 else None

    def run(self, anchors: list[int], committed: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden [N, B, H], stale []) from the bucket's graph, or None (eager: more requests than
        the largest bucket, or a window not yet full). The hidden rows are the graph's static
        output: read them before the next call."""
        n = len(anchors)
        nb = self.bucket(n)
        if nb is None or min(committed) < self.window:
            self.eager += 1
            return None
        static = self._inputs[nb]
        static.copy_(self._host(anchors, committed, slots, nb))
        hidden, stale = self._replays[nb]()
        self.replayed += 1
        return hidden[:n], stale

    def _warm(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its pool memory), over inputs
        that are all padding (no ring row is read as live)."""
        t = time.perf_counter()
        for nb in reversed(self.buckets):
            static = self._inputs[nb] = torch.zeros(4, nb, dtype=torch.int64, device=self.device)
            static.copy_(self._host([], [], [], nb))
            self._replays[nb] = self.runner.capture(lambda s=static: self._pass(s))
        self.capture_s = time.perf_counter() - t

    def _host(self, anchors: list[int], committed: list[int], slots: list[int], nb: int) -> torch.Tensor:
        """The static inputs [4, Nb] on the host: N real rows, then padding (anchor 0, n = W, slot 0,
        real 0)."""
        pad = nb - len(anchors)
        return torch.tensor([anchors + [0] * pad, committed + [self.window] * pad, slots + [0] * pad,
                             [1] * len(anchors) + [0] * pad], dtype=torch.int64)

    def _pass(self, static: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured work over the static inputs (module docstring)."""
        anchors, committed, slots, real = static[0], static[1], static[2], static[3].bool()
        pos = committed[:, None] - self.window + torch.arange(self.window, device=self.device)[None, :]
        ctx, stale = self.ring.window(slots, pos, real[:, None].expand_as(pos))  # padding rows never stale
        with torch.inference_mode():
            return self.block(anchors, committed, ctx, torch.ones_like(pos, dtype=torch.bool), pos), stale

    def counters(self) -> dict[str, float]:
        return {"drafter_graph_replays": self.replayed, "drafter_graph_eager": self.eager,
                "drafter_graph_capture_s": self.capture_s, "drafter_graph_buckets": len(self._replays)}


class IngestGraphs:
    """Per-row-bucket replays of `project(features [n, F*H], positions [n])` -> per draft layer
    (k, v) [n, kvh, d] (`DFlashModel.context_kv`; module docstring). Every bucket is captured here."""

    def __init__(self, project: Project, width: int, dtype: torch.dtype, device: torch.device, runner: Runner,
                 max_rows: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        top = max(1, min(max_rows, INGEST_MAX_ROWS))
        self.buckets = tuple(b for b in buckets if b < top) + (top,)
        self._feat = torch.zeros(top, width, dtype=dtype, device=device)
        self._pos = torch.zeros(top, dtype=torch.int64, device=device)
        self._replays: dict[int, Callable[[], list]] = {}
        self.replayed = self.eager = 0
        t = time.perf_counter()
        for nb in reversed(self.buckets):  # largest first: smaller graphs reuse its pool memory
            # the static rows bound now, as a graph holds their addresses (EagerRunner replays the thunk)
            self._replays[nb] = runner.capture(lambda f=self._feat[:nb], p=self._pos[:nb]: project(f, p))
        self.capture_s = time.perf_counter() - t

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None) if n > 0 else None

    def run(self, features: torch.Tensor, positions: torch.Tensor) -> list | None:
        """features [n, F*H] (any dtype, any device), positions [n] int64 -> per draft layer (k, v)
        [n, kvh, d], views of the bucket's static outputs (use them before the next replay); None
        when no bucket holds n rows (the caller runs the projection eagerly)."""
        n = features.shape[0]
        nb = self.bucket(n)
        if nb is None:
            self.eager += 1
            return None
        self._feat[:n].copy_(features)
        self._pos[:n].copy_(positions, non_blocking=True)
        out = self._replays[nb]()
        self.replayed += 1
        return [(k[:n], v[:n]) for k, v in out]

    def device_bytes(self) -> int:
        """The static inputs' bytes (the graphs' pool, their outputs and intermediates, is not counted)."""
        return self._feat.numel() * self._feat.element_size() + self._pos.numel() * self._pos.element_size()

    def counters(self) -> dict[str, float]:
        return {"drafter_ingest_graph_replays": self.replayed, "drafter_ingest_graph_eager": self.eager,
                "drafter_ingest_graph_capture_s": self.capture_s, "drafter_ingest_graph_buckets": len(self._replays)}
