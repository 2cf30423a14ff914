"""The two roles of a prefill/decode world around a rank's own `Engine` (engine/disagg_round.py
serves their rounds).

`PrefillRank`: a request runs with max_tokens 1 (min_tokens capped to 1: the first draw sees the
same mask) and `keep_prompt`; once its first token is sampled its KV and sampling state are held
here (`held`, host memory) until rank 0 sends them on. A request its first token finishes (EOS, a
stop, max_tokens 1, an error) is answered from here, with nothing handed over.

`DecodeRank`: received KV (a DeepSeek-V4 request: its whole streaming state, engine/disagg_v4.py)
is queued on its engine (`Engine.add_prompt_kv`); the first token is
reported at admission; outputs carry `DisaggMetrics` (their TTFT from the arrival at rank 0).

Counters both add to the engine's stats (summed over ranks by rank 0):

    prefill  disagg_handed_over, disagg_held, disagg_sent_bytes
    decode   disagg_received, disagg_received_bytes, disagg_transfer_s (the rounds' receive waits),
             disagg_handoff_s, disagg_alloc_wait_s (sums over requests), disagg_resident_first,
             disagg_host_first (admission placements)

rank 0 adds disagg_{handoff,transfer,alloc_wait}_mean_s (per request received) to the merged stats.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

from dhisparse.core.params import SamplingParams
from dhisparse.engine.disagg_kv import PromptKV
from dhisparse.engine.disagg_round import DisaggMetrics, error_output
from dhisparse.engine.disagg_v4 import check_v4_rows
from dhisparse.engine.disagg_wire import Header, Received, Wire, header_of
from dhisparse.engine.distributed import Load, detached, load_of
from dhisparse.engine.engine import Engine
from dhisparse.engine.request import RequestMetrics, RequestOutput
from dhisparse.engine.stats import EngineStats
from dhisparse.kv.v4.prefix import V4Prefix


COUNTERS = ("disagg_handed_over", "disagg_held", "disagg_sent_bytes", "disagg_received", "disagg_received_bytes",
            "disagg_transfer_s", "disagg_handoff_s", "disagg_alloc_wait_s", "disagg_resident_first", "disagg_host_first")
"""Every rank reports all of them (0 where its role has none), so rank 0's merge keeps each key."""


