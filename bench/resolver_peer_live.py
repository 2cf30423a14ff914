"""Issue 33 side by side: our resolver against SGLang's HiSparse kernel, both run here on the same inputs.

    python3 bench/peer/build.py                                   # CPU: builds .peer/ from the sglang wheel
    python3 bench/resolver_peer_live.py --out $OUT/resolver_peer_live.json   # GPU; carry [".whl", ".peer"]
    python3 bench/resolver_peer_live.py --quick --out /tmp/live.json         # CPU: the translation checks only

The issue's 36 cases (bench/resolver_peer.py's `build`: top-k 2,048, one query per request, hot cache H 4,096 /
8,192, batch 8 / 32 / 100, rows of 656 / 1,152 B, 0.1% / 20% / all of each selection missing). Per case, on
one GPU in one process, each call after a 256-MiB L2 flush and its state restored (untimed), 20 timed calls,
median, device time with the GPU spinning while the CPU enqueues (bench/resolver_timing.py). The calls of a case
are interleaved (`interleaved`): --rounds rounds (default 4) of 5 calls a form, the forms' order rotated by one
a round, so that a drift of the host link during a case falls on every form alike (session 52 saw one form's
copy-bound calls take 2.3x another's running the same kernel, timed one block after the other):

    ours: plan + copy (`plan_triton(defer=True, workspace=...)` + `launch_copies`, the engine's default),
          the fused plan + copy (`copy=`, `--resolver-copy fused`), the plan alone; and the first two again on
          the same case with the hot_entry index (`--resolver-lookup index`, `index_case`); each in the miss
          order the engine's resolver step picks for the shape (`miss_order_for`: selection order at batch 8,
          host order above), and where that is selection order the fused forms in host order too (`*_fused_host`)
    peer: `load_cache_to_device_buffer_kernel` (plan + copy in one launch), and its SkipIO instantiation
          (the same kernel with the row copies compiled out: its plan alone)

and the ratios ours / peer, with the form of ours that was fastest on the case (`best4_form`: a configuration the
engine can choose, not a repeat of one). The peer is SGLang 0.5.23's kernel, compiled unmodified from its wheel
(bench/peer/build.py: provenance in .peer/build.json, copied into the result). Its state is our case's,
translated by bench/peer/hisparse_peer.py (same hot slots and rows, recency from our stamps).

Checks, every case: the peer's locations equal its contract (`peer_expected`), the rows it copied equal
their host rows, its miss count equals our plan's host count, and its victim slots are ours as a set (the
pairing of misses to victims differs by design: ours by host address or by entry). Our plan is checked bit for bit
against `plan_reference` on the first batch run of each (H, row size, level), on the scan state and the index state,
as bench/resolver_peer.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.peer.hisparse_peer import PeerKernel, PeerState, peer_expected, peer_state  # noqa: E402
from bench.resolver_cases import Case, Rig, case_order, check_case, cpu_copy, index_case  # noqa: E402
from bench.resolver_peer import (PEER_US, Flush, build, case_grid, case_name, plan_bench_args,  # noqa: E402
                                 plan_bench_start, precompile_worker, start_rig)
from bench.resolver_timing import header, stats, timeit  # noqa: E402
from dhisparse.kernels.gather import row_copy  # noqa: E402
from dhisparse.kernels.resolver import PlanWorkspace, launch_copies, plan_triton  # noqa: E402
from dhisparse.kernels.resolver_ref import plan_reference  # noqa: E402


def translation_check(case: Case, now: int, ps0: PeerState) -> tuple[dict, torch.Tensor]:
    """The peer's contract on the translated state ps0 (`peer_state` of the case; not changed) against our
    `plan_reference` on the same case: the same hit locations, the same victims (as sets of device rows) and
    the miss count; and the contract's locations [N, k] int32 (what the peer's own call must return)."""
    top_k = case.sel[:, 0].to(torch.int32)
    exp, _ = peer_expected(ps0.copy("cpu"), top_k.cpu())
    ref = plan_reference(case.sel.cpu(), case.slots.cpu(), cpu_copy(case.state), now)
    loc = ref.loc[:, 0]
    hot = case.state.hot_pos.cpu()
    same_hits, same_victims, misses = True, True, 0
    for n in range(top_k.shape[0]):
        hit = torch.isin(case.sel[n, 0].cpu(), hot[n])
        same_hits &= bool(torch.equal(exp[n][hit].long(), loc[n][hit]))
        same_victims &= bool(torch.equal(torch.sort(exp[n][~hit].long()).values, torch.sort(loc[n][~hit]).values))
        misses += int((~hit).sum())
    return {"case": case.name, "hits": same_hits, "victims": same_victims, "misses": misses,
            "ours_host_rows": int(ref.counters.host)}, exp


def peer_check(peer: PeerKernel, rig: Rig, case: Case, ps0: PeerState, exp: torch.Tensor) -> dict:
    """One peer call on a copy of the translated state ps0: its locations against the contract, and the rows
    it copied (every miss) against their host rows."""
    ps = ps0.copy()
    top_k = case.sel[:, 0].to(torch.int32).contiguous()
    out = torch.empty_like(top_k)
    host, dev = rig.host_rows(case.rb), rig.dev_rows(case.rb, case.dev_rows).clone()
    peer.run(ps, top_k, out, host, dev, case.rb)
    torch.cuda.synchronize()
    hot = case.state.hot_pos
    miss = ~torch.stack([torch.isin(case.sel[n, 0], hot[n]) for n in range(top_k.shape[0])])
    hf, df = host.reshape(-1, host.shape[-1]), dev.reshape(-1, dev.shape[-1])
    src = torch.gather(ps.host_locs, 1, case.sel[:, 0])[miss].cpu()  # host rows live in (pinned) CPU memory
    rows = bool(torch.equal(df[out[miss].long()].cpu().view(torch.uint8), hf[src].view(torch.uint8)))
    return {"locations": bool(torch.equal(out.cpu(), exp)), "rows": rows, "copies": int(miss.sum())}


FORMS = {"ours_plan_copy": "scan, plan + copy", "ours_fused": "scan, fused",
         "ours_index_plan_copy": "index, plan + copy", "ours_index_fused": "index, fused"}


def _ours(rig: Rig, case: Case, now: torch.Tensor, host, dev, tag: str = "") -> tuple[dict, str]:
    """Ours on one case (its state: scan or index), in the miss order the engine picks for its shape
    (`miss_order_for`), as forms to time: plan + copy and the fused plan + copy, as ours{tag}_plan_copy /
    ours{tag}_fused; where that order is "selection", the fused form in host order too (ours{tag}_fused_host);
    without a tag the plan alone (ours_plan). Returns (forms, the order)."""
    ws = PlanWorkspace(rig.dev)
    order = case_order(case)
    plan = lambda order=order, **kw: plan_triton(case.sel, case.slots, case.state, now, defer=True,  # noqa: E731
                                                 workspace=ws, distinct=True, miss_order=order, **kw)
    fused = row_copy(host, dev)
    forms = {f"ours{tag}_plan_copy": lambda: launch_copies(plan(), host, dev),
             f"ours{tag}_fused": lambda: plan(copy=fused)}
    if order != "host":
        forms[f"ours{tag}_fused_host"] = lambda: plan("host", copy=fused)
    if not tag:
        forms["ours_plan"] = plan
    return forms, order


def interleaved(rig: Rig, forms: dict, restore, iters: int, warmup: int, rounds: int) -> dict:
    """Each form of `forms` (name -> call) timed `iters` times in `rounds` rounds (the calls split as evenly as
    they go), the forms' order rotated by one each round; warm-up calls before a form's first timed round only.
    Returns name -> `stats` over all of the form's calls."""
    names, rounds = list(forms), max(1, rounds)
    times = {k: ([], []) for k in names}
    for r in range(rounds):
        calls = iters // rounds + (r < iters % rounds)
        for k in names[r % len(names):] + names[:r % len(names)]:
            d, h = timeit(rig, forms[k], restore, calls, warmup if r == 0 else 0)
            times[k][0].extend(d)
            times[k][1].extend(h)
    return {k: stats(times[k]) for k in names}


