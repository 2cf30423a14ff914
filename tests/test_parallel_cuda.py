"""Issue 32, run 1: parallel worlds on CUDA + NCCL give one GPU's greedy tokens.

Every preset (resident, hisparse, adaptive, adaptive+spec) on the tiny checkpoints (`tiny`: random
weights; `tiny-code`: the trained built-in with its DFlash2 drafter), for DP2, DP2+EP2 (--tp-size 2
--dp-size 2 --enable-dp-attention --ep-size 2), TP2 and 1 prefill + 1 decode (and 2 + 2 with EP2
inside each role where 4 GPUs are visible): the world's greedy tokens must equal the same preset's
on one GPU, with the row checker (I2) on every rank (the placement checker on a decode rank), and
every rank on its own GPU, made current before its engine was built (`rank_spawn.bind_device`).

bf16 ties are avoided by running in float32: on the CPU (gloo), bf16 worlds of these models
already differ from one process under TP2 and EP2 (tensor-parallel partial sums and expert tiles
round differently in bf16; tiny under TP2: 4 of 6 prompts), while float32 worlds were identical
for both models, both presets tried, and TP2, DP2+EP2 and 1+1. A divergence is still reported
with the one-GPU run's logprob margin at the first differing token (`dhisparse.bench.multi_exact
.compare_tokens`: `tie` when under 1e-4), so a near-tie can be told from a broken path; the test
fails on any divergence. Worlds run without CUDA graphs (capture costs seconds a world; graph
exactness on one GPU is tests/test_graphs.py's and test_step_graphs.py's).

Skipped without two GPUs: the CPU / gloo versions of these worlds are tests/test_parallel_*.py and
tests/test_disagg*.py. Environment:
    DHISPARSE_PARALLEL_DEVICE=cpu   the same cases over gloo on the CPU (how this file was checked
                                    before any GPU was lent)
    DHISPARSE_PARALLEL_SHARD=k/n    keep every n-th case from the k-th (GPU pairs of a larger
                                    machine run shards side by side: bench/gpu_multi.sh exact32)
    DHISPARSE_PARALLEL_JSON=PATH    append one JSON line a case (bench/multi_gpu.py exact-report)
    DHISPARSE_PARALLEL_MODELS=a,b   the models (default tiny,tiny-code)
    DHISPARSE_PARALLEL_LAYOUTS=a,b  the layouts (default dp2,dpep2,tp2,pd1+1, and pd2+2ep2 on 4+ GPUs)
NOT yet run on a GPU.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from dhisparse.bench.multi import multicast_off, parse_layout
from dhisparse.bench.multi_exact import compare_tokens, greedy_outputs
from dhisparse.core.params import SamplingParams
from dhisparse.engine.config import EngineConfig

DEVICE = os.environ.get("DHISPARSE_PARALLEL_DEVICE", "cuda")
GPUS = torch.cuda.device_count() if DEVICE == "cuda" and torch.cuda.is_available() else 0
MODELS = tuple(m for m in os.environ.get("DHISPARSE_PARALLEL_MODELS", "tiny,tiny-code").split(",") if m)
PRESETS = ("resident", "hisparse", "adaptive", "adaptive+spec")
LAYOUTS = tuple(l for l in os.environ.get("DHISPARSE_PARALLEL_LAYOUTS", "").split(",") if l) or (
    ("dp2", "dpep2", "tp2", "pd1+1") + (("pd2+2ep2",) if GPUS >= 4 or DEVICE == "cpu" else ()))
PROMPTS = [[5 + (3 * i + j) % 90 for j in range(12 + 11 * i)] for i in range(8)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
POOLS = dict(dtype="float32", device=DEVICE, kv_pool_bytes=8 << 20, host_pool_bytes=16 << 20, cuda_graphs="none")

pytestmark = pytest.mark.skipif(DEVICE == "cuda" and GPUS < 2,
                                reason="needs 2+ GPUs (CUDA + NCCL); the gloo worlds are tests/test_parallel_*.py")


def _shard(cases: list) -> list:
    k, _, n = os.environ.get("DHISPARSE_PARALLEL_SHARD", "0/1").partition("/")
    return cases[int(k)::int(n)]


CASES = _shard([(m, p, l) for m in MODELS for l in LAYOUTS for p in PRESETS])


# -- hooks every rank runs (this module is imported by the spawned ranks) ------------------------

def _on_its_gpu(engine, rank: int) -> None:
    """The rank's engine is on its GPU, which is the process's current device."""
    if DEVICE == "cuda":
        assert engine.device == torch.device("cuda", rank % torch.cuda.device_count()), (rank, engine.device)
        assert torch.cuda.current_device() == engine.device.index, (rank, torch.cuda.current_device())


def rank_check(engine, rank: int) -> None:
    from dist_hooks import row_checker

    _on_its_gpu(engine, rank)
    row_checker(engine, rank)


def pd_check(engine, rank: int) -> None:
    from disagg_hooks import placement_checker

    _on_its_gpu(engine, rank)
    placement_checker(engine, rank)


def pd2_check(engine, rank: int) -> None:
    from disagg_hooks import placement_checker

    _on_its_gpu(engine, rank)
    placement_checker(engine, rank, first_decode=2)


HOOKS = {"pd1+1": "test_parallel_cuda:pd_check", "pd2+2ep2": "test_parallel_cuda:pd2_check"}


# -- the cases -----------------------------------------------------------------------------------

class _Refs(dict):
    def __missing__(self, key):
        model, preset = key
        t = time.perf_counter()
        out = greedy_outputs(EngineConfig(model=model, preset=preset, **POOLS), PROMPTS, GREEDY)
        self[key] = (out, time.perf_counter() - t)
        return self[key]


@pytest.fixture(scope="module")
def references() -> _Refs:
    multicast_off()
    return _Refs()


def _record(row: dict) -> None:
    path = os.environ.get("DHISPARSE_PARALLEL_JSON")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("model,preset,layout", CASES)
def test_world_tokens_equal_one_gpu(model, preset, layout, references):
    lay = parse_layout(layout)
    ref, ref_s = references[(model, preset)]
    cfg = EngineConfig(model=model, preset=preset, dist_timeout_s=120.0, **POOLS, **lay.engine_fields())
    t = time.perf_counter()
    got = greedy_outputs(cfg, PROMPTS, GREEDY, on_engine=HOOKS.get(layout, "test_parallel_cuda:rank_check"))
    result = compare_tokens(ref, got)
    _record({"model": model, "preset": preset, "layout": layout, "flags": lay.flags(), "device": DEVICE,
             "gpus": GPUS, "dtype": POOLS["dtype"], "wall_s": time.perf_counter() - t, "reference_wall_s": ref_s,
             "tokens": sum(len(o.token_ids) for o in got)} | result)
    assert result["equal"], result["diverged"]
