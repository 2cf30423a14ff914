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
def _release_cuda_memory():
    """On CUDA, engines of a finished test are collected before the next test sizes its pools."""
    yield
    if torch.cuda.is_available():
        from dhisparse.engine.memory import release_memory

        release_memory()
