"""One control round of a prefill/decode world, as every rank serves it (rank 0 drives the rounds:
engine/disagg.py). A rank is a `PrefillRank` or a `DecodeRank` (engine/disagg_ranks.py) around its
own `Engine`:

    rank 0     broadcast DControl(transfers, aborts, adds)
    each rank  1. transfers   prefill ranks send held prompt KV, decode ranks receive it (Wire)
               2. the rank's share: received KV queued on its decode engine (`add_prompt_kv`), then
                  aborts (after the transfers: one aborted mid-transfer is aborted where it landed),
                  then adds (prefill ranks: new requests, each handed over after its first token)
               3. engine.step() (not in a beat round)
    rank 0     gather <- DReply(outputs for clients, load, stats, ready: prompts handed over)

A request's life: add on prefill rank p -> its first token sampled (round r: p's reply lists it
ready, its KV held on p) -> rank 0 picks decode rank d with room (least loaded) -> round r + 1
moves the KV p -> d -> d admits it (allocation wait) and reports the first token, then decodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dhisparse.core.params import SamplingParams
from dhisparse.core.parallel import ControlChannel
from dhisparse.engine.disagg_wire import Header, Wire
from dhisparse.engine.distributed import Load
from dhisparse.engine.request import RequestMetrics, RequestOutput
from dhisparse.engine.stats import EngineStats


@dataclass
class DControl:
    """Rank 0's message of one round. adds: (prefill rank, request id, prompt ids, params,
    export_prefix, arrival wall time); transfers: (prefill rank, decode rank, Header); aborts:
    (rank, request id); beat: no step (a heartbeat); shutdown: the world ends; forget: every rank
    forgets what speculation learnt (`Engine.forget_learning`, after a warm-up)."""

    adds: list[tuple[int, str, list[int], SamplingParams, bool, float]] = field(default_factory=list)
    transfers: list[tuple[int, int, Header]] = field(default_factory=list)
    aborts: list[tuple[int, str]] = field(default_factory=list)
    beat: bool = False
    shutdown: bool = False
    forget: bool = False


@dataclass
class DReply:
    """One rank's answer: outputs for clients, its load, its stats (None in a beat round), the
    prompts it handed over this round (prefill), the prefix exports it finished, an error."""

    outputs: list[RequestOutput]
    load: Load
    stats: EngineStats | None = None
    ready: list[Header] = field(default_factory=list)
    exported: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class DisaggMetrics(RequestMetrics):
    """A request served by a prefill and a decode rank. ttft: its arrival at rank 0 -> the decode
    rank reports the first token, about prefill + handoff + alloc_wait (the paper's Table A2 split);
    queue: its wait for admission on the prefill rank; imported_len: prompt rows the prefill rank
    imported from a prepared prefix.

    prefill     arrival -> first token sampled on the prefill rank
    handoff     first token -> its KV received on the decode rank (a round's lag, any wait for a
                decode rank with room, the transfer)
    transfer    the point-to-point part of the hand-off: the decode rank's receive wait in that
                round (shared by the hand-overs that arrived in it)
    alloc_wait  KV received -> admitted: the decode rank's wait for pages"""

    prefill: float | None = None
    handoff: float | None = None
    transfer: float | None = None
    alloc_wait: float | None = None


def error_output(request_id: str, message: str, prompt_len: int) -> RequestOutput:
    """A finished output with finish_reason "error" for a request a rank could not take."""
    return RequestOutput(request_id, [], "", True, "error", RequestMetrics(None, None, None, 0, prompt_len, 0),
                         [], 0, [], 0, error=message)


def serve_round(side, wire: Wire, ctl: DControl) -> DReply:
    """This rank's round (module docstring). `side`: its PrefillRank or DecodeRank. A transfer
    that fails raises RankLost (the world cannot go on); a failure applying the rank's share is
    reported in the reply (rank 0 raises it as RankLost)."""
    received = wire.run(ctl.transfers, side.outgoing())
    try:
        side.transferred(ctl.transfers, received)
        if ctl.forget:
            side.engine.forget_learning()
        for rank, rid in ctl.aborts:
            if rank == side.rank:
                side.abort(rid)
        for rank, *add in ctl.adds:
            if rank == side.rank:
                side.add(*add)
    except Exception as e:  # noqa: BLE001 - rank 0 validated the adds; report, do not desert the round
        return DReply([], side.load(), error=f"rank {side.rank}: {type(e).__name__}: {e}")
    outs, ready = side.collect([] if ctl.beat else side.engine.step())
    return DReply(outs, side.load(), None if ctl.beat else side.stats(), ready, side.exported())


def follow(side, channel: ControlChannel, wire: Wire) -> None:
    """A rank other than 0: serve rounds until rank 0 says shutdown (RankLost when it is gone)."""
    while True:
        ctl = channel.broadcast()
        if ctl.shutdown:
            return
        channel.gather(serve_round(side, wire, ctl))
