"""The SiLU-gated MLP used by dense layers and by shared experts."""

import torch
import torch.nn.functional as F
from torch import nn

from mci.layers.linear import make_linear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); x: [T, hidden] -> [T, hidden]."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, fp8_block=None):
        super().__init__()
        self.gate_proj = make_linear(hidden, inter, dtype, fp8_block)
        self.up_proj = make_linear(hidden, inter, dtype, fp8_block)
        self.down_proj = make_linear(inter, hidden, dtype, fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
