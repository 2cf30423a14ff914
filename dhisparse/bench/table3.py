"""The paper's Table 3 (retrieval volume of GLM-5.x vs DeepSeek-V4.1), measured through the engine.

Both scaled benchmark models (`glm52-scaled`, `v41-scaled`; random weights, the KV structure of
the paper's models) run under `hisparse` at one fixed load: C requests with a prompt of P random
byte tokens each, G generated tokens, all admitted together. The resolver census gives, per
generated (decode) token per request:

    selections          valid selection entries resolved (selecting layers x k)
    host rows           distinct rows copied from host by the selecting layers
    host selections     selection entries served from host (the host-fetched share's numerator)
    host bytes          every byte copied from host: the selecting layer's rows plus, on GLM, the
                        follower (`shared`) layers' own payload rows for the same positions
and per decode step: resolver calls (one per selecting layer: GLM full layers; V4.1 full +
reindex layers, reuse layers make none) and follower copies (GLM shared layers; none on V4.1).

CPU runs truncate the layer plans (`--glm-layers`, `--v41-groups`) and use hot caches of B = k
rows (GLM 2048 latent rows per layer, V4.1 512 compressed rows per source) with the same prompt
for both (3072 tokens: 3072 GLM positions, 768 V4.1 rows, so B / history = 2/3 on both and the
miss rates are comparable); the first `--warmup` decode steps (cold hot caches after the
handoff) are excluded. Each row also reports the full plans' per-token values, scaled by the
ratio of selecting layers (selections, host rows) and of payload layers per selection (bytes).

Rows are stored in the format `--kv-cache-dtype` gives (core/kvformat.py): the bytes per row are
the engine arena's (`arena.formats.latent.nbytes`: GLM 1,152 B in bf16, 656 B in fp8_e4m3; V4.1
1,024 B in bf16, 584 B in fp8_e4m3), and the census counts the bytes each copy moved. The paper's
figures are FP8; each run's `paper` block sets the full-plan values beside them (`PAPER_TABLE3`).

    python -m dhisparse.bench.table3 --out bench/results/table3_cpu.json                  # CPU, ~6 min
    python -m dhisparse.bench.table3 --kv-cache-dtype fp8_e4m3 --out /tmp/table3_fp8.json  # FP8 rows
    python -m dhisparse.bench.table3 --paper --device cuda --pool-gib 40 --out $OUT/table3.json  # GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from dataclasses import asdict, dataclass

import torch

from dhisparse.bench.results import new_result, write_json
from dhisparse.core.kvformat import KV_CACHE_DTYPES

# The paper's Table 3 (FP8 rows, HiSparse at C128; ranges from the smallest to the largest hot-cache
# budget of its sweep; at the smallest both models miss about a third of their selections).
PAPER_TABLE3 = {
    "glm52-scaled": dict(selections_per_token=43008, bytes_per_missed_selection=(2400, 2500), host_bytes_per_token=(34e6, 4.2e6),
                         hot_cache_bytes_per_session=184e6, resolver_calls_per_step=21, follower_copies_per_step=57),
    "v41-scaled": dict(selections_per_token=4096, bytes_per_missed_selection=288, host_bytes_per_token=(0.42e6, 0.11e6),
                       hot_cache_bytes_per_session=6e6, resolver_calls_per_step=8, follower_copies_per_step=0),
}
PAPER_RATIO = 80  # GLM / V4.1 host bytes per token at the smallest budget ("about 80x")


@dataclass(frozen=True)
class Setup:
    """One measured model: name, truncation, hot cache rows B, load (C requests, P prompt, G out)."""

    model: str
    size: int  # glm: layers kept; v41: shared sources kept
    hot_cache_rows: int
    concurrency: int
    prompt_len: int
    output_len: int
    page_size: int = 64
    warmup: int = 4  # decode steps (all requests decoding) excluded: the hot caches start cold
    kv_cache_dtype: str = "auto"  # stored row format (--kv-cache-dtype)


@dataclass(frozen=True)
class Volume:
    """Per generated token per request (and per decode step) retrieval volume of one run."""

    model: str
    selecting_layers: int
    payload_layers: int
    kv_sources: int
    k: int
    kv_cache_dtype: str
    row_bytes: int
    hot_cache_rows: int
    hot_cache_bytes_per_session: int
    selections_per_token: float
    host_rows_per_token: float
    host_selections_per_token: float
    host_fetched_share: float
    host_bytes_per_token: float
    bytes_per_missed_selection: float
    resolver_calls_per_step: float
    follower_copies_per_step: float
    decode_steps: int
    decode_tokens: int
    wall_s: float
    full_plan: dict
    paper: dict


def _glm(setup: Setup, seed: int, device: str):
    from dhisparse.models.scaled import build_scaled, scaled_config

    cfg = scaled_config("glm52-scaled", setup.size)
    full = scaled_config("glm52-scaled")
    shape = dict(selecting=len(cfg.full_layers), payload=cfg.num_layers, sources=cfg.num_layers, k=cfg.index_topk,
                 width=cfg.latent_dim, full_selecting=len(full.full_layers), full_payload=full.num_layers)
    return build_scaled("glm52-scaled", seed, torch.bfloat16, device, setup.size), shape


def _v41(setup: Setup, seed: int, device: str):
    from dhisparse.models.v4_scaled import build_v41_scaled, v41_scaled_config

    loaded = build_v41_scaled(seed, torch.bfloat16, device, setup.size)
    cfg, full = loaded.config, v41_scaled_config()
    shape = dict(selecting=len(cfg.selecting_layers), payload=len(cfg.csa_sources), sources=len(cfg.csa_sources),
                 k=cfg.index_topk, width=cfg.head_dim, full_selecting=len(full.selecting_layers),
                 full_payload=len(full.csa_sources))
    return loaded, shape


def measure(setup: Setup, seed: int = 0, threads: int = 2, pool_bytes: int = 1 << 30, device: str = "cpu") -> Volume:
    """Run one model under hisparse at the setup's load on `device`; census counters -> Volume."""
    from dhisparse import SamplingParams
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine
    from dhisparse.models.tokenizer import ByteTokenizer

    loaded, shape = (_glm if setup.model == "glm52-scaled" else _v41)(setup, seed, device)
    loaded = dataclasses.replace(loaded, tokenizer=ByteTokenizer())
    eng = Engine(EngineConfig(model=setup.model, preset="hisparse", page_size=setup.page_size, cpu_threads=threads, device=device,
                              hot_cache_rows=setup.hot_cache_rows, max_running_requests=setup.concurrency,
                              max_num_batched_tokens=2048, kv_pool_bytes=pool_bytes, host_pool_bytes=pool_bytes,
                              kv_cache_dtype=setup.kv_cache_dtype,
                              max_model_len=setup.prompt_len + setup.output_len + 1), loaded=loaded)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=setup.output_len, ignore_eos=True)
    for _ in range(setup.concurrency):
        eng.add_request(torch.randint(3, min(259, loaded.config.vocab_size), (setup.prompt_len,), generator=gen).tolist(), params)
    t0, warm, steps, base = time.perf_counter(), 0, 0, None
    while eng.has_unfinished():
        eng.step()
        decoding = eng.stats().decoding
        if base is not None:
            steps += decoding > 0
        elif decoding == setup.concurrency:  # every request decodes: its hot caches start cold
            warm += 1
            if warm >= setup.warmup:  # measure after the warm-up steps
                base = (eng.store.resolver_census().copy(), eng.stats().generated_tokens)
    if base is None:
        raise ValueError(f"{setup.model}: output_len {setup.output_len} leaves no decode step after "
                         f"{setup.warmup} warm-up steps; raise --output-len")
    return _volume(setup, eng, shape, steps, time.perf_counter() - t0, base)


