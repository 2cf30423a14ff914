"""bench/gpu_session.sh's issue-31 steps `round31` (where a costed verification round goes) and
`locality31` (glm5-faithful's locality at full geometry) parse (`gpu_session_stub.session_commands`)."""

from __future__ import annotations

from gpu_session_stub import session_commands


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


def test_locality31_measures_glm5_faithful_at_full_geometry(tmp_path):
    from bench import locality

    (cmd,) = [c for c in session_commands(tmp_path, "locality31") if c[0] == "bench/locality.py"]
    ns = locality.parse(cmd[1:])
    assert (ns.model, ns.layers, ns.device, ns.dtype, ns.overrides) == ("glm5-faithful", 78, "cuda", "bfloat16", None)
    assert ns.offsets == "3" and ns.gains.split(",")[0] == "8" and ns.out.startswith(str(tmp_path / "out"))
    assert ns.kv_pool_gib == 4  # 8K of bf16 rows over 78 layers (~0.8 GB) beside the hot cache

