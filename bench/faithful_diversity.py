"""Does a faithful model's greedy output depend on its context? The check to run before an oracle
reference is decoded from it (issue 31: session 36's and 37's costed sweeps were superseded because
glm5-faithful's 100K reference was one token repeated for all 20 prompts).

    python3 bench/faithful_diversity.py --model glm5-faithful --device cuda --out $OUT/faithful_diversity.json
    python3 bench/faithful_diversity.py --layers 8 --overrides '{"hidden_size": 256, ...}' --memo-fp8 --out /tmp/d.json  # CPU
    python3 bench/faithful_diversity.py --device cuda --prompts 3 --prompt-len 102400 --tokens 1024 \
        --kv-cache-dtype fp8_e4m3 --kv-pool-gib 24 --margins [--head-vocab byte] --out ...  # the costed sweep's shape

Per prompt (the serving workload's: one pseudo-random prefix, a distinct suffix each, as gpu_serving's
`--distinct-suffixes`), greedy tokens through the engine (resident preset), then
`reference.output_diversity` over them, and the final normed hidden states' common share over the
first prompt's prefill positions with the locality offset's direction taken out (|mean h|^2 /
mean |h|^2: one vector shared by every position; models/faithful.py `offset_blind`). A share near
0.4 at 24 small layers went with a repeated-token output at full size; ~0.03 with a varied one.
Also where each output settled on one repeated token (`settled_at`: session 39's 100K reference, 1,024 tokens,
settled after 128-500 of them though the 4K / 64-token check had shown no repeat), and with --margins the
top-1 minus top-2 logprob by quarter of the output (how near-tied the greedy choices are).
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
from dhisparse.models.faithful import HEAD_VOCABS  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--model", default="glm5-faithful", choices=("glm5-faithful", "v41-faithful"))
    a("--layers", type=int, default=None, help="truncate the layer plan (default: the model's)")
    a("--overrides", default=None, help="config keys as JSON (a small geometry for CPU runs)")
    a("--prompts", type=int, default=4); a("--prompt-len", type=int, default=4096); a("--tokens", type=int, default=64)
    a("--device", default="cpu"); a("--dtype", default="bfloat16"); a("--kv-pool-gib", type=float, default=4.0)
    a("--kv-cache-dtype", default="auto", help="the engine's row format (fp8_e4m3: the costed sweep's 656-B rows)")
    a("--index-gain", type=float, default=None, help="the index queries' stable part (default: the builder's)")
    a("--head-vocab", default="full", choices=HEAD_VOCABS, help="the faithful model's lm_head over every id (the "
      "default from session 40, models/faithful.py full_vocab_head) or over the byte ids alone (the build before)")
    a("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency_penalty of every request (0: plain greedy)")
    a("--margins", action="store_true", help="also each output's top-1 minus top-2 logprob margin, by quarter of the output")
    a("--memo-fp8", action="store_true", help="CPU speed: keep each FP8 weight's dequantized copy instead of "
      "dequantizing it every call (kernels/fp8_gemm_ref; the same values, fp32 copies of every FP8 weight in memory)")
    a("--out", required=True)
    ns = p.parse_args(argv)
    ns.argv = ["bench/faithful_diversity.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def common_share(h: torch.Tensor, shared: torch.Tensor) -> float:
    """|mean_t h_t|^2 / mean_t |h_t|^2 of h [T, hidden] with `shared`'s direction taken out."""
    u = shared.float().to(h.device) / shared.float().norm()
    h = h.float() - (h.float() @ u)[:, None] * u[None, :]
    return float(h.mean(0).norm() ** 2 / (h.norm(dim=1) ** 2).mean())


def settled_at(tokens: list[int], min_run: int = 32) -> int | None:
    """Where the output's final run of one repeated token starts, if that run is min_run tokens or
    longer (the output has settled on one token), else None."""
    i = len(tokens)
    while i > 1 and tokens[i - 2] == tokens[-1]:
        i -= 1
    return i - 1 if tokens and len(tokens) - (i - 1) >= min_run else None


