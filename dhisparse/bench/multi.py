"""Benchmarks and exactness checks of parallel worlds (issue 32: several GPUs of one host).

The single-GPU harness (`bench/gpu_serving.py`) builds one `Engine` over a model loaded once in its
own process; a parallel world is built by `engine.launch.build` instead (rank 0 here, the other
ranks spawned), so a benchmark of one needs its own driver. This module is that driver's library;
`bench/multi_gpu.py` is its command line.

    Layout        "1" | "dpN" | "dpepN" | "tpN" | "pdP+D" | "pdP+DepE"  (`parse_layout`): one GPU, data
                  parallelism, DP attention + expert parallelism (--tp-size N --dp-size N
                  --enable-dp-attention --ep-size N), tensor parallelism, P prefill + D decode ranks
                  (with EP groups of E inside each role)
    multicast_off NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 set
                  (inherited by the spawned ranks); another value already set is refused
    MultiLoop     InProcessLoop over a world: prompts cycle over `distinct` suffixes (gpu_serving's
                  CyclingLoop), each request's TTFT parts kept (`ttft_parts`), the per-rank output of
                  the timed window (rank stats after the warm-up and at the end)
    run_world     one (layout, preset) world: build, [oracle reference], prefix, warm-up, window, close;
                  speculation's counters over the window alone (`window_spec`)

Output per GPU: the window's output tokens / duration / the world's GPUs (a disaggregated world also
per decode GPU). TTFT split (the paper's Table A2; `dhisparse.bench.tables.ttft_split` reads each
request's `queue` and `ttft`):

    colocated        allocation wait = the engine's queue (submit -> a slot); hand-off = the rest
                     (prefill or the prepared prefix's import)
    disaggregated    allocation wait = the prefill rank's queue + the decode rank's wait for pages
                     (DisaggMetrics.alloc_wait); hand-off = the rest: prefill, the round's lag and
                     the KV transfer (kept apart too: prefill_s, handoff_s, transfer_s per request)

The oracle drafter (+spec presets: a MEASUREMENT TOOL) needs each prompt's greedy continuation. A
world's ranks share no objects with this process, so the reference travels as a file: the format
and key of dhisparse.bench.reference (the key with the world's `layout`, the file with the prompts'
digests), read by `FileReference` and named by $DHISPARSE_MULTI_REFERENCE, which the ranks inherit.
Every rank's engine is built with it (`oracle_reference`, through `engine.rank_spawn.hook_reference`);
a prompt it does not know yet gets no drafts. When the file holds nothing for this run (or another
run's reference), the world decodes the distinct prompts greedily first (exact: speculation without
drafts is plain decoding) and writes it; later requests read it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from dhisparse.bench.inproc import InProcessLoop
from dhisparse.bench.reference import FileReference, load_reference, save_reference
from dhisparse.bench.results import source_commit
from dhisparse.bench.workload import Phases, Workload, suffix_text
from dhisparse.core.params import SamplingParams

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
REFERENCE_ENV = "DHISPARSE_MULTI_REFERENCE"
HOOK = "dhisparse.bench.multi:rank_hook"


def multicast_off() -> dict[str, str]:
    """Set the variables that keep NVLink multicast off in NCCL, PyTorch and NVSHMEM (the device
    machines' rule: a program that uses it can take the host's shared GPUs out of service); the
    spawned ranks inherit them. SystemExit when one is already set to another value."""
    for k, v in MULTICAST_OFF.items():
        have = os.environ.get(k)
        if have not in (None, v):
            raise SystemExit(f"{k}={have}: NVLink multicast must stay off ({k}={v}); unset it or set it to {v}")
        os.environ[k] = v
    return {k: os.environ[k] for k in MULTICAST_OFF}


# -- layouts -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """A world's shape. kind: one | dp | dpep | tp | pd; gpus: its ranks (one GPU each); prefill /
    decode: a pd world's roles; ep: expert-parallel group size (dpep: gpus; pd: E, 1 = none)."""

    name: str
    kind: str
    gpus: int
    prefill: int = 0
    decode: int = 0
    ep: int = 1

    @property
    def decode_gpus(self) -> int:
        """GPUs that decode: every GPU of a colocated world, the decode role of a disaggregated one."""
        return self.decode if self.kind == "pd" else self.gpus

    def engine_fields(self) -> dict:
        """The EngineConfig fields of this layout (SGLang's flags)."""
        n = self.gpus
        if self.kind == "one":
            return {}
        if self.kind == "dp":
            return dict(dp_size=n)
        if self.kind == "dpep":
            return dict(tp_size=n, dp_size=n, ep_size=n, enable_dp_attention=True)
        if self.kind == "tp":
            return dict(tp_size=n)
        pd = dict(disaggregation_prefill_size=self.prefill, disaggregation_decode_size=self.decode)
        return pd | (dict(ep_size=self.ep, enable_dp_attention=True) if self.ep > 1 else {})

    def flags(self) -> str:
        """The same as `dhisparse serve` flags."""
        return " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in self.engine_fields().items())