def first_token_params(params: SamplingParams) -> SamplingParams:
    """What a prefill engine runs: the request's params up to its first token."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


class _Rank:
    def __init__(self, engine: Engine, rank: int, wire: Wire) -> None:
        self.engine, self.rank, self.wire = engine, rank, wire
        self.counters: Counter = Counter({k: 0 for k in COUNTERS})
        self.failed: list[RequestOutput] = []  # requests this rank could not take, reported next

    def outgoing(self) -> dict[str, PromptKV]:
        return {}

    def exported(self) -> list[str]:
        return []

    def load(self) -> Load:
        return load_of(self.engine.stats())

    def stats(self) -> EngineStats:
        st = self.engine.stats()
        return dataclasses.replace(st, counters=st.counters | dict(self.counters))


class PrefillRank(_Rank):
    """A prefill rank (module docstring)."""

    def __init__(self, engine: Engine, rank: int, wire: Wire) -> None:
        super().__init__(engine, rank, wire)
        self.held: dict[str, PromptKV] = {}  # handed over, until sent
        self.reqs: dict[str, tuple[SamplingParams, float, float]] = {}  # id -> (params, arrival, added) wall times
        self.exports: set[str] = set()

    def outgoing(self) -> dict[str, PromptKV]:
        return self.held

    def add(self, rid: str, ids: list[int], params: SamplingParams, export: bool, arrival: float) -> None:
        if export:
            self.engine.add_request(ids, SamplingParams(max_tokens=1), request_id=rid, export_prefix=True)
            self.exports.add(rid)
            return
        try:
            self.engine.add_request(ids, first_token_params(params), request_id=rid, keep_prompt=True)
        except ValueError as e:
            self.failed.append(error_output(rid, str(e), len(ids)))
            return
        self.reqs[rid] = (params, arrival, time.time())

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)
        self.reqs.pop(rid, None)
        self.held.pop(rid, None)
        self.engine.kept_prompts.pop(rid, None)

    def transferred(self, transfers: list[tuple[int, int, Header]], received: list[Received]) -> None:
        for src, _, h in transfers:
            if src == self.rank:
                self.held.pop(h.request_id)

    def collect(self, outs: list[RequestOutput]) -> tuple[list[RequestOutput], list[Header]]:
        """Each output of a request here is its last (max_tokens 1): handed over, or answered."""
        client, ready, self.failed = self.failed, [], []
        for out in outs:
            entry = self.reqs.pop(out.request_id, None)
            kv = self.engine.kept_prompts.pop(out.request_id, None)
            if entry is None:  # not a request of this world's clients (none such is added)
                client.append(detached(out))
                continue
            params, arrival, added = entry
            if kv is not None and out.finish_reason == "length" and params.max_tokens > 1:
                kv = dataclasses.replace(kv, logprobs=out.logprobs)
                self.held[out.request_id] = kv
                ready.append(header_of(out.request_id, params, kv, arrival))
                self.counters["disagg_handed_over"] += 1
                continue
            m = out.metrics
            ttft = None if m.ttft is None else m.ttft + added - arrival
            client.append(dataclasses.replace(detached(out), metrics=DisaggMetrics(
                ttft, None, m.queue, m.output_len, m.prompt_len, m.imported_len, prefill=ttft)))
        return client, ready

    def exported(self) -> list[str]:
        done = [rid for rid in self.exports if rid not in self.engine.requests]
        self.exports.difference_update(done)
        return done

    def load(self) -> Load:
        ld = load_of(self.engine.stats())
        return dataclasses.replace(ld, sessions=ld.sessions + len(self.held))

    def stats(self) -> EngineStats:
        self.counters["disagg_held"] = len(self.held)
        self.counters["disagg_sent_bytes"] = self.wire.sent_bytes
        return super().stats()


class DecodeRank(_Rank):
    """A decode rank (module docstring)."""

    def __init__(self, engine: Engine, rank: int, wire: Wire) -> None:
        super().__init__(engine, rank, wire)
        self.arrived: dict[str, Received] = {}  # request id -> its hand-over, until finished

    def transferred(self, transfers: list[tuple[int, int, Header]], received: list[Received]) -> None:
        if received:  # the round's point-to-point wait, shared by what arrived in it
            self.counters["disagg_transfer_s"] += received[0].transfer_s
        for r in received:
            rid = r.header.request_id
            try:
                self._check_rows(r.kv)
                self.engine.add_prompt_kv(r.kv, r.header.params, rid)
            except ValueError as e:
                self.failed.append(error_output(rid, str(e), len(r.header.token_ids)))
                continue
            self.arrived[rid] = r
            self.counters.update(disagg_received=1, disagg_received_bytes=r.header.nbytes)
            self.counters["disagg_handoff_s"] += r.received_wall - r.header.sampled_wall

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)
        self.arrived.pop(rid, None)

    def _check_rows(self, kv: PromptKV) -> None:
        """The rows are in this store's row format (per-role hosts may differ in flags; the bytes are
        imported as they are): latent [L, n, W] and index [F, n, Wi] of its storage dtypes and widths;
        a DeepSeek-V4 state: its tails and stored rows (engine/disagg_v4.py `check_v4_rows`)."""
        item, eng = kv.item, self.engine
        if isinstance(item, V4Prefix):
            return check_v4_rows(item, eng.model_config, eng.config.kv_cache_dtype, eng.model.dtype)
        f = eng.arena.formats
        got = [(item.latent.dtype, item.latent.shape[-1]), (item.index.dtype, item.index.shape[-1])]
        want = [(f.latent.storage_dtype, f.latent.width), (f.index.storage_dtype, f.index.width)]
        if got != want:
            raise ValueError(f"the prefill rank's rows (dtype, width) {got} are not this decode rank's row format {want}: "
                             "every rank needs the same model, --dtype and --kv-cache-dtype")

    def collect(self, outs: list[RequestOutput]) -> tuple[list[RequestOutput], list[Header]]:
        client, self.failed = self.failed, []
        for host_first in self.engine.arrival_placements.values():
            self.counters["disagg_host_first" if host_first else "disagg_resident_first"] += 1
        self.engine.arrival_placements.clear()
        for out in outs:
            r = self.arrived.get(out.request_id)
            if r is None:
                client.append(detached(out))
                continue
            if out.finished:
                del self.arrived[out.request_id]
            client.append(dataclasses.replace(detached(out), metrics=self._metrics(out.metrics, r)))
        return client, []

    def _metrics(self, m: RequestMetrics, r: Received) -> DisaggMetrics:
        """The request's metrics from its arrival at rank 0 (wall clocks of both ranks)."""
        h = r.header
        before = r.received_wall - h.arrival_wall  # arrival at rank 0 -> KV here
        if m.output_len == 1 and m.queue is not None:  # the report of its first token: counted once
            self.counters["disagg_alloc_wait_s"] += m.queue
        return DisaggMetrics(None if m.ttft is None else before + m.ttft, m.tpot, h.queue_s, m.output_len,
                             m.prompt_len, h.imported_len, prefill=h.sampled_wall - h.arrival_wall,
                             handoff=r.received_wall - h.sampled_wall, transfer=r.transfer_s, alloc_wait=m.queue)