def _volume(setup: Setup, eng, shape: dict, steps: int, wall: float, base) -> Volume:
    """Census deltas since `base` (census copy, generated tokens) -> Volume."""
    now, (c0, gen0) = eng.store.resolver_census(), base
    c = now.minus(c0)
    B = eng.store.hot_cache_rows
    tokens = max(eng.stats().generated_tokens - gen0, 1)
    row_bytes = eng.arena.formats.latent.nbytes  # one stored latent (GLM) / compressed (V4.1) row, in its format
    per_tok = lambda x: x / tokens  # noqa: E731
    payload_per_sel = shape["payload"] / shape["selecting"]
    full_payload_per_sel = shape["full_payload"] / shape["full_selecting"]
    host_bytes = per_tok(c.bytes_moved)
    sel_scale = shape["full_selecting"] / shape["selecting"]
    missed = c.bytes_moved / max(c.host_selected, 1)
    full = {"selecting_layers": shape["full_selecting"], "payload_layers": shape["full_payload"],
            "selections_per_token": per_tok(c.selected) * sel_scale,
            "host_rows_per_token": per_tok(c.host) * sel_scale,
            "host_bytes_per_token": host_bytes * sel_scale * full_payload_per_sel / payload_per_sel,
            "bytes_per_missed_selection": missed * full_payload_per_sel / payload_per_sel,
            "resolver_calls_per_step": shape["full_selecting"],
            "follower_copies_per_step": (shape["full_payload"] - shape["full_selecting"]) * (setup.model == "glm52-scaled"),
            "hot_cache_bytes_per_session": B * row_bytes * shape["full_payload"]}
    return Volume(
        setup.model, shape["selecting"], shape["payload"], shape["sources"], shape["k"], setup.kv_cache_dtype, row_bytes,
        B, B * row_bytes * shape["payload"], per_tok(c.selected), per_tok(c.host),
        per_tok(c.host_selected), c.host_selected / max(c.selected, 1), host_bytes,
        missed, c.calls / max(steps, 1),
        (shape["payload"] - shape["selecting"]) * (setup.model == "glm52-scaled") * c.calls / max(steps, 1) / shape["selecting"],
        steps, tokens, round(wall, 1), full, paper_block(setup.model, full, c.host_selected / max(c.selected, 1)))


