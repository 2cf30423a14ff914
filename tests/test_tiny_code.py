"""The trained built-in checkpoint `tiny-code` (issue 29): shipped as package data under 25 MB,
loaded by name, its records say what it learned (sparse within 3% of dense), and every preset
serves it token-identically to `resident`, with its own MTP block, its own DFlash2 drafter and
n-gram drafting, under pools small enough that the hierarchy and reclaim do real work (I2 row
checker on). Its drafters' parity with the `dflash` package is in test_dflash_reference.py."""

from __future__ import annotations

import json

import pytest

from dhisparse import SamplingParams
from dhisparse.engine.llm import LLM
from dhisparse.models.registry import builtin_drafter, builtin_folder
from kv_check import checked

FOLDER = builtin_folder("tiny-code")
# held-out-style text (not from the training corpus): a function the model has to continue
CODE = '''import os


def walk_sizes(root, follow_links=False):
    """Return a dict mapping every file under root to its size in bytes."""
    sizes = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_links):
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                sizes[path] = os.path.getsize(path)
            except OSError:
                continue
    return sizes


class Registry:
    def __init__(self, name):
        self.name = name
        self._items = {}

    def register(self, key, value):
'''
PROMPTS = [CODE, CODE[:400] + "\ndef parse_line(line):", "def read_config(path, defaults=None):"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in LLM("tiny-code").generate(PROMPTS, GREEDY)]


def test_shipped_folder_is_small_and_complete():
    files = [p for p in FOLDER.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 25 * 2**20
    names = {str(p.relative_to(FOLDER)) for p in files}
    assert {"config.json", "model.safetensors", "model-mtp.safetensors", "model.safetensors.index.json",
            "tokenizer.json", "dflash2/config.json", "dflash2/model.safetensors", "model_record.json"} <= names
    cfg = json.loads((FOLDER / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["num_nextn_predict_layers"] == 1
    record = json.loads((FOLDER / "model_record.json").read_text())
    bpb = record["heldout_bits_per_byte"]
    assert bpb["sparse"] / bpb["dense"] < 1.03  # the trained indexer picks what matters
    assert cfg["index_topk"] * 4 <= 256 and "--seq-len 256" in record["command"]  # selection is real at 256


def test_its_drafter_is_the_default_for_dflash_presets():
    assert builtin_drafter("tiny-code", "dflash") == str(FOLDER / "dflash2")
    assert builtin_drafter("tiny", "dflash") is None
    assert LLM("tiny-code", preset="adaptive+spec").engine.config.spec_config().draft_model_path == str(FOLDER / "dflash2")


SMALL = dict(page_size=16, hot_cache_rows=64, debug_checks=True)
CASES = {
    "hisparse": dict(preset="hisparse"),
    "adaptive-tight": dict(preset="adaptive", kv_pool_bytes=38 * 15360, admission_reserve_pages=2),  # 38 pages
    "resident+mtp": dict(preset="resident", speculative_algorithm="mtp"),
    "adaptive+dflash2": dict(preset="adaptive+spec"),
    "resident+dflash2": dict(preset="resident+spec"),
    "hisparse+ngram": dict(preset="hisparse", speculative_algorithm="ngram"),
    "adaptive+mtp": dict(preset="adaptive", speculative_algorithm="mtp"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_preset_serves_it_like_resident(reference, case):
    llm = LLM("tiny-code", **SMALL, **CASES[case])
    if llm.engine.store.arena is not None:
        checked(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    llm.engine.store.check_integrity()
    st = llm.engine.stats().as_dict()
    if llm.engine.spec is not None:  # the trained drafters are accepted (n-gram: whatever the prompts repeat)
        assert st["spec_tokens_per_round"] > (1.0 if "ngram" in case else 1.2), st["spec_tokens_per_round"]
    if case.startswith("hisparse"):
        assert st["host_fetched_share"] > 0  # selected rows came from host
    if case == "adaptive-tight":
        from dhisparse.engine.step_graphs import StepGraphs  # the stats leave out the step graphs' scratch page

        scratch = StepGraphs.SCRATCH_PAGES if llm.engine.step_graphs is not None else 0
        assert st["kv_pages_total"] == 38 - scratch and st["reclaimed_pages"] > 0 and st["repopulated_pages"] > 0


@pytest.mark.filterwarnings("ignore")
def test_its_mtp_ring_drafts_what_the_dense_reference_drafts():
    """The trained MTP block served from its ring equals the dense windowed re-run
    (test_spec_mtp.reference_drafts) over rounds that wrap the ring; random target features."""
    import torch

    from dhisparse.spec.drafter import DraftRequest
    from test_spec_mtp import reference_drafts

    llm = LLM("tiny-code", speculative_algorithm="mtp")
    d, norm = llm.engine.spec.drafter, llm.engine.model.model.norm
    (layer,) = d.capture_layers
    H = norm.weight.shape[0]
    gen, dev = torch.Generator().manual_seed(0), norm.weight.device
    ids = [(7 * i + 3) % 4000 + 5 for i in range(8)]
    raw = torch.randn(len(ids) - 1, H, generator=gen).to(dev)
    d.observe("a", {layer: raw}, 0)
    with torch.inference_mode():
        for _ in range(40):  # ~100 positions past a window of index_topk = 64 rows
            (prop,) = d.propose([DraftRequest("a", ids[:-1], ids[-1], 4)])
            assert prop.tokens == reference_drafts(d, ids, norm(raw.to(norm.weight.dtype)).float(), 3)
            acc = int(torch.randint(0, 4, (1,), generator=gen))
            new = torch.randn(acc + 1, H, generator=gen).to(dev)
            d.commit("a", acc, {layer: new})
            raw = torch.cat([raw, new])
            ids = ids + prop.tokens[:acc] + [int(torch.randint(5, 4000, (1,), generator=gen))]


def test_the_demo_runs_tiny_code_by_default(capsys):
    from dhisparse.cli import main

    assert main(["demo", "--preset", "hisparse", "--duration", "1", "--concurrency", "1", "--input-len", "64",
                 "--output-len", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "dhisparse demo: tiny-code" in out and "def read_config(path, defaults=None):" in out
    assert "    return" in out or '"""' in out  # the continuation reads as code
