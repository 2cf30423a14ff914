"""bench/gpu_serving.py's sizing for DeepSeek-V4 models (dhisparse/bench/sizing.py), checked against
engines built with its settings on CPU; GLM's numbers unchanged; the Fig. 5 steps of
bench/gpu_session.sh (`fig5v41*`) parse and fit a device call; the V4 CPU smoke run.

Mutations tried once each in dhisparse/bench/sizing.py's v4_sizing (each failed
test_v4_sizing_is_what_the_engine_holds on the engine's count, then the line was restored):
  - the sources' index keys left out of the hierarchy's required pages (`required =
    hier.store.kv.required_pages(rows) - hier.arena.index_pages_for(rows)`): sizing promised 4 / 9
    hisparse sessions, the engines held 3 / 8 (both cases);
  - the compressed rows left out of a resident history (`resident = cdiv(v4_dense_bytes(cfg, total,
    ...), res.page_bytes)`: windows and tails only): the resident engine held 2 of --resident-fit 3
    (the plain float32 rows; under FP8 rows the float32 windows and tails set the page count either way);
  - the slots without one admission's workspace (`hier_pages // required`): 3 of 4 and 8 of 9.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_session_stub import session_commands

from dhisparse.bench.workload import prefix_ids
from dhisparse.core.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _gs():
    spec = importlib.util.spec_from_file_location("gpu_serving_v4", ROOT / "bench" / "gpu_serving.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gs = _gs()


@pytest.fixture(scope="module")
def loaded():
    """--quick --model v41-faithful's small geometry (8 layers: one CSA source, 3 HCA layers)."""
    return gs.load_model(gs.parse(["--quick", "--model", "v41-faithful"]))


def quick_v4(**over):
    """--quick --model v41-faithful settings with `over` applied (after --quick, which sets its own)."""
    ns = gs.parse(["--quick", "--model", "v41-faithful"])
    for k, v in over.items():
        setattr(ns, k, v)
    return ns, gs.model_config(ns.model, ns.layers, ns.overrides)


def held(ns, cfg, sz, loaded, preset: str, extra: int = 2):
    """(engine, requests it holds at once): `extra` more requests than it has slots of the workload's
    longest total (prompt = prefix + 8 tokens, the sizing's total), slots raised so that only memory
    binds, stepped until no request has been admitted for 3 steps."""
    config = gs.engine_config(ns, sz, preset)
    config = dataclasses.replace(config, max_running_requests=sz["max_running_requests"] + extra)
    eng = gs.fresh_engine(config, loaded, gs.new_prefixes(ns, cfg))
    prefix = prefix_ids(loaded.tokenizer, ns.input_len, cfg.vocab_size)
    eng.prepare_prefix(prefix)
    n = max(ns.resident_fit, sz["hierarchy_device_slots"]) + extra
    for i in range(n):
        eng.add_request(prefix + [3 + i] * 8, SamplingParams(max_tokens=ns.output_len, ignore_eos=True))
    quiet, seen = 0, 0
    while quiet < 3:
        eng.step()
        now = len(eng.scheduler.running)
        quiet, seen = (quiet + 1, seen) if now <= seen else (0, now)
    assert len(eng.scheduler.running) + len(eng.scheduler.waiting) == n  # nothing finished meanwhile
    return eng, len(eng.scheduler.running)


# 1,024-token prompts: long enough that the compressed rows change the resident page count and that one
# admission's workspace changes the hierarchy's slots (at 192 tokens neither does)
@pytest.mark.parametrize("kv_cache_dtype,fit", [("auto", 3), ("fp8_e4m3", 6)])
def test_v4_sizing_is_what_the_engine_holds(loaded, kv_cache_dtype, fit):
    """The pool holds exactly --resident-fit resident histories (more wait); the hierarchy's pool
    (the same bytes in row pages) holds exactly `hierarchy_device_slots` hisparse sessions, each
    holding `hierarchy_required_pages_per_request` pages; adaptive that less its reserve."""
    ns, cfg = quick_v4(kv_cache_dtype=kv_cache_dtype, resident_fit=fit, input_len=1024, output_len=64,
                       admit_factor=100.0, host_pool_gib=0.05)
    sz = gs.sizing(ns, cfg)
    assert sz["model_family"] == "deepseek_v4" and sz["max_running_requests"] == sz["hierarchy_device_slots"]
    total = sz["tokens_per_request"]
    eng, n = held(ns, cfg, sz, loaded, "resident")
    assert n == fit
    assert eng.store.pool.capacity == sz["kv_pool_pages"] == fit * eng.store.pages_for(total)
    assert eng.page_bytes == sz["resident_page_bytes"]
    u = eng.store.usage()
    assert u.used + u.reserved == eng.store.pool.capacity == fit * sz["resident_pages_per_request"]
    eng, n = held(ns, cfg, sz, loaded, "hisparse")
    kv, rows = eng.store.kv, sz["rows_per_request"]
    assert n == sz["hierarchy_device_slots"] >= 2
    assert eng.store.pool.capacity == sz["hierarchy_pool_pages"] and eng.page_bytes == sz["page_bytes"]
    assert kv.required_pages(rows) == sz["hierarchy_required_pages_per_request"]
    u = eng.store.usage()  # the engine's own accounting: every session handed off, holding its required pages
    assert u.used + u.reserved == n * sz["hierarchy_required_pages_per_request"]
    eng, n = held(ns, cfg, sz, loaded, "adaptive")
    reserve = eng.store.kv.res.reserve
    assert n == (sz["hierarchy_pool_pages"] - reserve - sz["hierarchy_admission_transient_pages"]) // \
        sz["hierarchy_required_pages_per_request"] >= sz["hierarchy_device_slots"] - 1


