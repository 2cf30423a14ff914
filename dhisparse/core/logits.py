"""Logit processors (penalties, bias, min_tokens) and the logprobs the API reports.

`apply_processors` changes the raw model logits of the rows whose `SamplingParams` ask for it,
before temperature / top-k / top-p. It is called by `processed_probs` and `Sampler.sample`
(core/sampling.py) and by the engine on speculative verification rows, so a request samples, and
has its drafts judged, against one and the same distribution. Per row, in this order:

  1. repetition_penalty r (CTRL / HF / vLLM): every token id in prompt + output so far: a logit
     l > 0 becomes l / r, l <= 0 becomes l * r;
  2. frequency / presence (OpenAI): l -= frequency_penalty * count(output) + presence_penalty * [count > 0],
     counting the output tokens only;
  3. logit_bias: l += bias (ids outside the vocabulary are ignored; the server rejects them);
  4. min_tokens: while len(output) < min_tokens, the request's EOS ids and stop_token_ids get -inf;
  5. grammar (structured output): tokens outside the row's `History.mask` get -inf.

The penalties need what the request emitted so far: each row carries a `History` (prompt ids,
output ids at that row, the request's EOS ids). A verification row i of a request sees
output + drafts[:i], exactly what decoding one token at a time would have seen there.

Logprobs (`token_logprobs`) are defined as the log-softmax of the **raw model logits** of the
position (before penalties, bias, min_tokens, temperature, top-k / top-p; vLLM's default
"raw_logprobs"), in fp32. They are the model's log-likelihoods, the number log-likelihood
evaluations need, and do not depend on the sampling settings. The top alternatives are ordered by
logprob, ties by lower id.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from dhisparse.core.params import SamplingParams


class History(NamedTuple):
    """What a row's processors read: the prompt, the output so far at that row, the EOS ids, and
    the grammar's allowed-token mask at that row ([V] bool; None: no grammar constraint)."""

    prompt: Sequence[int]
    output: Sequence[int]
    eos: tuple[int, ...] = ()
    mask: torch.Tensor | None = None

    def extended(self, drafts: Sequence[int], mask: torch.Tensor | None = None) -> "History":
        return History(self.prompt, list(self.output) + [int(t) for t in drafts], self.eos, mask)


class TokenLogprob(NamedTuple):
    """One position's report: the token, its logprob, and the top-k alternatives [(id, logprob)]."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def needs_history(p: SamplingParams) -> bool:
    return p.penalised or p.min_tokens > 0 or p.grammar is not None


def _row(logits: torch.Tensor, p: SamplingParams, h: History) -> torch.Tensor:
    vocab = logits.shape[0]
    dev = logits.device
    out = list(h.output)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in list(h.prompt) + out if 0 <= t < vocab}), dtype=torch.int64, device=dev)
        if seen.numel():
            v = logits[seen]
            logits[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and out:
        ids = torch.tensor([t for t in out if 0 <= t < vocab], dtype=torch.int64, device=dev)
        counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.logit_bias:
        pairs = [(t, b) for t, b in p.logit_bias if t < vocab]
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=dev)
            logits[ids] += torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=dev)
    if len(out) < p.min_tokens:
        banned = [t for t in (*h.eos, *p.stop_token_ids) if 0 <= t < vocab]
        if banned:
            logits[torch.tensor(banned, dtype=torch.int64, device=dev)] = float("-inf")
    if h.mask is not None:
        m = h.mask.to(dev)
        n = min(vocab, m.shape[0])
        logits[:n].masked_fill_(~m[:n], float("-inf"))
        logits[n:] = float("-inf")
    return logits


def apply_processors(logits: torch.Tensor, params: Sequence[SamplingParams],
                     history: Sequence[History | None] | None) -> torch.Tensor:
    """logits [N, V] -> fp32 logits with each row's processors applied (a new tensor when any row
    changes; the input is never modified). Rows without processors, or without a History, pass."""
    if history is None:
        return logits
    rows = [i for i, (p, h) in enumerate(zip(params, history))
            if h is not None and (needs_history(p) or h.mask is not None)]
    if not rows:
        return logits
    logits = logits.float().clone()
    for i in rows:
        logits[i] = _row(logits[i], params[i], history[i])
    return logits


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: Sequence[int]) -> list[TokenLogprob]:
    """logits [N, V] raw model logits; tokens[i] the token chosen at row i; k[i] alternatives.
    -> one TokenLogprob per row: log_softmax(logits[i])[tokens[i]] and the k[i] best alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tok = torch.tensor([int(t) for t in tokens], dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, tok.unsqueeze(1)).squeeze(1).tolist()
    kmax = max(k, default=0)
    top_v = top_i = None
    if kmax > 0:
        # stable descending sort: ties go to the lower id
        top_v, top_i = torch.sort(lp, dim=-1, descending=True, stable=True)
        top_v, top_i = top_v[:, :kmax].tolist(), top_i[:, :kmax].tolist()
    out = []
    for i, t in enumerate(tokens):
        top = tuple(zip(top_i[i][: k[i]], top_v[i][: k[i]])) if k[i] > 0 else ()
        out.append(TokenLogprob(int(t), chosen[i], top))
    return out
