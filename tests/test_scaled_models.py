"""Scaled benchmark models (config shapes, a reduced-layer CPU build) and the GPU serving driver's smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from dhisparse.models.registry import BUILTINS
from dhisparse.models.scaled import build_scaled, param_count, scaled_config

ROOT = Path(__file__).resolve().parents[1]


def test_glm52_scaled_kv_structure():
    cfg = scaled_config("glm52-scaled")
    assert cfg.architecture == "glm_moe_dsa" and cfg.num_layers == 78
    assert sum(cfg.indexer_full) == 21 and cfg.num_layers - sum(cfg.indexer_full) == 57
    assert cfg.latent_dim == 576 and cfg.kv_lora_rank == 512 and cfg.qk_rope_head_dim == 64
    assert cfg.index_head_dim == 128 and cfg.index_topk == 2048 and cfg.index_n_heads >= 8
    assert cfg.latent_dim * 2 == 1152  # bf16 latent row bytes
    assert 30000 <= cfg.vocab_size <= 40000


def test_dsv32_scaled_kv_structure():
    cfg = scaled_config("dsv32-scaled")
    assert cfg.architecture == "deepseek_v32" and cfg.num_layers == 61 and all(cfg.indexer_full)
    assert cfg.latent_dim == 576 and cfg.index_head_dim == 128 and cfg.index_topk == 2048


def test_weights_are_a_few_gb():
    for name in ("glm52-scaled", "dsv32-scaled"):
        gb = param_count(scaled_config(name)) * 2 / 1e9
        assert 1.0 < gb < 4.0, (name, gb)


def test_registered():
    assert {"glm52-scaled", "dsv32-scaled"} <= set(BUILTINS)


def test_reduced_build_runs_finite_on_cpu():
    lm = build_scaled("glm52-scaled", num_layers=6, dtype=torch.bfloat16)
    assert lm.config.num_layers == 6 and lm.model.lm_head.weight.dtype == torch.bfloat16
    assert lm.model.model.layers[5].mlp.gate.weight.dtype == torch.float32
    again = build_scaled("glm52-scaled", num_layers=6, dtype=torch.bfloat16)
    assert torch.equal(lm.model.lm_head.weight, again.model.lm_head.weight)
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine
    from dhisparse.core.params import SamplingParams
    from dhisparse.models.tokenizer import ByteTokenizer
    import dataclasses

    lm = dataclasses.replace(lm, tokenizer=ByteTokenizer())
    hidden = []
    lm.model.model.layers[-1].register_forward_hook(lambda m, i, o: hidden.append(o[0].float()))
    e = Engine(EngineConfig(model="glm52-scaled", device="cpu", dtype="bfloat16", page_size=64, kv_pool_bytes=1 << 30), loaded=lm)
    e.add_request(list(range(3, 200)), SamplingParams(max_tokens=4, ignore_eos=True))
    toks = []
    while e.has_unfinished():
        toks += [t for o in e.step() for t in o.new_token_ids]
    assert len(toks) == 4 and all(t < 259 for t in toks)
    h = torch.cat([x.reshape(-1) for x in hidden])
    assert torch.isfinite(h).all() and 0.3 < h.pow(2).mean().sqrt() < 10


def test_greedy_continuation_has_a_wide_margin():
    """The confident head: the next token is a function of the current one (any context), with the
    top logit far above the second, so greedy output survives a batch's GEMM rounding on a GPU."""
    import dataclasses

    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine
    from dhisparse.core.params import SamplingParams
    from dhisparse.models.tokenizer import ByteTokenizer

    lm = dataclasses.replace(build_scaled("glm52-scaled-k512", num_layers=4, dtype=torch.float32), tokenizer=ByteTokenizer())
    gaps = []
    logits = lm.model.logits
    lm.model.logits = lambda h: (lambda out: gaps.append(out.topk(2, -1).values.diff(dim=-1).neg().min()) or out)(logits(h))
    e = Engine(EngineConfig(model="glm52-scaled-k512", device="cpu", page_size=64, kv_pool_bytes=1 << 28,
                            cuda_graphs="none"), loaded=lm)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() + [77] for n in (40, 90)]
    out = {}
    for i, p in enumerate(prompts):
        out[e.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))] = i
    seqs = [None, None]
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                seqs[out[o.request_id]] = o.token_ids
    assert seqs[0] == seqs[1]  # same last prompt token, different contexts: same continuation
    nxt = {}
    for a, b in zip(seqs[0], seqs[0][1:]):
        assert nxt.setdefault(a, b) == b
    assert min(float(x) for x in gaps) > 4.0  # logit units; random heads leave gaps of ~0.1


def test_gpu_serving_quick(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_serving.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert {r["preset"] for r in data["runs"]} == {"hisparse", "adaptive", "adaptive+spec", "resident"}
    assert "adaptive/hisparse@C2" in data["config"]["ratios"] and data["config"]["sizing"]["kv_pool_pages"] > 0
    assert data["config"]["wall_s"] < 60
