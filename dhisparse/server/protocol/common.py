"""What every generation request shares: the limits, strict parsing (pydantic strict mode: a
boolean is not an int, a string is not a boolean, NaN / infinity are not numbers; a field the
models do not declare is a 400 naming it), bounded field types, `CommonRequest` (the fields of
completions and chat completions) and the served-model check."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dhisparse.server.protocol.errors import ApiError, quote

MAX_STOPS = 16  # OpenAI: "up to 4"; vLLM / SGLang: unbounded. 16 keeps the per-token stop scan cheap
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
INT32_MAX = 2**31 - 1
MAX_N = 16  # choices (n, best_of) per prompt; each is an engine request
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 1024
UINT64_MAX = 2**64 - 1

STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
MaxTokens = Annotated[int, Field(le=INT32_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]  # the lower bound (>= 1) is SamplingParams' check


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class CommonRequest(BaseModel):
    """Fields shared by completions and chat completions (OpenAI names, plus vLLM-style extras)."""

    model_config = STRICT

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
    # OpenAI fields this server does not implement: a 400 naming them unless null / off (protocol/sampling.py)
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


def check_model(requested: str | None, served: str) -> None:
    """A 400 unless the request names no model or the served one."""
    if requested is not None and requested != served:
        raise ApiError(f"model {quote(requested)} is not served here; use model={served!r} (see /v1/models)",
                       param="model", code="model_not_found")
