"""Issue 33's side-by-side harness (bench/peer/, bench/resolver_peer_live.py), on the CPU: the translation of our
resolver state into SGLang's HiSparse tables and the peer's contract that its GPU output is checked against.

The peer's kernel itself only runs on a GPU (bench/resolver_peer_live.py checks its output against
`peer_expected` there). Breakages tried: the LRU order reversed (newest first: the victims differ, caught below
in-test), misses paired with victims from the MRU end, the newest token not routed to slot H, host rows without
the page size (each caught by the contract tests)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import zipfile

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.peer.hisparse_peer import (PeerKernel, PeerState, check_args, host_rows_of, lru_order,  # noqa: E402
                                      peer_expected, peer_state)
from dhisparse.kernels.resolver_ref import ResolverState  # noqa: E402


def _state(N=1, H=4, L=12, ps=4) -> ResolverState:
    i64 = dict(dtype=torch.int64)
    table = torch.tensor([[2, 0, 1]] * N, **i64)
    return ResolverState(torch.full((N, H), -1, **i64), torch.zeros((N, H), **i64),
                         (torch.arange(N * H, **i64).view(N, H) + 100), torch.full((N,), L, **i64),
                         torch.arange(N * 2, **i64).view(N, 2) + 500, table, ps)


def test_host_rows_follow_the_page_table_and_lru_is_oldest_first_ties_by_slot():
    st = _state()
    assert host_rows_of(st, 12).tolist() == [[8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert lru_order(torch.tensor([[5, 1, 5, 0]])).tolist() == [[3, 1, 0, 2]]
    assert lru_order(torch.tensor([[5, 1, 5, 0]])).dtype == torch.int16


def test_the_peer_contract_hits_newest_and_misses_in_order():
    """Slots hold 3, 7, 9, -1 (stamps 4, 1, 9, 0: LRU order 3, 1, 0, 2); selecting 9 (hit, slot 2), 5 (miss),
    12 (the newest: slot H), 7 (hit, slot 1), 2 (miss): the misses take the stale slots oldest first, 3 then 0."""
    st = _state()
    st.hot_pos[0] = torch.tensor([3, 7, 9, -1])
    st.hot_stamp[0] = torch.tensor([4, 1, 9, 0])
    ps = peer_state(st, 12)
    ps.seq[0] = 13  # the newest token is 12 (our tail's first position)
    out, victims = peer_expected(ps, torch.tensor([[9, 5, 12, 7, 2]], dtype=torch.int32))
    assert out.tolist() == [[102, 103, 500, 101, 100]]
    assert victims[0].tolist() == [3, 0]
    assert ps.tokens[0].tolist() == [3, 7, 9, -1, 12] and ps.locs[0, 4] == 500
    assert ps.host_locs.shape == (1, 13) and ps.lru.tolist() == [[3, 1, 0, 2]]


def test_peer_state_refuses_a_tail_that_a_selection_could_reach():
    st = _state()
    st.tail_start[0] = 10
    with pytest.raises(ValueError, match="tail"):
        peer_state(st, 12)


def test_peer_state_refuses_a_history_the_peer_would_take_its_short_path_for():
    with pytest.raises(ValueError, match="short|fast path"):
        peer_state(_state(H=4, L=3), 3)


def _args(N=1, H=4, L=12, rb=32):
    ps = peer_state(_state(N=N, H=H, L=L), L)
    top_k = torch.zeros((N, 5), dtype=torch.int32)
    rows = lambda: torch.zeros((8, rb // 2), dtype=torch.int16)  # noqa: E731 - rows of rb bytes
    return ps, top_k, torch.empty_like(top_k), rows(), rows(), rb


def test_check_args_names_what_the_peer_kernel_cannot_take():
    """The launch's checks read shapes, dtypes, devices and strides only. On the CPU every tensor is off the
    GPU, which it says; a wrong table dtype, a locs width unlike tokens', rows of another width and an item
    size the 16-B vector copies cannot move are named too."""
    ps, top_k, out, host, dev, rb = _args()
    with pytest.raises(ValueError) as e:
        check_args(ps, top_k, out, host, dev, rb)
    msg = str(e.value)
    assert "top_k on cpu" in msg and "pageable" in msg and "lru" not in msg and "item_bytes" not in msg
    bad = dataclasses.replace(ps, lru=ps.lru.to(torch.int32), locs=ps.locs[:, :-1])
    with pytest.raises(ValueError) as e:
        check_args(bad, top_k, out, host, dev, 24)
    msg = str(e.value)
    assert "lru torch.int32" in msg and "locs" in msg and "not linear rows of 24 B" in msg and "item_bytes 24" in msg


def test_the_translation_gives_our_hits_and_victims_and_a_reversed_lru_does_not():
    """On the benchmark's own quick cases (bench/resolver_peer.py `build`), the peer's contract on the
    translated state has our `plan_reference`'s hit locations, victims (as a set) and miss count. The same
    check fails with the LRU order reversed."""
    from bench import resolver_peer_live as live
    from bench.resolver_cases import Rig
    from bench.resolver_peer import build, shapes

    rig = Rig(quick=True)
    sh = shapes(True)
    for level in ("20%", "all"):
        case = build(rig, sh, 32, 3, 656, level)
        now = int(case.state.hot_stamp.max()) + 1
        chk, exp = live.translation_check(case, now, peer_state(case.state, case.history))
        assert chk["hits"] and chk["victims"] and chk["misses"] == chk["ours_host_rows"] > 0, chk
        assert exp.shape == case.sel[:, 0].shape and exp.dtype == torch.int32
    ps = peer_state(case.state, case.history)  # the breakage: newest first
    chk, _ = live.translation_check(case, now, dataclasses.replace(ps, lru=ps.lru.flip(1)))
    assert chk["hits"] and not chk["victims"]


def test_peer_kernel_names_the_build_when_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench/peer/build.py"):
        PeerKernel(tmp_path / "libhisparse_peer.so")


def test_build_extracts_only_the_named_members(tmp_path):
    from bench.peer.build import extract

    whl = tmp_path / "w.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for name in ("a/include/x.h", "a/include/sub/y.h", "a/other.py", "b/k.cuh"):
            z.writestr(name, "//")
    assert extract(whl, ("a/include/", "b/k.cuh"), tmp_path / "out") == 3
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file()) == [
        "a/include/sub/y.h", "a/include/x.h", "b/k.cuh"]


def test_peer_state_copy_is_deep():
    ps = peer_state(_state(), 12)
    for c in (ps.copy(), ps.copy("cpu")):
        c.lru.fill_(0)
        assert isinstance(c, PeerState) and not torch.equal(c.lru, ps.lru)


def test_peer_check_reads_the_peers_locations_and_copied_rows():
    """bench/resolver_peer_live.py's `peer_check` against a stand-in peer that keeps the contract (its
    locations, its misses' rows copied): both checks pass; a stand-in that skips one row's copy fails `rows`,
    one that returns another victim fails `locations`."""
    from bench import resolver_peer_live as live
    from bench.resolver_cases import Rig
    from bench.resolver_peer import build, shapes

    rig = Rig(quick=True)
    case = build(rig, shapes(True), 32, 2, 656, "20%")
    now = int(case.state.hot_stamp.max()) + 1
    ps0 = peer_state(case.state, case.history)
    _, exp = live.translation_check(case, now, ps0)

    class Stand:
        def __init__(self, skip_row=False, swap=False):
            self.skip_row, self.swap = skip_row, swap

        def run(self, ps, top_k, out, host, dev, item_bytes, skip_io=False):
            got, _ = peer_expected(ps, top_k)
            hf, df = host.reshape(-1, host.shape[-1]), dev.reshape(-1, dev.shape[-1])
            hot = case.state.hot_pos
            for n in range(top_k.shape[0]):
                for i, t in enumerate(top_k[n].tolist()):
                    if t not in hot[n].tolist():
                        if not (self.skip_row and n == 0):
                            df[got[n, i]] = hf[ps.host_locs[n, t]]
                        if self.swap and n == 1:
                            got[n, i] = got[n, i] + 1
            out.copy_(got)

    cuda_sync = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a: None  # the stand-in runs on the CPU
    try:
        ok = live.peer_check(Stand(), rig, case, ps0, exp)
        bad_row = live.peer_check(Stand(skip_row=True), rig, case, ps0, exp)
        bad_loc = live.peer_check(Stand(swap=True), rig, case, ps0, exp)
    finally:
        torch.cuda.synchronize = cuda_sync
    assert ok["locations"] and ok["rows"] and ok["copies"] > 0
    assert bad_row["locations"] and not bad_row["rows"]
    assert not bad_loc["locations"]


def test_live_times_ours_on_both_states_and_restores_each():
    """bench/resolver_peer_live.py's `time_pair` with the index case: ours on the scan state (plan + copy, fused,
    plan alone) and on the hot_entry index state (plan + copy, fused), each call on restored states, and every
    state (hot_entry included) back as it was after. Breakage caught: hot_entry left out of the restore."""
    from bench import resolver_peer_live as live
    from bench.resolver_cases import Rig, index_case
    from bench.resolver_peer import build, shapes

    rig = Rig(quick=True)
    case = build(rig, shapes(True), 32, 2, 656, "20%")
    icase = index_case(case)
    before = [t.clone() for s in (case.state, icase.state) for t in (s.hot_pos, s.hot_stamp, s.hot_entry) if t is not None]
    rec = live.time_pair(rig, None, case, peer_state(case.state, case.history), lambda: None, 1, 1, icase)
    assert set(live.FORMS) | {"ours_plan"} <= set(rec) and "ratios" not in rec
    after = [t for s in (case.state, icase.state) for t in (s.hot_pos, s.hot_stamp, s.hot_entry) if t is not None]
    assert len(after) == 5 and all(torch.equal(a, b) for a, b in zip(before, after))


def test_live_ratios_name_the_fastest_form():
    """`ratios`: every timed form over the peer, `best_over_peer` over the scan state's two forms only (as session
    51's file has it), `best4_*` over all four."""
    from bench import resolver_peer_live as live

    t = lambda us: {"time_ms": us / 1e3}  # noqa: E731
    rec = {"ours_plan_copy": t(30.0), "ours_fused": t(25.0), "ours_index_plan_copy": t(28.0), "ours_index_fused": t(20.0),
           "ours_plan": t(18.0), "peer": t(24.0), "peer_plan": t(20.0)}
    r = live.ratios(rec)
    assert r["best_over_peer"] == pytest.approx(25 / 24) and r["best4_over_peer"] == pytest.approx(20 / 24)
    assert r["best4_form"] == "index, fused" and r["index_fused_over_peer"] == pytest.approx(20 / 24)
    assert r["plan_copy_over_peer"] == pytest.approx(30 / 24) and r["plan_over_peer_plan"] == pytest.approx(0.9)


