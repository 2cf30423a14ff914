"""Structured output: grammar-constrained decoding with llguidance.

Why llguidance (1.9.1) rather than xgrammar: it has no dependencies (xgrammar needs apache-tvm-ffi
and builds its tokenizer info from a `transformers` tokenizer, which this package does not use),
it reads a Hugging Face `tokenizer.json` directly (our HF tokenizers are `tokenizers` objects) and
takes an arbitrary byte vocabulary (our built-in byte tokenizer), computes a token mask per step
in microseconds without a compile phase per schema, and its matcher has the `rollback(n)` that
speculative verification needs. It compiles JSON schemas, `json_object` (= schema
{"type": "object"}), regexes and Lark / GBNF grammars to one grammar format.

How it is used: `SamplingParams.grammar` holds a compiled llguidance grammar (a string, so params
stay hashable). The engine gives each such request a `Matcher`; before every sampling step the
allowed-token mask of the matcher's state becomes part of the row's `History` and
`apply_processors` (core/logits.py) sets every other logit to -inf, so greedy rows take the argmax
of the masked logits and sampled rows draw from the masked, renormalised distribution. After a
token is emitted the matcher consumes it.

Speculative verification (every preset): row i of a round [anchor, d_1..d_{K-1}] is masked with
the matcher's state after d_1..d_i. The masks are computed by consuming the drafts one by one; the
first draft outside the grammar ends that (it has probability 0 at its row, so it is rejected:
greedy never matches it, rejection sampling accepts it with probability p(x)/q(x) = 0); rows after
it are never reached and get no mask. After acceptance the matcher rolls back the drafts that
were rejected and consumes the correction / bonus token, so its state is exactly that of
one-token-at-a-time decoding.
"""

from __future__ import annotations

import json
from typing import Sequence

import llguidance
import numpy as np
import torch

from dhisparse.models.tokenizer import ByteTokenizer, HFTokenizer


def _llg():
    return llguidance


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot compile (the client's 400)."""


def compile_response_format(fmt: dict) -> str | None:
    """An OpenAI `response_format` -> llguidance grammar (None for {"type": "text"}).

    {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema": {"schema":
    {...}, "name": ..., "strict": ...}}: a document of that schema. Extras (dhisparse): {"type":
    "regex", "regex": "..."}, {"type": "grammar", "grammar": "<Lark or GBNF>"}."""
    llg = _llg()
    kind = fmt.get("type")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return llg.grammar_from("json_schema", json.dumps(compact({"type": "object"})))
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise GrammarError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
            return llg.grammar_from("json_schema", json.dumps(compact(spec.get("schema", {"type": "object"}))))
        if kind == "regex" and isinstance(fmt.get("regex"), str):
            return llg.grammar_from("regex", fmt["regex"])
        if kind == "grammar" and isinstance(fmt.get("grammar"), str):
            return llg.grammar_from("grammar", fmt["grammar"])
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance's compile errors are the client's
        raise GrammarError(f"response_format could not be compiled: {e}") from None
    raise GrammarError(f"response_format type {kind!r} is not supported; use text, json_object, json_schema, "
                       "regex or grammar")


def compact(schema: dict) -> dict:
    """JSON without free whitespace between tokens (llguidance's `x-guidance` option) unless the
    schema sets its own: a model cannot then spend its max_tokens on indentation."""
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


class _ByteVocab:
    """The built-in ByteTokenizer as llguidance's TokenizerWrapper expects it."""

    def __init__(self, tokenizer, vocab: int) -> None:
        off = tokenizer.OFFSET
        names = [n.encode() for n in tokenizer.SPECIAL_NAMES]
        self.tokens = names + [bytes([b]) for b in range(256)] + [b"<|unused%d|>" % i for i in range(vocab - 256 - off)]
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(range(off)) + list(range(256 + off, vocab))
        self._off = off

    def __call__(self, s: bytes) -> list[int]:
        return [b + self._off for b in s]


def build_tokenizer(tokenizer, vocab: int):
    """llguidance's LLTokenizer for our tokenizer (byte tokenizer or tokenizers' tokenizer.json)."""
    llg = _llg()
    eos = list(tokenizer.eos_token_ids or ())
    if isinstance(tokenizer, ByteTokenizer):
        return llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tokenizer, vocab)), n_vocab=vocab, eos_token=eos or None)
    if isinstance(tokenizer, HFTokenizer):
        return llg.LLTokenizer(tokenizer._tok.to_str(), n_vocab=vocab, eos_token=eos or None)
    raise GrammarError("structured output needs the byte tokenizer or a tokenizers tokenizer.json")


