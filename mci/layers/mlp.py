"""The SiLU-gated MLP used by dense layers and by shared experts."""

import torch
import torch.nn.functional as F
from torch import nn

from mci.layers.linear import Linear, empty_rows


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up run as one fused matmul. [T, H] -> [T, H].

    With `shards` > 1 this holds 1/shards of the intermediate dimension (column-parallel gate
    and up, row-parallel down): its output is a partial sum the caller all-reduces."""

    def __init__(
        self, hidden: int, inter: int, dtype: torch.dtype, fp8_block=None, shards: int = 1
    ):
        super().__init__()
        if inter % shards:
            raise ValueError(f"intermediate size {inter} does not divide into {shards} shards")
        inter //= shards
        self.gate_up_proj = Linear(hidden, (inter, inter), dtype, fp8_block)
        self.down_proj = Linear(inter, (hidden,), dtype, fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        matvec = self.gate_up_proj.skinny(rows)
        if (
            matvec is not None
            and self.down_proj.skinny(rows) is not None
            and x.dtype == torch.bfloat16
            and x.dim() == 2
        ):
            # the same steps in one call of the CPU kernels (mci/kernels/cpu_moe.c)
            return matvec.gated_mlp(x, self.gate_up_proj.kernel, self.down_proj.kernel)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if gate.dim() != 2 or gate.requires_grad or gate.device.type != "cpu":
            return self.down_proj(F.silu(gate) * up)
        # the same product, with room for down_proj's bucketed rows (linear.empty_rows)
        act = empty_rows(gate.shape[0], gate.shape[1], dtype=gate.dtype)
        return self.down_proj(torch.mul(F.silu(gate), up, out=act))
