"""One DFlash-family drafter round, timed: `propose` for N requests at a full window, then their
commits. Three modes in the same run, order rotated over repeats:

  per_head  the named baseline (the drafter before session 34): eager, `per_head_attention` (K/V
            repeated to every query head, then upcast)
  grouped   eager, `grouped_attention` (each K/V head upcast once for its group of query heads)
  graph     grouped, the block pass replayed from per-bucket CUDA graphs (spec/dflash_graphs.py);
            on CPU replayed eagerly and counted as one op (its op count is then what a round
            dispatches outside the graph; its time is the eager one)

    python3 bench/drafter_round.py --model glm5-faithful --shape paper-glm5 --requests 20 \\
        --out $OUT/drafter_round.json                                                     # H200
    python3 bench/drafter_round.py --device cpu --dtype float32 --hidden 768 --vocab 4096 \\
        --shape paper-glm5 --requests 20 --out bench/results/drafter_round_cpu.json       # CPU

Random weights (the cost of a shape, not its acceptance); the target is only its embedding and LM
head, of the model's hidden size and vocabulary (`--hidden` / `--vocab` shrink them for a CPU run;
the attention shape is `--shape`'s whatever the hidden size). Per form: the median round (ms, after
`--warmup` rounds; synchronised on CUDA), aten ops a round and bytes those ops allocate (counted in
one extra untimed round), and on CUDA the peak transient device memory of a round above what the
drafter holds. Both forms' drafts are compared (`drafts_equal`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.drafter_checkpoint import SHAPES, shaped  # noqa: E402
from bench.op_counter import OneOpRunner, OpCounter  # noqa: E402
from dhisparse.bench import results as R  # noqa: E402
from dhisparse.models.graphs import CudaGraphRunner  # noqa: E402
from dhisparse.models.registry import builtin_config  # noqa: E402
from dhisparse.spec import dflash_model  # noqa: E402
from dhisparse.spec.dflash import DFlashDrafter  # noqa: E402
from dhisparse.spec.drafter import Commit, DraftRequest  # noqa: E402
from dhisparse.spec.factory import random_dflash_config  # noqa: E402

FORMS = {"grouped": dflash_model.grouped_attention, "per_head": dflash_model.per_head_attention}
MODES = ("per_head", "grouped", "graph")


def set_mode(drafter: DFlashDrafter, mode: str, graphs) -> None:
    """The attention form and the graphs `mode` runs with (graphs: the drafter's BlockGraphs)."""
    dflash_model.grouped_attention = FORMS["per_head" if mode == "per_head" else "grouped"]
    drafter.graphs = graphs if mode == "graph" else None


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="glm5-faithful"); a("--kind", default="dflash2", choices=("dflash", "dflash2", "dspark"))
    a("--shape", default="paper-glm5", choices=sorted(SHAPES) + ["target"], help="attention / MLP shape ('target': the target's heads)")
    a("--layers", type=int, default=6); a("--block", type=int, default=8); a("--width", type=int, default=4)
    a("--window", type=int, default=2048); a("--requests", type=int, default=20)
    a("--hidden", type=int, help="shrink the hidden size (CPU runs); default the model's")
    a("--vocab", type=int, help="shrink the vocabulary (CPU runs); default the model's")
    a("--device", default="cuda"); a("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    a("--modes", default=",".join(MODES), help="of per_head (the baseline), grouped, graph")
    a("--rounds", type=int, default=10); a("--warmup", type=int, default=3); a("--repeats", type=int, default=3)
    a("--out", required=True)
    ns = p.parse_args(argv)
    ns.argv = ["bench/drafter_round.py"] + list(sys.argv[1:] if argv is None else argv)
    return ns


def build(ns) -> tuple[DFlashDrafter, dict]:
    """The drafter over a stand-in target (embedding + LM head of the model's sizes)."""
    mcfg = builtin_config(ns.model)
    hidden, vocab = ns.hidden or mcfg.hidden_size, ns.vocab or mcfg.vocab_size
    dtype, g = getattr(torch, ns.dtype), torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(vocab, hidden).to(ns.device, dtype)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(ns.device, dtype)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(vocab, hidden, generator=g))
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) / hidden**0.5)
    tcfg = dataclasses.replace(mcfg, hidden_size=hidden, vocab_size=vocab)
    target = SimpleNamespace(model=SimpleNamespace(embed_tokens=embed), lm_head=head, config=tcfg)
    over = SimpleNamespace(shape=None if ns.shape == "target" else ns.shape, heads=None, kv_heads=None, head_dim=None,
                           intermediate=None)
    dcfg = shaped(random_dflash_config(target, ns.block, num_layers=ns.layers, kind=ns.kind), over)
    dcfg = dataclasses.replace(dcfg, sliding_window=ns.window)
    drafter = DFlashDrafter.random(dcfg, target, window=ns.window, max_requests=ns.requests, k_max=ns.width)
    shape = {"hidden": hidden, "vocab": vocab, "heads": dcfg.num_heads, "kv_heads": dcfg.num_kv_heads,
             "head_dim": dcfg.head_dim, "intermediate": dcfg.intermediate_size, "layers": dcfg.num_layers,
             "block": dcfg.block_size, "weights_bytes": drafter.device_bytes().weights}
    return drafter, shape


