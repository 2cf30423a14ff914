"""Which implementation a kernel dispatcher runs: Triton on CUDA, PyTorch elsewhere.

Environment overrides: DHISPARSE_TORCH_KERNELS=1 forces the PyTorch references everywhere;
DHISPARSE_TRITON_KERNELS=1 forces the Triton kernels on CPU too (they then need
TRITON_INTERPRET=1: tests and op-count measurements of the GPU code path run this way).
"""

from __future__ import annotations

import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """True when the dispatcher should run its Triton kernel for tensors like `t`."""
    if os.environ.get("DHISPARSE_TORCH_KERNELS", "0") == "1":
        return False
    return t.is_cuda or os.environ.get("DHISPARSE_TRITON_KERNELS", "0") == "1"
