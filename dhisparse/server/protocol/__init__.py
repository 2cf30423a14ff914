"""OpenAI-compatible request bodies, their translation to `SamplingParams`, and API errors.

Bodies are parsed by hand (`body.parse_body`) rather than by FastAPI's signature binding so every
problem - malformed JSON, a wrong type, an unsupported option - becomes one HTTP 400 with an
OpenAI-style error object naming the offending parameter (`errors.ApiError`). The models are strict
(pydantic strict mode: a boolean is not an int, a string is not a boolean, NaN / infinity are not
numbers), integers are bounded, stop strings are capped (`MAX_STOPS` strings of at most
`MAX_STOP_CHARS` characters, as OpenAI does), and error messages quote at most `QUOTE_CHARS`
characters of the offending value. The routes describe these models in `/openapi.json` (app.py).

No field is accepted and ignored: a field the models do not declare is a 400 naming it
(`extra="forbid"`), and the OpenAI fields declared but not implemented (`sampling.UNSUPPORTED`)
are a 400 naming them unless sent as null or their "off" value.

Modules: `errors.py` (ApiError, quote, clip), `body.py` (parse_body), `common.py` (limits, the
fields every generation request shares), one module of models per endpoint (`completions.py`,
`chat.py`, `tokens.py`: /tokenize and /v1/dhisparse/prefix) and `sampling.py` (a request ->
`SamplingParams`). The names below are this package's API.
"""

from __future__ import annotations

from pydantic import BaseModel

from dhisparse.server.protocol.body import M, described, parse_body
from dhisparse.server.protocol.chat import (MAX_TOOL_CALLS, MAX_TOOLS, ChatMessage, ChatRequest, ContentPart,
                                            FunctionCall, ToolCallIn, chat_messages, message_text)
from dhisparse.server.protocol.common import (INT32_MAX, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_STOP_CHARS,
                                              MAX_STOP_TOKEN_IDS, MAX_STOPS, UINT64_MAX, CommonRequest,
                                              StreamOptions, check_model)
from dhisparse.server.protocol.completions import (MAX_PROMPT_CHOICES, MAX_PROMPTS, CompletionRequest,
                                                   completion_prompts)
from dhisparse.server.protocol.errors import MAX_MESSAGE_CHARS, QUOTE_CHARS, ApiError, clip, quote
from dhisparse.server.protocol.sampling import (UNSUPPORTED, fit_max_tokens, logprob_counts, sampling_params,
                                                seeded)
from dhisparse.server.protocol.tokens import PrefixRequest, TokenizeRequest

REQUEST_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatRequest, TokenizeRequest, PrefixRequest)

__all__ = ["INT32_MAX", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_MESSAGE_CHARS", "MAX_N", "MAX_PROMPTS",
           "MAX_PROMPT_CHOICES", "MAX_STOPS", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "MAX_TOOLS", "MAX_TOOL_CALLS",
           "QUOTE_CHARS", "REQUEST_MODELS", "UINT64_MAX", "UNSUPPORTED", "ApiError", "ChatMessage", "ChatRequest",
           "CommonRequest", "CompletionRequest", "ContentPart", "FunctionCall", "M", "PrefixRequest", "StreamOptions",
           "TokenizeRequest", "ToolCallIn", "chat_messages", "check_model", "clip", "completion_prompts", "described",
           "fit_max_tokens", "logprob_counts", "message_text", "parse_body", "quote", "sampling_params", "seeded"]
