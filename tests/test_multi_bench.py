"""Issue 32's harness for parallel worlds (dhisparse/bench/multi.py, bench/multi_gpu.py) and its device
steps (bench/gpu_multi.sh), on CPU: layouts and their flags, NVLink multicast kept off, the oracle's
reference shared through a file, the token comparison, a CPU smoke of the serving runs (gloo, tiny,
2 processes a world: per-GPU output, per-rank window tokens, the TTFT split of a disaggregated world
against colocated serving, the oracle's speculation over the window), the NCCL probe over gloo,
the exactness report, and every command the device steps would run parsed and sized against the
machines' memory and the 10-minute call. Nothing here has run on a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dhisparse.bench import multi as M
from dhisparse.bench import multi_exact as X
from dhisparse.bench import multi_sizing as MS
from dhisparse.core.logits import TokenLogprob

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("multi_gpu", ROOT / "bench" / "multi_gpu.py")
mg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mg)
from bench import multi_serving as ms  # noqa: E402  (bench/multi_gpu.py's `serving`)

GIB = float(1 << 30)


@pytest.fixture()
def multicast_env(monkeypatch):
    for k in M.MULTICAST_OFF:
        monkeypatch.delenv(k, raising=False)
    yield
    for k in M.MULTICAST_OFF:  # monkeypatch restores what it deleted; these were set by the code under test
        os.environ.pop(k, None)


def test_layouts_parse_to_sglang_flags():
    assert M.parse_layout("1") == M.Layout("1", "one", 1)
    assert M.parse_layout("dpep4").flags() == "--tp-size 4 --dp-size 4 --ep-size 4 --enable-dp-attention"
    assert M.parse_layout("tp2").engine_fields() == {"tp_size": 2}
    pd = M.parse_layout("pd2+2ep2")
    assert (pd.gpus, pd.prefill, pd.decode, pd.ep, pd.decode_gpus) == (4, 2, 2, 2, 2)
    assert pd.flags() == ("--disaggregation-prefill-size 2 --disaggregation-decode-size 2 --ep-size 2 "
                          "--enable-dp-attention")
    assert M.parse_layout("pd1+1").engine_fields() == {"disaggregation_prefill_size": 1, "disaggregation_decode_size": 1}
    for bad in ("dp1", "ep2", "pd2+1ep2", "2"):
        with pytest.raises(ValueError):
            M.parse_layout(bad)


def test_multicast_is_set_off_and_another_value_is_refused(multicast_env, monkeypatch):
    assert M.multicast_off() == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(SystemExit, match="NCCL_NVLS_ENABLE=1"):
        M.multicast_off()


def test_a_file_reference_answers_once_written_and_nothing_before(tmp_path):
    """The world's reference file is dhisparse.bench.reference's, with the prompts' digests: the
    ranks' FileReference answers once it is written; another run's file is decoded again."""
    from dhisparse.bench.reference import FileReference, load_reference, reference_key, save_reference

    path = tmp_path / "ref.json"
    ref = FileReference(path)
    assert ref([1, 2, 3]) == []  # no file yet: no drafts
    key = reference_key("tiny", "float32", "auto", 3, 2, 2, "abc1234") | {"layout": "dpep2"}
    save_reference(path, key, {0: [7, 8], 1: [9]}, prompts=[[1, 2, 3], [1, 2, 4]])
    assert ref([1, 2, 3]) == [7, 8] and ref([1, 2, 4]) == [9] and ref([1, 2]) == []
    assert load_reference(path, key) == {0: [7, 8], 1: [9]} and M.holds_reference(path, key)
    assert not M.holds_reference(path, dict(key, layout="dp2"))  # another run's file is decoded again
    assert not M.holds_reference(tmp_path / "none.json", key)


def test_compare_tokens_gives_the_first_divergence_and_its_margin():
    def g(tokens, top=None):
        tops = [top or ((t, -0.1), (99, -0.3)) for t in tokens]
        return X.Greedy(tokens, [TokenLogprob(t, dict(tp)[t], tp) for t, tp in zip(tokens, tops)])

    assert X.compare_tokens([g([1, 2]), g([3])], [g([1, 2]), g([3])])["equal"]
    r = X.compare_tokens([g([1, 2, 5]), g([3])], [g([1, 99, 5]), g([3])])
    assert not r["equal"] and r["diverged"] == [{"request": 0, "position": 1, "reference_token": 2, "got_token": 99,
                                                 "margin": pytest.approx(0.2), "tie": False}]
    near = X.compare_tokens([g([4], ((4, -0.69310), (8, -0.69315)))], [g([8])])
    assert near["diverged"][0]["tie"] and near["diverged"][0]["margin"] == pytest.approx(5e-5)


def _serve(tmp_path, *args) -> dict:
    out = tmp_path / "multi.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "serving", "--quick", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_serving_smoke_one_gpu_dp_ep_and_disaggregated_against_colocated(tmp_path):
    """hisparse on one 'GPU', DP2+EP2, 1 prefill + 1 decode and DP2 (the colocated world of the same
    two), gloo: every world ran, per-GPU output and per-rank window tokens add up, the disaggregated
    world's TTFT splits into allocation wait and hand-off with its parts, and the comparisons name
    the one-GPU world and the colocated one."""
    data = _serve(tmp_path, "--presets", "hisparse", "--layouts", "1;dpep2;pd1+1;dp2")
    worlds = {w["layout"]["name"]: w for w in data["worlds"]}
    assert set(worlds) == {"1", "dpep2", "pd1+1", "dp2"} and not any("error" in w for w in worlds.values())
    assert {r["preset"] for r in data["runs"]} == {"hisparse@1", "hisparse@dpep2", "hisparse@pd1+1", "hisparse@dp2"}
    assert data["env"] == M.MULTICAST_OFF and data["commit"] and data["machine"]["cpu_count"]
    for name, w in worlds.items():
        pg = w["per_gpu"]
        assert pg["output_tok_s"] > 0 and pg["output_tok_s_per_gpu"] == pytest.approx(pg["output_tok_s"] / pg["gpus"])
        assert len(w["rank_window_tokens"]) == w["layout"]["gpus"]
        split = w["ttft_split"]["all"]
        assert split["n"] > 0 and split["allocation_s"] + split["handoff_s"] == pytest.approx(split["ttft_s"])
    assert all(t > 0 for t in worlds["dpep2"]["rank_window_tokens"] + worlds["dp2"]["rank_window_tokens"])
    prefill, decode = worlds["pd1+1"]["rank_window_tokens"]
    assert decode > 5 * prefill > 0  # the prefill rank samples first tokens only
    assert worlds["pd1+1"]["per_gpu"]["output_tok_s_per_decode_gpu"] == pytest.approx(worlds["pd1+1"]["per_gpu"]["output_tok_s"])
    parts = worlds["pd1+1"]["ttft_split"]
    assert parts["prefill_mean_s"] > 0 and parts["handoff_mean_s"] > 0 and parts["transfer_mean_s"] is not None
    pd_run = next(r for r in data["runs"] if r["preset"] == "hisparse@pd1+1")
    assert all(r.get("handoff") is not None for r in pd_run["requests"] if r["ttft"] is not None)
    cmp = {r["layout"]: r for r in data["comparison"]}
    assert "per_gpu_vs_one_gpu" in cmp["dpep2"] and cmp["pd1+1"]["colocated"] == "dp2"
    assert cmp["pd1+1"]["per_decode_gpu_vs_colocated_per_gpu"] > 0
    assert {m["layout"]: m["ep"] for m in data["memory"]} == {"1": 1, "dpep2": 2, "pd1+1": 1, "dp2": 1}
    from dhisparse.bench.tables import split_rows

    assert {r["preset"] for r in split_rows([data])} == {r["preset"] for r in data["runs"]}  # `dhisparse table` reads it


def test_an_oracle_world_decodes_its_reference_once_and_speculates_in_the_window(tmp_path):
    """adaptive+spec on DP2+EP2 with the oracle: the world decodes the distinct prompts' reference
    first (its ranks read it from the file), the window's rounds emit more than one token and
    follow the reference; a second run with the same --reference-dir reads the file, not decodes."""
    refs = tmp_path / "refs"
    first = _serve(tmp_path, "--presets", "adaptive+spec", "--layouts", "dpep2", "--reference-dir", str(refs))
    (w,) = first["worlds"]
    spec = w["window_spec"]
    assert spec["rounds"] > 0 and spec["tokens_per_round"] > 1.5 and spec["oracle_off_reference_share"] == 0.0
    assert all(n > 0 for n in spec["rounds_per_rank"])
    (ref,) = refs.iterdir()
    mtime = ref.stat().st_mtime_ns
    second = _serve(tmp_path, "--presets", "adaptive+spec", "--layouts", "dpep2", "--reference-dir", str(refs))
    assert ref.stat().st_mtime_ns == mtime and second["worlds"][0]["window_spec"]["tokens_per_round"] > 1.5


@pytest.mark.slow
def test_the_whole_quick_smoke(tmp_path):
    """`multi_gpu.py serving --quick`: hisparse and adaptive+spec on 1, DP2+EP2 and 1+1 (~35 s alone)."""
    data = _serve(tmp_path)
    assert len(data["worlds"]) == 6 and not any("error" in w for w in data["worlds"])


def test_the_nccl_probe_runs_over_gloo(tmp_path):
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "probe", "--device", "cpu", "--mib", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["ok"] and data["world"] == 2 and data["ranks"][0]["p2p_gbs"] > 0 and data["env"] == M.MULTICAST_OFF


def test_the_exactness_report_merges_records_and_junit(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"model": "tiny", "layout": "dp2", "equal": True, "diverged": []}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"model": "tiny", "layout": "tp2", "equal": False,
                                                  "diverged": [{"tie": True}]}) + "\n")
    for n, fails in (("a", 0), ("b", 1)):
        (tmp_path / f"{n}.xml").write_text(f'<testsuites><testsuite name="pytest" tests="1" failures="{fails}" errors="0" '
                                           f'skipped="0"><testcase name="t{n}"/></testsuite></testsuites>')
    ns = mg.parse(["exact-report", "--jsonl", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--junit",
                   str(tmp_path / "a.xml"), str(tmp_path / "b.xml"), "--junit-out", str(tmp_path / "all.xml"),
                   "--out", str(tmp_path / "exact.json")])
    assert ns.func(ns) == 1
    data = json.loads((tmp_path / "exact.json").read_text())
    assert data["summary"] == {"cases": 2, "equal": 1, "diverged": 1, "ties": 1,
                               "junit": {"tests": 2, "failures": 1, "errors": 0, "skipped": 0}}
    assert (tmp_path / "all.xml").read_text().count("<testcase") == 2


def test_dhisparse_bench_in_process_runs_the_world_its_flags_ask_for():
    """`dhisparse bench --dp-size 2` (in-process) builds a DP2 world for each run; it used to build
    one Engine on the shared model and report it under the world's flags."""
    from dhisparse.bench.sweep import ProgressBar, sweep_inprocess
    from dhisparse.bench.workload import Workload
    from dhisparse.engine.config import EngineConfig

    base = EngineConfig(model="tiny", device="cpu", dtype="float32", dp_size=2, dist_timeout_s=30.0,
                        kv_pool_bytes=8 << 20, host_pool_bytes=16 << 20)
    (run,) = sweep_inprocess(base, ["hisparse"], [2], Workload(input_len=64, output_len=8, duration_s=1.0), ProgressBar(False))
    assert run.engine["dp_size"] == 2 and run.metrics.output_tok_s > 0