def time_pair(rig: Rig, peer: PeerKernel | None, case: Case, ps0: PeerState, flush: Flush, iters: int,
              warmup: int, icase: Case | None = None, rounds: int = 4) -> dict:
    """Ours (plan + copy, fused, plan alone; with icase, the same case on its hot_entry index state: plan + copy
    and fused) and the peer's (full, plan alone, on a copy of the translated state ps0) on one case, `interleaved`;
    every state restored before each call."""
    st = case.state
    now = torch.full((1,), int(st.hot_stamp.max()) + 1, dtype=torch.int64, device=rig.dev)
    host, dev = rig.host_rows(case.rb), rig.dev_rows(case.rb, case.dev_rows)
    states = [st] + ([icase.state] if icase is not None else [])
    snap = [(t, t.clone()) for s in states for t in (s.hot_pos, s.hot_stamp, s.hot_entry) if t is not None]
    ps = ps0.copy()

    def restore() -> None:
        for t, v in snap:
            t.copy_(v)
        ps.tokens.copy_(ps0.tokens)
        ps.lru.copy_(ps0.lru)
        flush()

    forms, order = _ours(rig, case, now, host, dev)
    if icase is not None:
        forms |= _ours(rig, icase, now, host, dev, "_index")[0]
    if peer is not None:
        top_k = case.sel[:, 0].to(torch.int32).contiguous()
        out = torch.empty_like(top_k)
        for key, skip in (("peer", False), ("peer_plan", True)):
            forms[key] = lambda s=skip: peer.run(ps, top_k, out, host, dev, case.rb, skip_io=s)
    rec = interleaved(rig, forms, restore, iters, warmup, rounds)
    rec["miss_order"] = order
    if peer is not None:
        rec["ratios"] = ratios(rec)
    restore()
    return rec


