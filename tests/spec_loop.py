"""Test helper: a deterministic fake target and a speculative greedy loop over the Drafter protocol.

The fake target's next token is a function of the last two tokens (Fibonacci mod `vocab`, so the
greedy output is periodic) and its captured features are a function of (token, position), so the
loop exercises propose / verify / commit exactly as the engine will, without a KV store.
"""

from __future__ import annotations

import pytest
import torch

from dhisparse.spec.drafter import DraftRequest
from dhisparse.spec.verify import verify_greedy


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Tiny tensors: intra-op threads only add OpenMP wake-ups (ms each on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class FakeTarget:
    def __init__(self, vocab: int = 13, hidden: int = 64, layers: tuple[int, ...] = (1, 3)) -> None:
        self.vocab, self.hidden, self.layers = vocab, hidden, layers
        gen = torch.Generator().manual_seed(7)
        self.tok_feat = torch.randn(vocab, hidden, generator=gen)
        self.pos_feat = torch.randn(64, hidden, generator=gen) * 0.1

    def next_token(self, hist: list[int]) -> int:
        return (hist[-1] + (hist[-2] if len(hist) > 1 else 0)) % self.vocab

    def logits(self, hist: list[int]) -> torch.Tensor:
        out = torch.zeros(self.vocab)
        out[self.next_token(hist)] = 4.0
        return out

    def features(self, tokens: list[int], start: int) -> dict[int, torch.Tensor]:
        """{layer: [len(tokens), hidden]} for tokens at positions start.."""
        pos = torch.arange(start, start + len(tokens)) % 64
        base = self.tok_feat[torch.tensor(tokens)] + self.pos_feat[pos]
        return {l: base * (1 + 0.1 * l) for l in self.layers}

    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        ids = list(prompt)
        for _ in range(steps):
            ids.append(self.next_token(ids))
        return ids[len(prompt):]


def speculative_greedy(target: FakeTarget, drafter, prompt: list[int], steps: int, width: int,
                       rid: str = "r0") -> tuple[list[int], int]:
    """-> (first `steps` output tokens, number of rounds). Prefill features go in the first request."""
    drafter.admit(rid)
    out = [target.next_token(prompt)]
    pending = target.features(prompt, 0)
    rounds = 0
    while len(out) < steps:
        hist = list(prompt) + out[:-1]
        req = DraftRequest(rid, hist, out[-1], width, num_prompt_tokens=len(prompt), new_features=pending)
        pending = None
        prop = drafter.propose([req])[0]
        assert len(prop.tokens) <= width - 1
        block = [out[-1]] + prop.tokens
        logits = torch.stack([target.logits(hist + block[: i + 1]) for i in range(len(block))])
        acc = verify_greedy(logits, prop.tokens)
        feats = target.features(block[: acc.committed], len(hist))
        drafter.commit(rid, acc.accepted, feats)
        out += acc.emitted
        rounds += 1
    drafter.release(rid)
    return out[:steps], rounds
