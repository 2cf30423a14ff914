"""Row formats of the KV cache: how one stored row is laid out in every tier (`--kv-cache-dtype`).

A *row format* maps a row of `dim` model values to `width` storage elements and back. Plain rows
(`auto` / `bfloat16`) store the values as they are. FP8 rows (`fp8_e4m3`) are bytes (uint8
storage), quantized once when a row is written (`encode`) and never again: every tier (device
pages, hot cache, tail, optional history, staging, host, prefix pages) copies the same bytes, so a
row read from host is byte-identical to the row written, and placement stays exact.

  FP8 MLA latent row (FlashMLA / SGLang / vLLM "fp8_ds_mla", scale="fp32"): C = kv_lora, R = rope
    | C x e4m3 (the normalized latent) | NT x fp32 scale | R x bf16 (rope) | pad to 4 B |
      0                              C             C + 4 NT          C + 4 NT + 2 R
    GLM-5.x / V3.2: C 512, one scale per 128 values (NT 4), R 64 -> 512 + 16 + 128 = 656 B
  FP8 index key (scale="fp32", R = 0): | iD x e4m3 | 1 x fp32 scale |   128 + 4 = 132 B
  FP8 DeepSeek-V4 compressed row (FlashMLA "MODEL1", scale="ue8m0", rope_first):
    | N x e4m3 (the non-rope dims) | R x bf16 (rope) | NT x e8m0 scale | pad to 8 B |
    V4: head_dim 512 = N 448 + R 64, one power-of-two scale per 64 values: 448 + 128 + 7 + 1 = 584 B

Quantization of a tile of `tile` values x (DeepSeek's reference `act_quant`):
    amax = max(|x|, 1e-4);  s = amax / 448  (ue8m0: s = 2^ceil(log2(amax / 448)));  q = e4m3(x / s)
and dequantization is q * s in fp32, then the model dtype. |q * s - x| <= s * 2^-4 per value for
normal e4m3 values (3 mantissa bits, round to nearest), <= s * 2^-10 in the subnormal range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")


@dataclass(frozen=True)
class RowFormat:
    """One kind of stored row.

    dim     model values per row (C + R); `decode` returns [..., dim] in `dtype`
    dtype   the model dtype rows are read back in
    fp8     False: plain rows of `dtype` (width = dim); True: uint8 rows of the layout above
    rope    trailing values kept in bf16 (not quantized); 0 for index keys
    tile    values per scale (the quantized dims must be a multiple of it)
    scale   "fp32" (4 B, amax / 448) or "ue8m0" (1 B exponent, a power of two)
    rope_first  scales after the rope values (V4 "MODEL1") instead of before them
    align   the row's byte width is padded to a multiple of this
    """

    dim: int
    dtype: torch.dtype
    fp8: bool = False
    rope: int = 0
    tile: int = 128
    scale: str = "fp32"
    rope_first: bool = False
    align: int = 4

    def __post_init__(self) -> None:
        if not self.fp8:
            return
        n = self.dim - self.rope
        if n <= 0 or self.tile <= 0 or n % self.tile:
            raise ValueError(f"fp8 rows need the quantized dims ({n}) to be a positive multiple of the tile ({self.tile})")
        if self.scale not in ("fp32", "ue8m0"):
            raise ValueError(f"scale must be fp32 or ue8m0, got {self.scale!r}")

    @classmethod
    def plain(cls, dim: int, dtype: torch.dtype) -> "RowFormat":
        return cls(dim, dtype)

    # -- geometry ---------------------------------------------------------------------------
    @property
    def quantized(self) -> int:
        """Values stored as e4m3 (0 for plain rows)."""
        return self.dim - self.rope if self.fp8 else 0

    @property
    def tiles(self) -> int:
        return self.quantized // self.tile if self.fp8 else 0

    @property
    def scale_bytes(self) -> int:
        return 4 if self.scale == "fp32" else 1

    @property
    def offsets(self) -> tuple[int, int]:
        """Byte offsets (scales, rope) within an FP8 row."""
        n, s = self.quantized, self.tiles * self.scale_bytes
        return (n + 2 * self.rope, n) if self.rope_first else (n, n + s)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fp8 else self.dtype

    @property
    def width(self) -> int:
        """Storage elements per row (bytes for FP8 rows)."""
        if not self.fp8:
            return self.dim
        raw = self.quantized + self.tiles * self.scale_bytes + 2 * self.rope
        return -(-raw // self.align) * self.align

    @property
    def nbytes(self) -> int:
        """Bytes of one stored row."""
        return self.width * (1 if self.fp8 else self.dtype.itemsize)

    # -- encode / decode (the plain-PyTorch definition every kernel follows) ------------------
    def scales_of(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, quantized] float -> per-tile scales [n, tiles] fp32."""
        amax = x.float().view(*x.shape[:-1], self.tiles, self.tile).abs().amax(-1).clamp(min=AMAX_FLOOR)
        s = amax / FP8_MAX
        return torch.exp2(torch.ceil(torch.log2(s))) if self.scale == "ue8m0" else s

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, dim] (any float dtype) -> stored rows [n, width] of `storage_dtype`."""
        if not self.fp8:
            return x.to(self.dtype)
        n, Q = x.shape[0], self.quantized
        if n == 0:
            return torch.zeros(0, self.width, dtype=torch.uint8, device=x.device)
        s = self.scales_of(x[:, :Q])
        q = (x[:, :Q].float().view(n, self.tiles, self.tile) / s[..., None]).clamp(-FP8_MAX, FP8_MAX)
        q8 = q.view(n, Q).to(torch.float8_e4m3fn).view(torch.uint8)
        sb = s.contiguous().view(torch.uint8) if self.scale == "fp32" else _e8m0(s)
        rope = x[:, Q:].to(torch.bfloat16).contiguous().view(torch.uint8)
        parts = [q8, rope, sb] if self.rope_first else [q8, sb, rope]
        pad = self.width - sum(p.shape[1] for p in parts)
        if pad:
            parts.append(torch.zeros(n, pad, dtype=torch.uint8, device=x.device))
        return torch.cat(parts, dim=1)  # one write of the row, in the layout's order

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows [..., width] -> values [..., dim] in `dtype` (q * s in fp32, then `dtype`)."""
        if not self.fp8:
            return rows.to(self.dtype)
        lead, Q = rows.shape[:-1], self.quantized
        if rows.numel() == 0:
            return torch.zeros(*lead, self.dim, dtype=self.dtype, device=rows.device)
        so, ro = self.offsets
        q = rows[..., :Q].contiguous().view(torch.float8_e4m3fn).float()
        sb = rows[..., so : so + self.tiles * self.scale_bytes].contiguous()
        s = sb.view(torch.float32) if self.scale == "fp32" else torch.exp2(sb.float() - 127.0)
        vals = (q.view(*lead, self.tiles, self.tile) * s[..., None]).view(*lead, Q).to(self.dtype)
        rope = rows[..., ro : ro + 2 * self.rope].contiguous().view(torch.bfloat16).to(self.dtype)
        return torch.cat([vals, rope], dim=-1)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)): what attention sees of a row written as x."""
        return self.decode(self.encode(x))


def _e8m0(s: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales [n, t] fp32 -> their e8m0 bytes (biased exponent 127)."""
    return (torch.log2(s).round() + 127).clamp(0, 254).to(torch.uint8)