def ratios(rec: dict) -> dict:
    """Ours / peer for each timed form of ours; `best_over_peer` over the scan state's two (as session 51 recorded
    it), `best4_over_peer` and `best4_form` over every form timed."""
    us = lambda k: rec[k]["time_ms"] * 1e3  # noqa: E731
    forms = [k for k in FORMS if k in rec]
    best = min(forms, key=us)
    extra = [k for k in rec if k.endswith("_fused_host")]  # the host-order plan, where the engine's is selection
    return {**{f"{k[5:]}_over_peer": us(k) / us("peer") for k in forms + extra},
            "best_over_peer": min(us("ours_plan_copy"), us("ours_fused")) / us("peer"),
            "best4_over_peer": us(best) / us("peer"), "best4_form": FORMS[best],
            "plan_over_peer_plan": us("ours_plan") / us("peer_plan")}


def first_batch(seen: set, H: int, rb: int, level: str) -> bool:
    """Whether a case is the first run of its (H, row size, miss level), noting it in `seen`: its plan is then checked
    against the reference. Unfiltered that is the grid's smallest batch; under --cases the first batch selected."""
    new = (H, rb, level) not in seen
    seen.add((H, rb, level))
    return new


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    plan_bench_args(ap)  # --out, --quick (tiny shapes on the CPU: the translation checks only), --iters
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cases", default="", help="only the cases whose name (e.g. 20%%_N8_H4096_1152B) matches this "
                    "regular expression; with --iters and --rounds, repeats of a few cases in one call")
    ap.add_argument("--rounds", type=int, default=4, help="rounds a case's timed calls are split into, the forms' "
                    "order rotated each round (`interleaved`)")
    args = ap.parse_args(argv)
    if args.precompile:
        return precompile_worker(args.precompile)
    args.phases = False
    t0, sh, iters = plan_bench_start(args)
    peer = PeerKernel() if torch.cuda.is_available() and not args.quick else None
    rig, flush = start_rig(args, sh, t0)
    records, checks, seen = [], [], set()
    for H, N, rb, level in case_grid(sh):
        if not re.search(args.cases, case_name(H, N, rb, level)):
            continue
        case = build(rig, sh, H, N, rb, level)
        now = int(case.state.hot_stamp.max()) + 1
        ps0 = peer_state(case.state, case.history)  # the translation, built once a case; every use copies it
        chk, exp = translation_check(case, now, ps0)
        icase = index_case(case)  # the same inputs, hits looked up through hot_entry
        if first_batch(seen, H, rb, level):
            chk["ours_vs_reference"] = all(v for c in (case, icase)
                                           for k, v in check_case(rig, c, distinct=True, miss_order=case_order(c)).items()
                                           if k not in ("case", "copies"))
        if peer is not None:
            chk["peer"] = peer_check(peer, rig, case, ps0, exp)
        checks.append(chk)
        rec = {"case": case.name, "H": H, "batch": N, "row_bytes": rb, "miss_level": level,
               "misses": chk["misses"],
               **time_pair(rig, peer, case, ps0, flush, iters, 0 if args.quick else args.warmup, icase, args.rounds)}
        key = (level, N, rb)
        if H == 4096 and key in PEER_US:
            rec["issue_figures_us"] = {"peer_h200": PEER_US[key][0], "ours_at_filing_h200": PEER_US[key][1]}
        records.append(rec)
        r = rec.get("ratios", {})
        print(f"[{time.time() - t0:6.1f}s] {case.name}: ours {rec['ours_plan_copy']['time_ms'] * 1e3:7.1f} us"
              f" (fused {rec['ours_fused']['time_ms'] * 1e3:7.1f}, plan {rec['ours_plan']['time_ms'] * 1e3:6.1f};"
              f" index {rec['ours_index_plan_copy']['time_ms'] * 1e3:7.1f}, fused {rec['ours_index_fused']['time_ms'] * 1e3:7.1f})"
              + (f"  peer {rec['peer']['time_ms'] * 1e3:7.1f} us (plan {rec['peer_plan']['time_ms'] * 1e3:6.1f})"
                 f"  best/peer {r['best4_over_peer']:.2f} ({r['best4_form']})  plan/peer {r['plan_over_peer_plan']:.2f}"
                 if r else "")
              + f"  checks {chk}", flush=True)
        write(args.out, rig, sh, iters, args.rounds, peer, checks, records, t0)
    ok = write(args.out, rig, sh, iters, args.rounds, peer, checks, records, t0)
    print(f"checks {'pass' if ok else 'FAIL'}; wrote {args.out} in {time.time() - t0:.0f} s")
    return 0 if ok else 1


def _ok(c: dict) -> bool:
    peer = c.get("peer") or {}
    return c["hits"] and c["victims"] and c["misses"] == c["ours_host_rows"] and c.get("ours_vs_reference", True) and all(
        v for k, v in peer.items() if k != "copies")


def write(out: str, rig: Rig, sh: dict, iters: int, rounds: int, peer: PeerKernel | None, checks: list, records: list,
          t0: float) -> bool:
    """The JSON so far (rewritten after every case)."""
    ok = all(_ok(c) for c in checks)
    doc = header("resolver_peer_live", "bench/resolver_peer_live.py", rig.cuda, t0, shapes=sh, iters=iters,
                 rounds=rounds, peer_build=peer.build if peer else None, peer_ran=peer is not None, checks_pass=ok,
                 checks=checks, records=records)
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