# -- the device steps, read without a GPU ----------------------------------------------------------

def step_commands(tmp_path: Path, steps: str, gpus: int) -> list[dict]:
    """What bench/gpu_multi.sh would run for `steps` on a machine of `gpus` GPUs: each python3 call's
    arguments with its CUDA_VISIBLE_DEVICES and test environment, and the `timeout` around it,
    recorded by shell functions standing in for python3, timeout and nvidia-smi."""
    log = tmp_path / f"argv{gpus}.jsonl"
    # one write a call (the exact32 step's pytest processes start side by side): fields joined by \037
    rec = ('r=$(printf "%s\\037" "T=$T" "CVD=${CUDA_VISIBLE_DEVICES:-}" "SHARD=${DHISPARSE_PARALLEL_SHARD:-}" '
           '"LAYOUTS=${DHISPARSE_PARALLEL_LAYOUTS:-}" "$@"); printf "%s\\n" "$r" >> ' + shlex.quote(str(log)))
    stub = ('timeout() { while [ "${1#-}" != "$1" ]; do shift 2; done; T=$1; shift; "$@"; }; '
            f'python3() {{ {rec}; }}; nvidia-smi() {{ :; }}; export -f timeout python3 nvidia-smi; '
            f"bash bench/gpu_multi.sh {steps}")
    subprocess.run(["bash", "-c", stub], cwd=ROOT, check=True, capture_output=True, timeout=60,
                   env={**os.environ, "OUT": str(tmp_path / f"out{gpus}"), "GPUS": str(gpus), "T": ""})
    cmds = []
    for line in log.read_text().splitlines():
        if not line:
            continue
        t, cvd, shard, lays, *argv = line.rstrip("\037").split("\037")
        cmds.append({"timeout": float(t[2:]) if t[2:] else None, "gpus": cvd[4:], "shard": shard[6:],
                     "layouts": lays[8:], "argv": argv})
    return cmds


