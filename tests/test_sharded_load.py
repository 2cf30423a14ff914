"""Sharded checkpoint loading (models/shard_load.py, models/slice_read.py): each TP / EP rank reads
only the parts it keeps from a sharded safetensors checkpoint, into a model built at its local
shapes; CPU, fp32 / fp64.

Shown: a rank's parameters equal `load_checkpoint` then the in-memory sharding (layers/tp.py,
layers/ep_moe.py) bitwise, TP2 and EP2, per-expert and stacked expert names; another rank's experts
are never read; the FP8 reader against dequantize-whole-then-slice at block-aligned and unaligned
boundaries, and an FP8 checkpoint sharded-loaded against whole-loaded-then-sliced; each rank's peak
host memory (fresh spawned processes, RSS high-water rise over load + touching every parameter)
under 0.65x of one process loading the whole ~200 MB checkpoint, TP2 and EP2; TP2 and DP2+EP2
worlds loaded from a checkpoint folder give one process's greedy tokens.

Breakages tried by hand, each failing the tests named:
  - a neighbour's scale block (`slice_read.CheckpointFiles._fp8_part`: first block row
    ceil(lo / b) instead of lo // b, or lo // b + 1): the FP8 reader test and the FP8 checkpoint
    test (tp1, ep0, ep1 for the first; every rank for the second);
  - the scale slicing dropped (each part's covering blocks taken from block 0, the whole tensor's
    first ones, with only the offset inside a block kept): the FP8 reader test and the FP8
    checkpoint test, every rank (the small window starts chunks past block 0 on rank 0 too);
  - the whole tensor read and then cut (`read_into` copying `get_tensor(name)`, FP8 dequantized
    whole, then `Cut.take`): the memory test (a rank's peak about +500 MiB, TP2 and EP2, against +205 MiB
    for one process loading everything) and the TP parameter tests (`bytes_read`);
  - the window never released (`CheckpointFiles._touch` without `release`): the memory test (the
    mapped pages a rank touched stay resident: +220 to +280 MiB);
  - gate and up halves of the TP expert cut swapped (`expert_place` filling the other half's rows):
    the TP parameter tests and the TP FP8 checkpoint tests;
  - the launch path loading a folder whole then sharding (registry: `load_checkpoint` + in-memory
    shard instead of `load_sharded`): both world tests (no LoadReport on the ranks).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dhisparse.core.config import ModelConfig
from dhisparse.core.parallel import ParallelConfigError
from dhisparse.core.params import SamplingParams
from dhisparse.engine.config import EngineConfig
from dhisparse.engine.launch import build
from dhisparse.layers.tp import Cut
from dhisparse.models.dsa import DsaForCausalLM
from dhisparse.models.loader import ModelLoadError, dequantize_fp8, load_checkpoint, read_config
from dhisparse.models.shard_load import ShardSpec, host_peak_bytes, load_sharded, shard_in_memory
from dhisparse.models.slice_read import CheckpointFiles
from dhisparse.models.tiny import TINY_CONFIG, build_tiny
from dist_hooks import generate_on

SPECS = [ShardSpec(mode, r, 2) for mode in ("tp", "ep") for r in range(2)]
_STACK = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# the memory checkpoint: one dense and one MoE layer, 192 MB of stacked fp32 expert weights
MEM_CONFIG = dict(TINY_CONFIG, hidden_size=2048, moe_intermediate_size=1024, num_hidden_layers=2, n_shared_experts=0,
                  indexer_types=["full", "shared"])
WINDOW = 4 << 20


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors split into checkpoint names `...experts.{e}.{gate,up,down}_proj.weight`."""
    out = {}
    for name, t in state.items():
        m = _STACK.match(name)
        if m is None:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            halves = dict(zip(("gate_proj", "up_proj"), t[e].chunk(2)))
            parts = {"down_proj": t[e]} if m.group(2) == "down_proj" else halves
            out |= {f"{m.group(1)}.{e}.{k}.weight": v for k, v in parts.items()}
    return out


def _write(folder: Path, state: dict[str, torch.Tensor], config: dict, n_shards: int = 3) -> Path:
    """state as n shards + model.safetensors.index.json + config.json (names dealt round-robin)."""
    folder.mkdir(parents=True)
    names, weight_map = sorted(state), {}
    for s in range(n_shards):
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({n: state[n].contiguous() for n in names[s::n_shards]}, str(folder / fname))
        weight_map |= {n: fname for n in names[s::n_shards]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax e4m3: (w_fp8 [out, in], scale_inv [ceil(out/bo), ceil(in/bi)])."""
    (bo, bi), (R, C) = block, w.shape
    r, c = math.ceil(R / bo), math.ceil(C / bi)
    pad = torch.zeros(r * bo, c * bi)
    pad[:R, :C] = w
    blocks = pad.view(r, bo, c, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(r * bo, c * bi)[:R, :C].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def _same_as_whole_then_sharded(folder: Path, spec: ShardSpec, **kw) -> None:
    ref = load_checkpoint(folder, **kw).model
    shard_in_memory(ref, spec)
    got = load_sharded(folder, spec, window_bytes=1 << 12, **kw)
    a, b = ref.state_dict(), got.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (spec, k)
    assert got.report.mode == spec.mode and got.report.rank == spec.rank


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """The built-in tiny model's weights as a 3-shard checkpoint with per-expert names."""
    state = build_tiny(0, torch.float32).model.state_dict()
    return _write(tmp_path_factory.mktemp("shard") / "tiny", _per_expert(state), TINY_CONFIG)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}{s.rank}")
