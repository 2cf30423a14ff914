"""A generation request's fields -> validated `SamplingParams` (`sampling_params`; ValueError
messages become 400s naming the field), the OpenAI fields declared but not implemented
(`UNSUPPORTED`: a 400 naming them unless sent as null or their "off" value), an unset max_tokens
fitted to the context once the prompt length is known (`fit_max_tokens`), and choice i's seed
(`seeded`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from dhisparse.core.params import SamplingParams
from dhisparse.engine.grammar import GrammarError, compile_response_format
from dhisparse.server.protocol.chat import ChatRequest
from dhisparse.server.protocol.common import INT32_MAX, UINT64_MAX, CommonRequest
from dhisparse.server.protocol.completions import CompletionRequest
from dhisparse.server.protocol.errors import ApiError, quote

# field -> values that mean "off" (accepted); anything else is a 400 naming the field
UNSUPPORTED: dict[str, tuple] = {
    "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "metadata": (None, {}), "store": (None, False), "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,), "prompt_cache_key": (None,),
    "safety_identifier": (None,),
}


def _unsupported(req: CommonRequest) -> None:
    for name, off in UNSUPPORTED.items():
        v = getattr(req, name, None)
        if not any(v == o and type(v) is type(o) for o in off):
            raise ApiError(f"{name}={quote(v)} is not supported by this server; leave it unset", param=name)


def _logit_bias(req: CommonRequest) -> tuple[tuple[int, float], ...]:
    out = []
    for k, b in (req.logit_bias or {}).items():
        if not (k.isdigit() and len(k) <= 10 and int(k) <= INT32_MAX):
            raise ApiError(f"logit_bias keys must be token ids (decimal strings), got {quote(k)}", param="logit_bias")
        out.append((int(k), float(b)))
    return tuple(out)


def logprob_counts(req: CommonRequest) -> tuple[int | None, int | None]:
    """(logprobs per output token, per prompt token) for SamplingParams; None = not reported."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None, None
    assert isinstance(req, CompletionRequest)
    return req.logprobs, (req.logprobs or 0) if req.echo and req.logprobs is not None else None


def sampling_params(req: CommonRequest, max_tokens: int | None, default_max_tokens: int | None,
                    max_tokens_param: str = "max_tokens") -> SamplingParams:
    """Request fields -> validated SamplingParams; ValueError messages become 400s naming the field.
    max_tokens unset: `default_max_tokens` if given, else 1 here, and `fit_max_tokens` sets
    it to what the context leaves once the prompt length is known. With echo, max_tokens 0 asks
    for the prompt's logprobs only: one token is generated and dropped (`Choices.echo_only`)."""
    _unsupported(req)
    if isinstance(req, CompletionRequest):
        if req.best_of is not None and req.best_of < (req.n or 1):
            raise ApiError(f"best_of ({req.best_of}) must be >= n ({req.n or 1})", param="best_of")
        if req.best_of not in (None, req.n or 1) and req.stream:
            raise ApiError("best_of > n cannot be streamed; set stream=false or best_of=n", param="best_of")
    lp, plp = logprob_counts(req)
    grammar = _grammar(req.response_format)
    if max_tokens == 0 and isinstance(req, CompletionRequest) and req.echo:
        max_tokens = 1
    kw = dict(
        max_tokens=(default_max_tokens or max(1, req.min_tokens or 0)) if max_tokens is None else max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens or 0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req),
        logprobs=lp,
        prompt_logprobs=plp,
        grammar=grammar,
        skip_special_tokens=req.skip_special_tokens,
    )
    return _params(kw, max_tokens_param)


def _grammar(fmt: Any) -> str | None:
    """response_format -> a compiled llguidance grammar (engine/grammar.py), None for text / unset."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ApiError(f"response_format must be an object with a 'type', got {quote(fmt)}", param="response_format")
    try:
        return compile_response_format(fmt)
    except GrammarError as e:
        raise ApiError(str(e), param="response_format") from None


def _params(kw: dict, max_tokens_param: str = "max_tokens") -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        first = msg.split(" ", 1)[0]
        param = (max_tokens_param if first == "max_tokens" else first) if first in kw else None
        raise ApiError(msg, param=param) from None


def fit_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int, given: bool,
                   default_max_tokens: int | None, vocab: int) -> SamplingParams:
    """max_tokens unset -> min(default_max_tokens, max_model_len - prompt_len) (vLLM clamps
    rather than refusing a value the client never set); logit_bias ids checked against `vocab`."""
    for t, _ in params.logit_bias:
        if t >= vocab:
            raise ApiError(f"logit_bias token id {t} is outside the vocabulary [0, {vocab})", param="logit_bias")
    if given:
        return params
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(f"the prompt has {prompt_len} tokens: no room left in max_model_len {max_model_len}; "
                       "shorten the prompt", param="prompt")
    cap = room if default_max_tokens is None else min(default_max_tokens, room)
    return _params({**{f.name: getattr(params, f.name) for f in dataclasses.fields(params)},
                    "max_tokens": max(cap, params.min_tokens, 1)})


def seeded(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n: its own engine request; a seeded request's choice i uses seed + i."""
    if i == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + i) % (UINT64_MAX + 1))
