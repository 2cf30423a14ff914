"""bench/gpu_session.sh's issue-31 steps `round31` (where a costed verification round goes), `round44` (the same on
an H100 under each FP8 activation setting),
`locality31` (glm5-faithful's locality at full geometry) and `diversity31` (whether its greedy output
depends on the context) parse (`gpu_session_stub.session_commands`); bench/faithful_diversity.py runs
on a small geometry."""

from __future__ import annotations

import torch
from gpu_session_stub import session_commands

from dhisparse.models.faithful import SMALL_OVERRIDES

SMALL = SMALL_OVERRIDES  # the small glm5-faithful geometry for faithful_diversity's CPU runs


def test_round31_profiles_the_costed_round_at_the_sweeps_point(tmp_path):
    from bench import step_profile

    cmds = session_commands(tmp_path, "round31")
    ckpt = next(c for c in cmds if c[0] == "bench/drafter_checkpoint.py")
    prof = next(c for c in cmds if c[0] == "bench/step_profile.py")
    path = ckpt[ckpt.index("--out") + 1]
    assert ckpt[ckpt.index("--shape") + 1] == "paper-glm5" and ckpt[ckpt.index("--kind") + 1] == "dflash2"
    ns = step_profile.parse(prof[1:])
    assert (ns.model, ns.input_len, ns.concurrency, ns.kv_cache_dtype, ns.drafter) == (
        "glm5-faithful", 102400, 20, "fp8_e4m3", "oracle")
    assert ns.presets.split(",") == ["hisparse", "adaptive+spec"] and ns.out.startswith(str(tmp_path / "out"))
    cfg = step_profile.engine_config(ns, "adaptive+spec", "step")
    assert (cfg.speculative_oracle_drafter, cfg.speculative_draft_model_path) == ("dflash2", path)
    assert cfg.speculative_num_draft_tokens == 4 and cfg.cuda_graphs == "step"


def test_round44_profiles_the_round_on_an_h100_under_each_activation_setting(tmp_path):
    """round44: round31's profile on glm5-faithful with 12 routed experts (fits an H100), once under the default
    FP8 activations (auto) and once under none, to two files; ROUND44_ACTS picks one a call."""
    from bench import step_profile

    profs = [c for c in session_commands(tmp_path, "round44") if c[0] == "bench/step_profile.py"]
    got = [step_profile.parse(c[1:]) for c in profs]
    assert [ns.overrides for ns in got] == [{"n_routed_experts": 12}] * 2 and len({ns.out for ns in got}) == 2
    assert [step_profile.engine_config(ns, "hisparse").fp8_activations for ns in got] == ["auto", "none"]
    assert all((ns.model, ns.input_len, ns.concurrency, ns.kv_pool_gib, ns.max_batched_tokens) ==
               ("glm5-faithful", 102400, 20, 9.5, 2048) for ns in got)
    (tmp_path / "b").mkdir()
    (one,) = [c for c in session_commands(tmp_path / "b", "round44", {"ROUND44_ACTS": "none"}) if c[0] == "bench/step_profile.py"]
    assert step_profile.engine_config(step_profile.parse(one[1:]), "hisparse").fp8_activations == "none"


def test_locality31_measures_glm5_faithful_at_full_geometry(tmp_path):
    from bench import locality

    from dhisparse.models.faithful import FAITHFUL_EMBED_OFFSET, FAITHFUL_INDEX_GAIN

    (cmd,) = [c for c in session_commands(tmp_path, "locality31") if c[0] == "bench/locality.py"]
    ns = locality.parse(cmd[1:])
    assert (ns.model, ns.layers, ns.device, ns.dtype, ns.overrides) == ("glm5-faithful", 78, "cuda", "bfloat16", None)
    assert float(ns.offsets) == FAITHFUL_EMBED_OFFSET and float(ns.gains) == FAITHFUL_INDEX_GAIN and ns.out.startswith(str(tmp_path / "out"))
    # the serving context (102,400 tokens of bf16 rows over 78 layers, ~11 GB) and the paper's hot cache B = 2k
    assert (ns.prompt_len, ns.kv_pool_gib, ns.hot) == (102400, 16, "2")
    # several gains: one process (and one output file) each, so no second full-size build shares a GPU
    (tmp_path / "b").mkdir()
    cmds = [c for c in session_commands(tmp_path / "b", "locality31", {"LOCALITY31_GAINS": "0,4"})
            if c[0] == "bench/locality.py"]
    got = [locality.parse(c[1:]) for c in cmds]
    assert [ns.gains for ns in got] == ["0", "4"] and len({ns.out for ns in got}) == 2



