"""Prefill/decode disaggregation (SGLang's `--disaggregation-mode`): P prefill ranks compute prompts
and sample first tokens, D decode ranks admit the KV they are sent and decode. Rank 0 (a prefill
rank) fronts the world with the Engine surface (`DisaggCoordinator`), as `distributed.Coordinator`
does for data parallelism; `dhisparse serve` puts one HTTP endpoint on it.

    client -> rank 0: validate, pick the prefill rank (fewest sessions, then free pages)
    prefill rank p: prompt -> first token; KV + sampling state held (engine/disagg_ranks.py)
    rank 0: the decode rank d with room (fewest sessions, then free pages) -> transfer p -> d in
            the next round (engine/disagg_wire.py), d admits it resident-first or host-first
            (kv/hier/arrival.py) and decodes; outputs go back through rank 0 each round

The rounds (engine/disagg_round.py) run over the gloo world in lock-step, one per step, with a beat
round while idle; a failed or late round or transfer is `RankLost` (the server answers 503).
Inside a role: DP attention with experts sharded over the role (`--ep-size E --enable-dp-attention`,
E dividing P and D; engine/disagg_launch.py); TP inside a role is refused (config). DeepSeek-V4 prompts travel as their whole streaming state (engine/disagg_v4.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time

from dhisparse.core.params import SamplingParams
from dhisparse.core.parallel import ControlChannel, RankLost
from dhisparse.engine.disagg_layout import DisaggLayout
from dhisparse.engine.disagg_ranks import PrefillRank
from dhisparse.engine.disagg_round import DControl, DReply, serve_round
from dhisparse.engine.disagg_wire import Header, Wire
from dhisparse.engine.distributed import Load, RoundFront, merge_stats
from dhisparse.engine.request import RequestOutput, next_request_id
from dhisparse.engine.stats import EngineStats


def least_loaded(loads: dict[int, Load], placed: dict[int, int], cap: int | None = None) -> int | None:
    """The rank with the fewest sessions (its last load + those placed since), then the most free
    device / host pages, then the lowest rank; with `cap`, only ranks below it (None: none)."""
    def key(r: int) -> tuple:
        return (loads[r].sessions + placed[r], -loads[r].free_pages, -loads[r].free_host_pages, r)

    ok = [r for r in loads if cap is None or loads[r].sessions + placed[r] < cap]
    return min(ok, key=key) if ok else None


class DisaggCoordinator(RoundFront):
    """Rank 0's front of a prefill/decode world (module docstring). `close()` ends the world."""

    CONTROL = DControl
    WORLD = "prefill/decode world"
    LOST_WAIT_S = 1.0  # a failed world's survivors cannot hear a shutdown

    def __init__(self, side: PrefillRank, channel: ControlChannel, wire: Wire, layout: DisaggLayout, procs: list,
                 beat_s: float = 1.0) -> None:
        self.side, self.engine, self.channel, self.wire = side, side.engine, channel, wire
        self.layout, self.procs, self.world = layout, procs, layout.world_size
        self.loads = {r: Load(0, 0, 0) for r in range(self.world)}
        self.placed = {r: 0 for r in range(self.world)}
        self.owner: dict[str, int] = {}  # unfinished request id -> the rank holding it now
        self.ready: dict[str, tuple[int, Header]] = {}  # handed over on a prefill rank, no decode rank yet
        self._prefix_left: dict[str, set[int]] = {}
        self._pending, self._held = DControl(), []
        self._stats: list[EngineStats | None] = [None] * self.world
        self._lock, self._error, self._closed = threading.RLock(), None, False
        self._last, self.beat_s = time.monotonic(), beat_s
        threading.Thread(target=self._beat_loop, name="dhisparse-pd-beat", daemon=True).start()

    # -- the Engine surface ----------------------------------------------------------------------
    config = property(lambda self: self.engine.config)
    model_config = property(lambda self: self.engine.model_config)
    tokenizer = property(lambda self: self.engine.tokenizer)
    max_model_len = property(lambda self: self.engine.max_model_len)
    grammars = property(lambda self: self.engine.grammars)
    spec = property(lambda self: self.engine.spec)
    requests = property(lambda self: self.owner.keys())

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.engine.encode_prompt(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_ids, params)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    *, export_prefix: bool = False) -> str:
        """Validate on rank 0, place on a prefill rank (a prefix export on every one), queue for the
        next round; returns the id."""
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
            prefill = {r: self.loads[r] for r in self.layout.prefill_ranks}
            ranks = list(prefill) if export_prefix else [least_loaded(prefill, self.placed)]
            if export_prefix:
                self._prefix_left[rid] = set(ranks)
            self.owner[rid] = ranks[0]
            for r in ranks:
                self.placed[r] += 1
                self._pending.adds.append((r, rid, ids, params, export_prefix, time.time()))
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort wherever the request is: not sent yet, prefilling, held, moving (aborted on its decode
        rank right after the transfer, in the same round) or decoding. Its pages are freed there."""
        with self._lock:
            rank = self.owner.pop(request_id, None)
            if rank is None:
                return False
            ranks = self._prefix_left.pop(request_id, None) or {rank}
            self.ready.pop(request_id, None)
            adds = self._pending.adds
            self._pending.adds = [a for a in adds if a[1] != request_id]
            if len(self._pending.adds) == len(adds):
                self._pending.aborts += [(r, request_id) for r in ranks]
            return True

    def has_unfinished(self) -> bool:
        self._check()
        return bool(self.owner or self._held)

    def step(self) -> list[RequestOutput]:
        """One round: transfers, every rank's share and step; the clients' outputs of every rank."""
        with self._lock:
            self._check()
            ctl, self._pending = self._pending, DControl()
            replies = self._round(ctl)
            outs, self._held = self._held, []
            for rank, rep in enumerate(replies):
                outs += self._take(rank, rep)
            self.placed = {r: 0 for r in range(self.world)}
            self._send_ready()
            return outs

    def prepare_prefix(self, prompt: str | list[int]) -> int:
        """Prefill `prompt` on every prefill rank (each keeps its own copy for the requests it
        prefills); other requests' outputs of those rounds wait for the next `step`."""
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
        """Every rank's stats merged (engine/distributed.py `merge_stats`), with the hand-over means."""
        st = merge_stats([s for s in self.rank_stats() if s is not None])
        c = dict(st.counters, dp_size=1, disagg_prefill_size=self.layout.prefill, disagg_decode_size=self.layout.decode)
        n = c.get("disagg_received", 0)
        for k in ("handoff", "transfer", "alloc_wait"):
            c[f"disagg_{k}_mean_s"] = c.get(f"disagg_{k}_s", 0.0) / n if n else 0.0
        return dataclasses.replace(st, counters=c)

    def rank_stats(self) -> list[EngineStats | None]:
        """Each rank's stats as of the last round (rank 0's live)."""
        with self._lock:
            return [self.side.stats(), *self._stats[1:]]

    def _round(self, ctl: DControl) -> list[DReply]:
        try:
            self.channel.broadcast(ctl)
            replies = self.channel.gather(serve_round(self.side, self.wire, ctl))
        except RankLost as e:
            self._fail(e)
        except Exception as e:  # rank 0's own share failed: its peers wait in the gather, the world is over
            self._error = RankLost(0, "its round", e)
            raise
        self._last = time.monotonic()
        return replies

    def _take(self, rank: int, rep: DReply) -> list[RequestOutput]:
        """A rank's reply: its error is the world's, its loads and stats kept, ready prompts queued
        for a decode rank, outputs of live requests returned (finished ones leave `owner`)."""
        if rep.error is not None:
            self._fail(RankLost(rank, "apply", RuntimeError(rep.error)))
        self.loads[rank] = rep.load
        self._stats[rank] = rep.stats if rep.stats is not None else self._stats[rank]
        for h in rep.ready:
            if h.request_id in self.owner:
                self.ready[h.request_id] = (rank, h)
            else:  # aborted while its first token was computed: drop what the prefill rank holds
                self._pending.aborts.append((rank, h.request_id))
        for rid in rep.exported:
            self._exported(rank, rid)
        outs = []
        for o in rep.outputs:
            if o.request_id in self.owner:
                outs.append(o)
                if o.finished:
                    del self.owner[o.request_id]
        return outs

    def _send_ready(self) -> None:
        """Ready prompts, oldest first, to the least loaded decode rank with room: a decode rank holds
        at most twice its request slots (running + received, waiting for pages)."""
        decode = {r: self.loads[r] for r in self.layout.decode_ranks}
        cap = 2 * self.engine.config.max_running_requests
        for rid, (src, h) in list(self.ready.items()):
            dst = least_loaded(decode, self.placed, cap)
            if dst is None:
                return
            self.placed[dst] += 1
            del self.ready[rid]
            self.owner[rid] = dst
            self._pending.transfers.append((src, dst, h))