class Grammars:
    """One engine's grammar support: its llguidance tokenizer (built on first use) and matchers."""

    def __init__(self, tokenizer, vocab: int) -> None:
        self._tokenizer, self.vocab = tokenizer, vocab
        self._ll = None
        self._special: frozenset[str] | None = None

    @property
    def ll(self):
        if self._ll is None:
            self._ll = build_tokenizer(self._tokenizer, self.vocab)
        return self._ll

    def special_tokens(self) -> frozenset[str]:
        """Texts of the tokenizer's special tokens (a Lark grammar names them as <text>, not as a string)."""
        if self._special is None:
            tok = self._tokenizer
            if isinstance(tok, HFTokenizer):
                self._special = tok.special_token_texts()
            else:
                self._special = frozenset()
        return self._special

    def literal(self, text: str) -> str:
        """`text` in a Lark grammar: the special token <text> if the tokenizer has one, else a string."""
        if text in self.special_tokens() and text.startswith("<") and text.endswith(">"):
            return text
        return json.dumps(text)

    def validate(self, grammar: str) -> None:
        ok, msg = _validate(self.ll, grammar)
        if not ok:
            raise GrammarError(f"response_format: {msg}")

    def matcher(self, grammar: str) -> "Matcher":
        m = _llg().LLMatcher(self.ll, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"response_format: {m.get_error()}")
        return Matcher(m, self.vocab)


def _validate(ll, grammar: str) -> tuple[bool, str]:
    r = _llg().LLMatcher.validate_grammar(grammar, ll)
    if isinstance(r, tuple):
        return (not r[0], r[1]) if isinstance(r[0], bool) else (True, "")
    return (not r, str(r)) if isinstance(r, str) else (True, "")


class Matcher:
    """A request's grammar state: `mask()` of allowed next tokens, `consume`, and the speculative
    round's `round_masks` / `settle` (rollback of rejected drafts)."""

    def __init__(self, m, vocab: int) -> None:
        self.m, self.vocab = m, vocab

    def mask(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (EOS when it may end)."""
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = np.zeros(self.vocab, dtype=bool)
        n = min(self.vocab, bits.size)
        out[:n] = bits[:n].astype(bool)
        return torch.from_numpy(out)

    def consume(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if not self.m.consume_token(int(t)):
                raise RuntimeError(f"grammar matcher rejected token {int(t)}: {self.m.get_error()}")

    def round_masks(self, drafts: Sequence[int]) -> tuple[list[torch.Tensor | None], int]:
        """Masks for rows 0..len(drafts) of a verification round and how many drafts were
        consumed to compute them (rows past the first draft outside the grammar: None)."""
        masks: list[torch.Tensor | None] = [self.mask()]
        consumed = 0
        for d in drafts:
            if not bool(masks[-1][int(d)]) or not self.m.consume_token(int(d)):
                break
            consumed += 1
            masks.append(self.mask())
        masks += [None] * (len(drafts) + 1 - len(masks))
        return masks, consumed

    def settle(self, consumed: int, accepted: int, bonus: int) -> None:
        """After verification: roll back the rejected drafts, then consume the bonus token."""
        if consumed > accepted:
            self.m.rollback(consumed - accepted)
        self.consume([bonus])


def masked_fill(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """logits [V] with every token outside `mask` at -inf (in place)."""
    if mask is not None:
        logits.masked_fill_(~mask.to(logits.device), float("-inf"))
    return logits
