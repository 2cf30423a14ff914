"""What the one-kernel benches share (mla_tune_bench.py, attention_replay.py, stage_overflow_bench.py,
dflash_attention_bench.py, indexer_tune_bench.py, fp8_kernels.py, fp8_gemm_bench.py, moe_align_bench.py):
comma-separated integer options, the device set-up, and `timed`, the median of one call from CUDA-graph
replays or CUDA events on a GPU, wall time on the CPU."""

from __future__ import annotations

import os
import statistics
import time
from typing import NamedTuple

import torch


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def device_setup(quick: bool) -> tuple[bool, str, torch.dtype, torch.Generator, str]:
    """(cuda, device, dtype, seeded generator, device name): bf16 on CUDA, fp32 under the CPU
    interpreter (--quick)."""
    if quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cuda = torch.cuda.is_available() and not quick
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    return cuda, dev, dtype, torch.Generator().manual_seed(0), torch.cuda.get_device_name() if cuda else "cpu (interpreter)"


class Timing(NamedTuple):
    """How `timed` measures: warm-up calls, timed repetitions, calls per captured CUDA graph (0: no
    graph, CUDA events around each call)."""

    warmup: int
    reps: int
    graph: int


def timed(fn, tm: Timing, cuda: bool, reset=None) -> float:
    """Median milliseconds of one `fn()`: on CUDA from replays of a graph of tm.graph calls, or with
    tm.graph 0 from CUDA events around each eager call; on the CPU, wall time. `reset()` (untimed) runs
    before each timed call or replay: for an fn that changes its own input (bench/stage_overflow_bench.py)."""
    for _ in range(tm.warmup):
        fn()
    reset = reset or (lambda: None)
    if not cuda:
        out = []
        for _ in range(tm.reps):
            reset()
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)
    run, per = fn, 1
    if tm.graph:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(tm.graph):
                fn()
        graph.replay()
        run, per = graph.replay, tm.graph
    out = []
    for _ in range(tm.reps):
        reset()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / per)
    return statistics.median(out)
