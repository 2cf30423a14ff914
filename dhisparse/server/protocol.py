"""OpenAI-compatible request bodies, their translation to `SamplingParams`, and API errors.

Bodies are parsed by hand (`parse_body`) rather than by FastAPI's signature binding so every
problem - malformed JSON, a wrong type, an unsupported option - becomes one HTTP 400 with an
OpenAI-style error object naming the offending parameter. The models are strict (pydantic strict
mode: a boolean is not an int, a string is not a boolean, NaN / infinity are not numbers), integers
are bounded, stop strings are capped (`MAX_STOPS` strings of at most `MAX_STOP_CHARS` characters,
as OpenAI does), and error messages quote at most `QUOTE_CHARS` characters of the offending value.
The routes describe these models in `/openapi.json` (app.py).

No field is accepted and ignored: a field the models do not declare is a 400 naming it
(`extra="forbid"`), and the OpenAI fields declared but not implemented (`UNSUPPORTED`) are a 400
naming them unless sent as null or their "off" value.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dhisparse.core.params import SamplingParams
from dhisparse.engine.grammar import GrammarError, compile_response_format

MAX_STOPS = 16  # OpenAI: "up to 4"; vLLM / SGLang: unbounded. 16 keeps the per-token stop scan cheap
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
QUOTE_CHARS = 64  # longest quote of a client's value in an error message
MAX_MESSAGE_CHARS = 360  # longest error message
INT32_MAX = 2**31 - 1
MAX_N = 16  # choices (n, best_of) per prompt; each is an engine request
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_PROMPT_CHOICES = 128  # prompts x best_of per request
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # calls in one assistant message of the history
UINT64_MAX = 2**64 - 1
_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """A short, safe rendering of a client's value for an error message (never its whole text)."""
    if isinstance(value, _HugeInt):
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        return f"<an integer of {value.bit_length()} bits>"
    if isinstance(value, str):
        s = repr(value[: limit + 1])
    elif isinstance(value, (list, tuple, dict)):
        s = _short_container(value, limit)
    else:
        s = repr(value)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _short_container(value: Any, limit: int, depth: int = 0) -> str:
    """repr of a list / dict, cut short: a few items, a few levels, strings clipped."""
    if depth >= 3:
        return "[...]" if isinstance(value, (list, tuple)) else "{...}"
    if isinstance(value, dict):
        items = [f"{quote(k, 24)}: {_item(v, limit, depth)}" for k, v in list(value.items())[:4]]
        return "{" + ", ".join(items) + (", ..." if len(value) > 4 else "") + "}"
    items = [_item(v, limit, depth) for v in list(value[:6])]
    return "[" + ", ".join(items) + (", ..." if len(value) > 6 else "") + "]"


def _item(v: Any, limit: int, depth: int) -> str:
    return _short_container(v, limit, depth + 1) if isinstance(v, (list, tuple, dict)) else quote(v, 24)


def clip(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


class ApiError(Exception):
    """An error to return as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message = clip(message)
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
MaxTokens = Annotated[int, Field(le=INT32_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]  # the lower bound (>= 1) is SamplingParams' check


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions (OpenAI names, plus vLLM-style extras)."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = Field(
        None, description=f"up to {MAX_STOPS} stop strings of 1..{MAX_STOP_CHARS} characters")
    seed: Annotated[int, Field(ge=0, le=UINT64_MAX)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: str | None = None  # an end-user id: accepted (it changes no output), never stored
    # extras (not in the OpenAI API; vLLM / SGLang accept the same names)
    top_k: Annotated[int, Field(le=INT32_MAX)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    response_format: Any = None  # text / json_object / json_schema (+ regex, grammar): engine/grammar.py
    # OpenAI fields this server does not implement: a 400 naming them unless null / off (UNSUPPORTED)
    suffix: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _cap_stops(cls, v: Any) -> Any:
        """Checked before the items are validated, so 100,000 stop strings cost one len()."""
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"stop holds {len(v)} strings; at most {MAX_STOPS} are allowed")
        for s in [v] if isinstance(v, str) else (v if isinstance(v, list) else []):
            if isinstance(s, str) and not 1 <= len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1..{MAX_STOP_CHARS} characters; got one of {len(s)}")
        return v


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | \
        Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)] = Field(
        description=f"text, token ids, or a batch of up to {MAX_PROMPTS} of either (one choice per prompt and n)")
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history (OpenAI: arguments is a JSON string)."""

    model_config = _STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOL_CALLS)] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description=f"up to {MAX_TOOLS} functions: {{'type': 'function', 'function': {{name, description, parameters}}}}")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (vLLM / SGLang), e.g. {'enable_thinking': false}")


class PrefixRequest(BaseModel):
    """dhisparse extension: prefill a prompt once so later requests starting with it import its KV."""

    model_config = _STRICT

    model: str | None = None
    prompt: str | list[TokenId]


class TokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    prompt: str


REQUEST_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatRequest, TokenizeRequest, PrefixRequest)
M = TypeVar("M", bound=BaseModel)


class _HugeInt:
    """Stands in for an integer too long to convert (Python refuses > 4300 digits): fails strict int
    validation, so the 400 names the field."""

    def __init__(self, digits: str) -> None:
        self.n = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<a {self.n}-digit integer>"


def _parse_int(s: str) -> int | _HugeInt:
    return int(s) if len(s) <= 4000 else _HugeInt(s)


