"""How much FP8 KV rows move a model's outputs (issue 25): prefill logits with FP8 rows against plain
rows, and greedy agreement, on the tiny checkpoints of each family (CPU, a few seconds each).

    python3 bench/fp8_quality.py --out bench/results/fp8_quality_cpu_s16.json

For each model: the relative L2 error of every prefill position's fp32 logits, FP8 rows vs plain
rows (mean and max over positions and prompts), next to a yardstick: the same error when the rows
are only rounded to bf16 (what a bf16 KV cache does to an fp32 model). Greedy agreement: the share
of generated tokens equal between --kv-cache-dtype fp8_e4m3 and auto (resident, greedy, N tokens),
and the mean position of the first divergence. Measured, never asserted: these are random-weight
models, whose logits react to any KV perturbation far more than a trained model's (their softmax
over the sparse selection is nearly flat and one flipped top-k choice changes a whole row).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

from dhisparse.bench import results as R  # noqa: E402
from dhisparse.core.batch import ForwardBatch  # noqa: E402
from dhisparse.core.kvformat import KVFormats, RowFormat  # noqa: E402


class Bf16Rows(RowFormat):
    """Plain rows rounded to bf16 and read back in the model dtype: the yardstick."""

    def encode(self, x):
        return x.to(torch.bfloat16).to(self.dtype)


def dsa_logits(lm, ids: list[int], formats) -> torch.Tensor:
    from dhisparse.kv.resident.dense import DenseKV

    kv = DenseKV(lm.config, dtype=lm.model.dtype, formats=formats)
    batch = ForwardBatch.build([(list(ids), 0)])
    return lm.model.logits(lm.model(batch, kv.begin(batch, [0])).hidden).float()


def v4_logits(lm, ids: list[int], formats) -> torch.Tensor:
    from dhisparse.kv.v4.passes import V4Cache
    from dhisparse.kv.v4.rows import DenseRowStore

    cfg = lm.config
    store = DenseRowStore({"kv": cfg.head_dim, "index": cfg.index_head_dim}, "cpu", lm.model.dtype, formats)
    cache = V4Cache(cfg, store=store)
    st = cache.new_request(0)
    batch = ForwardBatch.build([(list(ids), 0)])
    return lm.model.logits(lm.model(batch, cache.begin(batch, [st])).hidden).float()


def formats_of(lm, v4: bool):
    c, dt = lm.config, lm.model.dtype
    if v4:
        fp8 = KVFormats.v4("fp8_e4m3", c.head_dim, c.rope_head_dim, c.index_head_dim, dt)
        dims = (c.head_dim, c.index_head_dim)
    else:
        fp8 = KVFormats.of_model("fp8_e4m3", c, dt)
        dims = (c.latent_dim, c.index_head_dim)
    bf16 = KVFormats(Bf16Rows(dims[0], dt), Bf16Rows(dims[1], dt))
    return fp8, bf16


def rel_errors(fn, lm, prompts, fmt) -> list[float]:
    out = []
    for p in prompts:
        base, got = fn(lm, p, None), fn(lm, p, fmt)
        out += ((got - base).norm(dim=-1) / base.norm(dim=-1)).tolist()
    return out


def greedy_agreement(name: str, lm, prompts, n: int) -> dict:
    from dhisparse import SamplingParams
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine

    sp = SamplingParams(max_tokens=n, ignore_eos=True)
    outs = {}
    for dt in ("auto", "fp8_e4m3"):
        eng = Engine(EngineConfig(kv_cache_dtype=dt, page_size=4), loaded=lm)
        ids = [eng.add_request(p, sp) for p in prompts]
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        outs[dt] = [done[i] for i in ids]
    same = sum(a == b for x, y in zip(outs["auto"], outs["fp8_e4m3"]) for a, b in zip(x, y))
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), n) for x, y in zip(outs["auto"], outs["fp8_e4m3"])]
    return {"tokens": n * len(prompts), "equal_share": same / (n * len(prompts)),
            "mean_first_divergence": sum(first) / len(first), "identical_requests": sum(f == n for f in first)}


def models(tmp: str):
    from hf_fixtures import glm_config, save_hf_checkpoint, v32_config
    from v4_engine_util import loaded_v41
    from dhisparse.models.registry import load_model

    yield "tiny (built-in, 259-token vocab)", load_model("tiny"), False, 259
    yield "GLM-5 tiny (transformers glm_moe_dsa)", load_model(save_hf_checkpoint(glm_config(), f"{tmp}/glm")), False, 128
    yield "DeepSeek-V3.2 tiny (transformers deepseek_v32)", load_model(save_hf_checkpoint(v32_config(), f"{tmp}/v32")), False, 128
    yield "DeepSeek-V4.1 tiny (random)", loaded_v41(), True, 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--out", default="bench/results/fp8_quality.json")
    ns = ap.parse_args(argv)
    torch.set_num_threads(2)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, lm, v4, vocab in models(tmp):
            g = torch.Generator().manual_seed(7)
            prompts = [torch.randint(3, vocab, (ns.prompt_len,), generator=g).tolist() for _ in range(ns.prompts)]
            fn = v4_logits if v4 else dsa_logits
            fp8, bf16 = formats_of(lm, v4)
            e8, e16 = rel_errors(fn, lm, prompts, fp8), rel_errors(fn, lm, prompts, bf16)
            row = {"model": name, "model_dtype": str(lm.model.dtype), "row_bytes_fp8": fp8.latent.nbytes,
                   "logits_rel_error_fp8": {"mean": sum(e8) / len(e8), "max": max(e8)},
                   "logits_rel_error_bf16_rows": {"mean": sum(e16) / len(e16), "max": max(e16)},
                   "greedy": greedy_agreement(name, lm, prompts, ns.tokens)}
            runs.append(row)
            print(f"{name}: fp8 mean {row['logits_rel_error_fp8']['mean']:.4f} max {row['logits_rel_error_fp8']['max']:.4f}"
                  f" | bf16 rows mean {row['logits_rel_error_bf16_rows']['mean']:.4f} | greedy equal "
                  f"{row['greedy']['equal_share']:.3f}", flush=True)
    config = vars(ns) | {"machine": "CPU"}
    notes = ["random-weight tiny models: logits react to any KV perturbation far more than a trained model's; "
             "the bf16-rows column is the yardstick measured on the same prompts"]
    R.write_json(R.new_result("fp8_quality", ["bench/fp8_quality.py"] + list(sys.argv[1:] if argv is None else argv),
                              config, runs, notes), ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