def test_live_interleaves_the_forms_in_rotated_rounds():
    """`interleaved`: each form's timed calls split over the rounds (20 calls, 4 rounds: 5 a round; 7 over 3: 3, 2,
    2), the forms' order rotated by one a round, so a drift during a case falls on every form alike; warm-up calls
    before a form's first round only, a restore before every call, every timed call counted once. Breakages caught:
    the rotation dropped (every round A, B, C), warm-up in every round, and the remainder calls lost (7 over 3 as 2 a
    round)."""
    from bench import resolver_peer_live as live
    from bench.resolver_cases import Rig

    rig, seen, restores = Rig(quick=True), [], []
    forms = {k: (lambda k=k: seen.append(k)) for k in "ABC"}
    rec = live.interleaved(rig, forms, lambda: restores.append(1), 20, 2, 4)
    assert seen[:7] == ["A"] * 7 and seen[7:14] == ["B"] * 7  # A's 2 warm-up calls and 5 timed, then B's
    rounds = [seen[:21], seen[21:36], seen[36:51], seen[51:]]  # round 0 has the 6 warm-up calls
    assert [r[-1] for r in rounds] == ["C", "A", "B", "C"] and [rounds[r][0] for r in (1, 2, 3)] == ["B", "C", "A"]
    assert len(seen) == 3 * (20 + 2) == len(restores) and all(rec[k]["n_timings"] == 20 for k in "ABC")
    seen.clear()
    rec = live.interleaved(rig, forms, lambda: None, 7, 0, 3)
    assert "".join(seen) == "AAA" "BBB" "CCC" + "BB" "CC" "AA" + "CC" "AA" "BB"  # 3, 2, 2 calls; order rotated
    assert all(rec[k]["n_timings"] == 7 for k in "ABC")
    assert live.interleaved(rig, forms, lambda: None, 2, 0, 4)["A"]["n_timings"] == 2  # more rounds than calls


