"""API errors: `ApiError`, returned as an OpenAI-shaped `{"error": {message, type, param, code}}`,
and the safe rendering of a client's value in its message (`quote`: at most `QUOTE_CHARS`
characters of it; `clip`: messages of at most `MAX_MESSAGE_CHARS`)."""

from __future__ import annotations

from typing import Any

QUOTE_CHARS = 64  # longest quote of a client's value in an error message
MAX_MESSAGE_CHARS = 360  # longest error message


class HugeInt:
    """Stands in for an integer too long to convert (Python refuses > 4300 digits): fails strict int
    validation, so the 400 names the field (protocol/body.py)."""

    def __init__(self, digits: str) -> None:
        self.n = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<a {self.n}-digit integer>"


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """A short, safe rendering of a client's value for an error message (never its whole text)."""
    if isinstance(value, HugeInt):
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
    """`message` cut to `limit` characters (ending "..." when cut)."""
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
        """The JSON error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
