"""Piecewise CUDA graphs: pure per-token pieces of each decoder layer replayed from graphs per bucket.

A decode step dispatches ~100+ small ops per layer; on a GPU each costs the host 5-20 us whether
or not the GPU is busy. The post-attention piece of a layer -- value up-projection, out-projection,
residual add, post-attention norm, router, experts (the small-batch dense path, no host sync) or
MLP, residual add -- is a pure function of the layer input h [T, H] and the attention output
o_lat [T, heads, C]: no KV state, no host-side decisions. `PiecewiseGraphs` captures it once per
(layer, bucket) -- at engine start for every bucket up to the decode / verification batch
(`DsaForCausalLM.capture_graphs`; larger passes run eagerly) -- and replays it, so the block costs a
copy in, one replay and a copy out. The
pre-attention piece (input norm, q / kv projections, RoPE, the absorbed query, the indexer's
projections; `MLAttention.pre`) is pure per token too ('layer' mode replays both). The KV part --
store, index top-k, locate -- stays eager (its context changes shape every step), as in vLLM's
piecewise graphs.

    tokens T -> bucket Tb = smallest bucket >= T (T > the largest bucket: eager)
    static_in[Tb][:T] = h          (rows T..Tb-1 keep finite earlier values; the FFN is per-token,
    graph(layer, Tb).replay()       so padded rows never touch real rows and no state changes)
    return static_out[:T].clone()  (the graph's output buffer is overwritten by its next replay)

The 'attn' piece (mode 'layer') goes further: the sparse attention itself joins the post piece,
because its inputs are fixed-shape per bucket -- q_abs, q_pe [T, heads, .] and the located rows
loc [T, k] -- and its row spaces (the engine's arena, the staging rows) have fixed addresses. Those
addresses are baked into the graph, so 'attn' graphs are keyed by the row spaces too (one set per
engine: a new engine's capture drops the graphs of row spaces it does not use). Padded loc rows
are -1 (no row: the kernel writes zeros), so a padded token never reads a stale location.

`runner` is pluggable: `CudaGraphRunner` on CUDA; tests use an eager runner with the same
bucketing and padding on CPU. Graphs share one memory pool; the static inputs are shared per
bucket across layers (layers run one after another).
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

from dhisparse.layers.moe import DENSE_MAX_EXPERTS, DENSE_ROWS

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

FFN = Callable[..., torch.Tensor]


class Runner(Protocol):
    def capture(self, thunk: Callable[[], object]) -> Callable[[], object]:
        """Record thunk() (a piece over static inputs); return a replay giving its static output."""


class CudaGraphRunner:
    """torch.cuda.CUDAGraph capture (after warm-up on a side stream), one shared memory pool.

    The capture brackets the thunk with capture_begin / capture_end on the side stream itself
    rather than `torch.cuda.graph(...)`, whose entry synchronizes the device, runs gc.collect()
    and empties the caching allocator: harmless at start-up, but a whole-step graph captured
    lazily while serving paid that (and re-allocating what was emptied) in the middle of a step,
    up to ~1.7 s a capture on the H200."""

    def __init__(self, warmup: int = 1) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.warmup = warmup
        self.stream = torch.cuda.Stream()

    def capture(self, thunk: Callable[[], object]) -> Callable[[], object]:
        side, main = self.stream, torch.cuda.current_stream()
        side.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                thunk()
            graph.capture_begin(pool=self.pool)
            try:
                out = thunk()
            finally:
                graph.capture_end()
        main.wait_stream(side)

        def replay() -> object:
            graph.replay()
            return out

        return replay


class EagerRunner:
    """Same bucketing and padding, no graph: replay runs fn on the static input (CPU tests)."""

    def capture(self, thunk: Callable[[], object]) -> Callable[[], object]:
        return thunk


def _head(out, T: int):
    """out (a tensor, or a NamedTuple / tuple of tensors and None) with every tensor cut to [:T]."""
    if isinstance(out, torch.Tensor):
        return out[:T]
    if out is None:
        return None
    parts = [_head(o, T) for o in out]
    return type(out)(*parts) if hasattr(out, "_fields") else type(out)(parts)


class PiecewiseGraphs:
    """Per-(piece, layer, bucket, row spaces) replays of per-token pieces of a decoder layer.

    `ffn(layer, fn, *inputs)` -> fn(*inputs) [T, H], cloned (it lives on into the next layer);
    `attn(layer, rows, fn, h, q_abs, q_pe, loc)` -> fn(h, q_abs, q_pe, loc) [T, H], cloned, with
    the row spaces `rows` (a tensor or a tuple of two) fixed in the graph;
    `pre(layer, fn, h, C, S)` -> fn(h, C, S) (PreAttention), not cloned: valid until the same
    graph replays again, i.e. within this layer of this pass.
    Static inputs are shared per (bucket, slot) across layers and pieces (layers run one after
    another); an input that is the very tensor copied last time (the pass's RoPE tables) is not
    copied again."""

    def __init__(self, runner: Runner, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 pieces: tuple[str, ...] = ("ffn",)) -> None:
        """pieces: which pieces replay ('pre', 'ffn'); the others run eagerly."""
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be distinct positive sizes in increasing order, got {buckets}")
        if not set(pieces) <= {"pre", "ffn", "attn"}:
            raise ValueError(f"pieces must be among 'pre', 'ffn', 'attn', got {pieces}")
        self.runner, self.buckets, self.pieces = runner, buckets, pieces
        self.inputs: dict[tuple, torch.Tensor] = {}  # (bucket, slot, dtype, row shape) -> [Tb, ...]
        self.last: dict[tuple, torch.Tensor] = {}  # the same key -> the source copied last
        self.replays: dict[tuple[str, int, int, tuple], Callable[[], object]] = {}  # (piece, layer, Tb, spaces)
        self.replayed = self.eager = 0  # counters: calls served by a graph / run eagerly
        self.capture_s = 0.0  # wall time spent capturing (first use of a (piece, layer, bucket))
        self.limit: int | None = None  # tokens above this bucket run eagerly (None: every bucket)

    def bucket(self, T: int) -> int | None:
        if T <= 0 or (self.limit is not None and T > self.limit):
            return None
        return next((b for b in self.buckets if b >= T), None)

    def allow(self, max_tokens: int) -> list[int]:
        """Raise the limit to the bucket of max_tokens (never lowers it: graphs are shared by the
        model's engines); returns the buckets now in use, to capture up front."""
        top = next((b for b in self.buckets if b >= max_tokens), self.buckets[-1])
        self.limit = max(self.limit or 0, top)
        return [b for b in self.buckets if b <= self.limit]

    def _static(self, Tb: int, slot: int, x: torch.Tensor, pad: int | None = None) -> torch.Tensor:
        """The bucket's static input for slot: x copied into rows [:T]; rows [T:] set to pad (if
        given) or left as they are (finite earlier values)."""
        key = (Tb, slot, x.dtype, tuple(x.shape[1:]))
        buf = self.inputs.get(key)
        if buf is None:
            fill = 0 if pad is None else pad
            buf = self.inputs[key] = torch.full((Tb,) + tuple(x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        if self.last.get(key) is not x:
            buf[: x.shape[0]].copy_(x)
            if pad is not None and x.shape[0] < Tb:
                buf[x.shape[0] :].fill_(pad)
            self.last[key] = x
        return buf

    def run(self, piece: str, layer: int, fn: Callable, inputs: tuple[torch.Tensor, ...], clone: bool,
            spaces: tuple = (), pads: dict[int, int] | None = None):
        T = inputs[0].shape[0]
        Tb = self.bucket(T)
        if Tb is None:
            self.eager += 1
            return fn(*inputs)
        pads = pads or {}
        static = tuple(self._static(Tb, i, x, pads.get(i)) for i, x in enumerate(inputs))
        key = (piece, layer, Tb, spaces)
        replay = self.replays.get(key)
        if replay is None:
            t0 = time.perf_counter()
            replay = self.replays[key] = self.runner.capture(lambda: fn(*static))
            self.capture_s += time.perf_counter() - t0
        self.replayed += 1
        out = _head(replay(), T)
        return out.clone() if clone else out

    def ffn(self, layer: int, fn: FFN, *inputs: torch.Tensor) -> torch.Tensor:
        """fn(*inputs) [T, H]: the layer's post-attention piece (out-projection, residual, FFN)."""
        return self.run("ffn", layer, fn, inputs, clone=True)

    def pre(self, layer: int, fn: Callable, h: torch.Tensor, C: torch.Tensor, S: torch.Tensor):
        return self.run("pre", layer, fn, (h, C, S), clone=False)

    def attn(self, layer: int, rows, fn: Callable, h: torch.Tensor, q_abs: torch.Tensor, q_pe: torch.Tensor,
             loc: torch.Tensor) -> torch.Tensor:
        """fn(h, q_abs, q_pe, loc) [T, H]: sparse attention over `rows` at loc [T, k] (-1: none),
        out-projection, residual, FFN. fn must read exactly the row spaces `rows`: their
        addresses are part of the graph and of its key."""
        return self.run("attn", layer, fn, (h, q_abs, q_pe, loc), clone=True, spaces=spaces_key(rows), pads={3: -1})

    def keep_spaces(self, keys: set[tuple]) -> int:
        """Drop 'attn' graphs over row spaces other than `keys` (an engine's own); returns how many."""
        stale = [k for k in self.replays if k[0] == "attn" and k[3] not in keys]
        for k in stale:
            del self.replays[k]
        return len(stale)

    __call__ = ffn


def spaces_key(rows) -> tuple:
    """Identity of row spaces (a tensor or a tuple of them): address, shape, strides, dtype each."""
    spaces = (rows,) if isinstance(rows, torch.Tensor) else tuple(rows)
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in spaces)


def graph_buckets(n_experts: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """Buckets whose FFN runs without a host sync (MoE: the dense expert path, T * E <= DENSE_ROWS)."""
    if n_experts > DENSE_MAX_EXPERTS:
        raise ValueError(f"cuda_graphs 'ffn' needs the sync-free dense expert path (<= {DENSE_MAX_EXPERTS} "
                         f"routed experts); this model has {n_experts}: use --cuda-graphs none")
    return tuple(b for b in buckets if b * max(n_experts, 1) <= DENSE_ROWS)


GRAPH_MODES = ("none", "ffn", "layer", "step")
# layer = the pre-attention piece and the attention + FFN piece; step = layer + whole-step graphs of
# decode / verification passes (engine.step_graphs)


def auto_graph_mode(device: torch.device, model_has_pieces: bool, n_experts: int) -> str:
    """What --cuda-graphs auto means: 'step' on CUDA for a model with graph pieces whose FFN runs
    sync-free (<= DENSE_MAX_EXPERTS routed experts), else 'none'."""
    ok = device.type == "cuda" and model_has_pieces and n_experts <= DENSE_MAX_EXPERTS
    return "step" if ok else "none"


def graph_counters(graphs: PiecewiseGraphs | None) -> dict:
    """Replay counters for engine stats (cumulative over the model's lifetime: graphs outlive
    engines); empty without graphs."""
    if graphs is None:
        return {}
    return {"graph_replays": graphs.replayed, "graph_eager_calls": graphs.eager,
            "graphs_captured": len(graphs.replays), "graph_capture_s": graphs.capture_s}


def graphs_for(device: torch.device, mode: str, n_experts: int,
               existing: PiecewiseGraphs | None = None) -> PiecewiseGraphs | None:
    """mode 'none' -> None; 'ffn' / 'layer' -> PiecewiseGraphs replaying CUDA graphs (CUDA only).
    `existing` (the model's graphs from an earlier engine) is kept when it replays the same pieces:
    the pieces are pure functions of the model's weights, so their graphs outlive an engine and a
    benchmark's fresh engines do not capture again."""
    if mode == "none":
        return None
    if mode not in GRAPH_MODES:
        raise ValueError(f"cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if device.type != "cuda":
        raise ValueError(f"cuda_graphs {mode!r} needs a CUDA device; use --cuda-graphs none on CPU")
    pieces = ("pre", "attn") if mode in ("layer", "step") else ("ffn",)
    if existing is not None and existing.pieces == pieces and isinstance(existing.runner, CudaGraphRunner):
        return existing
    return PiecewiseGraphs(CudaGraphRunner(), graph_buckets(n_experts), pieces)