def quarters(xs: list[float]) -> list[dict]:
    """mean and min of xs over each quarter of the list (the output's first to last quarter)."""
    n = len(xs)
    out = []
    for q in range(4):
        part = xs[q * n // 4:(q + 1) * n // 4]
        out.append({"mean": sum(part) / len(part), "min": min(part)} if part else {})
    return out


def memoized_fp8_dequant() -> None:
    """Make the CPU reference's `dequantize_block_fp8` keep each weight's fp32 copy (keyed by the
    weight's and its scale's storage): the same values, without dequantizing every expert every step
    (80% of a small CPU build's decode time). For this process's fixed weights only."""
    from dhisparse.kernels import fp8_gemm_ref

    plain = fp8_gemm_ref.dequantize_block_fp8
    if getattr(plain, "memoized", False):
        return
    kept: dict = {}

    def dequant(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        key = (w8.data_ptr(), tuple(w8.shape), scale.data_ptr(), tuple(scale.shape))
        if key not in kept:
            kept[key] = plain(w8, scale)
        return kept[key]

    dequant.memoized = True
    fp8_gemm_ref.dequantize_block_fp8 = dequant


def state_hook(got: list, need: int):
    """A forward hook on the final norm that keeps the first `need` rows of final states [T, hidden]
    on the CPU (the first prompt's prefill) and then nothing. It copies nothing while a CUDA graph
    is being captured: a device-to-host copy there fails the capture, and every decode step then
    ran eagerly (session 41's H100 settle31 ran out of time so)."""
    def hook(module, inputs, out: torch.Tensor) -> None:
        if out.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        if sum(t.shape[0] for t in got) < need:
            got.append(out.detach().reshape(-1, out.shape[-1]).float().cpu())
    return hook


def main(argv=None) -> int:
    ns = parse(argv)
    if ns.memo_fp8:
        memoized_fp8_dequant()
    from dhisparse import SamplingParams
    from dhisparse.bench.reference import output_diversity
    from dhisparse.bench.workload import prefix_ids, suffix_text
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine

    t0 = time.perf_counter()
    gain = {} if ns.index_gain is None else {"index_gain": ns.index_gain}  # else the builder's
    lm = build(ns, head_vocab=ns.head_vocab, **gain)
    hidden = lm.config.hidden_size
    from dhisparse.models.scaled import offset_direction
    from dhisparse.models.v4_faithful import v4_offset_direction

    direction = offset_direction if ns.model == "glm5-faithful" else v4_offset_direction
    shared = direction(hidden, 0, ns.device).cpu()  # the built model's (seed 0, drawn on its device)
    got: list[torch.Tensor] = []
    prefix = prefix_ids(lm.tokenizer, ns.prompt_len, lm.config.vocab_size)
    prompts = [prefix + lm.tokenizer.encode(suffix_text(i)) for i in range(ns.prompts)]
    lm.model.model.norm.register_forward_hook(state_hook(got, len(prompts[0])))
    eng = Engine(EngineConfig(model=ns.model, preset="resident", device=ns.device, page_size=64,
                              max_running_requests=ns.prompts, kv_pool_bytes=int(ns.kv_pool_gib * 2**30),
                              kv_cache_dtype=ns.kv_cache_dtype,
                              max_num_batched_tokens=8192, max_model_len=len(prompts[0]) + ns.tokens + 8), loaded=lm)
    params = SamplingParams(max_tokens=ns.tokens, ignore_eos=True, frequency_penalty=ns.frequency_penalty,
                            logprobs=2 if ns.margins else None)
    ids = [eng.add_request(p, params) for p in prompts[:1]]
    outputs: dict[int, list[int]] = {}
    margins: dict[int, list[float]] = {}

    def collect(i: int, o) -> None:
        outputs.setdefault(i, []).extend(o.new_token_ids)
        if o.logprobs:
            margins.setdefault(i, []).extend(lp.top[0][1] - lp.top[1][1] for lp in o.logprobs if len(lp.top) > 1)

    while eng.has_unfinished():  # the first prompt alone: its prefill's states are the first len(prompt) rows
        for o in eng.step():
            collect(0, o)
    share = common_share(torch.cat(got)[:len(prompts[0])], shared)
    ids = {eng.add_request(p, params): i for i, p in enumerate(prompts[1:], 1)}
    while eng.has_unfinished():
        for o in eng.step():
            collect(ids[o.request_id], o)
    div = output_diversity(outputs)
    graphs = {k: v for k, v in eng.stats().as_dict().items() if k.startswith("step_graph")}
    if graphs.get("step_graph_capture_failures"):
        print(f"[diversity] WARNING: {graphs['step_graph_capture_failures']} step graph captures failed; "
              f"{graphs['step_graph_eager_passes']} passes ran eagerly", flush=True)
    runs = {str(i): settled_at(o) for i, o in sorted(outputs.items())}
    print(f"[diversity] settled on one token from output position: {runs}", flush=True)
    print(f"[diversity] {ns.model}: {div['distinct_ids']:.1f} distinct ids an output of {ns.tokens}, "
          f"{100 * div['repeat_share']:.1f}% repeat the one before, {100 * div['cycle_share']:.1f}% the one d <= 16 before "
          f"(d {div['cycle_periods']}), {div['distinct_outputs']} distinct outputs of {div['n']}; "
          f"common share of the final states (offset aside) {share:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    extra = {"margins_by_quarter": {str(i): quarters(m) for i, m in sorted(margins.items())}} if ns.margins else {}
    if extra:
        print(f"[diversity] top-1 minus top-2 logprob by quarter: {extra['margins_by_quarter']}", flush=True)
    R.write_doc("faithful_diversity", ns, ns.out, diversity=div, common_share=share, settled_at=runs, **extra,
                step_graphs=graphs, outputs={str(k): v for k, v in sorted(outputs.items())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
