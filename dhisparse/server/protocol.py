"""OpenAI-compatible request bodies, their translation to `SamplingParams`, and API errors.

Bodies are parsed by hand (`parse_body`) rather than by FastAPI's signature binding so every
problem - malformed JSON, a wrong type, an unsupported option - becomes one HTTP 400 with an
OpenAI-style error object naming the offending parameter.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from dhisparse.core.params import SamplingParams


class ApiError(Exception):
    """An error to return as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions (OpenAI names, plus vLLM-style extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    user: str | None = None
    # extras (not in the OpenAI API; vLLM / SGLang accept the same names)
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class PrefixRequest(BaseModel):
    """dhisparse extension: prefill a prompt once so later requests starting with it import its KV."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str


M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model: type[M]) -> M:
    """JSON bytes -> `model`, or ApiError(400) naming the first bad field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"malformed JSON body: {e}; send a JSON object", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(*_describe(e)) from None


def _describe(e: ValidationError) -> tuple[str, str | None]:
    """First bad field -> (message, param); a union field lists what each accepted type said."""
    errors = e.errors()
    top = errors[0]["loc"][0] if errors[0]["loc"] else None
    same = [err for err in errors if err["loc"] and err["loc"][0] == top]
    if top is None:
        return f"invalid request body: {errors[0]['msg']}", None
    if same[0]["type"] == "missing":
        return f"'{top}' is required", str(top)
    msgs = list(dict.fromkeys(err["msg"] for err in same))
    where = ".".join(str(p) for p in same[0]["loc"]) if len(same) == 1 else str(top)
    return f"invalid value {same[0].get('input')!r} for '{where}': " + "; or ".join(msgs), str(top)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError(f"model {requested!r} is not served here; use model={served!r} (see /v1/models)",
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


def sampling_params(req: _Common, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
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
        param = msg.split(" ", 1)[0] if msg.split(" ", 1)[0] in kw else None
        raise ApiError(msg, param=param) from None


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """One prompt (text or token ids); batches of several prompts are rejected."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise ApiError(f"prompt holds {len(p)} prompts; send one prompt per request", param="prompt")
        p = p[0]
    return p


def message_text(content: str | list[dict] | None) -> str:
    """Chat content (a string or a list of {"type": "text", "text": ...} parts) -> text."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ApiError(f"content part type {part.get('type')!r} is not supported; send text parts",
                           param="messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def chat_messages(req: ChatRequest) -> list[dict]:
    if not req.messages:
        raise ApiError("messages is empty; send at least one message", param="messages")
    return [{"role": m.role, "content": message_text(m.content)} for m in req.messages]
