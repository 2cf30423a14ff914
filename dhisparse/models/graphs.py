"""Piecewise CUDA graphs: each decoder layer's FFN block replayed from a graph per token bucket.

A decode step dispatches ~100+ small ops per layer; on a GPU each costs the host 5-20 us whether
or not the GPU is busy. The FFN block of a layer -- post-attention norm, router, experts (the
small-batch dense path, no host sync) or MLP, residual add -- is a pure function of the layer's
hidden state [T, H]: no KV state, no host-side decisions. `FFNGraphs` captures it once per
(layer, bucket) and replays it, so the block costs one copy in, one replay and one copy out.
Attention stays eager (its KV context changes shape every step), as in vLLM's piecewise graphs.

    tokens T -> bucket Tb = smallest bucket >= T (T > the largest bucket: eager)
    static_in[Tb][:T] = h          (rows T..Tb-1 keep finite earlier values; the FFN is per-token,
    graph(layer, Tb).replay()       so padded rows never touch real rows and no state changes)
    return static_out[:T].clone()  (the graph's output buffer is overwritten by its next replay)

`runner` is pluggable: `CudaGraphRunner` on CUDA; tests use an eager runner with the same
bucketing and padding on CPU. Graphs share one memory pool; the static inputs are shared per
bucket across layers (layers run one after another).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

FFN = Callable[[torch.Tensor], torch.Tensor]


class Runner(Protocol):
    def capture(self, fn: FFN, static_in: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Record fn(static_in); return a replay function giving the static output."""


class CudaGraphRunner:
    """torch.cuda.CUDAGraph capture (after warm-up on a side stream), one shared memory pool."""

    def __init__(self, warmup: int = 2) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.warmup = warmup

    def capture(self, fn: FFN, static_in: torch.Tensor) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn(static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(static_in)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerRunner:
    """Same bucketing and padding, no graph: replay runs fn on the static input (CPU tests)."""

    def capture(self, fn: FFN, static_in: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: fn(static_in)


class FFNGraphs:
    """Per-(layer, bucket) replays of FFN blocks. `__call__(layer, fn, h)` -> fn(h) [T, H]."""

    def __init__(self, runner: Runner, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be distinct positive sizes in increasing order, got {buckets}")
        self.runner, self.buckets = runner, buckets
        self.inputs: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # bucket -> static input [Tb, H]
        self.replays: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.replayed = self.eager = 0  # counters: calls served by a graph / run eagerly

    def bucket(self, T: int) -> int | None:
        return next((b for b in self.buckets if b >= T), None)

    def __call__(self, layer: int, fn: FFN, h: torch.Tensor) -> torch.Tensor:
        T = h.shape[0]
        Tb = self.bucket(T) if T > 0 else None
        if Tb is None:
            self.eager += 1
            return fn(h)
        key = (Tb, h.dtype)
        static_in = self.inputs.get(key)
        if static_in is None:
            static_in = self.inputs[key] = torch.zeros(Tb, h.shape[1], dtype=h.dtype, device=h.device)
        static_in[:T].copy_(h)
        replay = self.replays.get((layer, Tb))
        if replay is None:
            replay = self.replays[(layer, Tb)] = self.runner.capture(fn, static_in)
        self.replayed += 1
        return replay()[:T].clone()


def graph_buckets(n_experts: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """Buckets whose FFN runs without a host sync (MoE: the dense expert path, T * E <= DENSE_ROWS)."""
    from dhisparse.layers.moe import DENSE_MAX_EXPERTS, DENSE_ROWS

    if n_experts > DENSE_MAX_EXPERTS:
        raise ValueError(f"cuda_graphs 'ffn' needs the sync-free dense expert path (<= {DENSE_MAX_EXPERTS} "
                         f"routed experts); this model has {n_experts}: use --cuda-graphs none")
    return tuple(b for b in buckets if b * max(n_experts, 1) <= DENSE_ROWS)


def ffn_graphs_for(device: torch.device, mode: str, n_experts: int) -> FFNGraphs | None:
    """mode 'none' -> None; 'ffn' -> FFNGraphs replaying CUDA graphs (CUDA only)."""
    if mode == "none":
        return None
    if mode != "ffn":
        raise ValueError(f"cuda_graphs must be 'none' or 'ffn', got {mode!r}")
    if device.type != "cuda":
        raise ValueError("cuda_graphs 'ffn' needs a CUDA device; use --cuda-graphs none on CPU")
    return FFNGraphs(CudaGraphRunner(), graph_buckets(n_experts))
