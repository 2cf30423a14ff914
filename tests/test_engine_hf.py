"""The engine on transformers-built checkpoints: a batch of prompts of different lengths, decoded
with continuous batching, is token-identical to transformers' greedy generate per prompt."""

from __future__ import annotations

import pytest

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from hf_fixtures import greedy_hf, load_hf


@pytest.mark.parametrize("arch", ["glm", "v32"])
def test_engine_batch_matches_transformers(hf_checkpoints, arch):
    folder = getattr(hf_checkpoints, arch)
    hf = load_hf(folder)
    prompts = [[3 + (11 * i + 7 * j) % 120 for j in range(6 + 10 * i)] for i in range(3)]
    outs = LLM(str(folder), page_size=4, max_num_batched_tokens=16).generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == greedy_hf(hf, p, 32)
