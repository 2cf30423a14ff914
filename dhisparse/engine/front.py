"""`RoundFront`: rank 0's front of a world of ranks driven in lock-step control rounds, one a step,
with the Engine surface the server, the warm-up, `generate` and `LLM` use. What the data-parallel
`Coordinator` (engine/distributed.py) and the prefill/decode `DisaggCoordinator` (engine/disagg.py)
share: tokenizing and validation on rank 0, the unfinished requests and the rank holding each,
prefix exports on every rank that takes requests, a step's round and its replies, the heartbeat
round while idle, the lost-rank latch (`RankLost` from the next call) and the shutdown.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dhisparse.core.params import SamplingParams
from dhisparse.core.parallel import ControlChannel, RankLost, leave
from dhisparse.engine.engine import Engine
from dhisparse.engine.request import RequestOutput, next_request_id
from dhisparse.engine.stats import EngineStats


class RoundFront:
    """What every rank-0 front of lock-step rounds shares (`Coordinator`, the prefill/decode
    `DisaggCoordinator`): the Engine surface over rank 0's engine, validation, the unfinished
    requests (`owner`), prefix exports done on every rank that takes requests (`prepare_prefix`,
    the outputs held while it runs), a step (one round, every rank's reply taken), each rank's stats,
    the lost-rank latch (`_fail` / `_check`), the heartbeat round while idle and the shutdown.

    A subclass sets CONTROL (its round message type), WORLD (its name in errors), BEAT (its
    heartbeat thread's name) and LOST_WAIT_S (how long `close` waits for a survivor of a lost world
    before killing it); it says where a new request goes (`_ranks`, `_queue`), serves rank 0's
    share of a round (`_serve`), aborts (`abort`, through `_forget`), and may extend what it takes
    from a rank's reply (`_note`) and does after a round's replies (`_settle`)."""

    CONTROL: type
    WORLD: str
    BEAT: str
    LOST_WAIT_S = 10.0

    def __init__(self, engine: Engine, channel: ControlChannel, procs: list, world: int, beat_s: float) -> None:
        """Rank 0's engine, the world's channel and its spawned processes; starts the heartbeat, so a
        subclass sets what its `_serve` needs before calling this."""
        self.engine, self.channel, self.procs, self.world = engine, channel, procs, world
        self.owner: dict[str, int] = {}  # unfinished request id -> the rank holding it now
        self._prefix_left: dict[str, set[int]] = {}  # prefix-export request -> ranks still preparing
        self._pending = self.CONTROL()
        self._held: list[RequestOutput] = []  # outputs of rounds run inside prepare_prefix
        self._stats: list[EngineStats | None] = [None] * world
        self._lock = threading.RLock()
        self._error: RankLost | None = None
        self._closed = False
        self._last = time.monotonic()
        self.beat_s = beat_s
        self._beat = threading.Thread(target=self._beat_loop, name=self.BEAT, daemon=True)
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
        """The prompt's token ids (rank 0's tokenizer)."""
        return self.engine.encode_prompt(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Rank 0's checks (every rank's store has the same geometry, so they answer for all)."""
        self.engine.validate(prompt_ids, params)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    *, export_prefix: bool = False) -> str:
        """Validate on rank 0, place (`_ranks`; a prefix export on every rank that takes requests),
        queue for the next round; returns the id."""
        self._check()
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        self.validate(ids, params)
        if params.grammar is not None:
            self.grammars.validate(params.grammar)
        rid = request_id or next_request_id()
        with self._lock:
            if rid in self.owner:
                raise ValueError(f"request_id {rid!r} is already in use")
            ranks = self._ranks(export_prefix)
            if export_prefix:
                self._prefix_left[rid] = set(ranks)
            self.owner[rid] = ranks[0]
            for r in ranks:
                self._queue(r, rid, ids, params, export_prefix)
        return rid

    def has_unfinished(self) -> bool:
        """Whether any request is unfinished on any rank, or outputs are held for the next `step`."""
        self._check()
        return bool(self.owner or self._held)

    def step(self) -> list[RequestOutput]:
        """One round: every rank applies its share of the message and steps; the clients' outputs
        of every rank."""
        with self._lock:
            self._check()
            ctl, self._pending = self._pending, self.CONTROL()
            replies = self._round(ctl)
            outs, self._held = self._held, []
            for rank, rep in enumerate(replies):
                outs += self._take(rank, rep)
            self._settle(replies)
            return outs

    def prepare_prefix(self, prompt: str | list[int]) -> int:
        """Prefill `prompt` on every rank that takes requests (each keeps its own copy for the
        requests it serves), through rounds like any request (ranks step together); other requests'
        outputs of those rounds wait for the next `step`. A prefix rank 0 holds already is kept
        (every such rank has it)."""
        ids = self.encode_prompt(prompt)
        if self.engine.prefixes.get(ids) is not None:
            return len(ids)
        rid = self.add_request(ids, SamplingParams(max_tokens=1), export_prefix=True)
        held = []
        while rid in self.owner:
            held += [o for o in self.step() if o.request_id != rid]
        self._held += held
        return len(ids)

    def rank_stats(self) -> list[EngineStats | None]:
        """Each rank's stats as of the last round (rank 0's live)."""
        with self._lock:
            return [self._own_stats(), *self._stats[1:]]

    def forget_learning(self) -> None:
        """Every rank's speculation forgets what it learnt (`Engine.forget_learning`): rank 0's
        now, the others' with the next round's message."""
        with self._lock:
            self.engine.forget_learning()
            self._pending.forget = True

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

    # -- what a subclass says --------------------------------------------------------------------
    def _ranks(self, export_prefix: bool) -> list[int]:
        """The ranks a new request goes to, the one serving it first."""
        raise NotImplementedError

    def _queue(self, rank: int, rid: str, ids: list[int], params: SamplingParams, export_prefix: bool) -> None:
        """Give a new request to `rank` (rank 0's engine now, or the next round's message)."""
        raise NotImplementedError

    def _serve(self, ctl: Any) -> Any:
        """Rank 0's share of the round `ctl`: its reply."""
        raise NotImplementedError

    def _own_stats(self) -> EngineStats:
        """Rank 0's live stats."""
        return self.engine.stats()

    def _note(self, rank: int, rep: Any) -> None:
        """What a subclass keeps of a rank's reply besides its stats, exports and outputs."""

    def _settle(self, replies: list) -> None:
        """After every reply of a step's round is taken."""

    # -- requests and rounds ---------------------------------------------------------------------
    def _forget(self, request_id: str) -> set[int] | None:
        """Rank 0 forgets an unfinished request: the ranks holding it (for a prefix export, those
        still preparing it); None for a request it does not know."""
        rank = self.owner.pop(request_id, None)
        left = self._prefix_left.pop(request_id, None)
        if rank is None:
            return None
        return left or {rank}

    def _round(self, ctl: Any) -> list:
        """Broadcast `ctl`, serve rank 0's share (`_serve`), gather every rank's reply."""
        try:
            self.channel.broadcast(ctl)
            replies = self.channel.gather(self._serve(ctl))
        except RankLost as e:
            self._fail(e)
        self._last = time.monotonic()
        return replies

    def _take(self, rank: int, rep: Any) -> list[RequestOutput]:
        """A rank's reply: its error is the world's, its stats kept (`_note`: what else the subclass
        keeps), its prefix exports counted, outputs of live requests returned (`_keep`)."""
        if rep.error is not None:
            self._fail(RankLost(rank, "apply", RuntimeError(rep.error)))
        if rep.stats is not None:
            self._stats[rank] = rep.stats
        self._note(rank, rep)
        for rid in rep.exported:
            self._exported(rank, rid)
        return [o for o in rep.outputs if self._keep(o)]

    def _keep(self, out: RequestOutput) -> bool:
        """Whether an output goes to the caller (not for an aborted request); finished ones leave
        the owner map."""
        rid = out.request_id
        if rid not in self.owner:
            return False
        if out.finished:
            del self.owner[rid]
        return True

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
