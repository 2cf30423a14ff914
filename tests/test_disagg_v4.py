"""Prefill/decode disaggregation of DeepSeek-V4 models (engine/disagg_v4.py): the prefill rank
exports the request's whole streaming state at its prompt's end (every layer's sliding-window
rows, compressor raw tails, compressed rows as stored, the tiered CSA rows, drafter features), it
travels as named tensors with a picklable `V4Shape`, and the decode rank imports it whole and
decodes from the first token. A tiny V4.1-style checkpoint (tests/v4_engine_util.py `tiny_v41`:
SWA, CSA full / reuse / reindex, HCA layers) saved to a folder so spawned ranks load it; fp64 on
CPU over gloo. 1 prefill + 1 decode give the single-process engine's greedy tokens under
`resident`, `hisparse`, `adaptive` and `adaptive+spec` (DFlash), the decode rank computing no
prompt token, with V4's row checks on the decode rank (I2 per located row, I1 host copies:
disagg_hooks.v4_checker) and pool checks on both; FP8 rows (584-B, 132-B) cross the wire as stored.

Breakages tried by hand, and the test that caught each:
  - a layer's window rows not sent (`disagg_v4.v4_tensors` sends layer 3's window as zeros):
    test_v4_tokens_equal_one_process, every preset (tokens differ)
  - the compressor tails not sent or zeroed (kv_raw / idx_raw zeros; or left out: the decode rank's
    adopt raises StateError): test_v4_tokens_equal_one_process, every preset (tokens differ / the
    requests fail with an error)
  - compressed rows sent for the wrong layer (`rows:<l>:<kind>` keyed by the next layer's rows of that
    kind; the tiered rows' sources swapped): test_v4_tokens_equal_one_process (tokens differ;
    resident: every source; hierarchical presets: HCA rows and the swapped sources)
  - the first token recomputed (the decode rank imports nothing and prefills the prompt):
    test_v4_tokens_equal_one_process (the decode rank's prefill_tokens is not 0)
  - the tiered rows kept as a shared prefix (not `whole_prompt`: the row hierarchy borrows prefix host
    pages of an item no PrefixStore holds): test_v4_state_crosses_the_wire_as_stored (whole_prompt)
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from dhisparse import SamplingParams
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.disagg_launch import build_disagg
from dhisparse.engine.disagg_ranks import first_token_params
from dhisparse.engine.disagg_v4 import check_v4_rows
from dhisparse.engine.disagg_wire import header_of, prompt_kv_of, tensors_of
from dhisparse.engine.engine import Engine
from dhisparse.kv.v4.prefix import V4Prefix
from dhisparse.models.v4_scaled import build_v4_random
from dist_hooks import generate_on, world_presets
from v4_engine_util import V41_LAYERS, tiny_v41
from v4_fixtures import V4_TINY

PROMPTS = [[5 + (3 * i + j) % 90 for j in range(12 + 11 * i)] for i in range(8)] + [[7, 8, 9]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SMALL = dict(dtype="float64", device="cpu", page_size=4, hot_cache_rows=4, kv_pool_bytes=1 << 20, host_pool_bytes=1 << 20,
             max_num_batched_tokens=32, debug_checks=True)
PD = dict(dist_timeout_s=20.0, disaggregation_prefill_size=1, disaggregation_decode_size=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny V4.1-style checkpoint folder (our module names, which the V4 loader reads)."""
    f = tmp_path_factory.mktemp("v4pd") / "ck"
    f.mkdir()
    (f / "config.json").write_text(json.dumps({**V4_TINY, **V41_LAYERS}))
    model = build_v4_random(tiny_v41(), 5)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(f / "model.safetensors"))
    return str(f)


def config(folder: str, preset: str, **kw) -> EngineConfig:
    return EngineConfig(model=folder, preset=preset, **(SMALL | kw))


