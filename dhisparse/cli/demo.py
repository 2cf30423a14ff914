"""`dhisparse demo`: the README's main job on the built-in trained model (`tiny-code`).

A short closed-loop run of every available preset (C clients, each request imports a private
copy of one prepared prefix), then a comparison table: output tok/s, TTFT, TPOT, host-fetched
share and the KV memory the pool used. It also prints a greedy sample text per preset, which
must be identical across presets (they only change where KV lives, not what the model computes).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from dhisparse.cli.args import HelpFormatter, add_engine_args, engine_config

DEFAULT_MODEL = "tiny-code"  # trained on the CPython standard library (models/builtin/tiny-code)
SAMPLE_PROMPT = "def read_config(path, defaults=None):"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="compare every available preset in a short closed-loop run on the built-in model",
                       formatter_class=HelpFormatter)
    add_engine_args(p)
    p.set_defaults(model=DEFAULT_MODEL)
    g = p.add_argument_group("demo")
    g.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    g.add_argument("--input-len", type=int, default=512, help="tokens of the shared prepared prefix")
    g.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    g.add_argument("--duration", type=float, default=None,
                   help="seconds per preset (default: 30 s split over the available presets, 3 to 8 s each)")
    g.add_argument("--out", default=None, help="also write the result JSON here")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)


def sample_text(engine, max_tokens: int = 48, timeout_s: float = 60.0) -> str:
    """Greedy continuation of SAMPLE_PROMPT (bounded in time)."""
    from dhisparse.core.params import SamplingParams

    rid = engine.add_request(SAMPLE_PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.text
    engine.abort(rid)
    return "(timed out)"


def run(ns: argparse.Namespace) -> int:
    from dhisparse.bench import results as R
    from dhisparse.bench.inproc import run_inprocess
    from dhisparse.bench.report import console as report_console
    from dhisparse.bench.sweep import ProgressBar, load_shared_model, on_fresh_engine
    from dhisparse.bench.workload import Phases, Workload
    from dhisparse.engine.config import AVAILABLE_PRESETS

    console = report_console()
    presets = [ns.preset] if ns.preset else list(AVAILABLE_PRESETS)
    duration = ns.duration or min(8.0, max(3.0, 30.0 / len(presets)))
    workload = Workload(input_len=ns.input_len, output_len=ns.output_len, duration_s=duration)
    phases = Phases.constant(ns.concurrency, duration)
    base = engine_config(ns, preset=presets[0])
    loaded = load_shared_model(base)
    runs, texts = [], {}
    with ProgressBar(not ns.no_progress, console) as bar:
        for preset in presets:
            tick = bar.task(f"{preset:<14} C{ns.concurrency}", workload, phases)

            def job(engine, tick=tick, preset=preset):
                trace = run_inprocess(engine, workload, phases, tick)
                texts[preset] = sample_text(engine)
                return trace

            trace = on_fresh_engine(dataclasses.replace(base, preset=preset), loaded, job)
            runs.append(R.run_result(preset, ns.concurrency, "in-process", trace))
    result = R.new_result("bench", getattr(ns, "argv", None),
                          {"engine": R.to_jsonable(base), "workload": R.to_jsonable(workload), "demo": True}, runs)
    _report(console, result, texts, base, ns)
    if ns.out:
        console.print(f"results: {R.write_json(result, ns.out)}")
    return 0


def _report(console, result, texts: dict, base, ns: argparse.Namespace) -> None:
    from dhisparse.bench import results as R
    from dhisparse.bench.report import demo_table

    console.print(f"[bold]prompt:[/bold] {SAMPLE_PROMPT!r}")
    for preset, text in texts.items():
        console.print(f"  [cyan]{preset:<14}[/cyan] -> {text!r}")
    if len(set(texts.values())) == 1 and len(texts) > 1:
        console.print("  greedy output is identical across presets (they change where KV lives, not the math)")
    data = R.to_jsonable(result)
    title = (f"dhisparse demo: {base.model}, closed loop C{ns.concurrency}, input {ns.input_len} tokens "
             f"(prepared prefix), output {ns.output_len}")
    console.print(demo_table(data, title))
    if any(p.endswith("+spec") for p in data_presets(data)):
        console.print(_spec_note(base.model))
    unavailable = data["unavailable_presets"]
    if unavailable:
        console.print(f"presets not in this build yet: {', '.join(unavailable)}")


def _spec_note(model: str) -> str:
    from dhisparse.models.registry import builtin_drafter

    if builtin_drafter(model, "dflash"):
        return (f"[dim]+spec presets draft with {model}'s own trained DFlash2 drafter. On a model this small a draft "
                "round costs more than the target steps it saves, so expect no speed-up here; tokens per round and "
                "bench/results/tiny_code_spec_* show what the drafters accept.[/dim]")
    return ("[dim]+spec presets draft with a randomly initialised DFlash drafter here (this model ships no trained "
            "drafter), so they show the verification overhead, not a speed-up; see README for real drafters.[/dim]")


def data_presets(data) -> list[str]:
    """Preset names of the demo's runs (whatever container `data` is)."""
    runs = data.get("runs", data) if isinstance(data, dict) else data
    return [r.get("preset", "") if isinstance(r, dict) else getattr(r, "preset", "") for r in runs]
