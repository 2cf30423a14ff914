"""Request bodies parsed by hand (`parse_body`) rather than by FastAPI's signature binding, so every
problem - malformed JSON, a wrong type, an unsupported option - becomes one HTTP 400 with an
OpenAI-style error object naming the offending parameter (`described`: pydantic's errors ->
`ApiError`)."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from dhisparse.server.protocol.errors import ApiError, HugeInt, clip, quote

M = TypeVar("M", bound=BaseModel)
_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}
_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _parse_int(s: str) -> int | HugeInt:
    return int(s) if len(s) <= 4000 else HugeInt(s)


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
    raise described(errors)


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
    raise described(errors)


def _where(loc: tuple) -> str:
    """A field path without pydantic's union-branch tags ('list[constrained-int]', 'str', ...)."""
    parts = [str(p) for p in loc if isinstance(p, int) or ("[" not in str(p) and str(p) not in _BRANCH_TAGS)]
    return ".".join(parts)


def described(errors: list[dict]) -> ApiError:
    """pydantic's validation errors -> the 400 naming the first bad field."""
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
