"""OpenAI response and stream-chunk bodies for completions and chat completions, and SSE framing.

One HTTP request may run several engine requests (`Sub`): n choices of a prompt, and in
/v1/completions one or more prompts; choice index = prompt index * n + choice number. Logprobs
are rendered in the two OpenAI shapes: completions `{tokens, token_logprobs, top_logprobs,
text_offset}` (echo puts the prompt's entries first; the first prompt token has no logprob), chat
`{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal}`. The
numbers are the engine's (dhisparse.core.logits: log-softmax of the raw model logits).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Sequence

from dhisparse.core.logits import TokenLogprob
from dhisparse.core.params import SamplingParams
from dhisparse.engine.request import RequestOutput
from dhisparse.models.tokenizer import ByteTokenizer
from dhisparse.server.chat import ToolReading
from dhisparse.server.tools import ToolCallParser


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = sse("[DONE]")


@dataclass(frozen=True)
class Sub:
    """One engine request of an HTTP request.

    echo: the prompt text (completions `echo`) is put before the output; echo_only (max_tokens 0
    with echo): the one generated token is dropped; report_logprobs: the client asked for them
    (best_of computes them to rank the candidates either way)."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0
    echo: bool = False
    echo_only: bool = False
    report_logprobs: bool = False


def _prompt_len(out: RequestOutput | None) -> int:
    return out.metrics.prompt_len if out is not None else 0


def usage(outs: Sequence[RequestOutput | None], subs: Sequence[Sub] | None = None, prompt_tokens: int = 0) -> dict:
    """Prompt tokens once per prompt (not per choice), completion tokens summed over choices."""
    if subs is None:
        p = sum(_prompt_len(o) for o in outs) or prompt_tokens
    else:
        seen = {}
        for s in subs:
            seen.setdefault(s.prompt_index, len(s.prompt_ids))
        p = sum(seen.values())
    c = sum(0 if o is None or (s is not None and s.echo_only) else len(o.token_ids)
            for o, s in zip(outs, subs or [None] * len(outs)))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def token_piece(tokenizer, tok: int) -> tuple[str, list[int]]:
    """A token's text and its bytes (exact for the byte tokenizer; UTF-8 of the decoded text else)."""
    if isinstance(tokenizer, ByteTokenizer) and tokenizer.OFFSET <= tok < tokenizer.OFFSET + 256:
        raw = bytes([tok - tokenizer.OFFSET])
        return raw.decode("utf-8", errors="replace"), list(raw)
    text = tokenizer.decode([tok], skip_special=False)
    return text, list(text.encode("utf-8"))


@dataclass
class _Track:
    """A streamed choice's state: whether it opened, its text offset (completions logprobs), and
    when tool calls are read, its parser and the text so far."""

    opened: bool = False
    offset: int = 0
    parser: ToolCallParser | None = None
    text: str = ""