def test_diversity31_checks_each_faithful_model_at_full_geometry(tmp_path):
    from bench import faithful_diversity

    cmds = [c for c in session_commands(tmp_path, "diversity31", {"DIVERSITY31_MODELS": "glm5-faithful v41-faithful"})
            if c[0] == "bench/faithful_diversity.py"]
    got = [faithful_diversity.parse(c[1:]) for c in cmds]
    assert [ns.model for ns in got] == ["glm5-faithful", "v41-faithful"]
    assert all((ns.device, ns.layers, ns.overrides, ns.prompt_len) == ("cuda", None, None, 4096) for ns in got)


def test_faithful_diversity_reports_outputs_and_the_common_share(tmp_path):
    """A small glm5-faithful: every prompt's tokens recorded, the diversity summary and the common
    share (offset aside) in [0, 1) -- and near the session-37 build's ~0.03, not the ~0.4 of a build
    whose layers keep the offset."""
    import json

    from bench import faithful_diversity

    out = tmp_path / "d.json"
    faithful_diversity.main(["--layers", "8", "--dtype", "float32", "--prompt-len", "200", "--prompts", "3",
                             "--tokens", "6", "--kv-pool-gib", "0.25", "--overrides", json.dumps(SMALL), "--out", str(out),
                             "--margins"])
    doc = json.loads(out.read_text())
    assert sorted(doc["outputs"]) == ["0", "1", "2"] and all(len(v) == 6 for v in doc["outputs"].values())
    assert doc["step_graphs"] == {}  # no step graphs on the CPU; on CUDA their counters, capture failures included
    assert doc["diversity"]["n"] == 3 and 0 <= doc["common_share"] < 0.15
    assert sorted(doc["settled_at"]) == ["0", "1", "2"]
    q = doc["margins_by_quarter"]["0"]
    assert len(q) == 4 and all(0 <= p["min"] <= p["mean"] for p in q if p)


def test_memoized_fp8_dequantization_gives_the_same_tokens(tmp_path, monkeypatch):
    """faithful_diversity --memo-fp8 (CPU speed) keeps each FP8 weight's dequantized copy: the same
    greedy tokens as dequantizing every call, and the copies are used (fewer plain dequantizations)."""
    import json

    from bench import faithful_diversity
    from dhisparse.kernels import fp8_gemm_ref

    plain = fp8_gemm_ref.dequantize_block_fp8
    calls = []

    def counted(w8, scale):
        calls.append(1)
        return plain(w8, scale)

    monkeypatch.setattr(fp8_gemm_ref, "dequantize_block_fp8", counted)  # restored after the test
    args = ["--layers", "4", "--dtype", "float32", "--prompt-len", "120", "--prompts", "2", "--tokens", "5",
            "--kv-pool-gib", "0.25", "--overrides", json.dumps(SMALL)]
    faithful_diversity.main(args + ["--out", str(tmp_path / "plain.json")])
    n_plain, calls[:] = len(calls), []
    faithful_diversity.main(args + ["--memo-fp8", "--out", str(tmp_path / "memo.json")])
    got = [json.loads((tmp_path / f).read_text())["outputs"] for f in ("plain.json", "memo.json")]
    assert got[0] == got[1] and len(got[0]) == 2
    assert 0 < len(calls) < n_plain / 4


def test_settle31_runs_the_costed_sweeps_shape_for_each_head(tmp_path):
    from bench import faithful_diversity

    cmds = [c for c in session_commands(tmp_path, "settle31") if c[0] == "bench/faithful_diversity.py"]
    got = [faithful_diversity.parse(c[1:]) for c in cmds]
    assert [ns.head_vocab for ns in got] == ["full", "byte"] and len({ns.out for ns in got}) == 2
    assert all((ns.model, ns.device, ns.prompt_len, ns.tokens, ns.kv_cache_dtype, ns.margins, ns.overrides) ==
               ("glm5-faithful", "cuda", 102400, 1024, "fp8_e4m3", True, None) for ns in got)
    (tmp_path / "b").mkdir()
    o = '{"n_routed_experts": 12}'
    (ns,) = [faithful_diversity.parse(c[1:]) for c in session_commands(
        tmp_path / "b", "settle31", {"SETTLE31_HEADS": "full", "SETTLE31_OVERRIDES": o, "SETTLE31_FP": "0.5",
                                     "SETTLE31_PROMPTS": "2", "SETTLE31_POOL": "14"})
        if c[0] == "bench/faithful_diversity.py"]
    assert (ns.head_vocab, ns.overrides, ns.frequency_penalty, ns.prompts, ns.kv_pool_gib) == ("full", o, 0.5, 2, 14)