def parse_body(raw: bytes, model: type[M]) -> M:
    """JSON bytes -> `model`, or ApiError(400) naming the first bad field. Never raises anything
    else: pydantic's JSON parser bounds nesting (no RecursionError) and rejects NaN / infinity."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = str((first.get("ctx") or {}).get("error", first["msg"]))
        if "number out of range" in detail:  # a huge integer: find its field with Python's parser
            return _parse_with_python(raw, model, detail)
        raise ApiError(f"malformed JSON body: {clip(detail, 120)}; send a JSON object", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        got = _JSON_NAMES.get(type(first.get("input")), "a non-object")
        raise ApiError(f"the request body must be a JSON object, got {got}", code="invalid_json")
    raise _described(errors)


def _parse_with_python(raw: bytes, model: type[M], detail: str) -> M:
    try:
        data = json.loads(raw, parse_int=_parse_int)
    except (ValueError, RecursionError):
        raise ApiError(f"malformed JSON body: {clip(detail, 120)}", code="invalid_json") from None
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    if errors[0]["type"] == "model_type" and not errors[0]["loc"]:
        raise ApiError("the request body must be a JSON object", code="invalid_json")
    raise _described(errors)


_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _where(loc: tuple) -> str:
    """A field path without pydantic's union-branch tags ('list[constrained-int]', 'str', ...)."""
    parts = [str(p) for p in loc if isinstance(p, int) or ("[" not in str(p) and str(p) not in _BRANCH_TAGS)]
    return ".".join(parts)


def _described(errors: list[dict]) -> ApiError:
    message, param, code = _describe(errors)
    return ApiError(message, param, code=code)


def _describe(errors: list[dict]) -> tuple:
    """First bad field -> (message, param, code); a union field lists what each accepted type said."""
    top = errors[0]["loc"][0] if errors[0]["loc"] else None
    if top is None:
        return f"invalid request body: {clip(errors[0]['msg'], 120)}", None, None
    same = [err for err in errors if err["loc"] and err["loc"][0] == top]
    if same[0]["type"] == "missing" and len(same[0]["loc"]) == 1:
        return f"'{top}' is required", str(top), None
    if same[0]["type"] == "extra_forbidden" and len(same[0]["loc"]) == 1:
        return f"unknown field {quote(str(top))}: not a parameter this server supports; remove it", str(top), \
            "unknown_parameter"
    msgs = list(dict.fromkeys(clip(err["msg"], 120) for err in same))[:4]
    where = _where(same[0]["loc"]) if len(same) == 1 else str(top)
    return f"invalid value {quote(same[0].get('input'))} for '{where}': " + "; or ".join(msgs), str(top), None


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError(f"model {quote(requested)} is not served here; use model={served!r} (see /v1/models)",
                       param="model", code="model_not_found")


# field -> values that mean "off" (accepted); anything else is a 400 naming the field
UNSUPPORTED: dict[str, tuple] = {
    "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "metadata": (None, {}), "store": (None, False), "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,), "prompt_cache_key": (None,),
    "safety_identifier": (None,),
}


def _unsupported(req: _Common) -> None:
    for name, off in UNSUPPORTED.items():
        v = getattr(req, name, None)
        if not any(v == o and type(v) is type(o) for o in off):
            raise ApiError(f"{name}={quote(v)} is not supported by this server; leave it unset", param=name)


def _logit_bias(req: _Common) -> tuple[tuple[int, float], ...]:
    out = []
    for k, b in (req.logit_bias or {}).items():
        if not (k.isdigit() and len(k) <= 10 and int(k) <= INT32_MAX):
            raise ApiError(f"logit_bias keys must be token ids (decimal strings), got {quote(k)}", param="logit_bias")
        out.append((int(k), float(b)))
    return tuple(out)


def logprob_counts(req: _Common) -> tuple[int | None, int | None]:
    """(logprobs per output token, per prompt token) for SamplingParams; None = not reported."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None, None
    assert isinstance(req, CompletionRequest)
    return req.logprobs, (req.logprobs or 0) if req.echo and req.logprobs is not None else None


def sampling_params(req: _Common, max_tokens: int | None, default_max_tokens: int | None,
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


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request (text or token ids), in order."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        per = max(req.n or 1, req.best_of or 1)
        if len(p) * per > MAX_PROMPT_CHOICES:
            raise ApiError(f"{len(p)} prompts x n / best_of {per} exceeds {MAX_PROMPT_CHOICES} choices per request",
                           param="prompt")
        return list(p)
    return [p]


def message_text(content: str | list[ContentPart] | None) -> str:
    """Chat content (a string or a list of {"type": "text", "text": ...} parts) -> text."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text":
            raise ApiError(f"content part type {quote(part.type)} is not supported; send text parts",
                           param="messages")
        parts.append(part.text or "")
    return "".join(parts)


def chat_messages(req: ChatRequest) -> list[dict]:
    """The messages as chat templates read them: role, content text, and for an assistant's calls
    `tool_calls` [{id, type, function: {name, arguments}}] (arguments as sent: server/chat.py turns
    them into objects), for a tool's answer `tool_call_id`."""
    if not req.messages:
        raise ApiError("messages is empty; send at least one message", param="messages")
    out = []
    for m in req.messages:
        d: dict[str, Any] = {"role": m.role, "content": message_text(m.content)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(f"only assistant messages carry tool_calls, not {m.role!r} ones", param="messages")
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out
