"""kernels/stage_overflow.py: the one-launch Triton staging of a deferred plan's overflow against its plain-PyTorch
form, bit for bit (loc rewritten in place, src_pad / dst_pad with their zero tails, copy_n, counts), on odd, ragged
and empty shapes, duplicates across a round's queries and positions at bitmap word edges; then a served round
stages through the kernel by default (through the PyTorch form under DHISPARSE_STAGE_KERNEL=0), and both give
the reference's tokens.

Breakages tried (each fails here): the rank without the bits below the position in its word, an inclusive
instead of exclusive prefix, the zero tail starting at the entry count instead of copy_n, the missing test
without `loc < 0`, counts' host_selected counting distinct rows."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dhisparse.core.rows import SPACE  # noqa: E402
from dhisparse.kernels.stage_overflow import stage_overflow_torch, stage_overflow_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(N, K, k, S=5, HP=9, ps=8, miss=0.5, dup=0.3, seed=0):
    """sel [N, K, k] positions < HP * ps with -1 padding and repeats across queries; loc with a `miss` share
    left -1 (placed nowhere); slots distinct of S; stage_loc [S, K*k] SPACE + rows; host_table [S, HP]."""
    g = torch.Generator().manual_seed(seed)
    L = HP * ps
    sel = torch.randint(0, L, (N, K, k), generator=g)
    if K > 1 and k:
        rep = torch.rand((N, K, k), generator=g) < dup
        sel = torch.where(rep, sel[:, :1].expand(-1, K, -1), sel)  # the round's queries share rows
    sel[torch.rand((N, K, k), generator=g) < 0.1] = -1
    loc = torch.where(torch.rand((N, K, k), generator=g) < miss, -1, torch.randint(0, 1000, (N, K, k), generator=g))
    slots = torch.randperm(S, generator=g)[:N]
    stage_loc = SPACE + torch.arange(S * K * k).view(S, K * k) * 3 + 7
    host_table = torch.stack([torch.randperm(HP, generator=g) for _ in range(S)])
    return [t.to(DEV) for t in (sel, loc, slots, stage_loc, host_table)] + [ps]


def _both(sel, loc, slots, stage_loc, host_table, ps):
    la, lb = loc.clone(), loc.clone()
    a = stage_overflow_torch(sel, la, slots, stage_loc, host_table, ps)
    b = stage_overflow_triton(sel, lb, slots, stage_loc, host_table, ps)
    return (la, *a), (lb, *b)


def _assert_same(ref, got):
    for name, x, y in zip(("loc", "src_pad", "dst_pad", "copy_n", "counts"), ref, got):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.cpu(), y.cpu()), name


@pytest.mark.parametrize("N,K,k,S,HP,ps", [(3, 4, 6, 5, 9, 8), (1, 1, 5, 2, 3, 7), (4, 2, 33, 6, 11, 4),
                                           (2, 5, 16, 3, 40, 64), (5, 3, 1, 5, 2, 1)])
def test_the_kernel_stages_what_torch_stages(N, K, k, S, HP, ps):
    ref, got = _both(*_case(N, K, k, S, HP, ps))
    _assert_same(ref, got)
    assert int(ref[3].sum()) > 0  # something was staged


def test_empty_and_nothing_missing():
    for shape in ((0, 2, 4), (2, 0, 4), (2, 3, 0)):
        ref, got = _both(*_case(*shape))
        _assert_same(ref, got)
    sel, loc, *rest = _case(3, 2, 8, miss=0.0)
    ref, got = _both(sel, loc, *rest)
    _assert_same(ref, got)
    assert int(got[3].sum()) == 0 and not bool(got[1].any())


def test_word_edges_and_duplicates_rank_by_position():
    """Positions 31, 32, 63, 64 (bitmap word edges), each selected by several queries: four distinct rows,
    ranked in position order, one copy each."""
    sel, loc, slots, stage_loc, host_table, ps = _case(1, 3, 4, S=2, HP=12, ps=8, miss=1.0)
    sel = torch.tensor([[[64, 31, 63, 32], [31, 31, -1, 64], [32, 63, 63, 31]]], device=DEV)
    loc = torch.full_like(sel, -1)
    ref, got = _both(sel, loc, slots, stage_loc, host_table, ps)
    _assert_same(ref, got)
    s = int(slots[0])
    rank = {31: 0, 32: 1, 63: 2, 64: 3}
    assert got[0][0, 0].tolist() == [int(stage_loc[s, rank[p]]) for p in (64, 31, 63, 32)]
    assert got[3].tolist() == [4] and got[4].tolist() == [0, 0, 0, 4, 11, 0]


@settings(max_examples=25, deadline=None)
@given(N=st.integers(1, 4), K=st.integers(1, 4), k=st.integers(1, 20), HP=st.integers(1, 12),
       ps=st.sampled_from([1, 4, 8, 64]), miss=st.floats(0, 1), dup=st.floats(0, 1), seed=st.integers(0, 10_000))
def test_any_round_stages_the_same(N, K, k, HP, ps, miss, dup, seed):
    ref, got = _both(*_case(N, K, k, S=N + 2, HP=HP, ps=ps, miss=miss, dup=dup, seed=seed))
    _assert_same(ref, got)


@pytest.mark.parametrize("env", [None, "0"])
def test_a_served_round_stages_through_the_chosen_form_and_gives_the_same_tokens(monkeypatch, env):
    """The engine's Triton resolver path: a round whose unions overflow a 16-row hot cache stages through
    the kernel by default (None) and through the PyTorch form under DHISPARSE_STAGE_KERNEL=0, only that
    one, and the greedy tokens equal the reference's either way."""
    from dhisparse import SamplingParams
    from dhisparse.engine.config import EngineConfig
    from dhisparse.engine.engine import Engine
    from dhisparse.engine.llm import LLM
    from dhisparse.kv.hier import staging

    calls = {"triton": 0, "torch": 0}
    for name in calls:
        real = getattr(staging, f"stage_overflow_{name}")
        monkeypatch.setattr(staging, f"stage_overflow_{name}",
                            lambda *a, _n=name, _f=real: calls.__setitem__(_n, calls[_n] + 1) or _f(*a))
    if env is None:
        monkeypatch.delenv("DHISPARSE_STAGE_KERNEL", raising=False)
    else:
        monkeypatch.setenv("DHISPARSE_STAGE_KERNEL", env)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ps = [[3 + (7 * i + 5 * j) % 120 for j in range(60 + 23 * i)] for i in range(3)]
    ref = {tuple(p): o.token_ids for p, o in zip(ps, LLM("tiny").generate(ps, sp))}
    llm = LLM.__new__(LLM)
    llm.engine = Engine(EngineConfig(preset="hisparse", resolver="triton", hot_cache_rows=16, page_size=4,
                                     kv_pool_bytes=1 << 20, max_running_requests=8, speculative_algorithm="oracle",
                                     speculative_num_draft_tokens=4, speculative_oracle_tokens_per_round=3.0),
                        oracle_reference=ref)
    assert [o.token_ids for o in llm.generate(ps, sp)] == [ref[tuple(p)] for p in ps]
    used, unused = ("triton", "torch") if env is None else ("torch", "triton")
    assert calls[used] and not calls[unused]  # the rounds staged through the chosen form only


def test_the_bench_compares_both_forms_on_one_input(tmp_path):
    """bench/stage_overflow_bench.py --quick: both forms timed on the round shape's small twin, equal bit for bit."""
    import json

    from bench import stage_overflow_bench

    out = tmp_path / "so.json"
    assert stage_overflow_bench.main(["--quick", "--widths", "5", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["equal"] and run["staged_rows"] > 0 and run["triton_over_torch"] == run["triton_ms"] / run["torch_ms"]