def test_where_an_output_settles_and_its_margins():
    from bench.faithful_diversity import quarters, settled_at

    assert settled_at([7, 8] + [5] * 40) == 2 and settled_at([5] * 40) == 0
    assert settled_at([1] + [5] * 31) is None and settled_at([1, 2, 3]) is None and settled_at([]) is None
    assert quarters([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) == [
        {"mean": 1.5, "min": 1.0}, {"mean": 3.5, "min": 3.0}, {"mean": 5.5, "min": 5.0}, {"mean": 7.5, "min": 7.0}]


def test_settle41_checks_v41_faithful_at_a_fig5_context(tmp_path):
    from bench import faithful_diversity

    (ns,) = [faithful_diversity.parse(c[1:]) for c in session_commands(tmp_path, "settle41")
             if c[0] == "bench/faithful_diversity.py"]
    assert (ns.model, ns.device, ns.prompt_len, ns.tokens, ns.kv_cache_dtype, ns.margins, ns.head_vocab) == (
        "v41-faithful", "cuda", 131072, 512, "fp8_e4m3", True, "full")
    (tmp_path / "b").mkdir()
    got = [faithful_diversity.parse(c[1:]) for c in session_commands(tmp_path / "b", "settle41",
                                                                      {"SETTLE41_HEADS": "full byte"})
           if c[0] == "bench/faithful_diversity.py"]
    assert [ns.head_vocab for ns in got] == ["full", "byte"] and len({ns.out for ns in got}) == 2


def test_the_state_hook_keeps_the_first_prompt_only_and_copies_nothing_in_a_capture(monkeypatch):
    """faithful_diversity's final-norm hook: rows up to `need`, then none; nothing while a CUDA graph
    is captured (a host copy there failed every decode capture on the H100, session 41)."""
    from bench.faithful_diversity import state_hook

    got: list = []
    hook = state_hook(got, 5)
    hook(None, (), torch.ones(3, 4))
    hook(None, (), torch.ones(1, 3, 4))
    hook(None, (), torch.ones(1, 4))  # 6 rows kept already: none more
    assert [t.shape for t in got] == [torch.Size([3, 4]), torch.Size([3, 4])]

    class Captured:  # a device tensor seen while a graph is captured
        is_cuda = True

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    got2: list = []
    state_hook(got2, 5)(None, (), Captured())
    assert got2 == []


def test_costedsweep48_is_costedsweep31_on_an_h100(tmp_path):
    """costedsweep48: the costed sweep on an H100 (12 routed experts, the H200's pool of three resident histories,
    prefill chunks of 2,048) at C18, one arm (2.88 tokens a round), to _e12 files; costedsweep31 keeps the H200's."""
    from bench import gpu_serving

    def serving(steps, sub):
        (tmp_path / sub).mkdir()
        (cmd,) = [c for c in session_commands(tmp_path / sub, steps) if c[0] == "bench/gpu_serving.py"]
        return gpu_serving.parse(cmd[1:])

    h100, h200 = serving("costedsweep48", "a"), serving("costedsweep31", "b")
    assert (h100.overrides, h100.resident_fit, h100.concurrency, h100.max_batched_tokens, h100.distinct_suffixes) == (
        {"n_routed_experts": 12}, 3, "18", 2048, 18)
    assert h100.arms == "speculative_oracle_tokens_per_round=2.88" and "_e12_" in h100.out
    assert h100.reference_file.endswith("oracle_reference_faithful_e12.json") and h100.replay_reference
    assert (h200.overrides, h200.resident_fit, h200.concurrency, h200.max_batched_tokens) == (None, 3, "20", 8192)
    assert h200.arms.count(";") == 1 and "_e12" not in h200.out + h200.reference_file
    for ns in (h100, h200):
        assert ns.model == "glm5-faithful" and ns.charge_spec_memory and ns.presets == "hisparse,adaptive+spec"


def test_lowload31_runs_resident_adaptive_and_hisparse_at_low_load_rotated(tmp_path):
    """lowload31: the three non-speculative presets side by side at C2 on glm5-faithful at 100K in the costed
    sweep's pool (3 resident histories), one repeat a call, the order rotated by LOWLOAD_ROTATE; on a card
    under 100 GiB (or none, as here) the 12-expert build."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("gpu_serving", pathlib.Path(__file__).parents[1] / "bench" / "gpu_serving.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    (cmd,) = [c for c in session_commands(tmp_path, "lowload31", {"LOWLOAD_ROTATE": "1"}) if c[0] == "bench/gpu_serving.py"]
    ns = gs.parse(cmd[1:])
    assert (ns.model, ns.overrides, ns.input_len, ns.kv_cache_dtype, ns.resident_fit) == (
        "glm5-faithful", {"n_routed_experts": 12}, 102400, "fp8_e4m3", 3)
    assert ns.concurrencies == [2] and ns.distinct_suffixes == 2 and "_e12_" in ns.out and "_r1_" in ns.out
    assert [p for _, p, _ in gs.schedule(ns)] == ["adaptive", "hisparse", "resident"]  # rotated by one


def test_budget31_sweeps_the_hot_cache_at_low_and_high_load(tmp_path):
    """budget31 (Fig. 9): hisparse and adaptive at C2 and C18 on glm5-faithful at 100K, one hot-cache budget a
    call (BUDGET31_B), the file named by it; the 12-expert build without a card of 100 GiB."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("gpu_serving", pathlib.Path(__file__).parents[1] / "bench" / "gpu_serving.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    (cmd,) = [c for c in session_commands(tmp_path, "budget31", {"BUDGET31_B": "8192"}) if c[0] == "bench/gpu_serving.py"]
    ns = gs.parse(cmd[1:])
    assert (ns.model, ns.overrides, ns.input_len, ns.hot_cache_rows) == ("glm5-faithful", {"n_routed_experts": 12}, 102400, 8192)
    assert ns.concurrencies == [2, 18] and ns.preset_list == ["hisparse", "adaptive"] and "_B8192_" in ns.out
    assert gs.engine_config(ns, gs.sizing(ns, gs.model_config(ns.model, ns.layers, ns.overrides)), "adaptive").hot_cache_rows == 8192


def test_widths31_runs_the_widths_and_the_online_policy_as_arms(tmp_path):
    """widths31 (Fig. 7): adaptive+spec with the costed oracle, charged for width 8, the arms WIDTHS31_ORDER names
    (policy and width; each arm's tokens a round comes from dhisparse.spec.oracle on the device), one load a call."""
    (cmd,) = [c for c in session_commands(tmp_path, "widths31", {"WIDTHS31_ORDER": "online:8 fixed:6", "WIDTHS31_C": "18"})
              if c[0] == "bench/gpu_serving.py"]
    arms = cmd[cmd.index("--arms") + 1].split(";")
    assert [a.split(",")[:2] for a in arms] == [["speculative_policy=online", "speculative_num_draft_tokens=8"],
                                                ["speculative_policy=fixed", "speculative_num_draft_tokens=6"]]
    assert cmd[cmd.index("--spec-width") + 1] == "8" and "--charge-spec-memory" in cmd and "--replay-reference" in cmd
    assert cmd[cmd.index("--concurrency") + 1] == "18" and cmd[cmd.index("--presets") + 1] == "adaptive+spec"


def test_loadstep31_runs_the_load_step_at_100k_rotated(tmp_path):
    """loadstep31 (Fig. 6 / Table A1): adaptive and hisparse through C2 -> C18 -> C2 on glm5-faithful at 100K in the
    costed sweep's pool, one repeat a call rotated by LOADSTEP31_ROTATE; the run's load is C_HIGH, its window the
    phases' total; the 12-expert build without a card of 100 GiB."""
    from bench import gpu_serving as gs

    (cmd,) = [c for c in session_commands(tmp_path, "loadstep31", {"LOADSTEP31_ROTATE": "1"}) if c[0] == "bench/gpu_serving.py"]
    ns = gs.parse(cmd[1:])
    assert (ns.model, ns.overrides, ns.input_len, ns.kv_cache_dtype, ns.resident_fit) == (
        "glm5-faithful", {"n_routed_experts": 12}, 102400, "fp8_e4m3", 3)
    assert [(p.concurrency, p.duration_s) for p in ns.phases.phases] == [(2, 30.0), (18, 60.0), (2, 60.0)]
    assert ns.concurrencies == [18] and ns.duration == 150.0 and ns.distinct_suffixes == 18
    assert [p for _, p, _ in gs.schedule(ns)] == ["hisparse", "adaptive"] and "_r1_" in ns.out and "_e12_" in ns.out


def test_fig4_31_runs_all_five_presets_at_one_load_costed_and_charged(tmp_path):
    """fig4_31 (Fig. 4 / Table 2): the five presets at one load a call (FIG4_C), the +spec ones with the costed
    DFlash2 oracle at 2.88 tokens a round and charged for their memory, every preset replaying the reference,
    rotated by FIG4_ROTATE; the reference named by the load (or carried as COSTED_REF)."""
    from bench import gpu_serving as gs

    env = {"FIG4_C": "30", "FIG4_ROTATE": "2"}
    (cmd,) = [c for c in session_commands(tmp_path, "fig4_31", env) if c[0] == "bench/gpu_serving.py"]
    ns = gs.parse(cmd[1:])
    assert (ns.model, ns.overrides, ns.input_len, ns.kv_cache_dtype, ns.resident_fit) == (
        "glm5-faithful", {"n_routed_experts": 12}, 102400, "fp8_e4m3", 3)
    assert ns.preset_list == ["resident", "hisparse", "adaptive", "resident+spec", "adaptive+spec"]
    assert ns.concurrencies == [30] and ns.distinct_suffixes == 30 and ns.charge_spec_memory and ns.replay_reference
    assert ns.spec_tokens_per_round == 2.88 and ns.spec_width == 4
    assert "speculative_oracle_drafter=dflash2" in ns.engine_arg
    assert [p for _, p, _ in gs.schedule(ns)][0] == "adaptive" and "_in102400_out1024_c30_r2_" in ns.out and "_e12_" in ns.out
    assert ns.reference_file.endswith("oracle_reference_faithful_e12_in102400_out1024_c30.json") and ns.kv_pool_gib is None
    (cmd,) = [c for c in session_commands(tmp_path / "b", "fig4_31", dict(env, COSTED_REF="/ref.json"))
              if c[0] == "bench/gpu_serving.py"]
    assert gs.parse(cmd[1:]).reference_file == "/ref.json"
    # Fig. 1: 32K in, 8K out, in the same pool's bytes, three presets
    fig1 = dict(FIG4_IN="32768", FIG4_OUT="8192", FIG4_POOL="15.6", FIG4_PRESETS="hisparse,adaptive+spec,resident+spec")
    (cmd,) = [c for c in session_commands(tmp_path / "c", "fig4_31", fig1) if c[0] == "bench/gpu_serving.py"]
    ns = gs.parse(cmd[1:])
    assert (ns.input_len, ns.output_len, ns.kv_pool_gib) == (32768, 8192, 15.6) and "_in32768_out8192_c9_r0_" in ns.out
    assert ns.preset_list == ["hisparse", "adaptive+spec", "resident+spec"]


def test_fig10_31_profiles_adaptive_at_each_budget(tmp_path):
    """fig10_31 (Fig. 10): adaptive's decode step at C18 on glm5-faithful at 100K in the costed sweep's pool, one
    step_profile process a budget of FIG10_B, each file named by its budget."""
    from bench import step_profile

    cmds = [c for c in session_commands(tmp_path, "fig10_31", {"FIG10_B": "2048 8192"}) if c[0] == "bench/step_profile.py"]
    nss = [step_profile.parse(c[1:]) for c in cmds]
    assert [ns.hot_cache_rows for ns in nss] == [2048, 8192] and ["_B2048_" in nss[0].out, "_B8192_" in nss[1].out] == [True, True]
    for ns in nss:
        assert (ns.model, ns.overrides, ns.input_len, ns.concurrency, ns.kv_pool_gib, ns.kv_cache_dtype) == (
            "glm5-faithful", {"n_routed_experts": 12}, 102400, 18, 15.6, "fp8_e4m3")
        assert ns.presets == "adaptive" and ns.cuda_graphs == "step"
