"""Does a faithful model's greedy output depend on its context? The check to run before an oracle
reference is decoded from it (issue 31: session 36's and 37's costed sweeps were superseded because
glm5-faithful's 100K reference was one token repeated for all 20 prompts).

    python3 bench/faithful_diversity.py --model glm5-faithful --device cuda --out $OUT/faithful_diversity.json
    python3 bench/faithful_diversity.py --layers 8 --overrides '{"hidden_size": 256, ...}' --out /tmp/d.json  # CPU

Per prompt (the serving workload's: one pseudo-random prefix, a distinct suffix each, as gpu_serving's
`--distinct-suffixes`), greedy tokens through the engine (resident preset), then
`reference.output_diversity` over them, and the final normed hidden states' common share over the
first prompt's prefill positions with the locality offset's direction taken out (|mean h|^2 /
mean |h|^2: one vector shared by every position; models/faithful.py `offset_blind`). A share near
0.4 at 24 small layers went with a repeated-token output at full size; ~0.03 with a varied one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.locality import build  # noqa: E402
from dhisparse.bench import results as R  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--model", default="glm5-faithful", choices=("glm5-faithful", "v41-faithful"))
    a("--layers", type=int, default=None, help="truncate the layer plan (default: the model's)")
    a("--overrides", default=None, help="config keys as JSON (a small geometry for CPU runs)")
    a("--prompts", type=int, default=4); a("--prompt-len", type=int, default=4096); a("--tokens", type=int, default=64)
    a("--device", default="cpu"); a("--dtype", default="bfloat16"); a("--kv-pool-gib", type=float, default=4.0)
    a("--index-gain", type=float, default=None, help="the index queries' stable part (default: the builder's)")
    a("--out", required=True)
    ns = p.parse_args(argv)
    ns.argv = ["bench/faithful_diversity.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def common_share(h: torch.Tensor, shared: torch.Tensor) -> float:
    """|mean_t h_t|^2 / mean_t |h_t|^2 of h [T, hidden] with `shared`'s direction taken out."""
    u = shared.float().to(h.device) / shared.float().norm()
    h = h.float() - (h.float() @ u)[:, None] * u[None, :]
    return float(h.mean(0).norm() ** 2 / (h.norm(dim=1) ** 2).mean())


def main(argv=None) -> int:
    ns = parse(argv)
    from dhisparse import SamplingParams
    from dhisparse.bench.reference import output_diversity
    from dhisparse.bench.workload import prefix_ids, suffix_text
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine

    t0 = time.perf_counter()
    lm = build(ns, **({} if ns.index_gain is None else {"index_gain": ns.index_gain}))  # else the builder's
    hidden = lm.config.hidden_size
    from dhisparse.models.scaled import offset_direction
    from dhisparse.models.v4_faithful import v4_offset_direction

    direction = offset_direction if ns.model == "glm5-faithful" else v4_offset_direction
    shared = direction(hidden, 0, ns.device).cpu()  # the built model's (seed 0, drawn on its device)
    got: list[torch.Tensor] = []
    lm.model.model.norm.register_forward_hook(lambda m, i, o: got.append(o.detach().float().cpu()))
    prefix = prefix_ids(lm.tokenizer, ns.prompt_len, lm.config.vocab_size)
    prompts = [prefix + lm.tokenizer.encode(suffix_text(i)) for i in range(ns.prompts)]
    eng = Engine(EngineConfig(model=ns.model, preset="resident", device=ns.device, page_size=64,
                              max_running_requests=ns.prompts, kv_pool_bytes=int(ns.kv_pool_gib * 2**30),
                              max_num_batched_tokens=8192, max_model_len=len(prompts[0]) + ns.tokens + 8), loaded=lm)
    ids = [eng.add_request(p, SamplingParams(max_tokens=ns.tokens, ignore_eos=True)) for p in prompts[:1]]
    outputs: dict[int, list[int]] = {}
    while eng.has_unfinished():  # the first prompt alone: its prefill's states are the first len(prompt) rows
        for o in eng.step():
            outputs.setdefault(0, []).extend(o.new_token_ids)
    share = common_share(torch.cat(got)[:len(prompts[0])], shared)
    got.clear()
    ids = {eng.add_request(p, SamplingParams(max_tokens=ns.tokens, ignore_eos=True)): i for i, p in enumerate(prompts[1:], 1)}
    while eng.has_unfinished():
        for o in eng.step():
            outputs.setdefault(ids[o.request_id], []).extend(o.new_token_ids)
    div = output_diversity(outputs)
    print(f"[diversity] {ns.model}: {div['distinct_ids']:.1f} distinct ids an output of {ns.tokens}, "
          f"{100 * div['repeat_share']:.1f}% repeat the one before, {div['distinct_outputs']} distinct outputs of {div['n']}; "
          f"common share of the final states (offset aside) {share:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    R.write_doc("faithful_diversity", ns, ns.out, diversity=div, common_share=share,
                outputs={str(k): v for k, v in sorted(outputs.items())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
