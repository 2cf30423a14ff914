"""Serving experiment on one GPU: hisparse / adaptive / adaptive+spec (oracle) / resident side by side.

    python3 bench/gpu_serving.py --out bench/results/gpu_serving_h200.json           # H200
    python3 bench/gpu_serving.py --quick --out /tmp/smoke.json                       # CPU smoke, < 60 s
    python3 bench/gpu_serving.py --quick --model v41-faithful --out /tmp/smoke4.json # DeepSeek-V4 CPU smoke, < 2 min
    python3 bench/gpu_serving.py --kv-cache-dtype fp8_e4m3 --out $OUT/gpu_serving_fp8.json  # FP8 rows (656 B)

Sizing (printed, and written under config.sizing; dhisparse.bench.sizing): the KV pool holds
`--resident-fit` full histories under `resident` (the stores' own page formulas for the
`--kv-cache-dtype` row format every preset's engine is given: GLM's arena pages, DeepSeek-V4's
resident pages and its row hierarchy's pages) plus the pages the engine holds for its life (GLM: the
whole-step graphs' scratch page);
max_running_requests = min(admit_factor x resident_fit, the hierarchy's steady-state device slots,
the host pool's histories: the prefix's complete pages once, which every request borrows, plus each
request's own pages). Every preset runs with the same pool and slot settings, unless
`--charge-spec-memory`: then the +spec presets pay for speculation out of that same memory (the
drafter's weights and ring come out of the pool's bytes, each slot also holds its staging share;
`spec_charge`), so they get fewer slots, as the paper's 140 against 208. Prompts are the
prepared prefix + one of `--distinct-suffixes` short suffixes (cycled), so the oracle drafter's
reference (a short non-speculative greedy run of those prompts) covers every request. The oracle is
calibrated to --spec-tokens-per-round at width --spec-width (a MEASUREMENT TOOL: label it oracle).
The closed loop itself is dhisparse.bench.inproc.InProcessLoop (only `_prompt` is overridden).
`--model v41-faithful --layers N --overrides JSON` builds a smaller geometry through v41-faithful's
own builder (`--quick --model v41-faithful`: QUICK_V4's, on CPU). `--load-step C_LOW,C_HIGH` runs Fig. 6's load
step (C_LOW -> C_HIGH -> C_LOW) in place of constant loads, with the same model, pools and charging; its file is
a loadstep result (`dhisparse plot`: loadstep.png; `dhisparse table`: Table A1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dhisparse.bench import results as R  # noqa: E402
from dhisparse.bench.inproc import InProcessLoop  # noqa: E402
from dhisparse.bench.loadstep import phase_summary, step_phases  # noqa: E402
from dhisparse.bench.workload import Phases, Workload, prefix_ids, suffix_text  # noqa: E402
from dhisparse.engine.config import EngineConfig  # noqa: E402
from dhisparse.engine.memory import release_memory  # noqa: E402
from dhisparse.layers.fp8_linear import fp8_activations_for  # noqa: E402
from dhisparse.core.params import SamplingParams  # noqa: E402
from dhisparse.core.kvformat import KV_CACHE_DTYPES  # noqa: E402
from dhisparse.core.v4_config import CSA, HCA, V4Config  # noqa: E402
from dhisparse.bench.sizing import (GIB, charge, describe, kv_formats, mem_available, model_config,  # noqa: E402,F401
                                    model_dtype, resident_bytes, resident_fit_for, sizing)

BUDGET_S = 9 * 60
METRICS = ("output_tok_s", "central_output_tok_s", "ttft_mean_ms", "ttft_p99_ms", "post_wave_ttft_mean_ms", "queue_mean_ms",
           "tpot_mean_ms", "tpot_p99_ms", "active", "slots", "requests_completed")
QUICK = dict(model="tiny", device="cpu", dtype="float32", input_len=192, output_len=12, concurrency="2", duration=1.5,
             resident_fit=2, page_size=16, distinct_suffixes=4, max_batched_tokens=512)
# --quick --model v41-faithful: tests/test_v41_faithful.py's small geometry (8 layers: one CSA source with Full,
# Reuse and Reindex layers, 3 HCA layers; the 512-wide K = V head and 128-wide index keys kept; k 8, so B = 16 rows a
# source and the hierarchy fetches from host)
QUICK_V4 = dict(layers=8, overrides=dict(hidden_size=256, num_attention_heads=4, q_lora_rank=128, o_groups=2,
                                         o_lora_rank=64, index_n_heads=8, index_topk=8, n_routed_experts=6,
                                         num_experts_per_tok=2, moe_intermediate_size=128, vocab_size=512,
                                         sliding_window=8, compress_rates={CSA: 4, HCA: 16}))
V4_PREFILL_TOK_S = 5000  # estimate_s's guess for DeepSeek-V4 prefill tokens a second on the H200 (unmeasured)
V4_BUILD_S = 60  # estimate_s's guess for building v41-faithful layer by layer on the device (unmeasured)


class CyclingLoop(InProcessLoop):
    """The harness's closed loop with prompts cycling over `distinct` suffixes."""

    distinct = 8

    def _prompt(self, index: int) -> list[int]:
        return self.prefix + self.engine.tokenizer.encode(suffix_text(index % self.distinct))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="glm52-scaled-k512"); a("--device", default="cuda"); a("--dtype", default="bfloat16")
    geometry_args(a)
    a("--input-len", type=int, default=8192); a("--output-len", type=int, default=256)
    a("--concurrency", default="4,12,36"); a("--duration", type=float, default=15.0, help="seconds per run")
    a("--presets", default="hisparse,adaptive,adaptive+spec,resident")
    a("--resident-fit", type=int, default=12, help="full histories the KV pool holds under resident")
    a("--kv-pool-gib", type=float, default=None, help="a KV pool of this size instead: --resident-fit becomes the full "
      "histories it holds under resident (a context sweep at one device budget)")
    a("--admit-factor", type=float, default=10.0, help="max_running_requests target = factor x resident-fit")
    a("--page-size", type=int, default=64); a("--hot-cache-rows", type=int, default=None, help="B (default 2k)")
    a("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
      help="stored KV row format of every preset (fp8_e4m3: 656-B latent rows at GLM-5's shape); the pools are sized from it")
    a("--host-pool-gib", type=float, default=None, help="host pool (default: what the slots need, <= 80%% of MemAvailable)")
    a("--max-batched-tokens", type=int, default=8192)
    a("--spec-tokens-per-round", type=float, default=2.88); a("--spec-width", type=int, default=4)
    a("--drafter", default="oracle", choices=("oracle", "ngram", "dflash", "dflash2", "dspark", "mtp"),
      help="drafter of the +spec presets: the calibrated oracle (a measurement tool) or a real one")
    a("--distinct-suffixes", type=int, default=32, help="prompts cycle over this many suffixes (oracle reference size)")
    a("--reference-file", default=None, metavar="PATH",
      help="the oracle's reference outputs: read from PATH when it was made for this model, workload, row format and "
           "commit, else decoded and written there (saves the reference decode in later calls; dhisparse.bench.reference)")
    a("--max-reference-repeat", type=float, default=0.25, metavar="SHARE",
      help="refuse an oracle reference in which more than SHARE of the tokens repeat the one d <= 16 before, at each "
           "output's worst d (one token repeated, or a short cycle: a degenerate model's output; byte text is under "
           "0.2; dhisparse.bench.reference.check_diversity); 1.0 accepts any")
    a("--replay-reference", action="store_true",
      help="MEASUREMENT TOOL (dhisparse/engine/replay.py): every preset's requests emit the reference's tokens (decoded "
           "as for the oracle) in place of their own, the model running on them, so every preset decodes the same "
           "histories and the oracle's acceptance is the one set (a model whose greedy margins are last-bit small leaves "
           "its reference in other batches: session 42); the target's own agreement is counted (replay_agreement)")
    a("--out", default="bench/results/gpu_serving.json")
    a("--cuda-graphs", default="auto", help="auto, none, ffn, layer (piecewise CUDA graphs) or step (layer + whole-step graphs)")
    a("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
      help="any other EngineConfig setting for every preset, e.g. backup_ahead_pages=128 (repeatable)")
    a("--arms", default="", metavar="A;B;...",
      help="engine settings compared in one process, e.g. 'staging_mode=paper;staging_mode=single' (each arm a "
           "comma-separated NAME=VALUE list on top of --engine-arg); every preset runs once per arm, labelled preset@arm")
    a("--arm-presets", default="", metavar="P,Q",
      help="with --arms: only these presets run once per arm; the others run once a repeat with no arm (a shared "
           "baseline: e.g. hisparse once beside adaptive+spec at three oracle rates), and each arm's ratio is taken "
           "against that baseline")
    a("--repeats", type=int, default=1, help="windows per (preset, arm, load); repeat r rotates the arm order by r")
    a("--rotate", type=int, default=0, metavar="R",
      help="start the rotation at repeat R: separate calls of one repeat each pass 0, 1, 2, ... so that the "
           "preset order rotates across calls as it does across repeats of one call")
    a("--graph-max-bs-per-load", action="store_true",
      help="each run's cuda_graph_max_bs is its load C (its C clients never hold more requests): with "
           "step_graph_warmup=true an engine captures only the graphs that load replays, not every bucket up to its slots")
    a("--load-step", default=None, metavar="C_LOW,C_HIGH",
      help="Fig. 6's load step instead of constant loads: each (preset, arm) runs once through C_LOW -> C_HIGH -> C_LOW "
           "clients (phases of --load-step-s seconds; --concurrency and --duration are then ignored), in-flight "
           "requests draining when the load falls; the file is a loadstep result (per-phase statistics, Table A1; "
           "`dhisparse plot` draws loadstep.png)")
    a("--load-step-s", default="30,60,60", metavar="LOW,HIGH,AFTER", help="the load step's phase lengths in seconds")
    a("--stagger", action="store_true", help="staggered starts (Workload.stagger): client k's first request is capped "
      "at output_len * (k + 1) / C tokens, so a window sees completions and re-admissions from its start")
    a("--prewarm", action="store_true",
      help="before the first window build and drop one engine per (preset, arm) with graphs for one request: the "
           "process's first engine of a verification width compiles its shapes (s22: 2-8 s a graph), so no measured run pays that")
    a("--charge-spec-memory", action="store_true",
      help="+spec presets pay for speculation out of the same device memory (issue 31): the drafter's weights and "
           "ring come out of the KV pool's bytes and each slot also holds its staging share, so they get fewer slots")
    a("--quick", action="store_true", help="CPU smoke test with the tiny model (< 60 s); with --model v41-faithful "
      "its small geometry (QUICK_V4, < 2 min)")
    a("--force", action="store_true", help="run even if the estimate exceeds 9 minutes")
    ns = p.parse_args(argv)
    if ns.quick:
        v4 = ns.model == "v41-faithful"
        for k, v in (QUICK | (dict(QUICK_V4, model=ns.model) if v4 else {})).items():
            if not (v4 and k in QUICK_V4 and getattr(ns, k) is not None):  # an explicit --layers / --overrides wins
                setattr(ns, k, v)
    check_geometry(p, ns)
    ns.argv = ["bench/gpu_serving.py"] + list(sys.argv[1:] if argv is None else argv)
    ns.concurrencies = [int(c) for c in ns.concurrency.split(",") if c.strip()]
    ns.phases = load_step_phases(p, ns)
    ns.preset_list = [s.strip() for s in ns.presets.split(",") if s.strip()]
    ns.arm_list = [a.strip() for a in ns.arms.split(";") if a.strip()] or [""]
    ns.armed = [x.strip() for x in ns.arm_presets.split(",") if x.strip()]
    if ns.armed and (not ns.arms or set(ns.armed) - set(ns.preset_list)):
        p.error(f"--arm-presets {ns.arm_presets!r} needs --arms and names only presets of --presets ({ns.presets})")
    if ns.repeats < 1:
        p.error(f"--repeats must be >= 1, got {ns.repeats}")
    for arm in ns.arm_list:
        engine_overrides(arm_pairs(arm))  # a bad arm fails here, before the model is built
    return ns


