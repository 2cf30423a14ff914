"""DeepSeek-V4 checkpoints through the engine (`resident` preset): batched greedy generation equals
transformers' generate per prompt; a prefix is prepared (import / export: test_v4_prefix.py). The
hierarchical presets and speculation over V4 are tested in test_v4_hier.py / test_v4_sources.py."""

from __future__ import annotations

import pytest

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from v4_fixtures import greedy_hf, load_v4_hf, prompt_ids, save_v4_checkpoint, v4_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_v4_checkpoint(v4_config(), tmp_path_factory.mktemp("v4eng") / "hf", seed=3)


def test_v4_engine_batch_matches_transformers(folder):
    hf = load_v4_hf(folder)
    prompts = [prompt_ids(n, seed=n) for n in (9, 13, 22)]
    llm = LLM(str(folder), page_size=4, max_num_batched_tokens=10, debug_checks=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == greedy_hf(hf, p, 20)
    assert llm.engine.stats().kv_pages_used == 0


def test_v4_prefix_is_prepared_and_the_engine_serves_on(folder):
    llm = LLM(str(folder))
    assert llm.prepare_prefix(prompt_ids(9, seed=1)) == 9
    assert not llm.engine.has_unfinished()
    assert llm.generate([prompt_ids(9, seed=1)], SamplingParams(max_tokens=4))[0].finish_reason == "length"
