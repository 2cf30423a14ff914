"""Verification staging, paper (chi arenas, promotion, copy-back) against single (one arena, staged
rows dropped): what each moves, through the engine (issue 26 item 1).

The trained built-in model `tiny-code` with its own MTP drafter (real drafts, real acceptance),
greedy, fixed-length outputs over held-out corpus text, under `hisparse` with a hot cache of k rows
(a width-4 union of 4k rows overflows it). Per mode: verification rounds, rows fetched from host
per round (distinct rows and selection entries), staged rows (misses with no victim) per round,
promoted rows and copy-back bytes per round, and the wall time of a batch. Both modes must give
`resident`'s tokens. Every mode is timed `--repeats` times after one untimed warm-up batch, the
mode order rotated between repeats; the record keeps every run (median and spread).

The counts are the point here: on CPU the wall times say nothing about the H200 (the `staging26`
step of bench/gpu_session.sh measures the round time there).

    python bench/staging_census.py --out bench/results/staging_census_cpu.json
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

MODES = ("paper", "single")
FIELDS = ("host_rows", "host_selected_rows", "resolver_overflow", "staging_promoted_rows", "staging_copyback_bytes",
          "resolver_bytes_moved", "selected_rows")


def prompts_from(corpus: Corpus, tokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens cut from consecutive held-out text."""
    ids = tokenizer.encode(Corpus.text(corpus.heldout))
    if len(ids) < n * length:
        raise ValueError(f"the held-out text has {len(ids)} tokens, fewer than {n} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def census(llm: LLM) -> dict:
    c = llm.engine.store.census
    st = llm.engine.stats().as_dict()
    return {"host_rows": c.host, **{k: st[k] for k in FIELDS if k in st}, "spec_rounds": st["spec_rounds"],
            "tokens_per_round": st["spec_tokens_per_round"]}


def minus(a: dict, b: dict) -> dict:
    return {k: a[k] - b[k] for k in FIELDS + ("spec_rounds",)}


def engine(folder: str, mode: str, ns) -> LLM:
    return LLM(folder, device=ns.device, preset="hisparse", hot_cache_rows=ns.hot, staging_mode=mode,
               speculative_algorithm="mtp", speculative_num_draft_tokens=ns.width, max_running_requests=ns.prompts)


def run(ns) -> dict:
    folder = str(builtin_folder("tiny-code"))
    base = LLM(folder, device=ns.device)
    corpus = Corpus.build(share=ns.heldout, max_files=ns.max_files)
    prompts = prompts_from(corpus, base.tokenizer, ns.prompts, ns.prompt_len)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    reference = [o.token_ids for o in base.generate(prompts, params)]
    llms = {m: engine(folder, m, ns) for m in MODES}
    runs = {m: [] for m in MODES}
    for m, llm in llms.items():  # warm-up batch, untimed
        if [o.token_ids for o in llm.generate(prompts, params)] != reference:
            raise RuntimeError(f"staging {m}: tokens differ from resident")
    for r in range(ns.repeats):
        order = list(MODES[r % 2:]) + list(MODES[: r % 2])
        for m in order:
            before = census(llms[m])
            t0 = time.perf_counter()
            out = [o.token_ids for o in llms[m].generate(prompts, params)]
            secs = time.perf_counter() - t0
            delta = minus(census(llms[m]), before)
            rounds = max(delta["spec_rounds"], 1)
            runs[m].append({"seconds": secs, "equal_resident": out == reference, **delta,
                            "per_round": {k: delta[k] / rounds for k in FIELDS}})
    summary = {m: {"seconds_median": statistics.median(x["seconds"] for x in rs),
                   "seconds_spread": [min(x["seconds"] for x in rs), max(x["seconds"] for x in rs)],
                   **{f"{k}_per_round": statistics.median(x["per_round"][k] for x in rs) for k in FIELDS}}
               for m, rs in runs.items()}
    return {"kind": "staging_census", "date": now_iso(), "commit": source_commit(), "command": command_line(),
            "machine": machine_info(), "device": ns.device, "model": "tiny-code (built-in, trained), its MTP drafter",
            "preset": "hisparse", "hot_cache_rows": ns.hot, "width": ns.width, "prompts": ns.prompts,
            "prompt_len": ns.prompt_len, "max_tokens": ns.max_tokens, "repeats": ns.repeats,
            "baseline": "single staging (one arena, staged rows dropped), same engine settings, same run",
            "runs": runs, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hot", type=int, default=64, help="hot-cache rows (tiny-code's index_topk is 64)")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heldout", type=float, default=0.05)
    ap.add_argument("--max-files", type=int, default=None)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    res = run(ns)
    for m, s in res["summary"].items():
        print(f"{m:>7}  host rows/round {s['host_rows_per_round']:8.1f}  staged/round {s['resolver_overflow_per_round']:8.1f}  "
              f"promoted/round {s['staging_promoted_rows_per_round']:7.1f}  copy-back B/round "
              f"{s['staging_copyback_bytes_per_round']:10.0f}  batch {s['seconds_median']:.2f} s")
    if ns.out:
        write_json(res, ns.out)
    return 0 if all(x["equal_resident"] for rs in res["runs"].values() for x in rs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
