"""Linear layers: plain weights, and FP8 e4m3 weights with 128x128 block scales.

FP8 weights stay FP8 in memory (one byte per parameter) and are dequantised to the
activation dtype at use: `w = fp8 * weight_scale_inv` per block. The scale tensor has shape
[..., ceil(out/bo), ceil(in/bi)]; partial edge blocks share their block's scale.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """weight: [..., out, in] fp8; scale_inv: [..., ceil(out/bo), ceil(in/bi)] -> [..., out, in]."""
    out_dim, in_dim = weight.shape[-2:]
    bo, bi = block
    scale = scale_inv.repeat_interleave(bo, dim=-2)[..., :out_dim, :]
    scale = scale.repeat_interleave(bi, dim=-1)[..., :in_dim]
    return (weight.to(torch.float32) * scale).to(dtype)


def quantize_fp8_blocks(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise e4m3 quantisation (max-abs per block maps to 448): returns (fp8, scale_inv)."""
    out_dim, in_dim = weight.shape
    bo, bi = block
    nbo, nbi = math.ceil(out_dim / bo), math.ceil(in_dim / bi)
    padded = torch.zeros(nbo * bo, nbi * bi, dtype=torch.float32)
    padded[:out_dim, :in_dim] = weight.float()
    blocks = padded.view(nbo, bo, nbi, bi)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [nbo, nbi]
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(nbo * bo, nbi * bi)[:out_dim, :in_dim].to(FP8_DTYPE)
    return q.contiguous(), scale_inv.contiguous()


class Linear(nn.Module):
    """y = x W^T with W: [out, in] in the activation dtype (no bias: DeepSeek-V3 has none)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Fp8BlockLinear(nn.Module):
    """y = x dequant(W)^T with W stored as fp8 [out, in] plus float32 block scales."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int]):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), False)
        scale_shape = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), False)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(x.dtype))


def make_linear(
    in_features: int, out_features: int, dtype: torch.dtype, fp8_block: tuple[int, int] | None
) -> Linear | Fp8BlockLinear:
    """An FP8 block linear when the checkpoint quantises this projection, else a plain one."""
    if fp8_block is not None:
        return Fp8BlockLinear(in_features, out_features, fp8_block)
    return Linear(in_features, out_features, dtype)
