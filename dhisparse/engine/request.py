"""Request state and what the engine reports back."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from dhisparse.core.logits import History, TokenLogprob
from dhisparse.core.params import SamplingParams

_ids = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_ids)}"


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request timings in seconds. ttft = first token - arrival; tpot = mean gap between
    later tokens; queue = admission - arrival (allocation wait)."""

    ttft: float | None
    tpot: float | None
    queue: float | None
    output_len: int
    prompt_len: int
    imported_len: int

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class Request:
    """One request's state. Positions 0..num_computed-1 have KV; the tokens still to run are
    all_ids[num_computed:] (a whole or partial prompt, or the last sampled token)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    stop: object | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    imported_len: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None  # set when the request's own work failed (finish_reason "error")
    export_prefix: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    eos: tuple[int, ...] = ()  # the EOS ids that stop it (empty with ignore_eos); min_tokens masks them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs: position 0 is None

    matcher: object | None = None  # params.grammar: its grammar state (engine/grammar.py Matcher)

    def history(self) -> History:
        """What its logit processors read at the next position (core/logits.py)."""
        return History(self.prompt_ids, self.output_ids, self.eos, None if self.matcher is None else self.matcher.mask())

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_from(self, start: int) -> list[int]:
        """all_ids[start:] without building all_ids (a decode step needs only the last token)."""
        P = len(self.prompt_ids)
        if start >= P:
            return self.output_ids[start - P :]
        return self.prompt_ids[start:] + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    def metrics(self) -> RequestMetrics:
        n = len(self.output_ids)
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        tpot = None
        if n > 1 and self.finished_at is not None and self.first_token_at is not None:
            tpot = (self.finished_at - self.first_token_at) / (n - 1)
        queue = None if self.admitted_at is None else self.admitted_at - self.arrival
        return RequestMetrics(ttft, tpot, queue, n, len(self.prompt_ids), self.imported_len)


@dataclass(frozen=True)
class RequestOutput:
    """A step's report for one request: new tokens/text since the last report, and totals.

    The totals (`token_ids`, `text`) are read on demand from the request's output ids and emitted
    text pieces as they were at this report (both lists only grow), so a step's reports cost O(new
    tokens), not O(output length) per request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    _ids: list[int] = field(repr=False, compare=False)  # the request's output ids; the first _n are this report's
    _n: int = field(repr=False, compare=False)
    _pieces: list[str] = field(repr=False, compare=False)  # emitted text pieces; the first _m are this report's
    _m: int = field(repr=False, compare=False)
    error: str | None = None  # finish_reason "error": what failed in this request's work
    logprobs: list[TokenLogprob] | None = None  # params.logprobs set: one per new_token_ids entry
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs set: one per prompt token

    @property
    def token_ids(self) -> list[int]:
        """Every output token id up to this report."""
        return self._ids[: self._n]

    @property
    def text(self) -> str:
        """All text emitted up to this report."""
        return "".join(self._pieces[: self._m])
