"""POST /v1/completions: `CompletionRequest` (text, token ids, or a batch of either; echo,
best_of, logprobs) and its prompts in order (`completion_prompts`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from dhisparse.server.protocol.common import MAX_LOGPROBS, MAX_N, CommonRequest, TokenId
from dhisparse.server.protocol.errors import ApiError

MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_PROMPT_CHOICES = 128  # prompts x best_of per request


class CompletionRequest(CommonRequest):
    prompt: str | list[TokenId] | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | \
        Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)] = Field(
        description=f"text, token ids, or a batch of up to {MAX_PROMPTS} of either (one choice per prompt and n)")
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


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