_LAYOUT = re.compile(r"^(?:(1)|(dp|dpep|tp)(\d+)|pd(\d+)\+(\d+)(?:ep(\d+))?)$")


def parse_layout(text: str) -> Layout:
    """'1', 'dp2', 'dpep4', 'tp2', 'pd1+1', 'pd2+2ep2' -> Layout (ValueError naming the forms)."""
    m = _LAYOUT.match(text.strip())
    if not m:
        raise ValueError(f"layout {text!r}: expected 1, dpN, dpepN, tpN, pdP+D or pdP+DepE (e.g. dpep2, pd1+1, pd2+2ep2)")
    one, kind, n, p, d, e = m.groups()
    if one:
        return Layout("1", "one", 1)
    if kind:
        if int(n) < 2:
            raise ValueError(f"layout {text!r}: a {kind} world needs at least 2 ranks (one GPU is '1')")
        return Layout(text.strip(), kind, int(n))
    p, d, e = int(p), int(d), int(e or 1)
    if p < 1 or d < 1 or p % e or d % e:
        raise ValueError(f"layout {text!r}: P, D >= 1 and E dividing both")
    return Layout(text.strip(), "pd", p + d, p, d, e)


# -- the oracle's reference, shared through a file -----------------------------------------------

def oracle_reference(cfg) -> FileReference | None:
    """`engine.rank_spawn.hook_reference`'s entry: the reference file named by $DHISPARSE_MULTI_REFERENCE
    (dhisparse.bench.reference's format, with the prompts' digests)."""
    path = os.environ.get(REFERENCE_ENV)
    return FileReference(path) if path else None


def rank_hook(engine, rank: int) -> None:
    """The world's on_engine hook (nothing to do on the engine; its module gives the reference)."""


# -- the closed loop over a world ----------------------------------------------------------------

def rank_stats(engine) -> list:
    """Each rank's EngineStats (a plain Engine: its own)."""
    get = getattr(engine, "rank_stats", None)
    return list(get()) if get is not None else [engine.stats()]


def ttft_parts(metrics) -> dict:
    """A first output's timing parts (s): queue, and for a disaggregated request prefill, handoff,
    transfer, alloc_wait (engine/disagg_round.DisaggMetrics); `allocation` = the Table A2 wait."""
    parts = {k: getattr(metrics, k, None) for k in ("ttft", "queue", "prefill", "handoff", "transfer", "alloc_wait")}
    disagg = parts["alloc_wait"] is not None or parts["handoff"] is not None
    if disagg:
        waits = [v for v in (parts["queue"], parts["alloc_wait"]) if v is not None]
        parts["allocation"] = sum(waits) if waits else None
    else:
        parts["allocation"] = parts["queue"]
    return parts