def load_step_phases(p: argparse.ArgumentParser, ns: argparse.Namespace) -> "Phases | None":
    """--load-step / --load-step-s -> the step's Phases (None without --load-step); the run's load is then C_HIGH
    (ns.concurrencies) and its window the phases' total (ns.duration). Bad values fail through `p.error`."""
    if not ns.load_step:
        return None
    try:
        c_low, c_high = (int(x) for x in ns.load_step.split(","))
        low, high, after = (float(x) for x in ns.load_step_s.split(","))
    except ValueError:
        p.error(f"--load-step {ns.load_step!r} / --load-step-s {ns.load_step_s!r}: expected C_LOW,C_HIGH and LOW,HIGH,AFTER")
    if not (1 <= c_low <= c_high) or min(low, high, after) <= 0:
        p.error(f"--load-step {ns.load_step!r}: needs 1 <= C_LOW <= C_HIGH; --load-step-s {ns.load_step_s!r}: positive")
    phases = step_phases(c_low, c_high, low, high, after)
    ns.concurrencies, ns.duration = [c_high], phases.total_s
    return phases


def geometry_args(a) -> None:
    """--layers / --overrides: a faithful model's geometry (bench/step_profile.py takes them too)."""
    a("--layers", type=int, default=None, help="faithful models only: truncate the layer plan (a small geometry)")
    a("--overrides", default=None, help="faithful models only: config keys as JSON (v41-faithful's small geometry; "
      "glm5-faithful: e.g. '{\"n_routed_experts\": 12}' to fit an H100)")


