"""Read parts of safetensors checkpoint tensors: a rank's rows / columns of a tensor (a `Cut` of
layers/tp.py, None = whole), written straight into a destination tensor of the model's dtype and device.

    files = CheckpointFiles(folder, window_bytes)
    files.read_into(dest, name, cut, block)     dest [local shape] <- tensor `name` cut, cast

Reading is `safe_open(shard).get_slice(name)[index]` over chunks of at most about `window_bytes`
of the file (leading-dim blocks; one leading index split further when it alone is larger). The
files are memory-mapped, so the pages a chunk touches stay resident while the mapping is open:
every `window_bytes` of touched file the handles are dropped (unmapped) and reopened on the next
read, so a rank's host memory is its own tensors plus at most one window, never a whole shard.

FP8 block-scaled weights (`float8_e4m3fn` / `e5m2` [..., out, in] with a fp32 `<name>_scale_inv`
[..., ceil(out/bo), ceil(in/bi)]): each chunk reads its weight part and only the scale blocks that
cover it (block rows lo//bo .. ceil(hi/bo), and likewise for columns), expands them and crops at the
chunk's offset inside its first block, so a boundary that is not a multiple of the block size
dequantizes exactly like `loader.dequantize_fp8` of the whole tensor then sliced (the same fp32
product per element).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from dhisparse.layers.tp import Cut
from dhisparse.models.loader import SCALE_SUFFIX, ModelLoadError, shard_files

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
WINDOW_BYTES = 256 << 20  # mapped file bytes a reader keeps resident before it unmaps its shards


def chunks(shape: tuple[int, ...], index: list[slice], itemsize: int, window: int) -> Iterator[tuple[list[slice], int]]:
    """Sub-indices of `index` (one step-1 slice per dim of a row-major tensor of `shape`) of at most
    about `window` file bytes each, with the bytes of the file region each one spans."""
    def rec(d: int, prefix: list[slice]) -> Iterator[tuple[list[slice], int]]:
        s, row = index[d], math.prod(shape[d + 1 :]) * itemsize
        if row > window and d + 1 < len(shape):
            for i in range(s.start, s.stop):
                yield from rec(d + 1, [*prefix, slice(i, i + 1)])
            return
        step = max(1, window // max(row, 1))
        for a in range(s.start, s.stop, step):
            b = min(a + step, s.stop)
            yield [*prefix, slice(a, b), *index[d + 1 :]], (b - a) * row

    yield from rec(0, [])


def scale_inv_pairs(names: Iterable[str]) -> dict[str, str]:
    """{weight name: its block-scale tensor name}: GLM / V3.2's `<name>_scale_inv` siblings."""
    return {n[: -len(SCALE_SUFFIX)]: n for n in names if n.endswith(SCALE_SUFFIX)}


def dequantize_part(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                    offset: tuple[int, int]) -> torch.Tensor:
    """w [..., r, c] float8 (a part starting `offset` rows / cols into its first scale block),
    scale [..., ceil((offset+r)/bo), ceil((offset+c)/bi)] covering it -> fp32 [..., r, c]."""
    (bo, bi), (oo, oi) = block, offset
    s = scale.float().repeat_interleave(bo, dim=-2).repeat_interleave(bi, dim=-1)
    return w.float() * s[..., oo : oo + w.shape[-2], oi : oi + w.shape[-1]]