def test_a_ranks_parameters_equal_the_whole_model_then_sharded(tiny_folder, spec):
    _same_as_whole_then_sharded(tiny_folder, spec, dtype=torch.float64)
    report, everything = load_sharded(tiny_folder, spec).report, load_sharded(tiny_folder, ShardSpec("ep", 0, 1)).report
    skipped = 5 * 4 * 3 if spec.mode == "ep" else 0  # MoE layers x another rank's experts x (gate, up, down)
    assert report.tensors_skipped == skipped and everything.tensors_skipped == 0
    if spec.mode == "ep":  # exactly the other experts' bytes are never read (each [32, 64] fp32)
        assert report.bytes_read == everything.bytes_read - skipped * 32 * 64 * 4
    else:  # every rank's halves: heads, index heads, intermediate blocks
        assert report.bytes_read < 0.65 * everything.bytes_read
    assert report.host_peak_bytes >= 0 and report.device_peak_bytes is None


def test_stacked_expert_names_and_refusals(tiny_folder, tmp_path):
    state = build_tiny(0, torch.float32).model.state_dict()
    folder = _write(tmp_path / "stacked", state, TINY_CONFIG, n_shards=2)
    for spec in SPECS:
        _same_as_whole_then_sharded(folder, spec)
    with pytest.raises(ParallelConfigError, match="--tp-size 3 must divide the model's 4 attention heads"):
        load_sharded(folder, ShardSpec("tp", 0, 3))
    with pytest.raises(ValueError, match="--ep-size 3 must divide the model's 8 routed experts"):
        load_sharded(folder, ShardSpec("ep", 0, 3))
    del state["model.layers.3.mlp.experts.down_proj"]
    broken = _write(tmp_path / "missing", state, TINY_CONFIG, n_shards=2)
    with pytest.raises(ModelLoadError, match="1 tensor\\(s\\) missing .*layers.3.mlp.experts.down_proj"):
        load_sharded(broken, ShardSpec("ep", 1, 2))


def test_fp8_reader_equals_dequantize_whole_then_slice_at_aligned_and_unaligned_boundaries(tmp_path):
    g = torch.Generator().manual_seed(0)
    w2, w3 = torch.randn(384, 320, generator=g), torch.randn(4, 256, 200, generator=g)
    q2, s2 = _quantize(w2, (128, 128))
    q3, s3 = zip(*(_quantize(w, (128, 128)) for w in w3))
    q3, s3 = torch.stack(q3), torch.stack(s3)
    tmp_path.joinpath("fp8").mkdir()
    save_file({"a": q2, "a_scale_inv": s2, "b": q3, "b_scale_inv": s3}, str(tmp_path / "fp8" / "model.safetensors"))
    files = CheckpointFiles(tmp_path / "fp8", window_bytes=5 * 320)  # chunks of 5 rows: inside blocks
    whole = {"a": dequantize_fp8(q2, s2, (128, 128)), "b": dequantize_fp8(q3, s3, (128, 128))}
    cuts = {"a": [Cut(0, ((128, 256),)), Cut(1, ((128, 256),)), Cut(0, ((64, 192),)), Cut(1, ((100, 228),)),
                  Cut(0, ((0, 48), (200, 260))), Cut(0, ((250, 384),))],
            "b": [Cut(0, ((2, 4),)), Cut(1, ((128, 256),)), Cut(1, ((16, 32), (144, 160))), Cut(2, ((60, 190),))]}
    for name, name_cuts in cuts.items():
        for cut in name_cuts:
            want = cut.take(whole[name])
            got = torch.empty(want.shape, dtype=torch.float64)
            files.read_into(got, name, cut, (128, 128))
            assert torch.equal(got, want.double()), (name, cut)
    assert (whole["a"] - w2).abs().max() < 0.1 * w2.abs().max()  # a real quantization


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory) -> Path:
    """The tiny model with every projection FP8 (block 32 x 32: TP boundaries at 16 / 48 rows are
    not block multiples, 64 are)."""
    state = _per_expert(build_tiny(1, torch.float32).model.state_dict())
    for name in [n for n, t in state.items() if t.dim() == 2 and "proj" in n]:
        state[name], state[name + "_scale_inv"] = _quantize(state[name], (32, 32))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}
    config = dict(TINY_CONFIG, quantization_config=quant)
    return _write(tmp_path_factory.mktemp("shard") / "fp8", state, config)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}{s.rank}")
