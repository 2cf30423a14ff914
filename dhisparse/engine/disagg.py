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
import time

from dhisparse.core.params import SamplingParams
from dhisparse.core.parallel import ControlChannel, RankLost
from dhisparse.engine.disagg_layout import DisaggLayout
from dhisparse.engine.disagg_ranks import PrefillRank
from dhisparse.engine.disagg_round import DControl, DReply, serve_round
from dhisparse.engine.disagg_wire import Header, Wire
from dhisparse.engine.distributed import Load, merge_stats
from dhisparse.engine.front import RoundFront
from dhisparse.engine.stats import EngineStats


def least_loaded(loads: dict[int, Load], placed: dict[int, int], cap: int | None = None) -> int | None:
    """The rank with the fewest sessions (its last load + those placed since), then the most free
    device / host pages, then the lowest rank; with `cap`, only ranks below it (None: none)."""
    def key(r: int) -> tuple:
        return (loads[r].sessions + placed[r], -loads[r].free_pages, -loads[r].free_host_pages, r)

    ok = [r for r in loads if cap is None or loads[r].sessions + placed[r] < cap]
    return min(ok, key=key) if ok else None


class DisaggCoordinator(RoundFront):
    """Rank 0's front of a prefill/decode world (module docstring; what it shares with the
    data-parallel front: engine/front.py). `close()` ends the world."""

    CONTROL = DControl
    WORLD = "prefill/decode world"
    BEAT = "dhisparse-pd-beat"
    LOST_WAIT_S = 1.0  # a failed world's survivors cannot hear a shutdown

    def __init__(self, side: PrefillRank, channel: ControlChannel, wire: Wire, layout: DisaggLayout, procs: list,
                 beat_s: float = 1.0) -> None:
        self.side, self.wire, self.layout = side, wire, layout
        self.loads = {r: Load(0, 0, 0) for r in range(layout.world_size)}
        self.placed = {r: 0 for r in range(layout.world_size)}
        self.ready: dict[str, tuple[int, Header]] = {}  # handed over on a prefill rank, no decode rank yet
        super().__init__(side.engine, channel, procs, layout.world_size, beat_s)

    def abort(self, request_id: str) -> bool:
        """Abort wherever the request is: not sent yet, prefilling, held, moving (aborted on its decode
        rank right after the transfer, in the same round) or decoding. Its pages are freed there."""
        with self._lock:
            ranks = self._forget(request_id)
            if ranks is None:
                return False
            self.ready.pop(request_id, None)
            adds = self._pending.adds
            self._pending.adds = [a for a in adds if a[1] != request_id]
            if len(self._pending.adds) == len(adds):
                self._pending.aborts += [(r, request_id) for r in ranks]
            return True

    def stats(self) -> EngineStats:
        """Every rank's stats merged (engine/distributed.py `merge_stats`), with the hand-over means."""
        st = merge_stats([s for s in self.rank_stats() if s is not None])
        c = dict(st.counters, dp_size=1, disagg_prefill_size=self.layout.prefill, disagg_decode_size=self.layout.decode)
        n = c.get("disagg_received", 0)
        for k in ("handoff", "transfer", "alloc_wait"):
            c[f"disagg_{k}_mean_s"] = c.get(f"disagg_{k}_s", 0.0) / n if n else 0.0
        return dataclasses.replace(st, counters=c)

    def _ranks(self, export_prefix: bool) -> list[int]:
        """The least loaded prefill rank (a prefix export: every prefill rank)."""
        prefill = {r: self.loads[r] for r in self.layout.prefill_ranks}
        return list(prefill) if export_prefix else [least_loaded(prefill, self.placed)]

    def _queue(self, rank: int, rid: str, ids: list[int], params: SamplingParams, export_prefix: bool) -> None:
        self.placed[rank] += 1
        self._pending.adds.append((rank, rid, ids, params, export_prefix, time.time()))

    def _own_stats(self) -> EngineStats:
        return self.side.stats()

    def _serve(self, ctl: DControl) -> DReply:
        try:
            return serve_round(self.side, self.wire, ctl)
        except RankLost:
            raise
        except Exception as e:  # rank 0's own share failed: its peers wait in the gather, the world is over
            self._error = RankLost(0, "its round", e)
            raise

    def _note(self, rank: int, rep: DReply) -> None:
        """A rank's load kept, its ready prompts queued for a decode rank."""
        self.loads[rank] = rep.load
        for h in rep.ready:
            if h.request_id in self.owner:
                self.ready[h.request_id] = (rank, h)
            else:  # aborted while its first token was computed: drop what the prefill rank holds
                self._pending.aborts.append((rank, h.request_id))

    def _settle(self, replies: list[DReply]) -> None:
        """Transfers for the next round (`_send_ready`), placements since the last loads forgotten."""
        self.placed = {r: 0 for r in range(self.world)}
        self._send_ready()

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
