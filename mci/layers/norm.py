"""RMSNorm, computed in float32 and rounded once to the output dtype.

The residual stream reaching it is float32 (see `mci.models.decoder_layer`); the output is in
the model dtype for the matmuls that follow, or float32 for a consumer that wants it unrounded
(the MoE router). Normalising and weighting both happen in float32 before the one rounding:
transformers rounds after normalising and again after the weight multiply, which measurably
adds to bf16 drift.

(torch's F.rms_norm is a composite of more, smaller ops on CPU and measured slower here.)"""

import torch
from torch import nn

from mci.layers.linear import empty_rows


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), returned in `out_dtype` (default: the weight's)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.kernels = None  # mci/kernels/cpu_kernels.py's library: the same steps in one pass

    def use_kernels(self, kernels) -> bool:
        """Run through the CPU kernels' one-pass RMSNorm (a bf16 weight on the CPU; the eager
        form is ~8 ops per call, a few microseconds each at decode sizes). Returns whether it
        will."""
        ok = kernels is not None and self.weight.dtype == torch.bfloat16
        self.kernels = kernels if ok and self.weight.device.type == "cpu" else None
        return self.kernels is not None

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # x: [..., dim], any float dtype; the product with a bf16 weight promotes to float32.
        out_dtype = out_dtype or self.weight.dtype
        if (
            self.kernels is not None
            and x.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16)
            and out_dtype in (torch.float32, torch.bfloat16)
            and not x.requires_grad
        ):
            out = _matmul_input(x.shape[0], x.shape[1], out_dtype)
            return self.kernels.rms_norm(x, self.weight, self.eps, out_dtype, out)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(out_dtype)

    def add_then_norm(
        self, x: torch.Tensor, addend: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + addend, this norm of it): the residual stream's sum after a sublayer and the
        next sublayer's input. On the CPU kernels one pass over each row, the same bits as
        the add and the norm called in turn (a [T, hidden] float32 temporary fewer)."""
        out_dtype = out_dtype or self.weight.dtype
        if (
            self.kernels is not None
            and x.dim() == 2
            and x.dtype == torch.float32
            and addend.dtype in (torch.float32, torch.bfloat16)
            and addend.shape == x.shape
            and out_dtype in (torch.float32, torch.bfloat16)
            and not x.requires_grad
        ):
            out = _matmul_input(x.shape[0], x.shape[1], out_dtype)
            return self.kernels.add_rms_norm(x, addend, self.weight, self.eps, out_dtype, out)
        total = x + addend
        return total, self(total, out_dtype)


def _matmul_input(rows: int, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Where a norm's output in the model dtype goes: it feeds a matmul, so with room for the
    matmul's bucketed rows (`empty_rows`); None (a plain new tensor) for float32 output."""
    return empty_rows(rows, n, dtype=dtype) if dtype == torch.bfloat16 else None
