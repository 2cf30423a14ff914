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
    prompts = [[3 + (11 * i + 7 * j) % 120 for j in range(6 + 10 * i)] for i in range(3)]
    llm = LLM(str(folder), page_size=4, max_num_batched_tokens=16)
    hf = load_hf(folder).to(llm.engine.device)  # same device: CPU and GPU round differently
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == greedy_hf(hf, p, 32)