def test_fp8_checkpoint_sharded_equals_whole_then_sliced(fp8_folder, spec):
    assert read_config(fp8_folder).fp8_block_size == (32, 32)
    _same_as_whole_then_sharded(fp8_folder, spec)


def _measure(folder: str, mode: str, rank: int, out) -> None:
    """Spawned: the RSS high-water rise of one load (+ touching every parameter, so mapped pages
    count); a rank also checks its parameters against the whole model then sharded."""
    torch.set_num_threads(1)
    with torch.device("meta"):  # the process's one-time costs (the first model build imports ~800 modules)
        DsaForCausalLM(ModelConfig.from_hf(TINY_CONFIG))
    torch.cat([torch.ones(4), torch.ones(4)]).sum()
    before = host_peak_bytes()
    spec = ShardSpec(mode, rank, 2) if mode != "whole" else None
    lm = load_checkpoint(folder) if spec is None else load_sharded(folder, spec, window_bytes=WINDOW)
    sum(float(p.detach().sum()) for p in lm.model.parameters())
    result = {"peak": host_peak_bytes() - before}
    if spec is not None:
        ref = load_checkpoint(folder).model
        shard_in_memory(ref, spec)
        a, b = ref.state_dict(), lm.model.state_dict()
        result |= {"equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
                   "reported": lm.report.host_peak_bytes, "read": lm.report.bytes_read}
    out.put((mode, rank, result))


@pytest.fixture(scope="module")
def mem_folder(tmp_path_factory) -> Path:
    """~200 MB: stacked expert tensors (gate_up [8, 2048, 2048], down [8, 2048, 1024], fp32)."""
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in DsaForCausalLM(ModelConfig.from_hf(MEM_CONFIG)).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}
    return _write(tmp_path_factory.mktemp("shard") / "mem", state, MEM_CONFIG, n_shards=4)


def test_each_ranks_peak_host_memory_is_about_half_of_one_process(mem_folder):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    jobs = [("whole", 0), ("tp", 0), ("tp", 1), ("ep", 0), ("ep", 1)]
    procs = [ctx.Process(target=_measure, args=(str(mem_folder), m, r, q)) for m, r in jobs]
    for p in procs:
        p.start()
    try:
        got = {(m, r): res for m, r, res in (q.get(timeout=120) for _ in jobs)}
    finally:
        for p in procs:
            p.join(timeout=30)
    whole = got["whole", 0]["peak"]
    size = sum(p.stat().st_size for p in mem_folder.glob("*.safetensors"))
    assert whole > 0.9 * size  # one process holds every byte
    for key, res in got.items():
        print(key, f"peak +{res['peak'] / 2**20:.1f} MiB ({res['peak'] / whole:.2f}x one process), {res}")
        if key[0] != "whole":
            assert res["equal"], key
            assert res["peak"] < 0.65 * whole, (key, res["peak"], whole)
            assert res["read"] < 0.55 * size and abs(res["reported"] - res["peak"]) < (16 << 20)  # LoadReport's own


def sharded_on_every_rank(engine, rank: int) -> None:
    """A rank hook (launch on_engine): this rank's model came from the sharded loader."""
    report = engine.loaded.report
    assert report is not None and report.rank == rank and report.world == 2, f"rank {rank}: not sharded-loaded"


PROMPTS = [[5 + (3 * i + j) % 90 for j in range(10 + 9 * i)] for i in range(3)]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
POOLS = dict(dtype="float64", device="cpu", preset="resident", kv_pool_bytes=8 << 20, host_pool_bytes=16 << 20)
WORLDS = {"tp2": dict(tp_size=2), "dp2ep2": dict(tp_size=2, dp_size=2, ep_size=2, enable_dp_attention=True)}


@pytest.mark.parametrize("world", list(WORLDS))
def test_worlds_loaded_from_a_sharded_checkpoint_give_one_process_tokens(tiny_folder, world):
    from dhisparse import LLM

    llm = LLM(str(tiny_folder), **POOLS)
    try:
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()
    engine = build(EngineConfig(model=str(tiny_folder), dist_timeout_s=20.0, **POOLS, **WORLDS[world]),
                   on_engine="test_sharded_load:sharded_on_every_rank")
    try:
        assert generate_on(engine, PROMPTS, GREEDY) == want
        assert engine.engine.loaded.report.mode == ("tp" if world == "tp2" else "ep")
    finally:
        engine.close()
