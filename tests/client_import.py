"""The `openai` client for the server tests: required on the CPU (CI installs it with the `test`
extra, so a missing client fails there loudly), optional on a CUDA machine, whose carried wheels
(bench/device_wheels.sh --lean) leave it out to fit the device tool's carry. These files drive the
server on CPU only, so the CUDA run loses no device coverage by skipping them."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch


def openai_client() -> ModuleType:
    """`import openai`; on a CUDA machine without it, skip the importing test module."""
    if torch.cuda.is_available():
        return pytest.importorskip("openai", reason="the lean device wheels carry no OpenAI client")
    return importlib.import_module("openai")
