"""Shared fixtures: tiny transformers checkpoints saved once per test session."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # no CUDA: Triton kernels run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass
from pathlib import Path

import pytest

from hf_fixtures import glm_config, save_hf_checkpoint, v32_config


@dataclass(frozen=True)
class HFCheckpoints:
    """Folders holding config.json + model.safetensors written by transformers' save_pretrained."""

    glm: Path
    v32: Path


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> HFCheckpoints:
    """GLM (5 layers F F S S F) and V3.2 (3 layers) tiny checkpoints; treat them as read-only."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf_ckpt")
    return HFCheckpoints(
        glm=save_hf_checkpoint(glm_config(), root / "glm", seed=1),
        v32=save_hf_checkpoint(v32_config(), root / "v32", seed=2),
    )


@pytest.fixture(autouse=True)
def _default_kernel_settings():
    """Engines configure the process's kernel choice at build (kernels/backend.py); each test
    starts from the default and leaves it so."""
    from dhisparse.kernels import backend

    backend.configure(backend.KernelSettings())
    yield
    backend.configure(backend.KernelSettings())


@pytest.fixture(autouse=True)
def _release_cuda_memory():
    """On CUDA, engines of a finished test are collected before the next test sizes its pools."""
    yield
    if torch.cuda.is_available():
        from dhisparse.engine.memory import release_memory

        release_memory()


CUDA_TEST_POOL_BYTES = 2 << 30  # default pools of test engines on a GPU machine


@pytest.fixture(autouse=True, scope="session")
def _small_default_pools_on_cuda():
    """On CUDA an engine's default pools are 90% of free device memory and up to half the host's
    memory pinned (tens of seconds to pin per engine); tests that leave the pools unset get
    CUDA_TEST_POOL_BYTES each instead. Explicit settings are untouched; CPU defaults are unchanged."""
    if not torch.cuda.is_available():
        yield
        return
    from dhisparse.engine import engine as engine_mod
    from dhisparse.kv import build as store_build

    kv, host = engine_mod.kv_pool_bytes, store_build.host_pool_bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_mod, "kv_pool_bytes",
                   lambda setting, fraction, device: kv(setting if setting is not None else CUDA_TEST_POOL_BYTES, fraction, device))
        capped = lambda setting, device_pool: host(setting if setting is not None else CUDA_TEST_POOL_BYTES, device_pool)  # noqa: E731
        mp.setattr(store_build, "host_pool_bytes", capped)
        yield
