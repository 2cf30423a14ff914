"""What one request carries from a prefill engine to a decode engine (prefill/decode
disaggregation, engine/disagg.py): its whole prompt's KV and the state its first token left.

A prefill engine keeps it for a request added with `keep_prompt` (`Engine.kept_prompts`, once the
first token is sampled); a decode engine admits it (`Engine.add_prompt_kv`) like a prefix import of
every prompt row, and the request decodes from the first token at position n:

    positions   0 ........................ n-1 | n
    item        latent / index rows (the store's row format), features (drafter) | first_token
    decode      imported whole, placed resident-first or host-first (kv/hier/arrival.py)

A DeepSeek-V4 request carries its whole streaming state at n instead (a `V4Prefix` exported as a
prepared prefix is, its tiered CSA rows marked `whole_prompt`: engine/disagg_v4.py), imported whole
by the decode engine's V4 store (`import_prefix`, kv/v4/prefix.py `import_len`).

Sampling state: the generator after the first draw (seeded sampling continues exactly); penalties,
`min_tokens` and grammars read the output so far (the first token), so nothing else travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dhisparse.core.logits import TokenLogprob
from dhisparse.kv.memory.prefix_store import StoredPrefix
from dhisparse.kv.v4.prefix import V4Prefix


@dataclass(frozen=True)
class PromptKV:
    """item: `StoredPrefix` with `whole_prompt` (latent [L, n, W], index [F, n, Wi] host tensors in
    the store's row format; features {layer: [f, hidden]} for a drafter that reads them), or a
    DeepSeek-V4 `V4Prefix` (the whole streaming state at n, `disagg_v4.whole_state`);
    first_token: sampled by the prefill engine; generator_state: its generator after that draw
    (uint8, `torch.Generator.get_state`); logprobs: the first token's (params.logprobs), or None;
    prompt_logprobs: one per prompt position (params.prompt_logprobs), or None; imported_len:
    prompt rows the prefill engine imported from a prepared prefix; queue_s: its wait for
    admission there; sampled_wall: `time.time()` when the first token was sampled."""

    item: StoredPrefix | V4Prefix
    first_token: int
    generator_state: torch.Tensor
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    imported_len: int = 0
    queue_s: float = 0.0
    sampled_wall: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.item.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors (rows, features; a V4 state's tails and rows too)."""
        feats = sum(f.numel() * f.element_size() for f in self.item.features.values())
        return self.item.nbytes + feats


def whole_prompt(token_ids: list[int], latent: torch.Tensor, index: torch.Tensor, features: dict,
                 pin: bool) -> StoredPrefix:
    """A `StoredPrefix(whole_prompt=True)` of host copies (pinned when `pin`): latent [L, n, W],
    index [F, n, Wi], features {layer: [f, hidden]}."""
    def host(t: torch.Tensor) -> torch.Tensor:
        t = t.cpu()
        return t.pin_memory() if pin else t

    return StoredPrefix(tuple(token_ids), host(latent), host(index), {l: host(f) for l, f in features.items()},
                        whole_prompt=True)
