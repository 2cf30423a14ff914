"""The token-level routes' bodies: POST /tokenize (vLLM's shape) and the dhisparse extension
POST /v1/dhisparse/prefix."""

from __future__ import annotations

from pydantic import BaseModel

from dhisparse.server.protocol.common import STRICT, TokenId


class PrefixRequest(BaseModel):
    """dhisparse extension: prefill a prompt once so later requests starting with it import its KV."""

    model_config = STRICT

    model: str | None = None
    prompt: str | list[TokenId]


class TokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    prompt: str
