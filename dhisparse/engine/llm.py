"""Offline Python API: `LLM(model, **config).generate(prompts, SamplingParams)`."""

from __future__ import annotations

from typing import Sequence

from dhisparse.engine.config import EngineConfig
from dhisparse.engine.launch import build
from dhisparse.core.params import SamplingParams
from dhisparse.engine.request import RequestOutput

Prompt = str | Sequence[int]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one pre-tokenized prompt
    return list(prompts)  # type: ignore[arg-type]


class LLM:
    """Run a batch of prompts to completion.

    >>> llm = LLM("tiny", preset="resident")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8))
    >>> out[0].text, out[0].token_ids, out[0].metrics.ttft
    """

    def __init__(self, model: str = "tiny", **config: object) -> None:
        self.engine = build(EngineConfig.from_kwargs(model=model, **config))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = build(config)
        return llm

    def close(self) -> None:
        """End a data-parallel world (`dp_size` > 1); nothing to do for one process."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); results in input order. Bad input
        raises ValueError before any request runs."""
        plist = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(plist)
        if len(params) != len(plist):
            raise ValueError(f"got {len(plist)} prompts but {len(params)} SamplingParams")
        for p, sp in zip(plist, params):  # validate everything before queueing anything
            self.engine.validate(self.engine.encode_prompt(p), sp)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(plist, params)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def prepare_prefix(self, prompt: Prompt) -> int:
        """Prefill a prompt prefix once; later prompts that start with it import its KV."""
        return self.engine.prepare_prefix(prompt if isinstance(prompt, str) else list(prompt))