class Rounds:
    """N requests whose drafter holds a full window; each round proposes, then commits one token."""

    def __init__(self, drafter: DFlashDrafter, ns) -> None:
        self.d, self.ns, self.n = drafter, ns, ns.window + 16
        dev, dt = ns.device, drafter.model.fc.weight.dtype
        ids = drafter.cfg.target_layer_ids
        g = torch.Generator().manual_seed(1)
        feat = lambda rows: {l: torch.randn(rows, drafter.cfg.hidden_size, generator=g).to(dev, dt) for l in ids}  # noqa: E731
        for r in range(ns.requests):
            drafter.observe(f"r{r}", feat(self.n), 0)
        self.new = feat(1)

    def propose(self) -> list[list[int]]:
        """The drafts of this round (no commit: the state does not move)."""
        reqs = [DraftRequest(f"r{r}", range(self.n), 5 + r, self.ns.width) for r in range(self.ns.requests)]
        return [p.tokens for p in self.d.propose(reqs)]

    def round(self) -> None:
        self.propose()
        errors = self.d.commit_many([Commit(f"r{r}", 0, self.new) for r in range(self.ns.requests)])
        assert not any(errors), errors
        self.n += 1


def sync(ns) -> None:
    if ns.device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(rounds: Rounds, ns) -> dict:
    """Median round (ms) of --rounds after --warmup."""
    for _ in range(ns.warmup):
        rounds.round()
    times = []
    for _ in range(ns.rounds):
        sync(ns)
        t = time.perf_counter()
        rounds.round()
        sync(ns)
        times.append(1e3 * (time.perf_counter() - t))
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def census(rounds: Rounds, ns) -> dict:
    """Ops and allocated bytes of one round; on CUDA the round's peak transient memory."""
    cuda = ns.device.startswith("cuda")
    if cuda:
        sync(ns)
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    counter = AllocCounter()
    with counter:
        rounds.round()
    out = {"ops": sum(counter.ops.values()), "allocated_bytes": counter.bytes}
    if cuda:
        sync(ns)
        out["peak_transient_bytes"] = torch.cuda.max_memory_allocated() - held
    return out


class AllocCounter(OpCounter):
    """`OpCounter` that also sums the bytes of the tensors non-view, out-of-place ops return."""

    VIEWS = {"aten.view", "aten.transpose", "aten.permute", "aten.slice", "aten.select", "aten.unsqueeze",
             "aten.expand", "aten._unsafe_view", "aten.unfold", "aten.alias", "aten.t", "aten.squeeze",
             "aten.detach", "aten.as_strided"}

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = str(func.overloadpacket)
        if not self.inside and not name.endswith("_") and name not in self.VIEWS:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


def run_modes(drafter: DFlashDrafter, rounds: Rounds, ns, modes: list[str]) -> tuple[dict, dict]:
    """Each mode measured --repeats times, order rotated by the repeat -> ({mode: [measure | census]},
    {mode: the drafts of one round proposed from the same state})."""
    graphs = drafter.graphs
    per: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        for rep in range(ns.repeats):
            for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                set_mode(drafter, mode, graphs)
                m = per[mode]
                m.append(measure(rounds, ns) | census(rounds, ns))
                print(f"repeat {rep} {mode:9s} {m[-1]['ms']:9.2f} ms a round  {m[-1]['ops']:5d} ops  "
                      f"{m[-1]['allocated_bytes'] / 2**30:7.2f} GiB allocated", flush=True)
        drafts = {}
        for mode in modes:
            set_mode(drafter, mode, graphs)
            drafts[mode] = rounds.propose()
    finally:
        set_mode(drafter, "grouped", graphs)
    return per, drafts


def summarize(per: dict, drafts: dict, modes: list[str]) -> tuple[list[dict], dict]:
    """(a row a mode: mean / min / max of its repeats' medians and its last census; ratios per
    repeat against the first mode, and whether each mode's drafts equal the first's)."""
    runs = []
    for mode in modes:
        ms = [m["ms"] for m in per[mode]]
        last = per[mode][-1]
        runs.append({"mode": mode, "ms_mean": statistics.mean(ms), "ms_min": min(ms), "ms_max": max(ms), "ms": ms,
                     **{k: last[k] for k in ("ops", "allocated_bytes", "peak_transient_bytes") if k in last}})
    base = modes[0]
    summary: dict = {f"drafts_equal_to_{base}": {m: drafts[m] == drafts[base] for m in modes[1:]}}
    for mode in modes[1:]:
        ratios = [a["ms"] / b["ms"] for a, b in zip(per[mode], per[base])]
        summary[f"{mode}_over_{base}"] = {"mean": statistics.mean(ratios), "min": min(ratios), "max": max(ratios)}
    return runs, summary


NOTES = ["a round = propose for every request (full window) + commit_many of one token each; random weights",
         "ratios per repeat against the first mode named (the baseline), measured back to back; order rotated",
         "CPU: 'graph' replays eagerly (its time is the eager one); its ops are what a round dispatches outside the graph"]


def main(argv=None) -> int:
    ns = parse(argv)
    drafter, shape = build(ns)
    rounds = Rounds(drafter, ns)
    drafter.use_graphs(CudaGraphRunner() if ns.device.startswith("cuda") else OneOpRunner(), ns.requests)
    modes = [m for m in MODES if m in ns.modes.split(",")]
    runs, summary = summarize(*run_modes(drafter, rounds, ns, modes), modes)
    print(summary)
    R.write_bench("drafter_round", ns, runs, NOTES, drafter=shape, summary=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