class MultiLoop(InProcessLoop):
    """gpu_serving's CyclingLoop over any world: prompts cycle over `distinct` suffixes; each
    request's TTFT parts are kept (`parts`, by request index) and its `queue` is the Table A2
    allocation wait (`ttft_parts`); rank stats are read when the timed window opens (`at_start`).
    reference: a callable run before the warm-up (the oracle's reference decode)."""

    def __init__(self, engine, workload: Workload, phases: Phases, distinct: int, reference=None) -> None:
        super().__init__(engine, workload, phases)
        self.distinct, self.reference = distinct, reference
        self.parts: dict[int, dict] = {}
        self.at_start: list = []
        self.reference_s = 0.0

    def _prompt(self, index: int) -> list[int]:
        return self.prefix + self.engine.tokenizer.encode(suffix_text(index % self.distinct))

    def warmup(self) -> None:
        if self.reference is not None:
            t = time.perf_counter()
            self.reference(self)
            self.reference_s = time.perf_counter() - t
        super().warmup()

    def run(self):
        if not self.workload.warmup and self.reference is not None:
            self.reference(self)
        return super().run()

    def _issue(self, now: float) -> None:
        if not self.at_start:
            self.at_start = rank_stats(self.engine)
        super()._issue(now)

    def _first(self, live, out, now: float) -> None:
        """The first token's time, its allocation wait and (disaggregated) the other parts of TTFT."""
        parts = ttft_parts(out.metrics)
        live.first, live.queue = now, parts["allocation"]
        self.parts[live.index] = parts

    def _finish_queue(self, live, out) -> float | None:
        return live.queue


def holds_reference(path: Path, key: dict) -> bool:
    """Whether the file holds this run's reference (`load_reference`); one made for another run, or
    not a whole reference, is decoded again and replaced."""
    try:
        return load_reference(path, key) is not None
    except ValueError:  # ReferenceMismatch among them
        return False


def reference_decoder(path: Path, key: dict, output_len: int):
    """The MultiLoop reference step: decode every distinct prompt greedily through the world (the
    oracle drafts nothing for a prompt the file lacks) and write the file with the prompts' digests
    (`save_reference`), unless it already holds this run's reference."""

    def decode(loop: MultiLoop) -> None:
        if holds_reference(path, key):
            return
        prompts = [loop._prompt(i) for i in range(loop.distinct)]
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        rids = {loop.engine.add_request(p, params): i for i, p in enumerate(prompts)}
        outs: dict[int, list[int]] = {}
        while len(outs) < len(rids):
            for o in loop.engine.step():
                if o.request_id in rids and o.finished:
                    outs[rids[o.request_id]] = list(o.token_ids)
        save_reference(path, key, outs, prompts=prompts, commit=source_commit())

    return decode


# -- one world -----------------------------------------------------------------------------------

def window_tokens(before: list, after: list) -> list[int]:
    """Generated tokens of each rank between two rank-stats reads (None-safe)."""
    return [(a.generated_tokens if a else 0) - (b.generated_tokens if b else 0) for b, a in zip(before, after)]


def window_spec(before: list, after: list) -> dict | None:
    """Speculation over the timed window, summed over the ranks (the engines' counters run from
    their start: the oracle's reference decode and the warm-up, whose rounds draft nothing, would
    drag tokens per round down; a merged world's ratios are means over ranks, prefill ranks
    included): rounds, tokens per round, oracle proposals and their off-reference share. None
    without speculation."""
    def counts(st) -> tuple[float, float, float, float]:
        c = st.counters if st is not None else {}
        rounds, props = c.get("spec_rounds", 0), c.get("oracle_proposals", 0)  # counts: the products are integers
        return (rounds, round(rounds * c.get("spec_tokens_per_round", 0.0)), props,
                round(props * c.get("oracle_off_reference_share", 0.0)))

    if not any(st is not None and "spec_rounds" in st.counters for st in after):
        return None
    d = [tuple(a - b for a, b in zip(counts(y), counts(x))) for x, y in zip(before, after)]
    rounds, emitted, props, off = (sum(v[i] for v in d) for i in range(4))
    return {"rounds": int(round(rounds)), "tokens_per_round": emitted / rounds if rounds else None,
            "oracle_proposals": int(round(props)), "oracle_off_reference_share": off / props if props else None,
            "rounds_per_rank": [int(round(v[0])) for v in d]}


