"""Engine flags shared by every command, named like SGLang's where an equivalent exists.
Each flag maps onto one field of the frozen EngineConfig."""

from __future__ import annotations

import argparse

from dhisparse.engine.config import PRESETS, EngineConfig

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only for real defaults (engine flags default to None = "the engine's")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


# flag -> (EngineConfig field, type, help)
ENGINE_FLAGS: dict[str, tuple[str, type, str]] = {
    "--model-path": ("model", str, "'tiny' (built-in GLM-5-architecture model, random weights) or a Hugging Face checkpoint folder"),
    "--preset": ("preset", str, f"KV policy: {', '.join(PRESETS)}"),
    "--device": ("device", str, "auto (cuda if available), cpu, cuda or cuda:N"),
    "--dtype": ("dtype", str, "float32, bfloat16 or float16 (default: the checkpoint's)"),
    "--page-size": ("page_size", int, "token positions per KV page"),
    "--kv-pool-bytes": ("kv_pool_bytes", int, "KV pool capacity in bytes (default: --kv-pool-fraction of free GPU memory; 256 MiB on CPU)"),
    "--kv-pool-fraction": ("kv_pool_fraction", float, "share of free GPU memory for the KV pool when --kv-pool-bytes is unset"),
    "--max-running-requests": ("max_running_requests", int, "requests decoding or prefilling at once"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "token budget of one engine step (chunked prefill)"),
    "--max-model-len": ("max_model_len", int, "limit on prompt + output tokens (default: the model's)"),
    "--hot-cache-rows": ("hot_cache_rows", int, "hot-cache rows B per request and KV source in hierarchical presets (default 2 x index_topk)"),
    "--host-pool-bytes": ("host_pool_bytes", int, "host backing capacity in bytes (default 4 x the KV pool)"),
    "--admission-reserve-pages": ("admission_reserve_pages", int, "adaptive: pages kept free for admissions (M_res); optional history never uses them"),
    "--reclaim-order": ("reclaim_order", str, "adaptive: who loses optional history first: remaining (fewest tokens left), largest, newest"),
    "--repopulate-pages": ("repopulate_pages", int, "adaptive: optional pages refilled from host per step at most"),
    "--backup-ahead-pages": ("backup_ahead_pages", int,
                             "adaptive: host backups of optional pages started per step under memory pressure"),
    "--cuda-graphs": ("cuda_graphs", str, "auto (default), none, ffn, layer or step: piecewise CUDA graphs per token bucket of each layer's FFN block (ffn), and also its pre-attention piece and sparse attention (layer); step = layer plus one graph of the whole forward per request bucket for decode / verification passes; auto = step on CUDA where the model supports it"),
    "--copy-stream": ("copy_stream", str, "adaptive on CUDA: page copies on a 'side' stream (events) or the 'compute' stream"),
    "--load-stream": ("load_stream", str, "CUDA: admission copies (prefix import, hisparse hand-off) on 'side' streams or the 'compute' stream"),
    "--speculative-algorithm": ("speculative_algorithm", str, "speculative decoding: dflash, dspark, ngram or oracle (benchmark tool); works with any preset"),
    "--speculative-num-draft-tokens": ("speculative_num_draft_tokens", int, "K_max: target queries per request and round, anchor included"),
    "--speculative-draft-window-size": ("speculative_draft_window_size", int, "W: positions the drafter's KV ring keeps"),
    "--speculative-draft-model-path": ("speculative_draft_model_path", str, "DFlash drafter checkpoint folder (default: seeded random weights)"),
    "--speculative-policy": ("speculative_policy", str, "verification width policy: fixed, static (by load) or online"),
    "--speculative-oracle-tokens-per-round": ("speculative_oracle_tokens_per_round", float, "oracle drafter calibration, e.g. 2.88"),
    "--resolver": ("resolver", str, "resolver implementation: auto, torch or triton"),
    "--kernel-backend": ("kernel_backend", str, "attention / indexer kernels: auto (Triton on CUDA), torch or triton"),
    "--mla-split-rows": ("mla_split_rows", int, "sparse-MLA locations per program (flash-decoding split; 0 = off)"),
    "--admission-lookahead": ("admission_lookahead", int, "waiting requests admitted past one that does not fit yet (0 = strict FCFS)"),
    "--admission-age-bound": ("admission_age_bound_s", float, "seconds after which a waiting request that does not fit blocks skip-ahead"),
    "--cpu-threads": ("cpu_threads", int, "torch intra-op threads on CPU (default 1)"),
    "--seed": ("seed", int, "seed of the built-in model's random weights and default sampling seed"),
}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    for flag, (field, typ, help_) in ENGINE_FLAGS.items():
        names = [flag, "--model"] if field == "model" else [flag]
        g.add_argument(*names, dest=field, type=typ, default=None, help=help_)
    g.add_argument("--debug-checks", dest="debug_checks", action="store_true", default=None, help="check KV pool integrity after every step")
    g.add_argument("--step-graph-warmup", dest="step_graph_warmup", action="store_true", default=None,
                   help="capture every decode / verification step graph at start (default: on first use)")


def engine_config(ns: argparse.Namespace, **overrides: object) -> EngineConfig:
    kw = {f: getattr(ns, f) for f, _, _ in ENGINE_FLAGS.values() if getattr(ns, f, None) is not None}
    if getattr(ns, "debug_checks", None):
        kw["debug_checks"] = True
    if getattr(ns, "step_graph_warmup", None):
        kw["step_graph_warmup"] = True
    kw.update(overrides)
    return EngineConfig.from_kwargs(**kw)
