"""OpenAI-compatible request bodies, their translation to `SamplingParams`, and API errors.

Bodies are parsed by hand (`parse_body`) rather than by FastAPI's signature binding so every
problem - malformed JSON, a wrong type, an unsupported option - becomes one HTTP 400 with an
OpenAI-style error object naming the offending parameter. The models are strict (pydantic strict
mode: a boolean is not an int, a string is not a boolean, NaN / infinity are not numbers), integers
are bounded, stop strings are capped (`MAX_STOPS` strings of at most `MAX_STOP_CHARS` characters,
as OpenAI does), and error messages quote at most `QUOTE_CHARS` characters of the offending value.
The routes describe these models in `/openapi.json` (app.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dhisparse.core.params import SamplingParams

MAX_STOPS = 16  # OpenAI: "up to 4"; vLLM / SGLang: unbounded. 16 keeps the per-token stop scan cheap
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
QUOTE_CHARS = 64  # longest quote of a client's value in an error message
MAX_MESSAGE_CHARS = 360  # longest error message
INT32_MAX = 2**31 - 1
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


_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
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
    n: Annotated[int, Field(le=INT32_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = Field(
        None, description=f"up to {MAX_STOPS} stop strings of 1..{MAX_STOP_CHARS} characters")
    seed: Annotated[int, Field(ge=0, le=UINT64_MAX)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    user: str | None = None
    # extras (not in the OpenAI API; vLLM / SGLang accept the same names)
    top_k: Annotated[int, Field(le=INT32_MAX)] | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None

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
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="text or token ids; a list of one prompt is accepted, batches of several are not")
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(le=INT32_MAX)] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None


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
    raise ApiError(*_describe(errors))


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
    raise ApiError(*_describe(errors))


_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _where(loc: tuple) -> str:
    """A field path without pydantic's union-branch tags ('list[constrained-int]', 'str', ...)."""
    parts = [str(p) for p in loc if isinstance(p, int) or ("[" not in str(p) and str(p) not in _BRANCH_TAGS)]
    return ".".join(parts)


def _describe(errors: list[dict]) -> tuple[str, str | None]:
    """First bad field -> (message, param); a union field lists what each accepted type said."""
    top = errors[0]["loc"][0] if errors[0]["loc"] else None
    if top is None:
        return f"invalid request body: {clip(errors[0]['msg'], 120)}", None
    same = [err for err in errors if err["loc"] and err["loc"][0] == top]
    if same[0]["type"] == "missing" and len(same[0]["loc"]) == 1:
        return f"'{top}' is required", str(top)
    msgs = list(dict.fromkeys(clip(err["msg"], 120) for err in same))[:4]
    where = _where(same[0]["loc"]) if len(same) == 1 else str(top)
    return f"invalid value {quote(same[0].get('input'))} for '{where}': " + "; or ".join(msgs), str(top)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError(f"model {quote(requested)} is not served here; use model={served!r} (see /v1/models)",
                       param="model", code="model_not_found")


def _unsupported(req: _Common) -> None:
    if req.n not in (None, 1):
        raise ApiError(f"n={req.n} is not supported; this server returns one choice per request (n=1)", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise ApiError(f"{name} is not supported; leave it unset or 0", param=name)
    if req.logprobs not in (None, False, 0):
        raise ApiError("logprobs are not supported; leave logprobs unset", param="logprobs")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError("echo=true is not supported; leave it false", param="echo")
        if req.suffix:
            raise ApiError("suffix is not supported; leave it unset", param="suffix")
        if req.best_of not in (None, 1):
            raise ApiError("best_of is not supported; leave it unset or 1", param="best_of")


def sampling_params(req: _Common, max_tokens: int | None, default_max_tokens: int,
                    max_tokens_param: str = "max_tokens") -> SamplingParams:
    """Request fields -> validated SamplingParams; ValueError messages become 400s naming the field."""
    _unsupported(req)
    kw = dict(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        msg = str(e)
        first = msg.split(" ", 1)[0]
        param = (max_tokens_param if first == "max_tokens" else first) if first in kw else None
        raise ApiError(msg, param=param) from None


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """One prompt (text or token ids); batches of several prompts are rejected."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise ApiError(f"prompt holds {len(p)} prompts; send one prompt per request", param="prompt")
        p = p[0]
    return p


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
    if not req.messages:
        raise ApiError("messages is empty; send at least one message", param="messages")
    return [{"role": m.role, "content": message_text(m.content)} for m in req.messages]
