"""Rotary position embeddings: plain RoPE and YaRN, on the `qk_rope_head_dim` slice of q and k.

The cos/sin table is built once per model for the positions in use and indexed per token, so
nothing about rope is recomputed per layer or per step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mci.model_config import RopeConfig, yarn_mscale


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin multiplier ("attention factor").

    YaRN blends interpolated (1/(factor*base^(2i/d))) and extrapolated (1/base^(2i/d))
    frequencies with a linear ramp between the dims that complete `beta_fast` and `beta_slow`
    rotations over the original context; this matches DeepSeek's and transformers' formula.
    """
    # float32, like the DeepSeek and transformers references, so tables agree bit for bit.
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extrapolated = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return extrapolated, 1.0
    original = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1 - ramp
    interpolated = 1.0 / (rope.factor * rope.theta**exponents)
    inv_freq = interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated
    factor = rope.attention_factor
    if factor is None:
        if rope.mscale and rope.mscale_all_dim:
            factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(
                rope.factor, rope.mscale_all_dim
            )
        else:
            factor = yarn_mscale(rope.factor)
    return inv_freq, float(factor)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table; `cos_sin(positions)` returns [T, dim/2] each, in float32.

    The table grows (doubling) when a position beyond it is requested, so memory follows the
    longest sequence actually served, not `max_position_embeddings`.
    """

    def __init__(self, rope: RopeConfig, dim: int, initial_positions: int = 4096):
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos_table", torch.empty(0, dim // 2), persistent=False)
        self.register_buffer("sin_table", torch.empty(0, dim // 2), persistent=False)
        self._ensure(initial_positions)

    def _ensure(self, num_positions: int) -> None:
        if num_positions <= self.cos_table.shape[0]:
            return
        size = max(num_positions, 2 * self.cos_table.shape[0])
        t = torch.arange(size, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        self.cos_table = freqs.cos() * self.attention_factor
        self.sin_table = freqs.sin() * self.attention_factor

    def tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables [positions, dim/2] float32, covering `max_position`."""
        self._ensure(max_position + 1)
        return self.cos_table, self.sin_table

    def cos_sin(
        self, positions: torch.Tensor, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos [T, dim/2], sin [T, dim/2]); `max_position` bounds positions."""
        self._ensure(max_position + 1)
        return self.cos_table[positions], self.sin_table[positions]


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Rotate x: [..., dim] by angles whose cos/sin broadcast against [..., dim/2].

    Interleaved checkpoints pair dims (0,1), (2,3), ...; the others pair (i, i + dim/2). Both
    write the result de-interleaved ([rotated evens | rotated odds]); q and k get the same
    permutation, so their dot products are exactly the rotated ones.

    The result has the promoted dtype of x and cos/sin: float32 for bf16 x and the float32
    tables, and the caller rounds once. (bf16 tables, as transformers uses, cost accuracy: the
    angles' own rounding, then a rounding per product.)
    """
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