def test_live_case_filter_names_cases_as_built():
    """resolver_peer_live.py's --cases matches `case_name`, the name `build` gives a case, so a filter written
    against a result file's names selects those cases. Breakage caught: build naming cases by another format."""
    import re

    from bench.resolver_cases import Rig
    from bench.resolver_peer import build, case_grid, case_name, shapes

    rig, sh = Rig(quick=True), shapes(True)
    H, N, rb, level = next(c for c in case_grid(sh) if c[3] == "20%")
    assert build(rig, sh, H, N, rb, level).name == case_name(H, N, rb, level) == f"20%_N{N}_H{H}_{rb}B"
    picked = [c for c in case_grid(sh) if re.search(r"^20%_N\d+_H32_", case_name(*c))]
    assert picked and all(c[3] == "20%" and c[0] == 32 for c in picked)


def test_live_checks_the_first_batch_run_of_each_kind():
    """resolver_peer_live.py checks our plan against the reference on the first case run of each (H, row size, miss
    level): unfiltered the grid's smallest batch, as before --cases; filtered to larger batches, still one of each.
    (The breakage of main checking only the grid's smallest batch is caught by the next test.)"""
    from bench import resolver_peer_live as live
    from bench.resolver_peer import case_grid, shapes

    sh = shapes(True)
    seen: set = set()
    picked = [c for c in case_grid(sh) if live.first_batch(seen, c[0], c[2], c[3])]
    assert picked == [c for c in case_grid(sh) if c[1] == sh["batches"][0]]
    seen.clear()
    later = [c for c in case_grid(sh) if c[1] != sh["batches"][0]]
    picked = [c for c in later if live.first_batch(seen, c[0], c[2], c[3])]
    assert len(picked) == len({(c[0], c[2], c[3]) for c in later}) > 0


def test_live_filtered_run_checks_its_cases_against_the_reference(tmp_path):
    """A --cases run of one case past the grid's smallest batch (CPU, quick shapes, one timed call) still checks
    our plan against the reference, writes only that case and records its rounds. Breakage caught: main checking
    only the grid's smallest batch, as before --cases."""
    from bench import resolver_peer_live as live
    from bench.resolver_peer import shapes

    n = shapes(True)["batches"][-1]
    out = tmp_path / "live.json"
    assert live.main(["--quick", "--cases", f"^20%_N{n}_H32_656B$", "--iters", "1", "--rounds", "1",
                      "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["case"] for r in doc["records"]] == [f"20%_N{n}_H32_656B"] and doc["rounds"] == 1
    assert doc["checks"][0]["ours_vs_reference"] is True and doc["checks_pass"]
