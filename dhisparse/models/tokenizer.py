"""Tokenizers: a common protocol, a built-in byte tokenizer, a `tokenizers`-backed HF wrapper, and an
incremental detokenizer for streaming and stop strings.

Conventions: `encode(text)` adds no special tokens (chat templates write them as text, and added
special tokens inside text are recognized); `decode(ids, skip_special=True)` drops specials.
"""

from __future__ import annotations

import codecs
import json
import logging
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)
REPLACEMENT = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer folder or template we cannot use; the message names the file and the fix."""


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...

    chat_template: str | None  # None: the built-in default_chat_template

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, **kwargs: Any) -> str: ...


def default_chat_template(messages: list[dict]) -> str:
    """Plain template: "<|role|>\\ncontent\\n" per message, then "<|assistant|>\\n". It reads only
    role and content: the server writes tools and tool calls into the text of the messages first."""
    parts = [f"<|{m.get('role', 'user')}|>\n{m.get('content', '')}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


class ByteTokenizer:
    """ids 0/1/2 = pad/bos/eos, byte b -> b + 3; ids >= 259 (model vocab padding) decode to nothing."""

    PAD, BOS, EOS, OFFSET = 0, 1, 2, 3
    SPECIAL_NAMES = ("<|pad|>", "<|bos|>", "<|eos|>")
    chat_template: str | None = None  # set by with_chat_template (--chat-template); None = default_chat_template

    def __init__(self) -> None:
        self.eos_token_ids: tuple[int, ...] = (self.EOS,)
        self.bos_token_id: int | None = self.BOS
        self.pad_token_id: int | None = self.PAD
        self.vocab_size = 256 + self.OFFSET

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        if skip_special:  # the streaming detokenizer's path: one bytes() over the window
            hi = self.vocab_size
            return bytes(i - self.OFFSET for i in map(int, ids) if self.OFFSET <= i < hi).decode("utf-8", errors="replace")
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if self.OFFSET <= i < self.vocab_size:
                buf.append(i - self.OFFSET)
                continue
            if not skip_special and 0 <= i < self.OFFSET:
                out.append(buf.decode("utf-8", errors="replace") + self.SPECIAL_NAMES[i])
                buf = bytearray()
        return "".join(out) + buf.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, **kwargs: Any) -> str:
        if self.chat_template is not None:
            return render_chat_template(self.chat_template, messages, tools=tools, bos_token="<|bos|>",
                                        eos_token="<|eos|>", **kwargs)
        return default_chat_template(messages)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: invalid JSON ({e}); fix or delete the file") from None


def _token_text(tok: Any) -> str | None:
    """tokenizer_config.json writes tokens as strings or AddedToken dicts {"content": ...}."""
    return tok.get("content") if isinstance(tok, dict) else tok


def _id_list(v: Any) -> list[int]:
    return [] if v is None else [int(x) for x in (v if isinstance(v, list) else [v])]


class HFTokenizer:
    """Wraps `tokenizers.Tokenizer.from_file(folder/tokenizer.json)`; ids of bos/eos come from
    tokenizer_config.json, generation_config.json and config.json; the chat template from
    chat_template.jinja or tokenizer_config.json `chat_template` (rendered with jinja2)."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json; export one with the model's tokenizer (save_pretrained)")
        self._tok = _Tok.from_file(str(path))
        tcfg = _read_json(folder / "tokenizer_config.json")
        gcfg = _read_json(folder / "generation_config.json")
        mcfg = _read_json(folder / "config.json")
        self.bos_token = _token_text(tcfg.get("bos_token"))
        self.eos_token = _token_text(tcfg.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        if self.bos_token_id is None:
            ids = _id_list(mcfg.get("bos_token_id")) or _id_list(gcfg.get("bos_token_id"))
            self.bos_token_id = ids[0] if ids else None
        eos = _id_list(gcfg.get("eos_token_id")) + [self._id_of(self.eos_token)] + _id_list(mcfg.get("eos_token_id"))
        self.eos_token_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = self._find_template(folder, tcfg)

    def special_token_texts(self) -> frozenset[str]:
        """The texts of the added tokens marked special (decode drops them unless skip_special=False)."""
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @staticmethod
    def _find_template(folder: Path, tcfg: dict) -> str | None:
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        t = tcfg.get("chat_template")
        if isinstance(t, list):  # [{"name": ..., "template": ...}]
            named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
            t = named.get("default") or next(iter(named.values()), None)
        return t if isinstance(t, str) else None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, **kwargs: Any) -> str:
        if self.chat_template is None:
            return default_chat_template(messages)
        return render_chat_template(self.chat_template, messages, tools=tools, bos_token=self.bos_token or "",
                                    eos_token=self.eos_token or "", **kwargs)