def paper_block(model: str, full: dict, share: float) -> dict:
    """The full plan's values beside the paper's Table 3 figures for `model` (ours / paper)."""
    p = PAPER_TABLE3.get(model)
    if p is None:
        return {}
    out = {"host_fetched_share": share,
           # the paper's figures are at ~1/3 missed; ours at its own share: this is ours at a third
           "host_bytes_per_token_at_third_missed": full["selections_per_token"] * full["bytes_per_missed_selection"] / 3}
    for k, v in p.items():
        lo = v[0] if isinstance(v, tuple) else v  # the smallest budget's value (where the misses are ~1/3)
        ours = full.get(k)
        out[k] = {"ours": ours, "paper": list(v) if isinstance(v, tuple) else v,
                  "ratio": (ours / lo) if ours is not None and lo else None}
    return out


def compare(rows: list[Volume]) -> list[str]:
    """Lines setting the full-plan values beside the paper's (GLM and V4.1 host bytes per token, their
    ratio, bytes per missed selection)."""
    by = {r.model: r for r in rows}
    g, v = by.get("glm52-scaled"), by.get("v41-scaled")
    out = []
    for r in (g, v):
        if r is None:
            continue
        p, f = PAPER_TABLE3[r.model], r.full_plan
        third = r.paper["host_bytes_per_token_at_third_missed"]
        out.append(f"{r.model} full plan vs paper (FP8, smallest budget): host {f['host_bytes_per_token'] / 1e6:.3f} MB/token "
                   f"at a host-fetched share of {r.host_fetched_share:.3f}, {third / 1e6:.3f} MB at a third missed, vs "
                   f"{p['host_bytes_per_token'][0] / 1e6:.2f} MB (paper, ~1/3 missed); "
                   f"{f['bytes_per_missed_selection']:.0f} B per missed selection vs "
                   f"{p['bytes_per_missed_selection']} B; hot cache {f['hot_cache_bytes_per_session'] / 1e6:.1f} MB vs "
                   f"{p['hot_cache_bytes_per_session'] / 1e6:.0f} MB ({r.row_bytes}-B rows)")
    if g is not None and v is not None:
        ratio = g.full_plan["host_bytes_per_token"] / max(v.full_plan["host_bytes_per_token"], 1e-9)
        third = g.paper["host_bytes_per_token_at_third_missed"] / max(v.paper["host_bytes_per_token_at_third_missed"], 1e-9)
        out.append(f"GLM / V4.1 host bytes per token: {ratio:.1f}x as measured, {third:.1f}x at a third missed on both "
                   f"(paper: about {PAPER_RATIO}x)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dhisparse.bench.table3", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--glm-layers", type=int, default=8, help="GLM-5.2 scaled layers kept (full: 78)")
    ap.add_argument("--v41-groups", type=int, default=1, help="V4.1 scaled shared sources kept (full: 4)")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--glm-prompt", type=int, default=3072)
    ap.add_argument("--v41-prompt", type=int, default=3072)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4, help="decode steps excluded (cold hot caches)")
    ap.add_argument("--glm-hot", type=int, default=2048, help="GLM hot cache rows (paper sweep: k..8k)")
    ap.add_argument("--v41-hot", type=int, default=512, help="V4.1 hot cache rows per source (paper sweep: 2k..16k)")
    ap.add_argument("--paper", action="store_true",
                    help="GPU run: full layer plans, the paper's hot caches (V4.1 8192, GLM 4096 rows), long prompts")
    ap.add_argument("--pool-gib", type=float, default=1.0, help="device KV pool and host pool, GiB each")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=64, help="positions (GLM) / rows (V4.1) per page; B rounds up to it")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the models are built there)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="stored row format: auto / bfloat16 (GLM 1152-B, V4.1 1024-B rows) or fp8_e4m3 (656 B, 584 B; "
                         "the paper's Table 3 is FP8)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.paper:
        args.glm_layers, args.v41_groups, args.glm_hot, args.v41_hot = 78, 4, 4096, 8192
        args.glm_prompt, args.v41_prompt = max(args.glm_prompt, 16384), max(args.v41_prompt, 65536)
    common = dict(concurrency=args.concurrency, output_len=args.output_len, warmup=args.warmup, page_size=args.page_size,
                  kv_cache_dtype=args.kv_cache_dtype)
    setups = [Setup("glm52-scaled", args.glm_layers, args.glm_hot, prompt_len=args.glm_prompt, **common),
              Setup("v41-scaled", args.v41_groups, args.v41_hot, prompt_len=args.v41_prompt, **common)]
    pool = int(args.pool_gib * (1 << 30))
    rows = [measure(s, threads=args.threads, pool_bytes=pool, device=args.device) for s in setups]
    for r in rows:
        print(f"{r.model}: {r.selections_per_token:.0f} selections, {r.host_rows_per_token:.1f} host rows, "
              f"{r.host_bytes_per_token / 1e6:.3f} MB host, {r.resolver_calls_per_step:.1f} calls/step per token "
              f"({r.row_bytes}-B rows, {r.kv_cache_dtype})")
    comparison = compare(rows)
    for line in comparison:
        print(line)
    g, v = rows
    notes = [f"per generated decode token per request; hisparse; kv_cache_dtype {args.kv_cache_dtype} "
             f"(GLM {g.row_bytes}-B, V4.1 {v.row_bytes}-B rows) on {args.device}",
             "full_plan scales the truncated run to the full layer plans by selecting / payload layer ratios",
             "the paper's Table 3 is FP8 (paper block per run); its 288 B per missed V4.1 selection is narrower than "
             "our FP8 V4 row (584 B: 448 e4m3 + 64 bf16 rope + 7 e8m0 scales + 1 pad, FlashMLA MODEL1), and its 184 MB "
             "GLM hot cache is 4096 x 78 x 576 B (at 656-B rows: 210 MB)", *comparison]
    config = {"setups": [asdict(s) for s in setups], "threads": args.threads, "device": args.device}
    res = new_result("table3", argv, config, rows, notes)
    res = dataclasses.replace(res, command=shlex.join(["python", "-m", "dhisparse.bench.table3", *argv]))
    print(write_json(res, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
