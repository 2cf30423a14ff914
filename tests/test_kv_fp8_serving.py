"""FP8 KV rows in serving: placement exact under FP8 (every preset against the same model's FP8
`resident` run, with the I2 row checker comparing stored bytes), prepared prefixes imported exactly,
and one paged copy of a prefix (quantizer and kernels: test_kv_fp8.py)."""

from __future__ import annotations

import pytest
import torch
from kv_check import checked

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPTS = [[3 + (7 * i + 5 * j) % 250 for j in range(20 + 23 * i)] for i in range(3)] + [[5, 6, 7, 8, 9] * 8]


# -- placement is exact under FP8 ------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_reference() -> list[list[int]]:
    return [o.token_ids for o in LLM("tiny", kv_cache_dtype="fp8_e4m3", page_size=4).generate(PROMPTS, GREEDY)]


PRESETS = [
    ("hisparse", {}),
    ("adaptive", {"kv_pool_bytes": 48 * 1024, "admission_reserve_pages": 0, "max_running_requests": 4}),  # reclaims
    ("resident+spec", {"speculative_algorithm": "dflash"}),
    ("adaptive+spec", {"speculative_algorithm": "dflash2"}),
    ("adaptive+spec", {"speculative_algorithm": "dspark"}),
    ("hisparse", {"speculative_algorithm": "ngram"}),
    ("adaptive+spec", {"speculative_algorithm": "mtp"}),
]


@pytest.mark.parametrize("preset,kw", PRESETS, ids=[f"{p}-{k.get('speculative_algorithm', '')}" for p, k in PRESETS])
def test_every_preset_is_token_identical_under_fp8(fp8_reference, preset, kw):
    llm = checked(LLM("tiny", preset=preset, kv_cache_dtype="fp8_e4m3", page_size=4, hot_cache_rows=16,
                      debug_checks=True, **kw))
    assert llm.engine.arena.formats.fp8 and llm.engine.arena.dtype == torch.uint8
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == fp8_reference
    st = llm.engine.stats().as_dict()
    if preset == "adaptive":
        assert st["reclaimed_pages"] > 0 and st["repopulated_pages"] > 0
    if "spec" in preset or "speculative_algorithm" in kw:
        assert st["spec_rounds"] > 0


@pytest.mark.parametrize("preset", ["resident", "adaptive"])
def test_prepared_prefix_imports_fp8_pages_exactly(fp8_reference, preset):
    prefix = PROMPTS[2]
    reqs = [prefix + [50 + i] for i in range(3)]
    ref = [o.token_ids for o in LLM("tiny", kv_cache_dtype="fp8_e4m3").generate(reqs, GREEDY)]
    llm = checked(LLM("tiny", preset=preset, kv_cache_dtype="fp8_e4m3", hot_cache_rows=16, max_num_batched_tokens=9,
                      page_size=8, debug_checks=True))
    llm.prepare_prefix(prefix)
    outs = llm.generate(reqs, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert all(o.metrics.imported_len == len(prefix) for o in outs)


def test_a_prefix_is_paged_once_under_fp8():
    """The hierarchy's shared host pages and its imports use one paged copy of a prefix (a second
    layout would be a second pinned host copy of every row)."""
    llm = LLM("tiny", preset="hisparse", kv_cache_dtype="fp8_e4m3", hot_cache_rows=16, page_size=8)
    llm.prepare_prefix(PROMPTS[2])
    llm.generate([PROMPTS[2] + [50]], GREEDY)
    item = llm.engine.prefixes.get(PROMPTS[2])
    assert list(item._paged) == [llm.engine.store.prefix_layout()]
