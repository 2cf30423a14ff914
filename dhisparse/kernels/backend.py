"""Which implementation a kernel dispatcher runs, set once when an engine is built.

`KernelSettings` is the process's kernel choice: `backend` "auto" runs Triton for CUDA tensors and
the plain-PyTorch references elsewhere, "torch" the references everywhere, "triton" the kernels on
CPU too (they then need TRITON_INTERPRET=1: tests and op counts of the GPU path run this way).
`mla_split_rows` is the sparse-MLA split (`kernels/sparse_mla.py`, 0 = off, None = by the plan's tile:
DEFAULT_SPLIT_ROWS for the narrow tile, WIDE_SPLIT_ROWS for the wide one), `indexer_group`
turns grouped verification scoring on (`kernels/indexer.py`), `indexer_topk` is the form of the
indexers' tie-ruled top-k (`core/topk.py`: stable, packed or lean; the same selections), `stage_kernel`
stages a verification round's overflow in one Triton launch (`kernels/stage_overflow.py`; off: its PyTorch
form, the same outputs) and `plan_output_reuse` lets a resolver plan workspace hand an earlier call's output
block to a later one (`kernels/resolver_args.py` `OutBlock`; an experiment until a CUDA run has checked it).

The engine calls `configure(EngineConfig.kernel_settings())` at build. Nothing is read from the
environment at import; the documented environment overrides are applied by
`KernelSettings.from_env` at that same engine build:

  DHISPARSE_TORCH_KERNELS=1    backend "torch"
  DHISPARSE_TRITON_KERNELS=1   backend "triton"
  DHISPARSE_MLA_SPLIT_ROWS=n   mla_split_rows n
  DHISPARSE_INDEXER_GROUP=0|1  indexer_group
  DHISPARSE_INDEXER_TOPK=form  indexer_topk
  DHISPARSE_STAGE_KERNEL=0|1   stage_kernel
  DHISPARSE_PLAN_OUTPUT_REUSE=0|1  plan_output_reuse
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from dhisparse.core.topk import TOPK_FORMS

BACKENDS = ("auto", "torch", "triton")
# Sparse-MLA split rows by tile (a model's heads fix its tile, so its split never depends on the batch):
# 128 for the narrow tile (16 heads x 32 rows; session 10 at 16 heads, k 512: 0.47x of no split at T 18,
# bench/results/mla_tune_s10b_h200.json), 512 for the wide one (64 heads x 64 rows; session 48 at 64 heads,
# k 2,048, FP8 rows: geometric mean 0.67x of 128 over T 20 / 47 / 90 / 235, mla_split_s48_h100.json).
DEFAULT_SPLIT_ROWS = 128
WIDE_SPLIT_ROWS = 512


@dataclass(frozen=True)
class KernelSettings:
    """backend: auto | torch | triton; mla_split_rows >= 0 or None (by tile); indexer_group: grouped
    verification scoring; indexer_topk: one of core/topk.py's TOPK_FORMS; stage_kernel: the one-launch
    overflow staging; plan_output_reuse: kept plan output blocks (module docstring)."""

    backend: str = "auto"
    mla_split_rows: int | None = None
    indexer_group: bool = True
    indexer_topk: str = "auto"
    stage_kernel: bool = True
    plan_output_reuse: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"kernel_backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.mla_split_rows is not None and self.mla_split_rows < 0:
            raise ValueError(f"mla_split_rows must be >= 0 (0: no split), got {self.mla_split_rows}")
        if self.indexer_topk not in TOPK_FORMS:
            raise ValueError(f"indexer_topk must be one of {', '.join(TOPK_FORMS)}; got {self.indexer_topk!r}")

    def with_env(self) -> "KernelSettings":
        """These settings with the documented environment overrides applied (module docstring)."""
        s, env = self, os.environ
        if env.get("DHISPARSE_TORCH_KERNELS", "0") == "1":
            s = replace(s, backend="torch")
        elif env.get("DHISPARSE_TRITON_KERNELS", "0") == "1":
            s = replace(s, backend="triton")
        if "DHISPARSE_MLA_SPLIT_ROWS" in env:
            s = replace(s, mla_split_rows=int(env["DHISPARSE_MLA_SPLIT_ROWS"]))
        if "DHISPARSE_INDEXER_GROUP" in env:
            s = replace(s, indexer_group=env["DHISPARSE_INDEXER_GROUP"] == "1")
        if "DHISPARSE_INDEXER_TOPK" in env:
            s = replace(s, indexer_topk=env["DHISPARSE_INDEXER_TOPK"])
        if "DHISPARSE_STAGE_KERNEL" in env:
            s = replace(s, stage_kernel=env["DHISPARSE_STAGE_KERNEL"] == "1")
        if "DHISPARSE_PLAN_OUTPUT_REUSE" in env:
            s = replace(s, plan_output_reuse=env["DHISPARSE_PLAN_OUTPUT_REUSE"] == "1")
        return s


_active = KernelSettings()
_listeners: list = []


def configure(settings: KernelSettings) -> None:
    """Make `settings` the process's kernel choice (the engine calls this at build)."""
    global _active
    _active = settings
    for fn in _listeners:
        fn()


def on_configure(fn) -> None:
    """Register `fn()` to run after every `configure` (plan caches that depend on the settings)."""
    _listeners.append(fn)


def settings() -> KernelSettings:
    return _active


def use_triton(t: torch.Tensor) -> bool:
    """True when the dispatcher should run its Triton kernel for tensors like `t`."""
    if _active.backend == "torch":
        return False
    return _active.backend == "triton" or t.is_cuda