def one_process(folder: str, preset: str, prompts=PROMPTS, **kw) -> list[list[int]]:
    return generate_on(Engine(config(folder, preset, **kw)), prompts, GREEDY)


def handed_over(folder: str, preset: str, prompts, **kw) -> tuple[Engine, list]:
    """A prefill engine's kept prompts of `prompts` through the wire format (header pickled, tensors
    cloned), and the decode engine they were queued on: (decode engine, [(header, PromptKV)])."""
    pre = Engine(config(folder, preset, admission_placement="import", **kw))
    dec = Engine(config(folder, preset, **kw))
    for i, p in enumerate(prompts):
        pre.add_request(p, first_token_params(GREEDY), request_id=f"r{i}", keep_prompt=True)
    while pre.has_unfinished():
        pre.step()
    got = []
    for i in range(len(prompts)):
        kv = pre.kept_prompts.pop(f"r{i}")
        h = pickle.loads(pickle.dumps(header_of(f"r{i}", GREEDY, kv, 0.0)))
        arrived = prompt_kv_of(h, [t.clone() for _, t in tensors_of(kv)], False)
        dec.add_prompt_kv(arrived, GREEDY, f"r{i}")
        got.append((h, kv, arrived))
    return dec, got


def test_v4_state_crosses_the_wire_as_stored(folder):
    """hisparse under fp8_e4m3: every tensor of the exported state is rebuilt bit for bit, the
    compressed rows as their stored FP8 bytes, the tiered rows marked as one request's whole
    prompt; the decode engine computes no prompt token and decodes one process's tokens; a rank
    of another --kv-cache-dtype refuses the state."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3")
    prompts = PROMPTS[1:4]
    dec, got = handed_over(folder, "hisparse", prompts, **fp8)
    for h, kv, arrived in got:
        assert isinstance(arrived.item, V4Prefix) and arrived.item.tiered.whole_prompt and h.v4 is not None
        sent, back = tensors_of(kv), tensors_of(arrived)
        assert [n for n, _ in sent] == [n for n, _ in back]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sent, back))
        stored = {t.dtype for t in arrived.item.rows.values()} | {arrived.item.tiered.latent.dtype}
        assert stored == {torch.uint8}  # FP8 rows as their stored bytes
        assert any(n.startswith("kv_raw:") for n, _ in sent) and any(n.startswith("idx_raw:") for n, _ in sent)
    outs = {}
    while dec.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in dec.step() if o.finished})
    assert [outs[f"r{i}"] for i in range(len(prompts))] == one_process(folder, "hisparse", prompts, **fp8)
    assert dec.stats().prefill_tokens == 0
    mc = dec.model_config
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        check_v4_rows(got[0][2].item, mc, "auto", torch.float64)


@pytest.mark.parametrize("preset", world_presets())
def test_v4_tokens_equal_one_process(folder, preset):
    """Greedy tokens of 1 prefill + 1 decode equal one process's; every prompt handed over, admitted
    through the V4 store's import (resident-first: V4 imports whole states), no prompt token
    computed on the decode rank; V4's row checks on the decode rank (disagg_hooks.v4_checker)."""
    want = one_process(folder, preset)
    eng = build_disagg(config(folder, preset, **PD), on_engine="disagg_hooks:v4_checker")
    try:
        assert generate_on(eng, PROMPTS, GREEDY) == want
        prefill, decode = eng.rank_stats()
        n = len(PROMPTS)
        assert (prefill.admitted, decode.admitted, decode.prefill_tokens) == (n, n, 0)
        assert prefill.prefill_tokens == sum(map(len, PROMPTS))
        c = eng.stats().counters
        assert (c["disagg_handed_over"], c["disagg_received"], c["disagg_resident_first"]) == (n, n, n)
        assert c["disagg_sent_bytes"] == c["disagg_received_bytes"] > 0 and c["disagg_held"] == 0
    finally:
        eng.close()
    assert not torch.distributed.is_initialized() and all(not p.is_alive() for p in eng.procs)
