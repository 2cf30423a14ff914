"""OpenAI response and stream-chunk bodies for completions and chat completions, and SSE framing."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from dhisparse.engine.request import RequestOutput


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = sse("[DONE]")


def usage(out: RequestOutput | None, prompt_tokens: int = 0) -> dict:
    p = out.metrics.prompt_len if out is not None else prompt_tokens
    c = len(out.token_ids) if out is not None else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@dataclass(frozen=True)
class Formatter:
    """Shapes bodies for one request. `chat` picks the chat.completion shapes."""

    request_id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    def response(self, out: RequestOutput, finish_reason: str | None = None) -> dict:
        """The whole (non-streamed) response."""
        reason = finish_reason or out.finish_reason
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                      "finish_reason": reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": reason}
            body = self._head("text_completion")
        return {**body, "choices": [choice], "usage": usage(out)}

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role; completions have no opening chunk."""
        if not self.chat:
            return None
        return self.chunk("", None, role=True)

    def chunk(self, text: str, finish_reason: str | None, role: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, out: RequestOutput | None) -> dict:
        """The final `stream_options.include_usage` chunk: no choices, only usage."""
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": usage(out)}
