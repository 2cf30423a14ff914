"""Expert parallelism inside each role of a prefill/decode world (gloo, CPU processes, fp64, the
tiny model): the layout (EP groups of --ep-size ranks per role) and its refusals naming the flag,
and a world of 2 prefill + 2 decode ranks with `--ep-size 2 --enable-dp-attention` whose greedy
tokens equal the single-process engine's under every preset: both ranks of each role serve
requests (DP attention: each its own; the experts sharded between them, the MoE exchanges inside
the role), with the row and placement checkers and each rank's expert block checked on every rank;
then one request alone, so one rank of each role is idle while the other runs (it joins its role
peer's exchanges with an idle pass).

Breakages tried by hand, and the test that caught each:
  - the exchanges over the whole world instead of the role (`join_ep_groups` keeping the world as
    the data group): test_2p2d_ep2_tokens_equal_one_process, every preset (RankLost within the
    deadline: a 2-way split over a world of 4)
  - a decode rank's expert block swapped (rank 3's stacks flipped along the expert dim, as
    `dist_hooks.swap_experts_on_rank1`): test_2p2d_ep2_tokens_equal_one_process[adaptive] (the tiny
    model's greedy tokens survive it; the logprobs differ by 1.6e-2, the tolerance is 1e-6)
  - an idle rank of a role skipping its idle pass (rank 1's lockstep reports no work and joins no
    exchange, as `dist_hooks.no_idle_pass_on_rank1`): test_2p2d_ep2_tokens_equal_one_process, the
    one-request part (RankLost within the 20 s deadline, not a hang)
"""

from __future__ import annotations

import pytest
import torch

from dhisparse import LLM
from dhisparse.cli import build_parser
from dhisparse.cli.args import engine_config
from dhisparse.core.params import SamplingParams
from dhisparse.engine.config import ConfigValueError, EngineConfig
from dhisparse.engine.disagg_launch import build_disagg
from dist_hooks import ByPreset, generate_on, one_process_tokens, world_presets

PROMPTS = [[5 + (3 * i + j) % 90 for j in range(12 + 9 * i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)  # the logprobs catch a small MoE error too
POOLS = dict(dtype="float64", device="cpu", kv_pool_bytes=8 << 20, host_pool_bytes=16 << 20)
EP = dict(POOLS, dist_timeout_s=20.0, disaggregation_prefill_size=2, disaggregation_decode_size=2, ep_size=2, enable_dp_attention=True)
CHECKER = "disagg_hooks:ep_placement_checker"


def test_layout_of_ep_inside_each_role_and_refusals_name_the_flag():
    args = build_parser().parse_args(["serve", "--disaggregation-prefill-size", "4", "--disaggregation-decode-size", "2",
                                      "--ep-size", "2", "--enable-dp-attention"])
    lay = engine_config(args, full_loader=True).disagg_layout()
    assert lay.world_size == 6 and lay.expert_parallel and not lay.parallel_config().expert_parallel
    assert lay.ep_blocks == [range(0, 2), range(2, 4), range(4, 6)] and [lay.ep_rank(r) for r in range(6)] == [0, 1] * 3
    sgl = EngineConfig(**(EP | dict(tp_size=2, dp_size=2))).disagg_layout()  # SGLang's spelling of DP attention
    assert sgl.ep_blocks == [range(0, 2), range(2, 4)]
    for kw, flag in [(dict(ep_size=3), "--ep-size 3 must divide both role sizes"),
                     (dict(disaggregation_decode_size=3), "--ep-size 2 must divide both role sizes"),
                     (dict(enable_dp_attention=False), "with --ep-size 2: .*--enable-dp-attention"),
                     (dict(ep_size=1, enable_dp_attention=False, tp_size=2), "with --tp-size 2"),
                     (dict(tp_size=4), "--tp-size 4 inside a role"),
                     (dict(dp_size=4), "--dp-size 4 inside a role")]:
        with pytest.raises(ConfigValueError, match=flag):
            EngineConfig(**(EP | kw))


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    return one_process_tokens(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def ref_logprobs() -> dict[str, list[list[float]]]:
    """preset -> one process's logprob of each output token (fp64, the same pools)."""
    return ByPreset(lambda p: logprobs_on(LLM("tiny", preset=p, **POOLS).engine))


def logprobs_on(engine) -> list[list[float]]:
    """Each of PROMPTS run to completion: the logprob of every token reported (streamed)."""
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    got: dict[str, list[float]] = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id].extend(lp.logprob for lp in o.logprobs or [])
    return [got[r] for r in rids]


@pytest.mark.parametrize("preset", world_presets())
def test_2p2d_ep2_tokens_equal_one_process(preset, references, ref_logprobs):
    """Four requests: each prefill and each decode rank serves some (its role peer's exchanges meet
    its own), tokens equal and logprobs within 1e-6 of one process's; then one alone: one rank of
    each role runs, the other joins with idle passes."""
    eng = build_disagg(EngineConfig(model="tiny", preset=preset, **EP), on_engine=CHECKER)
    try:
        assert generate_on(eng, PROMPTS, GREEDY) == references[preset]
        for got, want in zip(logprobs_on(eng), ref_logprobs[preset]):  # fp32 logprobs; EP's tiles: not bit-equal
            assert len(got) == GREEDY.max_tokens and got == pytest.approx(want, abs=1e-6)
        before = [s.admitted for s in eng.rank_stats()]
        assert min(before) >= 1 and sum(before) == 4 * len(PROMPTS)
        assert generate_on(eng, PROMPTS[:1], GREEDY) == references[preset][:1]
        grew = [s.admitted - b for s, b in zip(eng.rank_stats(), before)]
        assert sum(grew[:2]) == sum(grew[2:]) == 1  # one rank of each role ran it, its peer idled
    finally:
        eng.close()
    assert not torch.distributed.is_initialized() and all(not p.is_alive() for p in eng.procs)