def _raise(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson` for chat templates: json.dumps, not HTML-escaped (jinja's own
    filter writes < > & ' as \\u escapes, which no model saw in training)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_chat_template(template: str, messages: list[dict], **context: Any) -> str:
    """Render a Hugging Face-style jinja2 chat template with add_generation_prompt=True (as
    transformers does: trim_blocks, lstrip_blocks, its tojson, raise_exception; `tools` and any
    chat_template_kwargs as variables)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    context.setdefault("add_generation_prompt", True)
    try:
        return env.from_string(template).render(messages=messages, **context)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template failed to render: {e}; fix 'chat_template' in tokenizer_config.json") from None


class IncrementalDetokenizer:
    """Feed token ids one at a time, get back the newly completed text.

    Decodes a short window of context tokens plus the new ones and emits only the text past the
    context; while the tail decodes to a replacement char (an incomplete multi-byte sequence) the
    text is held back. `flush()` releases whatever is held at the end of a stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, context: int = 6) -> None:
        self.tok, self.skip_special, self.context = tokenizer, skip_special, context
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this were emitted
        self.text = ""  # everything emitted so far

    def _decode(self, a: int, b: int) -> str:
        return self.tok.decode(self.ids[a:b], self.skip_special)

    def feed(self, token_id: int) -> str:
        """Append one token; returns the new text (possibly "")."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.ids))
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        new = full[len(prefix) :]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - self.context)
        self.text += new
        return new

    def flush(self) -> str:
        """Emit held-back text (incomplete bytes become replacement chars)."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.ids))
        new = full[len(prefix) :]
        self.read_offset = len(self.ids)
        self.text += new
        return new


class ByteStreamDetokenizer:
    """`IncrementalDetokenizer` for the `ByteTokenizer`, in O(1) per token: an incremental UTF-8
    decoder (`codecs`, errors="replace") over the byte ids. Special ids (and ids past the byte
    range) add nothing when skip_special. An incomplete multi-byte sequence is held until it
    completes; `flush()` turns a still-incomplete tail into replacement chars. Every prefix of
    the stream's text is a prefix of `ByteTokenizer.decode` of all ids fed, and text + flush()
    equals it."""

    def __init__(self, tokenizer: ByteTokenizer, skip_special: bool = True) -> None:
        self.tok, self.skip_special = tokenizer, skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def feed(self, token_id: int) -> str:
        """Append one token; returns the new text (possibly "")."""
        i, tok = int(token_id), self.tok
        if tok.OFFSET <= i < tok.vocab_size:
            new = self._utf8.decode(bytes((i - tok.OFFSET,)))
        elif not self.skip_special and 0 <= i < tok.OFFSET:
            new = self._utf8.decode(b"", final=True) + tok.SPECIAL_NAMES[i]
            self._utf8.reset()
        else:
            return ""
        if new:
            self._pieces.append(new)
        return new

    def flush(self) -> str:
        """Emit held-back bytes (an incomplete sequence becomes replacement chars)."""
        new = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        if new:
            self._pieces.append(new)
        return new


def stream_detokenizer(tokenizer: Tokenizer, skip_special: bool = True):
    """The fastest exact incremental detokenizer for `tokenizer`: `ByteStreamDetokenizer` for the
    byte tokenizer, the windowed `IncrementalDetokenizer` otherwise. Both have feed / flush / text."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteStreamDetokenizer(tokenizer, skip_special)
    return IncrementalDetokenizer(tokenizer, skip_special)


def load_tokenizer(folder: str | Path | None) -> Tokenizer:
    """None -> ByteTokenizer; a folder with tokenizer.json -> HFTokenizer; else ByteTokenizer (warned)."""
    if folder is None:
        return ByteTokenizer()
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder)
    log.warning("%s has no tokenizer.json; using the built-in byte tokenizer", folder)
    return ByteTokenizer()


def read_chat_template(spec: str) -> str:
    """--chat-template: a file (a Jinja template, or a tokenizer_config.json-style JSON holding
    `chat_template`) or, when no such file exists, the template text itself."""
    path = Path(spec).expanduser()
    looks_like_path = "{" not in spec and "\n" not in spec
    if looks_like_path and not path.is_file():
        raise TokenizerError(f"--chat-template {spec!r}: no such file; pass a Jinja file or the template text")
    if not looks_like_path:
        text = spec
    else:
        text = path.read_text()
        if path.suffix == ".json":
            t = _read_json(path).get("chat_template")
            if not isinstance(t, str):
                raise TokenizerError(f"--chat-template {spec}: the JSON file has no 'chat_template' string")
            text = t
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"--chat-template: not a valid Jinja template ({e})") from None
    return text


def with_chat_template(tok: Tokenizer, spec: str | None) -> Tokenizer:
    """The tokenizer with its chat template replaced by --chat-template `spec` (None: unchanged)."""
    if spec is not None:
        tok.chat_template = read_chat_template(spec)  # type: ignore[attr-defined]
    return tok
