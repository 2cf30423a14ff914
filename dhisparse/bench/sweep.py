"""Sweeps: every (preset, concurrency) pair as one closed-loop run, in-process or over HTTP.

In-process, the model is loaded once and each run gets a fresh `Engine` (fresh KV pool and
counters) built on it; the prefix is prepared in each engine before its timed window. A parallel
world (--dp-size / --tp-size / --ep-size, or prefill/decode disaggregation) is built afresh for
each run by `engine.launch.build` (every rank loads its own model) and closed after it; before,
such a config was given to one `Engine` on the shared model, which ran one process and
reported it under the world's flags.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Callable

from dhisparse.bench.inproc import run_inprocess
from dhisparse.bench.results import RunResult, run_result
from dhisparse.bench.workload import Phases, Workload
from dhisparse.engine.config import AVAILABLE_PRESETS, PRESETS, EngineConfig

def check_presets(presets: list[str]) -> list[str]:
    """Reject unknown or not-yet-available presets with the list of available ones."""
    for p in presets:
        if p not in PRESETS:
            raise ValueError(f"--presets: unknown preset {p!r}; known: {', '.join(PRESETS)}")
        if p not in AVAILABLE_PRESETS:
            raise ValueError(f"--presets: preset {p!r} is not available in this build; available: "
                             f"{', '.join(AVAILABLE_PRESETS)}")
    return list(presets)


def load_shared_model(config: EngineConfig):
    """Load the model once for every engine of a sweep."""
    from dhisparse.engine.memory import DTYPES, resolve_device
    from dhisparse.models.registry import load_model

    dtype = DTYPES[config.dtype] if config.dtype else None
    return load_model(config.model, dtype=dtype, device=resolve_device(config.device), seed=config.seed)


def is_world(config: EngineConfig) -> bool:
    """Whether `config` asks for several processes (a parallel or prefill/decode world)."""
    return config.disaggregated or config.parallel_config().distributed


def on_fresh_engine(config: EngineConfig, loaded, fn: Callable):
    """`fn(engine)` on a new Engine over the shared model, or on a new world (`is_world`: loaded is
    None, every rank loads its own) closed after; the engine (and its KV pool) is released before
    returning, so two pools never coexist on the device."""
    from dhisparse.engine.engine import Engine
    from dhisparse.engine.launch import build

    engine = build(config) if is_world(config) else Engine(config, loaded=loaded)
    try:
        return fn(engine)
    finally:
        if is_world(config):
            engine.close()
        del engine
        gc.collect()
        _empty_cuda_cache()


def _empty_cuda_cache() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


class ProgressBar:
    """A rich progress bar, one task per run (silent when disabled)."""

    def __init__(self, enabled: bool, console=None) -> None:
        self.enabled = enabled
        self._progress = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                                      TimeElapsedColumn(), console=console, transient=False)

    def __enter__(self) -> "ProgressBar":
        if self._progress is not None:
            self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def task(self, label: str, workload: Workload, phases: Phases) -> Callable[[float, int], None]:
        """A callback (elapsed s, completed requests) for one run."""
        if self._progress is None:
            return lambda t, n: None
        by_count = workload.num_requests is not None
        total = float(workload.num_requests if by_count else phases.total_s)
        tid = self._progress.add_task(label, total=total, info="")

        def update(t: float, n: int) -> None:
            self._progress.update(tid, completed=min(n if by_count else t, total), info=f"{n} done")

        return update


def sweep_inprocess(base: EngineConfig, presets: list[str], concurrencies: list[int], workload: Workload,
                    bar: ProgressBar, sample_interval_s: float = 1.0) -> list[RunResult]:
    """Run every preset at every concurrency on one loaded model (a world: each run builds its own)."""
    loaded = None if is_world(base) else load_shared_model(base)
    runs = []
    for preset in presets:
        cfg = dataclasses.replace(base, preset=preset)
        for c in concurrencies:
            phases = Phases.constant(c, workload.duration_s)
            tick = bar.task(f"{preset} C{c}", workload, phases)
            trace = on_fresh_engine(cfg, loaded, lambda e: run_inprocess(e, workload, phases, tick, sample_interval_s))
            runs.append(run_result(preset, c, "in-process", trace))
    return runs


def sweep_http(url: str, model: str | None, concurrencies: list[int], workload: Workload, bar: ProgressBar,
               sample_interval_s: float = 1.0, label: str | None = None, api_key: str | None = None) -> list[RunResult]:
    """Run every concurrency against a running server (its preset labels the runs)."""
    from dhisparse.bench.http import HttpTarget, run_http

    target = HttpTarget.connect(url, model, api_key=api_key)
    runs = []
    for c in concurrencies:
        phases = Phases.constant(c, workload.duration_s)
        preset = label or target.preset
        trace = run_http(target, workload, phases, bar.task(f"{preset} C{c}", workload, phases), sample_interval_s)
        runs.append(run_result(preset, c, url, trace))
    return runs