def per_gpu(layout: Layout, output_tok_s: float) -> dict:
    """Output tok/s per GPU of the world, and per decode GPU."""
    return {"gpus": layout.gpus, "decode_gpus": layout.decode_gpus, "output_tok_s": output_tok_s,
            "output_tok_s_per_gpu": output_tok_s / layout.gpus, "output_tok_s_per_decode_gpu": output_tok_s / layout.decode_gpus}


def ttft_split_summary(run: dict) -> dict:
    """Table A2's split of one run (all requests and post-wave), seconds, plus the disaggregated parts' means."""
    from dhisparse.bench.records import mean
    from dhisparse.bench.tables import ttft_split

    out = {part: dataclasses.asdict(s) for part, s in ttft_split(run).items()}
    reqs = [r for r in run.get("requests") or [] if r.get("ttft") is not None]
    for k in ("prefill", "handoff", "transfer", "alloc_wait"):
        vals = [r[k] for r in reqs if r.get(k) is not None]
        out[f"{k}_mean_s"] = mean(vals)
    return out


def run_world(cfg, layout: Layout, workload: Workload, concurrency: int, distinct: int,
              reference: tuple[Path, dict] | None = None, progress=print) -> dict:
    """Build the world `cfg` describes (its layout fields set), run one closed loop at
    `concurrency` clients, close it; a jsonable dict: the run (`dhisparse.bench.results` schema,
    each request with its TTFT parts), per-GPU output, per-rank window tokens, TTFT split, times.
    reference: (file, key) for an oracle +spec engine (module docstring)."""
    from dhisparse.bench import results as R
    from dhisparse.engine.launch import build

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    if reference is not None:
        os.environ[REFERENCE_ENV] = str(reference[0])
    engine = build(cfg, on_engine=HOOK)
    times["build_s"] = time.perf_counter() - t0
    progress(f"[world] {layout.name} {cfg.preset} built in {times['build_s']:.1f} s")
    try:
        decode = reference_decoder(reference[0], reference[1], workload.output_len) if reference else None
        loop = MultiLoop(engine, workload, Phases.constant(concurrency, workload.duration_s), distinct, decode)
        t = time.perf_counter()
        trace = loop.run()
        times["loop_s"] = time.perf_counter() - t
        times["reference_s"] = loop.reference_s
        end = rank_stats(engine)
        mem = device_memory(engine)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    run = R.to_jsonable(R.run_result(cfg.preset, concurrency, f"in-process {layout.name}", trace))
    for r in run["requests"]:
        r.update({k: v for k, v in loop.parts.get(r["index"], {}).items() if k not in ("ttft", "queue")})
    start = loop.at_start or [None] * len(end)
    return {"layout": dataclasses.asdict(layout), "flags": layout.flags(), "preset": cfg.preset,
            "concurrency": concurrency, "per_gpu": per_gpu(layout, run["metrics"]["output_tok_s"]),
            "rank_window_tokens": window_tokens(start, end), "window_spec": window_spec(start, end),
            "ttft_split": ttft_split_summary(run), "times": times,
            "device_memory_rank0": mem, "run": run}


def device_memory(engine) -> dict:
    """Rank 0's device bytes (its peak, its weights); {} off CUDA. The other ranks' are not read."""
    import torch

    inner = getattr(engine, "engine", engine)
    dev = getattr(inner, "device", None)
    if dev is None or getattr(dev, "type", "cpu") != "cuda":
        return {}
    weights = sum(t.numel() * t.element_size() for t in [*inner.model.parameters(), *inner.model.buffers()])
    return {"device": str(dev), "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev), "weight_bytes": weights}
