"""Host-first admission (issue 26 item 5, HierarchicalKV._placement): a request whose prompt starts
with a prepared prefix shared on host takes the prefix's host pages as its history at once; only
the prefix's index keys and its partial last page come to the device, and the rest of the prompt
runs K_max tokens a pass through the resolver. Tokens equal `resident`'s, every located row is
checked (I2) and I1 holds after every step (debug checks). Breakages tried, each failing
`test_host_first_requests_are_exact[hisparse]`: the partial last page not copied into the tail; the
prefix's index keys not imported."""

from __future__ import annotations

import pytest

from dhisparse import SamplingParams
from dhisparse.engine.config import ConfigValueError, EngineConfig
from dhisparse.engine.llm import LLM
from kv_check import checked

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
PREFIX = [11 + (13 * j) % 97 for j in range(45)]  # 45 tokens: 5 whole pages of 8 and a partial one
SUFFIXES = [[60 + i, 61 + 2 * i, 62 + 3 * i][: 1 + i] for i in range(4)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in LLM("tiny").generate([PREFIX + s for s in SUFFIXES], GREEDY)]


def hier(preset: str, **kw) -> LLM:
    llm = checked(LLM("tiny", preset=preset, hot_cache_rows=16, page_size=8, debug_checks=True, **kw))
    llm.prepare_prefix(PREFIX)
    return llm


def run(llm: LLM) -> list[list[int]]:
    """The first request imports the prefix (and shares it on host); the others may go host-first."""
    first = llm.generate([PREFIX + SUFFIXES[0]], GREEDY)
    rest = llm.generate([PREFIX + s for s in SUFFIXES[1:]], GREEDY)
    return [o.token_ids for o in first + rest]


@pytest.mark.parametrize("preset,kw", [
    ("hisparse", {}),
    ("adaptive", {}),
    ("hisparse", {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3}),
    ("adaptive", {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}),
], ids=["hisparse", "adaptive", "hisparse-ngram3", "adaptive-ngram4"])
def test_host_first_requests_are_exact(reference, preset, kw):
    llm = hier(preset, admission_placement="host", **kw)
    assert run(llm) == reference
    assert llm.engine.store.host_first_admits == len(SUFFIXES) - 1  # the first one shared the prefix
    assert llm.engine.store._host_first == set()  # freed with their requests


def test_import_placement_never_goes_host_first(reference):
    llm = hier("hisparse", admission_placement="import")
    assert run(llm) == reference and llm.engine.store.host_first_admits == 0


def test_auto_goes_host_first_only_when_the_import_does_not_fit(reference):
    roomy = hier("hisparse")
    assert run(roomy) == reference and roomy.engine.store.host_first_admits == 0
    tight = hier("hisparse")
    store = tight.engine.store
    real = store._import_fits
    store._import_fits = lambda pages: False  # no spare pages for a workspace
    try:
        assert run(tight) == reference and store.host_first_admits == len(SUFFIXES) - 1
    finally:
        store._import_fits = real


def test_the_setting_is_checked():
    with pytest.raises(ConfigValueError, match="admission_placement"):
        EngineConfig(admission_placement="device")
