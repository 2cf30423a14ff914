"""Parallel serving: one `Engine` per rank, fronted on rank 0 by a `Coordinator`.

Data parallelism: each rank owns its requests and its whole KV hierarchy (the paper's per-GPU
session); weights are replicated. Rank 0 places every new request on a rank (`Router`).
Tensor parallelism (`replicate`): every add and abort goes to every rank (same request id, same
params; a seed is drawn once on rank 0 when the request has none), every rank runs the same steps
with its shard of the weights, and only rank 0's outputs are reported (followers send none).
Either way rank 0 drives all ranks in lock-step, one control round per engine step over the gloo
world (`core.parallel.ControlChannel`):

    rank 0                                   rank r > 0 (`follow`)
    broadcast Control(adds, aborts, ...) ->  apply its adds / aborts
    own adds applied at add_request          engine.step()
    engine.step()
    gather <- Reply(outputs, load, stats)    <- Reply(outputs, load, stats)

A beat round (no step) runs when rank 0 has been idle for `beat_s`, so idle followers never hit
the deadline and a dead rank is noticed with no traffic. Any failed or timed-out round raises
`RankLost` from the Coordinator's next call (the server answers 503).

The Coordinator has the Engine surface the server, the warm-up, `generate` and `LLM` use (what it
shares with the prefill/decode front: engine/front.py `RoundFront`). Tokenizing, validation and
grammar checks run on rank 0: every rank's store has the same geometry, so `never_fits` answers
the same everywhere.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from typing import Any

from dhisparse.core.params import SamplingParams
from dhisparse.core.parallel import ControlChannel
from dhisparse.engine.engine import Engine
from dhisparse.engine.front import RoundFront
from dhisparse.engine.request import RequestOutput
from dhisparse.engine.stats import EngineStats


@dataclass
class Control:
    """One round's message from rank 0. adds: (rank, request id, prompt ids, params, export_prefix);
    aborts: (rank, request id); beat: no step this round (a heartbeat); forget: every rank forgets
    what speculation learnt (`Engine.forget_learning`, after a warm-up) before its share."""

    adds: list[tuple[int, str, list[int], SamplingParams, bool]] = field(default_factory=list)
    aborts: list[tuple[int, str]] = field(default_factory=list)
    beat: bool = False
    shutdown: bool = False
    forget: bool = False


@dataclass(frozen=True)
class Load:
    """What the router weighs: sessions held (running + waiting) and free device / host pages."""

    sessions: int
    free_pages: int
    free_host_pages: int = 0


@dataclass
class Reply:
    outputs: list[RequestOutput]
    load: Load
    stats: EngineStats | None = None
    error: str | None = None  # a failure applying this round's message
    exported: list[str] = field(default_factory=list)  # prefix exports that finished (they emit no output)


class Router:
    """Places a new request on the rank with the fewest sessions, then the most free device pages,
    then the most free host pages, then the lowest rank. Loads are the last round's, plus one
    session for each request placed since."""

    def __init__(self, world: int) -> None:
        self.loads = [Load(0, 0, 0) for _ in range(world)]
        self._placed = [0] * world

    def update(self, loads: list[Load]) -> None:
        self.loads, self._placed = list(loads), [0] * len(loads)

    def pick(self) -> int:
        def key(r: int) -> tuple:
            ld = self.loads[r]
            return (ld.sessions + self._placed[r], -ld.free_pages, -ld.free_host_pages, r)

        rank = min(range(len(self.loads)), key=key)
        self._placed[rank] += 1
        return rank


def load_of(st: EngineStats) -> Load:
    host_free = int(st.counters.get("host_pages_total", 0)) - int(st.counters.get("host_pages_used", 0))
    return Load(st.running + st.waiting, st.kv_pages_total - st.kv_pages_used, host_free)


def detached(out: RequestOutput) -> RequestOutput:
    """The output with its totals cut to this report (what crosses the wire)."""
    return dataclasses.replace(out, _ids=out._ids[: out._n], _pieces=out._pieces[: out._m])


def apply(engine: Engine, rank: int, ctl: Control) -> None:
    """A rank's share of a round's message (a warm-up's forget, its aborts, then its adds)."""
    if ctl.forget:
        engine.forget_learning()
    for r, rid in ctl.aborts:
        if r == rank:
            engine.abort(rid)
    for r, rid, ids, params, export in ctl.adds:
        if r == rank:
            engine.add_request(ids, params, request_id=rid, export_prefix=export)


def serve_round(engine: Engine, rank: int, ctl: Control, exports: set[str], outputs: bool = True) -> Reply:
    """Apply the message and (unless it is a beat) step: the reply rank 0 gathers. exports: this
    rank's prefix-export requests in flight (they finish without an output; reported once gone);
    outputs False: a TP follower's (rank 0 reports the same outputs)."""
    try:
        apply(engine, rank, ctl)
    except Exception as e:  # noqa: BLE001 - rank 0 validated the adds; report, do not desert the round
        return Reply([], load_of(engine.stats()), error=f"rank {rank}: {type(e).__name__}: {e}")
    exports.update(rid for r, rid, _, _, export in ctl.adds if export and r == rank)
    outs = [] if ctl.beat else [detached(o) for o in engine.step()]
    outs = outs if outputs else []
    done = [rid for rid in exports if rid not in engine.requests]
    exports.difference_update(done)
    st = engine.stats()
    return Reply(outs, load_of(st), None if ctl.beat else st, exported=done)


def follow(engine: Engine, channel: ControlChannel, outputs: bool = True) -> None:
    """A follower's life: serve rounds until rank 0 says shutdown (RankLost when it is gone).
    outputs False under tensor parallelism (rank 0's are the world's)."""
    exports: set[str] = set()
    while True:
        ctl = channel.broadcast()
        if ctl.shutdown:
            return
        channel.gather(serve_round(engine, channel.rank, ctl, exports, outputs))


def replica_stats(rank0: EngineStats, world: int) -> EngineStats:
    """Tensor parallelism: every rank holds the same requests and (replicated-KV) pages, so the
    world's stats are rank 0's, requests and pages counted once (pages are per rank), with
    counters["tp_size"] = world."""
    return dataclasses.replace(rank0, counters={**rank0.counters, "tp_size": world})


def merge_stats(per_rank: list[EngineStats]) -> EngineStats:
    """One EngineStats over the ranks: requests, pages, tokens and counters summed; `steps` is
    rank 0's (ranks step together); float counters that are shares or rates are the mean."""
    first = per_rank[0]
    total = {f: sum(getattr(s, f) for s in per_rank) for f in
             ("running", "waiting", "kv_pages_total", "kv_pages_used", "kv_pages_peak", "generated_tokens",
              "prefill_tokens", "decoding", "admitted", "alloc_wait_s")}
    counters: dict[str, Any] = {}
    for k, v in first.counters.items():
        vals = [s.counters.get(k, 0) for s in per_rank]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            counters[k] = v
        elif isinstance(v, float) and any(t in k for t in ("share", "ratio", "per_", "_ms", "coverage")):
            counters[k] = sum(vals) / len(vals)
        else:
            counters[k] = sum(vals)
    counters["dp_size"] = len(per_rank)
    return EngineStats(steps=first.steps, kv_page_bytes=first.kv_page_bytes, counters=counters, **total)


class Coordinator(RoundFront):
    """Rank 0's front of a parallel world (module docstring). replicate: tensor parallelism (every
    request on every rank, rank 0's outputs). `close()` ends the world."""

    CONTROL = Control
    WORLD = "parallel world"
    BEAT = "dhisparse-dp-beat"

    def __init__(self, engine: Engine, channel: ControlChannel, procs: list, beat_s: float = 1.0,
                 replicate: bool = False) -> None:
        self.replicate = replicate
        self.router = Router(channel.world)
        self._exports: set[str] = set()  # rank 0's own prefix exports in flight
        super().__init__(engine, channel, procs, channel.world, beat_s)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    *, export_prefix: bool = False) -> str:
        """Validate on rank 0, place (a prefix export, or any request under `replicate`, goes to
        every rank), queue; returns the id."""
        params = params or SamplingParams()
        if self.replicate and params.seed is None:  # every rank's sampler draws the same numbers
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        return super().add_request(prompt, params, request_id, export_prefix=export_prefix)

    def abort(self, request_id: str) -> bool:
        """Abort the request on its rank (every rank under `replicate` or for a prefix export);
        whether rank 0 knew it (and, where rank 0 holds it, whether its engine did)."""
        with self._lock:
            ranks = self._forget(request_id)
            if ranks is None:
                return False
            ranks = set(range(self.world)) if self.replicate else ranks
            done = True
            for r in ranks:
                if r == 0:
                    done = self.engine.abort(request_id)
                else:
                    self._pending.adds = [a for a in self._pending.adds if a[1] != request_id or a[0] != r]
                    self._pending.aborts.append((r, request_id))
            return done

    def has_unfinished(self) -> bool:
        """Whether any request is unfinished on any rank (rank 0's engine included)."""
        return super().has_unfinished() or self.engine.has_unfinished()

    def stats(self) -> EngineStats:
        """Every rank's stats merged (`merge_stats`); under `replicate` rank 0's (`replica_stats`)."""
        if self.replicate:
            with self._lock:
                return replica_stats(self.engine.stats(), self.world)
        return merge_stats([s for s in self.rank_stats() if s is not None])

    def _ranks(self, export_prefix: bool) -> list[int]:
        return list(range(self.world)) if export_prefix or self.replicate else [self.router.pick()]

    def _queue(self, rank: int, rid: str, ids: list[int], params: SamplingParams, export_prefix: bool) -> None:
        if rank != 0:
            self._pending.adds.append((rank, rid, ids, params, export_prefix))
            return
        self.engine.add_request(ids, params, request_id=rid, export_prefix=export_prefix)
        if export_prefix:
            self._exports.add(rid)

    def _serve(self, ctl: Control) -> Reply:
        """Rank 0's share: its adds and aborts were applied at the call, so only its step."""
        return serve_round(self.engine, 0, dataclasses.replace(ctl, adds=[], aborts=[]), self._exports)

    def _settle(self, replies: list[Reply]) -> None:
        self.router.update([rep.load for rep in replies])