@dataclass(frozen=True)
class KVFormats:
    """The formats of a store's two row kinds: MLA latent (or V4 compressed) rows and index keys.
    Both share one storage dtype (one page arena holds both)."""

    latent: RowFormat
    index: RowFormat

    def __post_init__(self) -> None:
        if self.latent.storage_dtype != self.index.storage_dtype:
            raise ValueError("latent and index rows must share a storage dtype")

    @property
    def fp8(self) -> bool:
        return self.latent.fp8

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.latent.storage_dtype

    @classmethod
    def plain(cls, latent_dim: int, index_dim: int, dtype: torch.dtype) -> "KVFormats":
        return cls(RowFormat.plain(latent_dim, dtype), RowFormat.plain(index_dim, dtype))

    @classmethod
    def mla(cls, kv_cache_dtype: str, latent_dim: int, rope: int, index_dim: int, dtype: torch.dtype) -> "KVFormats":
        """GLM-5.x / DeepSeek-V3.2: fp8_e4m3 gives 656-B latent rows and 132-B index keys at the
        production shapes (tiles of 128, or of the whole quantized part when it is smaller)."""
        if not is_fp8(kv_cache_dtype):
            return cls.plain(latent_dim, index_dim, dtype)
        c = latent_dim - rope
        return cls(RowFormat(latent_dim, dtype, True, rope, min(128, c)),
                   RowFormat(index_dim, dtype, True, 0, index_dim))

    @classmethod
    def of_model(cls, kv_cache_dtype: str, cfg, dtype: torch.dtype) -> "KVFormats":
        """`mla` with the dims of a GLM-5.x / V3.2 `ModelConfig` (what kv/build.py stores)."""
        return cls.mla(kv_cache_dtype, cfg.latent_dim, cfg.qk_rope_head_dim, cfg.index_head_dim, dtype)

    @classmethod
    def v4(cls, kv_cache_dtype: str, head_dim: int, rope: int, index_dim: int, dtype: torch.dtype) -> "KVFormats":
        """DeepSeek-V4 compressed rows: fp8_e4m3 gives the 584-B "MODEL1" rows (448 e4m3 in tiles
        of 64 with e8m0 scales, 64 bf16 rope, padded to 8 B) and 132-B index keys."""
        if not is_fp8(kv_cache_dtype):
            return cls.plain(head_dim, index_dim, dtype)
        n = head_dim - rope
        return cls(RowFormat(head_dim, dtype, True, rope, min(64, n), "ue8m0", True, 8),
                   RowFormat(index_dim, dtype, True, 0, index_dim))


def is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype == "fp8_e4m3"


def check_device(kv_cache_dtype: str, device: torch.device) -> None:
    """Refuse FP8 rows where the kernels cannot read them: CUDA GPUs below compute capability 8.9
    have no e4m3 conversions (Triton's fp8e4nv). CPUs decode with PyTorch."""
    if not is_fp8(kv_cache_dtype) or device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} needs a GPU of compute capability >= 8.9 (e4m3 "
                         f"conversions); {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}: use "
                         "--kv-cache-dtype auto")