MACHINE_RAM_GIB = {2: 256, 4: 512, 8: 560}


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_scale32_runs_one_gpu_and_ep_on_every_gpu_and_fits(tmp_path, gpus):
    """scale32: glm5-faithful at 100K with FP8 rows; the one-GPU world and EP on every GPU (x4 / x8:
    the smaller EP worlds too, side by side on disjoint GPUs); weights + the pool fit an H200 with
    room for activations; each world's estimate is inside its timeout, the timeouts inside the call."""
    cmds = [c for c in step_commands(tmp_path, "scale32", gpus) if c["argv"][:2] == ["bench/multi_gpu.py", "serving"]]
    layouts = {}
    for c in cmds:
        ns = mg.parse(c["argv"][1:])
        (layout,) = ns.layout_list
        layouts[layout.name] = c["gpus"]
        assert (ns.model, ns.kv_cache_dtype, ns.input_len, ns.device) == ("glm5-faithful", "fp8_e4m3", 102400, "cuda")
        assert len(c["gpus"].split(",")) == layout.gpus or (not c["gpus"] and layout.gpus == gpus)
        sz = MS.rank_sizing(ns, MS.model_config(ns.model))
        assert sz["max_running_requests"] >= ns.per_gpu and ns.host_pool_gib
        (mem,) = MS.memory_rows(ns, sz)
        assert mem["device_gib_per_gpu_before_activations"] < 125, mem  # ~139 GiB usable, activations beside
        assert MS.estimate_s(ns, layout, ns.preset_list[0]) < ns.world_timeout < c["timeout"]
    want = {"1", f"dpep{gpus}"} | ({"dpep2"} if gpus >= 4 else set()) | ({"dpep4"} if gpus >= 8 else set())
    assert set(layouts) == want
    side = [set(layouts[n].split(",")) for n in layouts if n != f"dpep{gpus}"]
    assert sum(map(len, side)) == len(set().union(*side))  # side by side on disjoint GPUs
    assert 2 * max(c["timeout"] for c in cmds) < 560  # the side-by-side phase, then the whole machine


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_disagg32_runs_the_papers_layout_beside_colocated_and_fits(tmp_path, gpus):
    (c,) = [c for c in step_commands(tmp_path, "disagg32", gpus) if c["argv"][:2] == ["bench/multi_gpu.py", "serving"]]
    ns = mg.parse(c["argv"][1:])
    h = gpus // 2
    names = [l.name for l in ns.layout_list]
    assert names == (["pd1+1", "dp2"] if gpus == 2 else [f"pd{h}+{h}ep{h}", f"dpep{gpus}"])
    assert ns.concurrency == 16 * h and ns.input_len == 32768 and ns.model == "glm5-faithful"
    sz = MS.rank_sizing(ns, MS.model_config(ns.model))
    for row, layout in zip(MS.memory_rows(ns, sz), ns.layout_list):
        assert row["device_gib_per_gpu_before_activations"] < 125
        assert row["host_pool_gib_world"] < 0.6 * MACHINE_RAM_GIB[gpus], row
        if layout.kind == "pd":  # prefill ranks pin only what their in-flight prompts need
            assert row["host_pool_gib_per_prefill_rank"] < row["host_pool_gib_per_rank"] / 4, row
            assert ms.engine_kwargs(ns, sz, "adaptive", layout)["disaggregation_prefill_host_pool_bytes"] < \
                ms.engine_kwargs(ns, sz, "adaptive", layout)["host_pool_bytes"]
    assert sum(MS.estimate_s(ns, l, ns.preset_list[0]) for l in ns.layout_list) < c["timeout"] < 600
    assert 2 * ns.world_timeout <= c["timeout"]


@pytest.mark.parametrize("gpus", [2, 4])
def test_exact32_covers_every_case_once_on_gpu_pairs(tmp_path, gpus):
    cmds = [c for c in step_commands(tmp_path, "exact32", gpus) if c["argv"][:2] == ["-m", "pytest"]]
    pairs = [c for c in cmds if c["shard"]]
    assert len(pairs) == gpus // 2 * 2 and all(len(c["gpus"].split(",")) == 2 for c in pairs)
    assert all(int(g) < gpus for c in cmds for g in c["gpus"].split(","))
    assert sorted(c["shard"] for c in pairs) == [f"{k}/{len(pairs)}" for k in range(len(pairs))]
    assert all(c["layouts"] == "dp2,dpep2,tp2,pd1+1" for c in pairs)
    assert [c["layouts"] for c in cmds if not c["shard"]] == (["pd2+2ep2"] if gpus >= 4 else [])
    assert all("tests/test_parallel_cuda.py" in c["argv"] and c["timeout"] <= 480 for c in cmds)
