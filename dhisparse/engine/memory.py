"""Device choice and KV pool sizing."""

from __future__ import annotations

import gc

import torch

CPU_DEFAULT_POOL_BYTES = 256 << 20

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available; use --device cpu")
    return dev


def release_memory() -> None:
    """Collect unreachable engines (their stores hold reference cycles) and return cached CUDA
    blocks, so the next engine sees what is free. A freed host pool's pinned registration stays
    (kv/memory/pinned.py) and the next pool that fits reuses it without pinning again (pinning tens of
    GiB takes ~1 s per GiB)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kv_pool_bytes(setting: int | None, fraction: float, device: torch.device) -> int:
    """Bytes for the KV pool: the explicit setting, else `fraction` of free CUDA memory, else
    CPU_DEFAULT_POOL_BYTES on CPU."""
    if setting is not None:
        return setting
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return CPU_DEFAULT_POOL_BYTES


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
