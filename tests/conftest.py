"""Shared fixtures: tiny transformers checkpoints saved once per test session."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # no CUDA: Triton kernels run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gc
import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from hf_fixtures import glm_config, save_hf_checkpoint, v32_config


def _freeze_imports() -> None:
    """Import what many test files import (transformers and its modeling code, the engine, the server,
    hypothesis, openai, scipy, matplotlib) and move every object alive now into the collector's
    permanent generation (`gc.freeze`). The full collection `_release_memory` runs after every test
    then walks only what tests made: here 0.07-0.16 s a test before, about 0 after (~1,200 tests).
    Only import-time objects are frozen; no engine or pool exists yet, so the cycles the fixture is
    there for are still collected."""
    for name in ("transformers", "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",  # ~176K objects
                 "hypothesis", "httpx", "openai", "scipy.stats", "matplotlib.pyplot",
                 "dhisparse.engine.engine", "dhisparse.server", "dhisparse.models.registry"):
        try:
            importlib.import_module(name)
        except ImportError:  # an optional dependency missing: its tests skip
            pass
    gc.collect()
    gc.freeze()


_freeze_imports()


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
    starts from the default with the documented environment overrides applied, as an engine build
    applies them (so an exactness run under e.g. DHISPARSE_PLAN_OUTPUT_REUSE=1 reaches the kernels a
    test calls directly too; none is set in CI), and leaves it so."""
    from dhisparse.kernels import backend

    backend.configure(backend.KernelSettings().with_env())
    yield
    backend.configure(backend.KernelSettings().with_env())


@pytest.fixture(autouse=True)
def _release_memory():
    """Engines of a finished test are collected before the next test runs: their stores hold
    reference cycles, so without a full collection their pools (on CPU, a 256 MiB device pool and a
    1 GiB host pool by default, both written at allocation) outlive the test until the cyclic
    collector happens to run, and the suite's RSS climbs. On CUDA the cached blocks are returned too."""
    yield
    from dhisparse.engine.memory import release_memory

    release_memory()


CUDA_TEST_POOL_BYTES = 2 << 30  # default pools of test engines on a GPU machine
CPU_TEST_POOL_BYTES = 64 << 20  # ... and on CPU (the engine's CPU default is 256 MiB + a 1 GiB host pool)


@pytest.fixture(autouse=True, scope="session")
def _small_default_pools():
    """Tests that leave the pools unset get small ones; explicit settings are untouched.

    On CUDA an engine's default pools are 85% of free device memory and up to half the host's
    memory pinned (tens of seconds to pin per engine): CUDA_TEST_POOL_BYTES each instead. On CPU the
    defaults are a 256 MiB device pool and a 4 x 256 MiB host pool, both zero-filled (resident) at
    build: 1.25 GiB per engine, and tests that compare presets hold two or three engines at once
    (that was most of the suite's 19.7 GB peak). CPU tests get a CPU_TEST_POOL_BYTES device pool
    (4,369 tiny-model pages, 70K token positions) and the usual 4 x host pool."""
    from dhisparse.engine import engine as engine_mod
    from dhisparse.kv import build as store_build

    default = CUDA_TEST_POOL_BYTES if torch.cuda.is_available() else CPU_TEST_POOL_BYTES
    kv, host = engine_mod.kv_pool_bytes, store_build.host_pool_bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_mod, "kv_pool_bytes",
                   lambda setting, fraction, device: kv(setting if setting is not None else default, fraction, device))
        if torch.cuda.is_available():
            capped = lambda setting, device_pool: host(setting if setting is not None else CUDA_TEST_POOL_BYTES, device_pool)  # noqa: E731
            mp.setattr(store_build, "host_pool_bytes", capped)
        yield


# ---- test memory (issue #28 item 9) ----------------------------------------------------------------

def _rss_kib(field: str = "VmRSS") -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@pytest.fixture(autouse=True)
def _rss_log(request):
    """DHISPARSE_TEST_RSS=path appends "test rss_before_kib rss_after_kib peak_kib" per test."""
    path = os.environ.get("DHISPARSE_TEST_RSS")
    if not path:
        yield
        return
    before = _rss_kib()
    yield
    with open(path, "a") as f:
        f.write(f"{request.node.nodeid} {before} {_rss_kib()} {_rss_kib('VmHWM')}\n")