def _reason(reason: str | None, calls: list) -> str | None:
    """OpenAI: a choice that ends by calling tools finishes with "tool_calls"."""
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass(frozen=True)
class Formatter:
    """Shapes bodies for one HTTP request. `chat` picks the chat.completion shapes."""

    request_id: str
    model: str
    chat: bool
    tokenizer: object = None
    prompt_texts: Sequence[str] = ()
    tools: ToolReading | None = None  # chat with tools: each choice's text is read for tool calls
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    # -- logprobs ---------------------------------------------------------------------------------
    def _entries(self, sub: Sub, out: RequestOutput, new: Sequence[TokenLogprob] | None, with_prompt: bool):
        """(token id, logprob | None, top | None) of the prompt (echo) and the output tokens."""
        items = []
        if with_prompt and sub.echo and out.prompt_logprobs is not None:
            for pos, tid in enumerate(sub.prompt_ids):
                lp = out.prompt_logprobs[pos] if pos < len(out.prompt_logprobs) else None
                items.append((tid, None if lp is None else lp.logprob, None if lp is None else lp.top))
        if not sub.echo_only:
            items += [(lp.token, lp.logprob, lp.top) for lp in (new or ())]
        return items

    def _completion_logprobs(self, items, offset: int) -> dict:
        tokens, lps, tops, offsets = [], [], [], []
        for tid, lp, top in items:
            text, _ = token_piece(self.tokenizer, tid)
            tokens.append(text)
            lps.append(lp)
            tops.append(None if top is None else {token_piece(self.tokenizer, t)[0]: v for t, v in top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, items) -> dict:
        content = []
        for tid, lp, top in items:
            text, raw = token_piece(self.tokenizer, tid)
            alts = []
            for t, v in top or ():
                tt, tb = token_piece(self.tokenizer, t)
                alts.append({"token": tt, "logprob": v, "bytes": tb})
            content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts})
        return {"content": content, "refusal": None}

    def _logprobs(self, sub: Sub, out: RequestOutput, new, with_prompt: bool, offset: int = 0):
        if not sub.report_logprobs:
            return None
        items = self._entries(sub, out, new, with_prompt)
        return self._chat_logprobs(items) if self.chat else self._completion_logprobs(items, offset)

    # -- whole responses --------------------------------------------------------------------------
    def _text(self, sub: Sub, out: RequestOutput) -> str:
        text = "" if sub.echo_only else out.text
        return (self.prompt_texts[sub.prompt_index] + text) if sub.echo else text

    def response(self, outs: Sequence[RequestOutput], subs: Sequence[Sub] | None = None,
                 finish_reason: str | None = None, all_logprobs: Sequence[list] | None = None) -> dict:
        """The whole (non-streamed) response: one choice per (sub, out), in index order.
        all_logprobs[i]: every logprob of out i (collected from its reports)."""
        subs = subs or [Sub(0, self.request_id, [], SamplingParams())]
        choices = []
        for k, (sub, out) in enumerate(zip(subs, outs)):
            reason = finish_reason or ("length" if sub.echo_only else out.finish_reason)
            lp = self._logprobs(sub, out, all_logprobs[k] if all_logprobs else out.logprobs, True)
            if self.chat:
                message, reason = self._message(out, reason)
                choices.append({"index": sub.index, "message": message, "logprobs": lp, "finish_reason": reason})
            else:
                choices.append({"index": sub.index, "text": self._text(sub, out), "logprobs": lp,
                                "finish_reason": reason})
        body = self._head("chat.completion" if self.chat else "text_completion")
        return {**body, "choices": choices, "usage": usage(outs, subs)}

    def _message(self, out: RequestOutput, reason: str | None) -> tuple[dict, str | None]:
        if self.tools is None:
            return {"role": "assistant", "content": out.text}, reason
        parser = self.tools.parser()
        parser.finish(out.text)
        parsed = parser.message()
        message: dict = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        return message, _reason(reason, parsed.tool_calls)

    # -- stream chunks ----------------------------------------------------------------------------
    def track(self) -> _Track:
        """A new streamed choice's state."""
        return _Track(parser=self.tools.parser() if self.tools is not None else None)

    def first_chunk(self, index: int = 0) -> dict | None:
        """Chat streams open each choice with the assistant role; completions have no opening chunk."""
        if not self.chat:
            return None
        return self.chunk("", None, role=True, index=index)

    def output_chunk(self, sub: Sub, out: RequestOutput, track: _Track) -> dict | None:
        """The chunk for one engine report of `sub` (None when it carries nothing)."""
        first = not track.opened
        track.opened = True
        text = "" if sub.echo_only else out.text_delta
        if first and sub.echo:
            text = self.prompt_texts[sub.prompt_index] + text
        lp = self._logprobs(sub, out, out.logprobs, first, track.offset)
        track.offset += len(text)
        calls: list = []
        if track.parser is not None:
            track.text += text
            text, calls = (track.parser.finish if out.finished else track.parser.feed)(track.text)
        has_lp = lp is not None and (lp.get("content") if self.chat else lp["tokens"])
        if not (text or has_lp or out.finished or calls):
            return None
        reason = ("length" if sub.echo_only else out.finish_reason) if out.finished else None
        if track.parser is not None:
            reason = _reason(reason, track.parser.ids)
        return self.chunk(text, reason, index=sub.index, logprobs=lp if has_lp else None,
                          tool_calls=[d.as_dict() for d in calls])

    def chunk(self, text: str, finish_reason: str | None, role: bool = False, index: int = 0,
              logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, outs: Sequence[RequestOutput | None], subs: Sequence[Sub] | None = None) -> dict:
        """The final `stream_options.include_usage` chunk: no choices, only usage."""
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        if subs is None:
            return {**head, "choices": [], "usage": usage(outs)}
        return {**head, "choices": [], "usage": usage(outs, subs)}