class CheckpointFiles:
    """The tensors of a checkpoint folder, read part by part (module docstring). `by_shard`: {shard:
    its tensor names, scale tensors left out (they come with their weight)}; `bytes_read`: bytes
    copied out of the files (kept parts and the scale blocks covering them). pair_scales: all
    tensor names -> {weight: its scale tensor} (default `_scale_inv` siblings; V4 adds `.scale`)."""

    def __init__(self, folder: Path, window_bytes: int = WINDOW_BYTES,
                 pair_scales: Callable[[Iterable[str]], dict[str, str]] = scale_inv_pairs) -> None:
        self.window, self.touched, self.bytes_read = max(1, window_bytes), 0, 0
        self.handles: dict[Path, Any] = {}
        self.where: dict[str, Path] = {}
        self.by_shard: dict[Path, list[str]] = {}
        self._info: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for path, names in shard_files(folder).items():
            names = names if names is not None else list(self._open(path).keys())
            self.where |= {n: path for n in names}
            self.by_shard[path] = names
        self.scale_of = pair_scales(self.where)
        scales = set(self.scale_of.values())
        self.by_shard = {p: [n for n in names if n not in scales] for p, names in self.by_shard.items()}
        self.release()

    def _open(self, path: Path) -> Any:
        if path not in self.handles:
            try:
                self.handles[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"{path}: not a readable safetensors file ({e}); "
                                     "re-download or re-export it") from None
        return self.handles[path]

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of a tensor as stored, from the file header."""
        if name not in self._info:
            sl = self._open(self.where[name]).get_slice(name)
            self._info[name] = tuple(sl.get_shape()), DTYPES[sl.get_dtype()]
        return self._info[name]

    def release(self) -> None:
        """Drop every open handle (their mappings go with them)."""
        self.handles.clear()
        self.touched = 0

    def _part(self, name: str, index: list[slice]) -> torch.Tensor:
        part = self._open(self.where[name]).get_slice(name)[tuple(index)]
        self.bytes_read += part.numel() * part.element_size()
        return part

    def _fp8_part(self, name: str, index: list[slice], block: tuple[int, int], device: torch.device) -> torch.Tensor:
        """fp32 of weight[index] on `device` from the weight part and the scale blocks covering it
        (dequantized there: the same IEEE fp32 products on any device)."""
        sname = self.scale_of.get(name, name + SCALE_SUFFIX)
        shape, nd = self.info(name)[0], len(index)
        if sname not in self.where:
            raise ModelLoadError(f"{name} is FP8 but has no {sname} tensor; FP8 weights need their block scales")
        if nd < 2:
            raise ModelLoadError(f"{name}: an FP8 tensor of shape {list(shape)}; block scales need [..., out, in]")
        want = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
        if self.info(sname)[0] != want:
            raise ModelLoadError(f"{sname}: shape {list(self.info(sname)[0])} does not match weight {list(shape)} "
                                 f"with block {list(block)} (expected {list(want)}); check "
                                 "quantization_config.weight_block_size")
        s_index = list(index[:-2])
        for d, b in zip((nd - 2, nd - 1), block):
            s_index.append(slice(index[d].start // b, -(-index[d].stop // b)))
        offset = tuple(index[d].start - s_index[d].start * b for d, b in zip((nd - 2, nd - 1), block))
        w, scale = self._part(name, index).to(device), self._part(sname, s_index).to(device)
        return dequantize_part(w, scale, block, offset)

    def read_into(self, dest: torch.Tensor, name: str, cut: Cut | None, block: tuple[int, int]) -> None:
        """dest [shape of `name` with `cut` applied] <- that part, cast to dest's dtype (FP8 weights
        dequantized in fp32 first); reads nothing outside the cut but the covering scale blocks."""
        shape, dtype = self.info(name)
        if not shape:  # a scalar
            dest.copy_(self._open(self.where[name]).get_tensor(name))
            return
        dim = cut.dim if cut is not None else 0
        spans = cut.spans if cut is not None else ((0, shape[0]),)
        full = [slice(0, n) for n in shape]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        at = 0
        for lo, hi in spans:
            span = [*full[:dim], slice(lo, hi), *full[dim + 1 :]]
            for index, nbytes in chunks(shape, span, itemsize, self.window):
                part = self._fp8_part(name, index, block, dest.device) if dtype in FP8 else self._part(name, index)
                d = index[dim]
                out = [*index[:dim], slice(at + d.start - lo, at + d.stop - lo), *index[dim + 1 :]]
                dest[tuple(out)].copy_(part)
                del part
                self._touch(nbytes)
            at += hi - lo

    def _touch(self, nbytes: int) -> None:
        self.touched += nbytes
        if self.touched >= self.window:
            self.release()
