"""Real acceptance of the trained built-in model's drafters, through the engine (issue 29).

On held-out function signatures of the `tiny-code` corpus (train/evaluate.signatures), greedy,
fixed-length outputs (ignore_eos), every preset is served once without speculation (the baseline
of that preset, measured in the same run) and once per drafter at width K:

    mtp      the checkpoint's own NextN block (model-mtp.safetensors)
    dflash2  the DFlash2 drafter in the checkpoint's dflash2/ folder
    ngram    prompt-lookup drafting (no network)

Reported per (preset, drafter): tokens per round (emitted tokens / verification rounds, the anchor's
token included), first-position acceptance, output tok/s and its ratio to the same preset's
non-speculative tok/s, and whether the tokens equal `resident` without speculation (they must).
Each point is timed `--repeats` times after one untimed warm-up batch, with the order of the
drafters rotated between repeats; the record keeps every run (median and spread, never the best).

    python bench/tiny_code_spec.py --device cuda --out bench/results/tiny_code_spec_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dhisparse.bench.results import command_line, machine_info, now_iso, source_commit, write_json  # noqa: E402
from dhisparse.core.params import SamplingParams  # noqa: E402
from dhisparse.engine.llm import LLM  # noqa: E402
from dhisparse.models.registry import builtin_folder  # noqa: E402
from dhisparse.train.corpus import Corpus  # noqa: E402
from dhisparse.train.evaluate import signatures  # noqa: E402

DRAFTERS = ("mtp", "dflash2", "ngram")


def spec_args(folder: Path, drafter: str | None, width: int) -> dict:
    """Engine keyword arguments of one drafter (None: no speculation)."""
    if drafter is None:
        return {}
    kw = {"speculative_algorithm": drafter, "speculative_num_draft_tokens": width}
    if drafter == "dflash2":
        kw["speculative_draft_model_path"] = str(folder / "dflash2")
    return kw


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], time.perf_counter() - t0


def measure(folder: Path, preset: str, drafter: str | None, prompts: list[str], params: SamplingParams,
            width: int, device: str, repeats: int) -> dict:
    """One engine for (preset, drafter): a warm-up batch, then `repeats` timed batches."""
    llm = LLM(str(folder), device=device, preset=preset, **spec_args(folder, drafter, width))
    tokens, _ = timed(llm, prompts, params)  # warm-up: compiles, graphs, caches
    secs = []
    for _ in range(repeats):
        again, s = timed(llm, prompts, params)
        if again != tokens:
            raise RuntimeError(f"{preset} / {drafter}: a repeat changed the greedy tokens")
        secs.append(s)
    st = llm.engine.stats().as_dict()
    n_tok = sum(len(t) for t in tokens)
    rates = [n_tok / s for s in secs]
    return {"preset": preset, "drafter": drafter or "none", "tokens": tokens, "output_tokens": n_tok,
            "seconds": secs, "tok_s": rates, "tok_s_median": statistics.median(rates),
            "tokens_per_round": st.get("spec_tokens_per_round"), "accept_pos1": st.get("spec_accept_pos1"),
            "spec_rounds": st.get("spec_rounds")}


def run(ns) -> dict:
    folder = Path(ns.model)
    corpus = Corpus.build(share=ns.heldout, max_files=ns.max_files)
    prompts = signatures(corpus.heldout, ns.prompts)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    reference = None
    points = []
    for pi, preset in enumerate(ns.presets.split(",")):
        base = measure(folder, preset, None, prompts, params, ns.width, ns.device, ns.repeats)
        reference = reference or base["tokens"]
        base["tokens_equal_resident"] = base["tokens"] == reference
        points.append(base)
        order = list(ns.drafters.split(","))
        order = order[pi % len(order):] + order[: pi % len(order)]  # rotated per preset
        for d in order:
            p = measure(folder, preset, d, prompts, params, ns.width, ns.device, ns.repeats)
            p["tokens_equal_resident"] = p["tokens"] == reference
            p["speedup_median"] = p["tok_s_median"] / base["tok_s_median"]
            p["speedup_runs"] = [a / b for a, b in zip(p["tok_s"], base["tok_s"])]
            points.append(p)
    for p in points:
        del p["tokens"]
    return {"kind": "tiny_code_spec", "date": now_iso(), "commit": source_commit(), "command": command_line(),
            "machine": machine_info(), "device": ns.device, "model": str(folder), "corpus": corpus.manifest(),
            "prompts": len(prompts), "max_tokens": ns.max_tokens, "width": ns.width, "repeats": ns.repeats,
            "baseline": "the same preset without speculation, same prompts, same run",
            "points": points}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="trained checkpoint folder (default: the built-in tiny-code)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--presets", default="resident,hisparse,adaptive")
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    ap.add_argument("--width", type=int, default=4, help="K: target queries per round, anchor included")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heldout", type=float, default=0.05)
    ap.add_argument("--max-files", type=int, default=None, help="smoke mode: only the first N corpus files")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    ns.model = ns.model or str(builtin_folder("tiny-code"))
    for d in ns.drafters.split(","):
        if d not in DRAFTERS:
            ap.error(f"--drafters: {d!r} is not one of {', '.join(DRAFTERS)}")
    res = run(ns)
    for p in res["points"]:
        print(f"{p['preset']:>9} {p['drafter']:>8}  tok/round {p['tokens_per_round'] or 1.0:5.2f}  "
              f"tok/s {p['tok_s_median']:8.1f}  speedup {p.get('speedup_median', 1.0):5.2f}x  "
              f"equal {p['tokens_equal_resident']}")
    if ns.out:
        write_json(res, ns.out)
    return 0 if all(p["tokens_equal_resident"] for p in res["points"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
