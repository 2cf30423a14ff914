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

The Coordinator has the Engine surface the server, the warm-up, `generate` and `LLM` use. Tokenizing,
validation and grammar checks run on rank 0: every rank's store has the same geometry, so
`never_fits` answers the same everywhere.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dhisparse.core.params import SamplingParams
from dhisparse.core.parallel import ControlChannel, RankLost, leave
from dhisparse.engine.engine import Engine
from dhisparse.engine.request import RequestOutput, next_request_id
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


class RoundFront:
    """What every rank-0 front of lock-step rounds shares (`Coordinator`, the prefill/decode
    `DisaggCoordinator`): the lost-rank latch (`_fail` / `_check`), the heartbeat round while idle,
    the shutdown, and prefix exports done on every rank. A subclass sets CONTROL (its round message
    type), WORLD (its name in errors), LOST_WAIT_S (how long `close` waits for a survivor of a lost
    world before killing it) and `_round(ctl)`; it holds channel, procs, _lock, _error, _closed,
    _last, beat_s, owner, _prefix_left and _pending (its next round message)."""

    CONTROL: type = Control
    WORLD = "parallel world"
    LOST_WAIT_S = 10.0

    def close(self) -> None:
        """Tell every follower to stop, reap them, leave the world."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._error is None:
                try:
                    self.channel.broadcast(self.CONTROL(shutdown=True))
                except RankLost:
                    pass
        wait = 10 if self._error is None else self.LOST_WAIT_S
        for p in self.procs:
            p.join(timeout=wait)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        leave()

    def forget_learning(self) -> None:
        """Every rank's speculation forgets what it learnt (`Engine.forget_learning`): rank 0's
        now, the others' with the next round's message."""
        with self._lock:
            self.engine.forget_learning()
            self._pending.forget = True

    def _exported(self, rank: int, rid: str) -> None:
        """A rank finished a prefix export; once every rank has, the request is done."""
        left = self._prefix_left.get(rid)
        if left is None:
            return
        left.discard(rank)
        if not left:
            del self._prefix_left[rid]
            self.owner.pop(rid, None)

    def _beat_loop(self) -> None:
        while not self._closed and self._error is None:
            time.sleep(self.beat_s / 4)
            if time.monotonic() - self._last < self.beat_s or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closed and self._error is None and time.monotonic() - self._last >= self.beat_s:
                    self._round(self.CONTROL(beat=True))
            except RankLost:
                pass  # kept in self._error: the next call raises it
            finally:
                self._lock.release()

    def _fail(self, e: RankLost):
        self._error = e
        raise e

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError(f"the {self.WORLD} is closed")


class Coordinator(RoundFront):
    """Rank 0's front of a parallel world (module docstring). replicate: tensor parallelism (every
    request on every rank, rank 0's outputs). `close()` ends the world."""

    def __init__(self, engine: Engine, channel: ControlChannel, procs: list, beat_s: float = 1.0,
                 replicate: bool = False) -> None:
        self.engine, self.channel, self.procs = engine, channel, procs
        self.world, self.replicate = channel.world, replicate
        self.router = Router(self.world)
        self.owner: dict[str, int] = {}  # unfinished request id -> its rank
        self._prefix_left: dict[str, set[int]] = {}  # prefix-export request -> ranks still preparing
        self._exports: set[str] = set()  # rank 0's own prefix exports in flight
        self._pending = Control()
        self._held: list[RequestOutput] = []  # outputs of rounds run inside prepare_prefix
        self._stats: list[EngineStats | None] = [None] * self.world
        self._lock = threading.RLock()
        self._error: RankLost | None = None
        self._closed = False
        self._last = time.monotonic()
        self.beat_s = beat_s
        self._beat = threading.Thread(target=self._beat_loop, name="dhisparse-dp-beat", daemon=True)
        self._beat.start()

    # -- the Engine surface ----------------------------------------------------------------------
    config = property(lambda self: self.engine.config)
    model_config = property(lambda self: self.engine.model_config)
    tokenizer = property(lambda self: self.engine.tokenizer)
    max_model_len = property(lambda self: self.engine.max_model_len)
    grammars = property(lambda self: self.engine.grammars)
    spec = property(lambda self: self.engine.spec)

    @property
    def requests(self):
        """Ids of the requests not finished yet, on any rank (supports `in` and len)."""
        return self.owner.keys()

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.engine.encode_prompt(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_ids, params)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    *, export_prefix: bool = False) -> str:
        """Validate on rank 0, place (a prefix export, or any request under `replicate`, goes to
        every rank), queue; returns the id."""
        self._check()
        params = params or SamplingParams()
        if self.replicate and params.seed is None:  # every rank's sampler draws the same numbers
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        ids = self.encode_prompt(prompt)
        self.validate(ids, params)
        if params.grammar is not None:
            self.grammars.validate(params.grammar)
        rid = request_id or next_request_id()
        with self._lock:
            if rid in self.owner:
                raise ValueError(f"request_id {rid!r} is already in use")
            ranks = list(range(self.world)) if export_prefix or self.replicate else [self.router.pick()]
            if export_prefix:
                self._prefix_left[rid] = set(ranks)
            self.owner[rid] = ranks[0]
            for r in ranks:
                if r == 0:
                    self.engine.add_request(ids, params, request_id=rid, export_prefix=export_prefix)
                    if export_prefix:
                        self._exports.add(rid)
                else:
                    self._pending.adds.append((r, rid, ids, params, export_prefix))
        return rid

    def abort(self, request_id: str) -> bool:
        with self._lock:
            rank = self.owner.pop(request_id, None)
            ranks = self._prefix_left.pop(request_id, None) or ({rank} if rank is not None else set())
            if rank is None:
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
        self._check()
        return bool(self.owner or self._held) or self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One round: every rank applies its messages and steps; every rank's outputs."""
        with self._lock:
            self._check()
            ctl, self._pending = self._pending, Control()
            replies = self._round(ctl)
            outs, self._held = self._held, []
            for rank, rep in enumerate(replies):
                if rep.error is not None:
                    self._fail(RankLost(rank, "apply", RuntimeError(rep.error)))
                self._stats[rank] = rep.stats
                outs += [o for o in rep.outputs if self._keep(o)]
                for rid in rep.exported:
                    self._exported(rank, rid)
            self.router.update([rep.load for rep in replies])
            return outs

    def prepare_prefix(self, prompt: str | list[int]) -> int:
        """Prefill `prompt` on every rank (each keeps its own copy for the requests it serves),
        through rounds like any request (ranks step together); other requests' outputs of those
        rounds wait for the next `step`. A prefix rank 0 holds already is kept (every rank has it)."""
        ids = self.encode_prompt(prompt)
        if self.engine.prefixes.get(ids) is not None:
            return len(ids)
        rid = self.add_request(ids, SamplingParams(max_tokens=1), export_prefix=True)
        held = []
        while rid in self.owner:
            held += [o for o in self.step() if o.request_id != rid]
        self._held += held
        return len(ids)

    def stats(self) -> EngineStats:
        with self._lock:
            mine = self.engine.stats()
        if self.replicate:
            return replica_stats(mine, self.world)
        others = [s for s in self._stats[1:] if s is not None]
        return merge_stats([mine, *others])

    def rank_stats(self) -> list[EngineStats | None]:
        """Each rank's stats as of the last round (rank 0's live)."""
        with self._lock:
            return [self.engine.stats(), *self._stats[1:]]

    # -- rounds ----------------------------------------------------------------------------------
    def _round(self, ctl: Control) -> list[Reply]:
        """Broadcast `ctl`, serve rank 0's share (its adds and aborts were applied at the call), gather."""
        try:
            self.channel.broadcast(ctl)
            mine = serve_round(self.engine, 0, dataclasses.replace(ctl, adds=[], aborts=[]), self._exports)
            replies = self.channel.gather(mine)
        except RankLost as e:
            self._fail(e)
        self._last = time.monotonic()
        return replies

    def _keep(self, out: RequestOutput) -> bool:
        """Whether an output goes to the caller (not for an aborted request); finished ones leave
        the owner map."""
        rid = out.request_id
        if rid not in self.owner:
            return False
        if out.finished:
            del self.owner[rid]
        return True
