"""Whole-step CUDA graphs: a decode / verification pass replayed as one graph per batch bucket.

Piecewise graphs (`models.graphs`) remove the per-token pieces' launches but leave the KV part of
every layer -- store, indexer top-k, resolver, copies, locate -- to the host: ~100 Python-level
ops a layer, the host-bound part of a 78-layer decode step. A pass in which every request runs
the same K tokens (plain decode K = 1, speculative verification K = width + 1) is instead replayed
from one graph of the whole forward, embeddings to final norm:

  1. the engine builds the pass's context (host-side bookkeeping, one staged copy of the slots;
     location tables are built only if the pass then runs eagerly);
  2. the context names the per-request tensors its forward reads (`GraphPass.rows`); they, the
     token ids, positions and lengths are copied into the bucket's static buffers, padded:

        requests   | r0 | r1 | ... | rN-1 | pad ... pad |     N_b = bucket(N)
        tokens     r * K .. r * K + K - 1 (req_idx is static: t // K)
        seq_len    real lengths          | 0           |   (a padded request sees no history)
        tables     [N, W] copied into [N_b, W_b], -1 elsewhere (no location); the hierarchy's
                   are computed in the graph from the slots' persistent state instead
        writes     real rows             | scratch row |   (`ScratchRows`: owned by no request)

  3. the graph of (N_b, K, W_b, variant) replays; its hidden rows [:N*K] are copied out.

A padded request selects nothing, so the resolver's direct exit writes no slot state (it takes the
first real slot's id only to stay in bounds), its copy plan is empty, and its rows land in the
scratch page: no real request's state changes (tests/test_step_graphs.py). A graph is captured
on first use of its key, over padding only (every request padded), so the warm-up and capture
runs touch no real state; census counters accumulate in place on the device (`Census.in_place`).
A pass with fewer requests replays a captured graph of up to twice its bucket rather than
capturing its own, and a mixed step is split only onto a captured graph (`split`). Addresses that
can move while serving (the hierarchy's slot tables) are part of the key (`graph_fingerprint`). Passes of other shapes (prefill, mixed) run eagerly with the piecewise
graphs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dhisparse.core.batch import ForwardBatch, GraphPass, ScratchRows
from dhisparse.models.dsa import ModelOutput
from dhisparse.models.graphs import graph_buckets

log = logging.getLogger("dhisparse.engine")

MIN_WIDTH = 64
# token buckets of whole-step graphs: finer than the piecewise graphs' (they are captured lazily,
# only for the batch sizes that occur), so a batch of 36 pads to 40 tokens, not 48
STEP_BUCKETS = tuple(range(1, 9)) + (10, 12, 14) + tuple(range(16, 129, 8)) + tuple(range(144, 257, 16)) + tuple(range(288, 513, 32))


def width_bucket(W: int, max_width: int) -> int | None:
    """Static table width for a pass whose tables are W wide: the next power of two (>= 64),
    capped at max_width (the model length); None when W exceeds max_width."""
    if W > max_width:
        return None
    return min(max(MIN_WIDTH, 1 << max(0, W - 1).bit_length()), max_width)


@dataclass
class StepEntry:
    """One captured step: static inputs, the replay and its static output."""

    ids: torch.Tensor  # [Tb] int64
    positions: torch.Tensor  # [Tb] int64
    seq_lens: torch.Tensor  # [Nb] int64
    rows: dict  # name -> static [Nb, ...] (2-D tables [Nb, Wb])
    pads: dict  # name -> pad value
    replay: Callable[[], ModelOutput] | None = None
    keep: tuple = ()  # what the graph reads but no other object holds (the static batch's req_idx)
    uses: int = field(default=0)

    def load(self, batch: ForwardBatch, gp: GraphPass, slots: torch.Tensor | None) -> None:
        """Copy one pass's inputs into the static buffers, padding the rest (see the module).
        slots [T]: the graph token of each of the pass's tokens (a ragged pass), or None (token t
        is graph token t)."""
        if slots is None:
            _put(self.ids, batch.input_ids, 0)
            _put(self.positions, batch.positions, -1)
        else:
            self.ids.zero_().index_copy_(0, slots, batch.input_ids)
            self.positions.fill_(-1).index_copy_(0, slots, batch.positions)
        _put(self.seq_lens, batch.seq_lens, 0)
        for name, (t, pad) in gp.rows.items():
            _put(self.rows[name], t, pad)

    def clear(self) -> None:
        """Every request padded (the capture's inputs)."""
        self.ids.zero_(), self.positions.fill_(-1), self.seq_lens.zero_()
        for name, buf in self.rows.items():
            buf.fill_(self.pads[name])


def _put(buf: torch.Tensor, x: torch.Tensor, pad) -> None:
    """buf[:n, :w] = x (n, w = x's leading sizes); the rest of buf = pad."""
    n = x.shape[0]
    if x.dim() == 2:
        w = x.shape[1]
        buf[:n, :w].copy_(x)
        if w < buf.shape[1]:
            buf[:n, w:].fill_(pad)
    else:
        buf[:n].copy_(x)
    if n < buf.shape[0]:
        buf[n:].fill_(pad)


class StepGraphs:
    """Whole-step graphs of one engine (they bake in its KV tensors' addresses).

    `forward(batch, ctx, capture_layers)` -> ModelOutput of the pass from a graph replay, or None
    when the pass is not graphable (the caller runs it eagerly). Buckets: request counts N_b with
    N_b * K within the model's graph token buckets (the MoE's sync-free path)."""

    SCRATCH_PAGES = 1  # pool pages an engine with step graphs holds for its life (padding writes)

    def __init__(self, model, kv, runner, token_buckets: tuple[int, ...], max_width: int, scratch: ScratchRows,
                 max_k: int = 1, widths: tuple[int, ...] = (), max_reqs: int | None = None) -> None:
        """max_k: the longest request a ragged pass may pad the others to (the verification width);
        a pass whose requests all run the same number of tokens replays whatever that number.
        widths: the round widths `warm` captures besides 1 and max_k (the speculation policy's,
        `SpecConfig.round_widths`). max_reqs: a pass of more requests runs eagerly (the engine's
        `graph_max_reqs`, --cuda-graph-max-bs); None: no limit but the token buckets."""
        self.model, self.kv, self.runner = model, kv, runner
        self.max_k, self.max_reqs = max_k, max_reqs
        self.widths = tuple(sorted({1, max_k, *widths}))
        self.token_buckets, self.max_width, self.scratch = token_buckets, max_width, scratch
        self.entries: dict[tuple, StepEntry] = {}
        self.failed: set[tuple] = set()  # keys whose capture raised: their passes run eagerly
        self.replayed = self.eager = self.ragged = 0
        self.capture_s = 0.0

    def store_replays(self) -> bool:
        """Whether the store's decode passes can replay at all (the hierarchy needs the deferred,
        sync-free resolver and no debug checks: `HierarchicalKV.replayable`)."""
        return self.kv.replayable

    @classmethod
    def for_engine(cls, engine, runner) -> "StepGraphs | None":
        """An engine's step graphs (None for stores without step-graph contexts: DeepSeek-V4).
        Takes one arena page as the scratch rows of padded requests and tokens."""
        arena = engine.arena
        if arena is None or engine.store.graph_context() is None or not engine.model.supports_cuda_graphs:
            return None
        page = arena.pool.alloc_permanent("step-graph-scratch", cls.SCRATCH_PAGES)[0]
        scratch = ScratchRows(page * arena.page_size, page * arena.index_page_size)
        experts = engine.model_config.n_routed_experts
        cfg = engine.config
        max_k = cfg.speculative_num_draft_tokens if cfg.speculative else 1
        widths = engine.spec.cfg.round_widths() if engine.spec is not None else ()
        return cls(engine.model, engine.store, runner, graph_buckets(experts, STEP_BUCKETS), engine.max_model_len, scratch,
                   max_k, widths, max_reqs=cfg.graph_max_reqs)

    def warm(self, max_reqs: int, capture_layers: tuple[int, ...] = ()) -> int:
        """Capture before serving the graphs decode (K = 1) and verification passes (K = max_k and
        the policy's other widths, `self.widths`) replay: every request bucket up to `max_reqs`, at
        the full table width (a narrower pass replays them, `_reuse`), one per variant of the
        store's context (`graph_templates`).
        Returns the number captured; a capture that fails leaves that key to the eager path."""
        ctx_cls = self.kv.graph_context()
        fp = self.kv.graph_fingerprint()
        t0, n = time.perf_counter(), 0
        for K in self.widths:
            buckets = sorted({b for b in (self.bucket(N, K) for N in range(1, max_reqs + 1)) if b is not None})
            for gp in ctx_cls.graph_templates(self.kv, K):
                family = (ctx_cls.__name__, K, gp.variant, tuple(capture_layers), fp)
                for Nb in buckets:
                    key = (family, Nb, self.max_width)
                    if key in self.entries or key in self.failed:
                        continue
                    try:
                        self.entries[key] = self._capture(ctx_cls, gp, Nb, self.max_width, tuple(capture_layers))
                        n += 1
                    except Exception as e:  # noqa: BLE001 - as in forward: that key runs eagerly
                        log.warning("step graph capture failed for %s (%s: %s)", key[0][:3] + key[1:], type(e).__name__, e)
                        self.failed.add(key)
        log.info("captured %d step graphs before serving in %.1f s", n, time.perf_counter() - t0)
        return n

    def split(self, chunks: list) -> list[list]:
        """A step's chunks as passes: [decodes, prefills] when the step mixes them and its decodes
        (chunks past their prompt: decode or verification) form a pass that an already captured
        graph can replay, else [chunks]. A split never captures: mixed steps come with every batch
        size as a wave of requests is admitted, and capturing those while serving cost more than
        the split saved (on the H200, 10-16 captures of up to 0.3 s in a 13 s window)."""
        dec = [c for c in chunks if c.decodes]
        if not dec or len(dec) == len(chunks) or not self.store_replays():
            return [chunks]
        sizes = {len(c.tokens) for c in dec}
        K = max(sizes)
        if (K > self.max_k and len(sizes) > 1) or not self._captured_fits(len(dec), K):
            return [chunks]
        return [dec, [c for c in chunks if not c.decodes]]

    def _captured_fits(self, N: int, K: int) -> bool:
        """Whether a captured graph of K tokens a request has a request bucket in [bucket(N), 2N]
        (what `_reuse` accepts; the pass's variant and table width are not known yet)."""
        Nb = self.bucket(N, K)
        return Nb is not None and any(k[0][1] == K and Nb <= k[1] <= 2 * N for k in self.entries)

    def bucket(self, N: int, K: int) -> int | None:
        """Smallest request bucket N_b >= N whose N_b * K tokens is a token bucket (None: eager,
        also when N exceeds `max_reqs`)."""
        if self.max_reqs is not None and N > self.max_reqs:
            return None
        return next((b // K for b in self.token_buckets if b % K == 0 and b // K >= N), None)

    def forward(self, batch: ForwardBatch, ctx, capture_layers: tuple[int, ...] = ()) -> ModelOutput | None:
        gp = ctx.graph_pass()
        N, T = batch.num_reqs, batch.num_tokens
        ragged = gp is not None and T != N * gp.K
        if ragged and gp.K > self.max_k:
            gp = None
        Nb = self.bucket(N, gp.K) if gp is not None else None
        Wb = width_bucket(max(max(batch.lens, default=1), 1), self.max_width) if gp is not None else None
        if Nb is None or Wb is None:
            self.eager += 1
            return None
        fp = self.kv.graph_fingerprint()
        self.kv.prepare_replay()
        family = (type(ctx).__name__, gp.K, gp.variant, tuple(capture_layers), fp)
        key = self._reuse(family, N, Nb, Wb) or (family, Nb, Wb)
        if key in self.failed:
            self.eager += 1
            return None
        entry = self.entries.get(key)
        if entry is None:
            try:
                entry = self.entries[key] = self._capture(type(ctx), gp, Nb, Wb, tuple(capture_layers))
            except Exception as e:  # a capture that fails leaves the pass to the eager path, loudly
                log.warning("step graph capture failed for %s (%s: %s); such passes run eagerly", key[0][:3] + key[1:], type(e).__name__, e)
                self.failed.add(key)
                self.eager += 1
                return None
        slots = self._slots(batch, gp.K) if ragged else None
        entry.load(batch, gp, slots)
        out = entry.replay()
        entry.uses += 1
        self.replayed += 1
        self.ragged += ragged
        if slots is None:
            return ModelOutput(out.hidden[:T].clone(), {i: h[:T].clone() for i, h in out.captured.items()})
        return ModelOutput(out.hidden.index_select(0, slots), {i: h.index_select(0, slots) for i, h in out.captured.items()})

    # keys of `entries`: (family, N_b, W_b), family = (context type, K, variant, layers, fingerprint)

    def _reuse(self, family: tuple, N: int, Nb: int, Wb: int) -> tuple | None:
        """The key of an already captured graph of the same family (context, K, variant, layers,
        addresses) that can run this pass padded: request bucket in [Nb, 2N] and table width
        >= Wb; the smallest such. Reusing one instead of capturing (Nb, Wb) keeps the graph count
        (and the captures made while serving, e.g. as a wave of requests drains) small; padded
        requests and table columns cost little in a decode pass."""
        fits = [k for k in self.entries if k[0] == family and Nb <= k[1] <= 2 * N and k[2] >= Wb]
        return min(fits, key=lambda k: (k[1], k[2])) if fits else None

    def _slots(self, batch: ForwardBatch, K: int) -> torch.Tensor:
        """[T] graph token of each token of a ragged pass: request r's j-th token -> r * K + j.

            pass    | r0: a0 d0 d1 | r1: a1 | r2: a2 d2 |            (K = 3)
            graph   | a0 d0 d1     | a1 -- --| a2 d2 -- |   -- = padding (position -1)
        """
        qs = batch.query_start
        idx = [r * K + j for r in range(batch.num_reqs) for j in range(qs[r + 1] - qs[r])]
        return torch.tensor(idx, dtype=torch.int64).to(self.kv.device, non_blocking=True)  # staged: no sync

    def _static(self, gp: GraphPass, Nb: int, Wb: int) -> StepEntry:
        dev = self.kv.device
        Tb = Nb * gp.K
        i64 = dict(dtype=torch.int64, device=dev)
        rows, pads = {}, {}
        for name, (t, pad) in gp.rows.items():
            shape = (Nb, Wb) + tuple(t.shape[2:]) if t.dim() >= 2 else (Nb,) + tuple(t.shape[1:])
            rows[name], pads[name] = torch.full(shape, pad, dtype=t.dtype, device=dev), pad
        return StepEntry(torch.zeros(Tb, **i64), torch.zeros(Tb, **i64), torch.zeros(Nb, **i64), rows, pads)

    def _capture(self, ctx_cls, gp: GraphPass, Nb: int, Wb: int, capture_layers: tuple[int, ...]) -> StepEntry:
        """Capture the forward over all-padding inputs (no real state is read or written)."""
        t0 = time.perf_counter()
        entry = self._static(gp, Nb, Wb)
        entry.clear()
        K, dev = gp.K, self.kv.device
        req_idx = torch.arange(Nb * K, device=dev) // K
        batch = ForwardBatch(entry.ids, entry.positions, req_idx, entry.seq_lens,
                             list(range(0, Nb * K + 1, K)), [0] * Nb)
        census = self.kv.resolver_census()
        shape = GraphPass(gp.K, gp.variant, {}, Wb)  # not the capturing pass's own tensors: the graph outlives them

        def step() -> ModelOutput:
            ctx = ctx_cls.for_graph(self.kv, batch, shape, entry.rows, self.scratch)
            return self.model(batch, ctx, capture_layers=capture_layers, piecewise=False)

        saved = None
        if census is not None:
            acc = census.accumulator(dev)
            saved, census.in_place = acc.clone(), True
        entry.keep = (batch, step)  # a CUDA graph holds raw addresses: these must outlive it
        try:
            entry.replay = self.runner.capture(step)
        finally:
            if census is not None:
                census.in_place = False
                census.accumulator(dev).copy_(saved)  # the capture's own (padding) calls do not count
        self.capture_s += time.perf_counter() - t0
        return entry

    def counters(self) -> dict:
        return {"step_graph_replays": self.replayed, "step_graph_ragged_replays": self.ragged, "step_graph_eager_passes": self.eager,
                "step_graphs_captured": len(self.entries), "step_graph_capture_failures": len(self.failed),
                "step_graph_capture_s": self.capture_s}