def check_geometry(p: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """ns.overrides parsed from JSON; --layers / --overrides on a model they do not apply to (or a bad key)
    fail through `p.error`, naming them (`sizing.model_config` decides)."""
    try:
        ns.overrides = json.loads(ns.overrides) if isinstance(ns.overrides, str) else ns.overrides
        model_config(ns.model, ns.layers, ns.overrides)
    except (ValueError, KeyError) as e:
        p.error(f"--model {ns.model} --layers {ns.layers} --overrides {ns.overrides}: {e}")


def arm_pairs(arm: str) -> list[str]:
    """'a=1,b=2' -> ['a=1', 'b=2'] (the empty arm: no settings)."""
    return [x.strip() for x in arm.split(",") if x.strip()]


def schedule(ns) -> list[tuple[int, str, str]]:
    """(C, preset, arm) in run order: per load, `--repeats` rounds of every arm x preset; round r
    starts at arm r mod len(arms) and, within each arm, at preset r mod len(presets), so no arm and
    no preset always runs first on a warm machine (issue 31 item 4: preset order rotated).
    With --arm-presets a round is the presets not armed (arm "") and every armed (preset, arm), that
    list rotated by r."""
    n, m = len(ns.arm_list), len(ns.preset_list)
    if ns.armed:
        items = [(p, "") for p in ns.preset_list if p not in ns.armed]
        items += [(p, a) for a in ns.arm_list for p in ns.preset_list if p in ns.armed]
        k = len(items)
        return [(c, *items[(r + i) % k]) for c in ns.concurrencies
                for r in range(ns.rotate, ns.rotate + ns.repeats) for i in range(k)]
    return [(c, ns.preset_list[(r + j) % m], ns.arm_list[(r + i) % n]) for c in ns.concurrencies
            for r in range(ns.rotate, ns.rotate + ns.repeats) for i in range(n) for j in range(m)]


def label(preset: str, arm: str) -> str:
    return f"{preset}@{arm}" if arm else preset


def spec_charge(ns, sz: dict, cfg, loaded, reference) -> dict:
    """The +spec presets' pool and slots when speculation is charged for its memory
    (`--charge-spec-memory`; the arithmetic: dhisparse.bench.sizing.charge). The drafter is built
    as the engine builds it, for its weights and one slot's ring; the staging share is a meta-device
    hierarchy's (memreport.staging_bytes_per_slot)."""
    from dhisparse.bench.memreport import staging_bytes_per_slot
    from dhisparse.spec.factory import build_drafter

    config = engine_config(ns, sz, "adaptive+spec")
    drafter = build_drafter(config.spec_config(), loaded.model, reference=reference or {}, max_requests=1)
    weights, ring = drafter.device_bytes().weights, drafter.state_bytes_per_request()
    del drafter
    release_memory()
    stage = staging_bytes_per_slot(cfg, ns.page_size, sz["hot_cache_rows"], model_dtype(ns), ns.spec_width,
                                   kv_formats(ns, cfg), config.staging_mode)
    return charge(sz, weights, ring, stage)


def bench_sizing(ns, cfg) -> dict:
    """`sizing`, with --resident-fit set first from --kv-pool-gib where given (`resident_fit_for`)."""
    if ns.kv_pool_gib:
        ns.resident_fit = resident_fit_for(ns, cfg, int(ns.kv_pool_gib * GIB))
    return sizing(ns, cfg)


def uses_oracle(ns) -> bool:
    """Whether a +spec preset runs with the oracle drafter, or every preset replays (both need the
    recorded reference)."""
    return ns.replay_reference or (ns.drafter == "oracle" and any(p.endswith("+spec") for p in ns.preset_list))


def estimate_s(ns, sz: dict) -> float:
    """Rough wall time: model build, reference run, and per run: engine (host pool pinning), prefix
    hand-off, warm-up imports (one per client at ~20 GB/s) and the timed window; DeepSeek-V4 adds
    its model build and the prefix's prefill at guessed rates (V4_BUILD_S, V4_PREFILL_TOK_S)."""
    if ns.quick:
        return 10 + len(schedule(ns)) * (ns.duration + 3)
    v4_s = V4_BUILD_S + ns.input_len / V4_PREFILL_TOK_S if sz.get("model_family") == "deepseek_v4" else 0
    import_s = resident_bytes(sz) / 20e9
    engine_s = sz["host_pool_bytes"] / 4e9 + 4 + ns.input_len / 20000
    runs = sum(engine_s + ns.duration + c * import_s for c, _, _ in schedule(ns))
    ref_s = engine_s + ns.distinct_suffixes * import_s + ns.output_len * 0.06 if uses_oracle(ns) else 0
    return 30 + v4_s + ref_s + runs


def engine_overrides(pairs: list[str]) -> dict:
    """--engine-arg NAME=VALUE pairs -> EngineConfig keyword values, typed from the field's default
    (int, float, bool or str; a None default: an int or float when VALUE reads as one; 'none' -> None, except
    for a field whose default is a string, where 'none' may be a value: fp8_activations=none)."""
    from dataclasses import fields

    defaults = {f.name: f.default for f in fields(EngineConfig)}
    out = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or name not in defaults:
            raise SystemExit(f"--engine-arg {pair!r}: expected NAME=VALUE with NAME one of {sorted(defaults)}")
        d = defaults[name]
        if raw.lower() == "none" and not isinstance(d, str):
            out[name] = None
        elif isinstance(d, bool):
            out[name] = raw.lower() in ("1", "true", "yes", "on")
        elif isinstance(d, (int, float)):
            out[name] = type(d)(raw)
        else:
            out[name] = _number(raw) if d is None else raw
    return out


def _number(raw: str):
    """raw as an int, else a float, else the string itself."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def model_key(ns) -> str:
    """The model's name, with --layers / --overrides when a smaller geometry is built."""
    if ns.layers is None and not ns.overrides:
        return ns.model
    return f"{ns.model} layers={ns.layers} overrides={json.dumps(ns.overrides, sort_keys=True)}"


def load_model(ns):
    """The model every engine shares: a built-in by name, or a faithful model's builder at --layers /
    --overrides (with the byte tokenizer, as the registry gives it). ns: model, device, dtype, layers, overrides."""
    if ns.layers is None and not ns.overrides:
        from dhisparse.bench.sweep import load_shared_model

        return load_shared_model(EngineConfig(model=ns.model, device=ns.device, dtype=ns.dtype))
    from dhisparse.models.faithful import build_faithful
    from dhisparse.models.tokenizer import ByteTokenizer
    from dhisparse.models.v4_faithful import build_v41_faithful

    if ns.model == "v41-faithful":
        loaded = build_v41_faithful(EngineConfig.seed, model_dtype(ns), ns.device, ns.layers, ns.overrides)
    else:  # glm5-faithful (sizing.model_config refused the others at parse time)
        loaded = build_faithful(ns.model, EngineConfig.seed, model_dtype(ns), ns.device, ns.layers, ns.overrides)
    return dataclasses.replace(loaded, tokenizer=ByteTokenizer())


def engine_config(ns, sz: dict, preset: str, arm: str = "") -> EngineConfig:
    spec = preset.endswith("+spec")
    charged = sz.get("spec_charged") if spec else None  # --charge-spec-memory: the +spec presets' own pool and slots
    pool, slots = (charged["kv_pool_bytes"], charged["max_running_requests"]) if charged else \
        (sz["kv_pool_bytes"], sz["max_running_requests"])
    base = dict(model=ns.model, preset=preset, device=ns.device, dtype=ns.dtype, page_size=ns.page_size,
                        kv_pool_bytes=pool, max_running_requests=slots,
                        max_num_batched_tokens=ns.max_batched_tokens, hot_cache_rows=ns.hot_cache_rows,
                        host_pool_bytes=sz["host_pool_bytes"], max_model_len=sz["tokens_per_request"] + 8,
                        speculative_algorithm=ns.drafter if spec else None, speculative_num_draft_tokens=ns.spec_width,
                        speculative_oracle_tokens_per_round=ns.spec_tokens_per_round if spec and ns.drafter == "oracle" else None,
                        cuda_graphs=ns.cuda_graphs, kv_cache_dtype=ns.kv_cache_dtype, replay_reference=ns.replay_reference)
    return EngineConfig(**(base | engine_overrides(ns.engine_arg) | engine_overrides(arm_pairs(arm))))


def fresh_engine(cfg: EngineConfig, loaded, prefixes, reference=None):
    from dhisparse.engine.engine import Engine

    engine = Engine(cfg, loaded=loaded, oracle_reference=reference)
    if prefixes is not None:
        engine.prefixes = prefix_store(prefixes, cfg.preset)  # prefilled once, then imported by every engine
    return engine


def new_prefixes(ns, cfg):
    """The prepared prefixes the engines share: one PrefixStore, or for DeepSeek-V4 one for `resident`
    and one for the hierarchy (a V4 prefix is the exporting store's whole state, its CSA rows tiered or
    not: kv/v4/prefix.py; a resident V4 store cannot import a hierarchical one, nor the reverse)."""
    from dhisparse.kv.memory.prefix_store import PrefixStore

    pin = ns.device.startswith("cuda")
    if isinstance(cfg, V4Config):
        return {"resident": PrefixStore(pin=pin), "hierarchy": PrefixStore(pin=pin)}
    return PrefixStore(pin=pin)


def prefix_store(prefixes, preset: str):
    """The PrefixStore an engine of `preset` imports from (`new_prefixes`)."""
    if isinstance(prefixes, dict):
        return prefixes["resident" if preset.partition("+")[0] == "resident" else "hierarchy"]
    return prefixes


def oracle_reference(ns, sz, loaded, prefixes) -> dict:
    """Greedy non-speculative outputs of every distinct prompt (prompt ids -> output ids): those of
    `--reference-file` when it holds this run's (dhisparse.bench.reference), else decoded here and
    written there. How varied they are (`output_diversity`) is printed and kept in sz (the JSON's sizing)."""
    from dhisparse.bench.reference import (check_diversity, load_reference, output_diversity, prompts_digest,
                                           reference_key, save_reference)

    tok = loaded.tokenizer
    prefix = prefix_ids(tok, ns.input_len, loaded.config.vocab_size)
    prompts = [tuple(prefix + tok.encode(suffix_text(i))) for i in range(ns.distinct_suffixes)]
    key = reference_key(model_key(ns), ns.dtype, ns.kv_cache_dtype, ns.input_len, ns.output_len,
                        ns.distinct_suffixes) | {"prompts": prompts_digest(prompts)}
    t = time.perf_counter()
    outputs = load_reference(ns.reference_file, key) if ns.reference_file else None
    if outputs is not None:
        print(f"[reference] {len(outputs)} outputs read from {ns.reference_file}", flush=True)
    else:
        outputs = decode_reference(ns, sz, loaded, prefixes, prefix, prompts)
        if ns.reference_file:
            save_reference(ns.reference_file, key, outputs, commit=R.source_commit())
        print(f"[reference] {len(outputs)} outputs decoded in {time.perf_counter() - t:.0f} s"
              + (f", written to {ns.reference_file}" if ns.reference_file else ""), flush=True)
    sz["reference_diversity"] = div = output_diversity(outputs)
    print(f"[reference] diversity: {div['distinct_ids']:.1f} distinct ids an output, {100 * div['repeat_share']:.1f}% "
          f"of tokens repeat the one before, {100 * div['cycle_share']:.1f}% the one d <= 16 before (d "
          f"{sorted(set(div['cycle_periods']))}), {div['distinct_outputs']} distinct outputs of {div['n']}", flush=True)
    check_diversity(div, ns.max_reference_repeat)
    return {prompts[i]: outputs[i] for i in range(ns.distinct_suffixes)}


def decode_reference(ns, sz, loaded, prefixes, prefix: list[int], prompts: list[tuple]) -> dict[int, list[int]]:
    """Suffix index -> greedy output ids (adaptive preset, one batch; the prefix prepared first)."""
    engine = fresh_engine(dataclasses.replace(engine_config(ns, sz, "adaptive"), replay_reference=False), loaded, prefixes)
    engine.prepare_prefix(prefix)
    index = {engine.add_request(list(ids), SamplingParams(max_tokens=ns.output_len, ignore_eos=True)): i
             for i, ids in enumerate(prompts)}
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[index[o.request_id]] = list(o.token_ids)
    del engine  # the last reference: its pools go now, before the next engine sizes its own
    release_memory()
    return out


def arm_engine(ns, sz, loaded, prefixes, preset: str, arm: str, reference, **replace):
    """A fresh engine of (preset, arm), its config with `replace` applied; +spec presets (every preset
    under --replay-reference) get the oracle reference."""
    cfg = dataclasses.replace(engine_config(ns, sz, preset, arm), **replace)
    return fresh_engine(cfg, loaded, prefixes, reference if preset.endswith("+spec") or ns.replay_reference else None)


MAX_OFF_REFERENCE = 0.2  # oracle proposals off the reference above which its acceptance is not the one set
MIN_AGREEMENT = 0.8  # replayed positions where the target's own token is the reference's, below which its KV path is suspect


def run_warnings(engine: dict) -> list[str]:
    """What a run's counters say about its measurement tools: the oracle off its reference (session 42: 94.7%,
    seen only in the JSON after the call), or a replayed target that mostly disagrees with the reference
    (a broken KV path would)."""
    out = []
    off = engine.get("oracle_off_reference_share")
    if off is not None and engine.get("oracle_proposals") and off > MAX_OFF_REFERENCE:
        out.append(f"{100 * off:.1f}% of the oracle's proposals were off its reference: its acceptance is not the one "
                   f"set ({engine.get('spec_tokens_per_round', 0):.2f} tokens a round); --replay-reference keeps it")
    agree = engine.get("replay_agreement")
    if agree is not None and engine.get("replay_judged") and agree < MIN_AGREEMENT:
        out.append(f"the target's own token equals the replayed reference's at {100 * agree:.1f}% of positions "
                   f"(< {100 * MIN_AGREEMENT:.0f}%): check the KV path before citing this run")
    return out


def one_run(ns, sz, loaded, prefixes, preset: str, c: int, reference, arm: str = ""):
    cuda = ns.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    engine = arm_engine(ns, sz, loaded, prefixes, preset, arm, reference,
                        **(dict(cuda_graph_max_bs=c) if ns.graph_max_bs_per_load else {}))
    build_s = time.perf_counter() - t
    workload = Workload(input_len=ns.input_len, output_len=ns.output_len, duration_s=ns.duration,
                        timeout_s=ns.duration + 600, stagger=ns.stagger)
    phases = ns.phases or Phases.constant(c, ns.duration)
    loop = CyclingLoop(engine, workload, phases)
    loop.distinct = ns.distinct_suffixes
    trace = loop.run()
    # where a run's wall time goes beyond its window (a first window pays compiles and graph captures)
    trace.engine.update(engine_build_s=build_s, loop_s=time.perf_counter() - t - build_s)
    if cuda:
        trace.engine.update(device_memory(loaded, trace.engine))
    del loop, engine  # the last references: the pools go now, before the next engine sizes its own
    release_memory()
    return R.run_result(label(preset, arm), c, "in-process", trace, phase_summary(trace, phases) if ns.phases else None)


def device_memory(loaded, counters: dict) -> dict:
    """Device bytes of a run, for what speculation holds beyond what `--charge-spec-memory` charges:
    the peak allocated from engine build to the window's end, the target's weights, the KV pool
    and speculation's accounted bytes (drafter weights, ring, staging: `spec_bytes`), and the rest
    (activations, graph pools, metadata, the verification batch's buffers) = peak - the three."""
    # buffers too: the FP8 models' weights and scales are buffers (layers/fp8_linear.py)
    weights = sum(t.numel() * t.element_size() for t in (*loaded.model.parameters(), *loaded.model.buffers()))
    peak = torch.cuda.max_memory_allocated()
    pool, spec = int(counters.get("kv_pool_bytes", 0)), int(counters.get("spec_bytes", 0))
    return {"device_peak_bytes": peak, "device_model_bytes": weights,
            "device_outside_pool_bytes": peak - weights - pool - spec}


def prewarm(ns, sz, loaded, prefixes, reference) -> None:
    """One engine per (preset, arm), whole-step graphs warmed for one request, built and dropped
    unmeasured: what a process compiles the first time it runs a verification width is paid here."""
    for preset, arm in dict.fromkeys((p, a) for _, p, a in schedule(ns)):  # each (preset, arm) the windows run
        t = time.perf_counter()
        engine = arm_engine(ns, sz, loaded, prefixes, preset, arm, reference, cuda_graph_max_bs=1, step_graph_warmup=True)
        del engine
        release_memory()
        print(f"[prewarm] {label(preset, arm)} in {time.perf_counter() - t:.0f} s", flush=True)


def summarize(runs, concurrencies, arms=("",)) -> tuple[list[dict], dict, list[dict]]:
    """(one row a run, ratios of mean throughputs, spread: mean / min / max tok/s per (label, C), and
    the same of the central-half rate where every run has one). Ratios: each preset against hisparse,
    and adaptive and resident+spec against resident, at one load, and with several arms each arm's mean against the
    first arm's (same preset, same load); the central-half rates' ratios under "central:" keys."""
    rows, tok, cen = [], {}, {}
    for r in runs:
        m = r.metrics
        row = {"preset": r.preset, "C": r.concurrency, **{k: getattr(m, k) for k in METRICS}}
        for k in ("host_fetched_share", "coverage"):
            if k in m.counters:
                row[k] = m.counters[k]
        for k in ("spec_tokens_per_round", "spec_rounds", "host_selected_rows", "resolver_overflow",
                  "staging_promoted_rows", "staging_copyback_bytes", "device_peak_bytes", "device_outside_pool_bytes"):
            if k in r.engine:
                row[k] = r.engine[k]
        rows.append(row)
        tok.setdefault((r.preset, r.concurrency), []).append(m.output_tok_s)
        cen.setdefault((r.preset, r.concurrency), []).append(m.central_output_tok_s)
    spread = []
    for (p, c), v in tok.items():
        d = {"preset": p, "C": c, "runs": len(v), "mean_tok_s": sum(v) / len(v), "min_tok_s": min(v), "max_tok_s": max(v)}
        cv = cen[(p, c)]
        if all(x is not None for x in cv):
            d |= {"central_mean_tok_s": sum(cv) / len(cv), "central_min_tok_s": min(cv), "central_max_tok_s": max(cv)}
        spread.append(d)
    ratios = _ratios({(d["preset"], d["C"]): d["mean_tok_s"] for d in spread}, concurrencies, arms)
    central = {(d["preset"], d["C"]): d["central_mean_tok_s"] for d in spread if "central_mean_tok_s" in d}
    ratios |= {f"central:{k}": v for k, v in _ratios(central, concurrencies, arms).items()}
    return rows, ratios, spread


def eq13(runs) -> list[dict]:
    """Eq. 13's prediction beside the measured ratio for every speculative (label, C) against hisparse at
    that load (dhisparse.bench.eq13): means over the runs of each series, slots from the engine's counters."""
    from dhisparse.bench.eq13 import Series, eq13_dicts

    by: dict = {}
    for r in runs:
        by.setdefault((r.preset, r.concurrency), []).append(r)
    mean = lambda xs: sum(xs) / len(xs) if xs and None not in xs else None  # noqa: E731
    series = [Series(p, c, mean([r.metrics.output_tok_s for r in rs]), mean([r.metrics.tpot_mean_ms for r in rs]),
                     rs[0].engine.get("slots_total")) for (p, c), rs in by.items()]
    return eq13_dicts(series)


def _ratios(by: dict, concurrencies, arms) -> dict:
    """Ratios of the mean rates `by` {(label, C): tok/s} (see `summarize`)."""
    ratios = {}
    for c in concurrencies:
        for arm in arms:
            for p, base in ([(p, "hisparse") for p in ("adaptive", "adaptive+spec", "resident", "resident+spec")]
                            + [("adaptive", "resident"), ("resident+spec", "resident")]):
                b = label(base, arm) if (label(base, arm), c) in by else base  # --arm-presets: a shared baseline
                num, den = by.get((label(p, arm), c)), by.get((b, c))
                if num is not None and den:
                    ratios[f"{label(p, arm)}/{b}@C{c}"] = num / den
        for (name, cc), v in by.items():  # arm k against arm 0, same preset and load
            preset, _, arm = name.partition("@")
            first = label(preset, arms[0])
            if cc == c and arm and arm != arms[0] and by.get((first, c)):
                ratios[f"{name}/{first}@C{c}"] = v / by[(first, c)]
    return ratios


def spec_note(ns) -> str | None:
    """What the +spec presets' drafting costs and leaves out (every table that uses the oracle says so), and
    whether every preset was replayed; None for a run with neither (no +spec preset, no replay)."""
    replay = ("REPLAYED (measurement tool): every preset emits the reference's tokens, the model running on them, "
              "so outputs are not the target's own (replay_agreement: its own tokens' agreement)") if ns.replay_reference else ""
    drafting = _drafting_note(ns) if any(p.endswith("+spec") for p in ns.preset_list) else ""
    return "; ".join(x for x in (drafting, replay) if x) or None


def _drafting_note(ns) -> str:
    if ns.drafter != "oracle":
        return f"+spec presets use the {ns.drafter} drafter at width {ns.spec_width} (real acceptance)"
    note = (f"+spec presets use the ORACLE drafter (measurement tool), calibrated to {ns.spec_tokens_per_round} "
            f"tokens/round at width {ns.spec_width}")
    network = engine_overrides(ns.engine_arg).get("speculative_oracle_drafter")
    if network:
        return note + f"; COSTED: the {network} drafter's network runs every round and holds its memory, its drafts discarded"
    return note + "; drafting is free (no drafter network runs, no drafter memory is held)"


def write(ns, sz, est, t0, runs):
    """The result file of the runs so far; returns (path, ratios, eq. 13's rows)."""
    rows, ratios, spread = summarize(runs, ns.concurrencies, ns.arm_list)
    gpu = torch.cuda.get_device_name() if ns.device.startswith("cuda") else "cpu"
    config = {"engine": R.to_jsonable(engine_config(ns, sz, ns.preset_list[0])), "sizing": sz, "gpu": gpu,
              "model": {"name": ns.model, "layers": ns.layers, "overrides": ns.overrides},
              "workload": {"input_len": ns.input_len, "output_len": ns.output_len, "duration_s": ns.duration,
                           "distinct_suffixes": ns.distinct_suffixes},
              "concurrency": ns.concurrencies, "drafter": ns.drafter, "oracle": {"tokens_per_round": ns.spec_tokens_per_round, "width": ns.spec_width},
              "estimated_s": est, "wall_s": time.perf_counter() - t0, "summary": rows, "spread": spread, "ratios": ratios,
              "arms": ns.arm_list, "repeats": ns.repeats, "rotate": ns.rotate, "eq13": eq13(runs)}
    if ns.phases:  # a load step (Fig. 6): its phases, and the runs' per-phase statistics (Table A1)
        config["phases"] = [ph._asdict() for ph in ns.phases.phases]
    result = R.ResultFile("loadstep" if ns.phases else "bench", R.now_iso(), R.command_line(ns.argv), R.machine_info(), config, ns.preset_list, [], runs,
                          notes=[n for n in (spec_note(ns),) if n],
                          commit=R.source_commit())
    return R.write_json(result, ns.out), ratios, config["eq13"]


def main(argv=None) -> int:
    ns = parse(argv)
    cfg = model_config(ns.model, ns.layers, ns.overrides)
    sz = bench_sizing(ns, cfg)
    est = estimate_s(ns, sz)
    print(f"[sizing] {describe(sz)}", flush=True)
    if sz["max_running_requests"] < sz["slot_target"]:
        print(f"[sizing] WARNING: the hierarchy admits only {sz['max_running_requests']} < {sz['slot_target']} requests "
              "(device or host memory); more host memory or a shorter --input-len raises it", flush=True)
    print(f"[budget] estimated wall time {est:.0f} s ({len(schedule(ns))} windows of {ns.duration:.0f} s: "
          f"{len(ns.preset_list)} presets, {len(ns.arm_list)} arms{' for ' + ','.join(ns.armed) if ns.armed else ''}, "
          f"{ns.repeats} repeats, {len(ns.concurrencies)} concurrencies; + overheads)", flush=True)
    if est > BUDGET_S and not ns.force:
        print(f"[budget] REFUSING: {est:.0f} s > {BUDGET_S} s; lower --duration / --concurrency / --presets or pass --force")
        return 2
    t0 = time.perf_counter()
    loaded = load_model(ns)
    # what the engines' fp8_activations ("auto": the checkpoint's activation_scheme) resolve to, in the JSON
    sz["fp8_activations"] = fp8_activations_for(loaded.model, engine_config(ns, sz, ns.preset_list[0]).fp8_activations,
                                                loaded.config.fp8_activation_scheme)
    print(f"[model] {model_key(ns)} built in {time.perf_counter() - t0:.1f} s; FP8 activations: {sz['fp8_activations']}",
          flush=True)
    prefixes = new_prefixes(ns, cfg)
    reference = oracle_reference(ns, sz, loaded, prefixes) if uses_oracle(ns) else None
    if ns.charge_spec_memory and any(p.endswith("+spec") for p in ns.preset_list):
        sz["spec_charged"] = ch = spec_charge(ns, sz, cfg, loaded, reference)
        print(f"[sizing] +spec charged: drafter {ch['drafter_weight_bytes'] / GIB:.3f} GiB + ring "
              f"{ch['drafter_ring_bytes_per_slot'] / 2**20:.1f} MiB and staging {ch['staging_bytes_per_slot'] / 2**20:.1f} "
              f"MiB a slot -> pool {ch['kv_pool_bytes'] / GIB:.2f} GiB, max_running_requests {ch['max_running_requests']} "
              f"(uncharged {ch['uncharged_max_running_requests']})", flush=True)
    if ns.prewarm:
        prewarm(ns, sz, loaded, prefixes, reference)
    runs = []
    for c, preset, arm in schedule(ns):  # every preset and arm at one load side by side before the next load
        t = time.perf_counter()
        runs.append(one_run(ns, sz, loaded, prefixes, preset, c, reference, arm))
        m = runs[-1].metrics
        central = None if m.central_output_tok_s is None else round(m.central_output_tok_s, 1)
        print(f"[run] {label(preset, arm):14} C{c:<4} {m.output_tok_s:9.1f} tok/s (central half {central})  "
              f"TTFT {m.ttft_mean_ms}  TPOT {m.tpot_mean_ms}  "
              f"active {m.active}  queue {m.queue_mean_ms}  ({time.perf_counter() - t:.0f} s: engine "
              f"{runs[-1].engine['engine_build_s']:.0f}, loop {runs[-1].engine['loop_s']:.0f})", flush=True)
        for w in run_warnings(runs[-1].engine):
            print(f"[run] WARNING: {w}", flush=True)
        path, ratios, rows13 = write(ns, sz, est, t0, runs)  # after every run: a cut-off call keeps what ran
    for k, v in ratios.items():
        print(f"[ratio] {k} = {v:.3f}")
    for e in rows13:
        print(f"[eq13] {e['label']}/{e['baseline']}@C{e['concurrency']}: predicted {e['predicted']:.3f} "
              f"(slots {e['slots_spec']}/{e['slots_base']}, TPOT {e['tpot_base_ms']:.1f}/{e['tpot_spec_ms']:.1f} ms), "
              f"measured {e['measured']:.3f}")
    print(f"[done] {path} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