def test_v4_spec_charge_is_what_the_engine_allocates(loaded):
    """--charge-spec-memory on a V4 model (the costed DSpark oracle): the +spec pool + drafter
    weights + ring is the others' pool; the engine built with the charged settings allocates
    exactly S slots' staging (V4's row hierarchy, memreport.staging_bytes_per_slot) and that pool."""
    ns, cfg = quick_v4(kv_cache_dtype="fp8_e4m3", kv_pool_gib=0.05, charge_spec_memory=True,
                       engine_arg=["speculative_oracle_drafter=dspark", "speculative_draft_window_size=16"])
    sz = gs.bench_sizing(ns, cfg)
    assert ns.resident_fit > 2  # --kv-pool-gib set it
    ch = gs.spec_charge(ns, sz, cfg, loaded, {})
    S = ch["max_running_requests"]
    assert ch["drafter_weight_bytes"] > 0 and ch["drafter_ring_bytes_per_slot"] > 0 and ch["staging_bytes_per_slot"] > 0
    assert ch["kv_pool_bytes"] + ch["drafter_weight_bytes"] + S * ch["drafter_ring_bytes_per_slot"] == sz["kv_pool_bytes"]
    assert 1 <= S < sz["max_running_requests"]
    sz["spec_charged"] = ch
    eng = gs.fresh_engine(gs.engine_config(ns, sz, "adaptive+spec"), loaded, None, {})
    kv = eng.store.kv
    assert kv.stage_arenas.numel() * kv.stage.element_size() == S * ch["staging_bytes_per_slot"]
    assert eng.store.pool.num_pages == ch["kv_pool_bytes"] // sz["page_bytes"]  # staging: permanent pages in it
    assert eng.spec.drafter.state_bytes_per_request() == ch["drafter_ring_bytes_per_slot"]
    session = sz["hierarchy_required_pages_per_request"] * sz["page_bytes"]
    assert S * (session + ch["staging_bytes_per_slot"]) + sz["admission_workspace_bytes"] <= ch["kv_pool_bytes"]


# recorded before the DeepSeek-V4 sizing was added (commit 1fd4ccc's bench/gpu_serving.py)
GLM = {
    ("--model", "glm52-scaled", "--input-len", "102400", "--resident-fit", "3", "--host-pool-gib", "24",
     "--kv-cache-dtype", "fp8_e4m3"):
        dict(page_bytes=3274752, resident_pages_per_request=1693, hierarchy_required_pages_per_request=154,
             hierarchy_admission_transient_pages=1601, kv_pool_pages=5080, kv_pool_bytes=16635740160,
             hierarchy_device_slots=32, host_bytes_per_request=16373760, host_shared_prefix_bytes=5239603200,
             host_pool_bytes=25769803776, host_slots=1253, max_running_requests=30),
    ("--model", "glm5-faithful", "--input-len", "102400", "--output-len", "1024", "--resident-fit", "3",
     "--host-pool-gib", "16", "--kv-cache-dtype", "fp8_e4m3", "--spec-width", "4"):
        dict(page_bytes=3274752, resident_pages_per_request=1705, hierarchy_required_pages_per_request=154,
             hierarchy_admission_transient_pages=1601, kv_pool_pages=5116, kv_pool_bytes=16753631232,
             hierarchy_device_slots=33, host_bytes_per_request=55670784, host_shared_prefix_bytes=5239603200,
             host_pool_bytes=17179869184, host_slots=214, max_running_requests=30),
    ("--input-len", "32768", "--resident-fit", "3", "--host-pool-gib", "92", "--hot-cache-rows", "2048",
     "--page-size", "32"):
        dict(page_bytes=2875392, resident_pages_per_request=1095, hierarchy_required_pages_per_request=128,
             hierarchy_admission_transient_pages=1025, kv_pool_pages=3286, kv_pool_bytes=9448538112,
             hierarchy_device_slots=25, host_bytes_per_request=25878528, host_shared_prefix_bytes=2944401408,
             host_pool_bytes=98784247808, host_slots=3703, max_running_requests=25),
    ("--quick",):
        dict(page_bytes=15360, resident_pages_per_request=17, hierarchy_required_pages_per_request=7,
             hierarchy_admission_transient_pages=13, kv_pool_pages=35, kv_pool_bytes=537600, hierarchy_device_slots=5,
             host_bytes_per_request=30720, host_shared_prefix_bytes=184320, host_pool_bytes=337920, host_slots=5,
             max_running_requests=5),
}
GLM_ESTIMATES = {("--quick",): 28.0}


@pytest.mark.parametrize("argv", list(GLM), ids=lambda a: " ".join(a)[:40])
def test_glm_sizing_is_unchanged(argv):
    ns = gs.parse(list(argv))
    sz = gs.sizing(ns, gs.model_config(ns.model))
    assert {k: sz[k] for k in GLM[argv]} == GLM[argv]
    assert "resident_page_bytes" not in sz and "model_family" not in sz  # GLM's keys only
    if argv in GLM_ESTIMATES:
        assert gs.estimate_s(ns, sz) == GLM_ESTIMATES[argv]


FIG5_STEPS = "fig5v41a,fig5v41b,fig5v41c,fig5v41d,fig5v41e,fig5v41f,fig5v41g"


def fig5_commands(tmp_path: Path, env: dict | None = None) -> list[list[str]]:
    """The gpu_serving.py argument lists bench/gpu_session.sh's fig5v41* steps run (`session_commands`)."""
    return [c[1:] for c in session_commands(tmp_path, FIG5_STEPS, env) if c[0] == "bench/gpu_serving.py"]


def test_fig5v41_steps_parse_fit_a_call_and_make_a_context_sweep(tmp_path):
    """Every fig5v41* command parses; v41-faithful, FP8 rows, one concurrency, the four presets over
    the steps with resident among them, every input length one file under $OUT, each estimated
    under the 9-minute budget; the pool is --kv-pool-gib at every context, so resident's fit
    falls with the context while the hierarchy (and the charged +spec slots' bound) still hold C
    at the longest context but one."""
    cmds = fig5_commands(tmp_path)
    assert len(cmds) >= 5
    seen, fits = {}, {}
    for argv in cmds:
        ns = gs.parse(argv)
        assert (ns.model, ns.kv_cache_dtype, ns.device) == ("v41-faithful", "fp8_e4m3", "cuda")
        assert ns.out.startswith(str(tmp_path / "out")) and ns.kv_pool_gib and not ns.quick
        sz = gs.bench_sizing(ns, gs.model_config(ns.model))
        assert gs.estimate_s(ns, sz) < gs.BUDGET_S, argv
        assert abs(sz["kv_pool_bytes"] - ns.kv_pool_gib * gs.GIB) <= sz["resident_bytes_per_request"]
        seen.setdefault(ns.input_len, set()).update(ns.preset_list)
        fits[ns.input_len] = (ns.resident_fit, sz["max_running_requests"], ns.concurrencies)
    assert len({tuple(c) for _, _, c in fits.values()}) == 1 and len(next(iter(fits.values()))[2]) == 1
    C = next(iter(fits.values()))[2][0]
    lengths = sorted(seen)
    assert lengths[:3] == [32768, 65536, 131072] and len(lengths) >= 5
    for L in lengths:
        assert seen[L] == {"resident", "hisparse", "adaptive", "adaptive+spec"}, L
    assert fits[lengths[0]][0] >= C and fits[lengths[-2]][0] < C  # resident queues at the long end
    assert all(fits[L][1] >= C for L in lengths[:-1])  # the hierarchy holds C up to there


def test_quick_v4_smoke_run(tmp_path):
    """`gpu_serving.py --quick --model v41-faithful`: four presets on CPU in well under 2 minutes."""
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_serving.py"), "--quick", "--model", "v41-faithful",
                           "--out", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert {r["preset"] for r in data["runs"]} == {"hisparse", "adaptive", "adaptive+spec", "resident"}
    assert all(r["metrics"]["output_tok_s"] > 0 for r in data["runs"])
    assert data["config"]["sizing"]["model_family"] == "deepseek_v4" and data["config"]["wall_s"] < 120


def test_fig5_pool_follows_the_card_and_tags_its_files(tmp_path):
    """fig5v41's pool: FIG5_POOL_GIB when set; else 12 GiB on a card under 100 GB (here no nvidia-smi answers, as
    on an H100's smaller memory) and 16 from 100 GB; a pool other than 16 tags every file _poolN."""
    small = fig5_commands(tmp_path / "a")
    assert {gs.parse(a).kv_pool_gib for a in small} == {12.0}
    assert all("_fp8_pool12" in Path(gs.parse(a).out).name for a in small)
    set16 = fig5_commands(tmp_path / "b", {"FIG5_POOL_GIB": "16"})
    assert {gs.parse(a).kv_pool_gib for a in set16} == {16.0} and not any("_pool" in Path(gs.parse(a).out).name for a in set16)
