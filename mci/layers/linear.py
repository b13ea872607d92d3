"""Linear layers with fused parts, optional expert stacking, and FP8 e4m3 block weights.

One `Linear` can hold several checkpoint projections that read the same input, stacked along
the output dimension, so they run as one matmul (e.g. `gate_proj` + `up_proj` ->
`gate_up_proj`, `q_a_proj` + `kv_a_proj_with_mqa` -> `fused_qkv_a_proj`):

    weight [(E,) out_0 + out_1 + ..., in]        part j owns rows offset_j .. offset_j + out_j

FP8 weights stay FP8 in memory (one byte per parameter). Each part keeps its own 128x128
block scales, stacked the same way:

    weight_scale_inv [(E,) ceil(out_0/128) + ceil(out_1/128) + ..., ceil(in/128)]

`row_block[r]` / `col_block[c]` give the scale row / column of weight row r / column c, so
dequantisation is one gather and one multiply whatever the parts' alignment. On the CPU the
matmuls read the FP8 bytes in place (mci/kernels/cpu_fp8.c, any number of rows): up to 16
rows bit for bit the bf16 skinny kernel's result on `dense_weight`, more rows through a GEMM
within float32 summation order of it (as oneDNN is for bf16), and under `--deterministic`
the skinny kernel's order at every row count; elsewhere, or without the kernels, the weight
is dequantised to the activation dtype at each use (`dense_weight`).

On the CPU an engine packs bf16 weights once into oneDNN's blocked layout
(`pack_for_cpu`). aten's own bf16 matmul goes through oneDNN too but re-lays the weight out on
every call, which halves its speed at decode sizes; the packed matmul gives bitwise the same
result at the sizes tested (a few dozen rows; with more rows the two may pick kernels that sum
in another order). float32 and float16 stay on aten, whose kernels sum in another order.

With the CPU kernels, a bf16 call of a few rows runs on them instead (`skinny`: up to
`kernel_rows`, on AMX tiles from 2 rows where the CPU has AMX), and on AMX a call past that
bound, up to 1,536 rows, runs on their AMX expert kernel from one more packed copy of a
weight of up to 2 MB (`amx_packed`; cpu_kernels.py's AMX_PACKED_WEIGHT_BYTES and
AMX_PACKED_MAX_ROWS), not oneDNN: faster there, and each
row's result the same whatever the other rows of the call (within one bf16 rounding of
oneDNN's, equal at the sizes measured). Batch invariance keeps oneDNN (below).

On a CPU without bf16 matmul instructions (no AVX-512 BF16/BW, no AVX-NE-CONVERT: oneDNN
cannot pack bf16 there), torch's bf16 matmul falls back to a slow generic loop: measured on an
AVX2 AMD EPYC, a 2,048^2 bf16 matmul ran at 1.2 GFLOP/s against 135 in float32, and a
32-request decode step of the `small` model took 426 ms. There `pack_for_cpu` keeps a float32
copy of the weight (`widened`, two more bytes per parameter), and calls of `WIDENED_MIN_ROWS`
rows or more run in float32 on the bf16 input widened exactly, the result rounded once to
bf16: float32 sums of exact bf16 products rounded once, the contract of a bf16 matmul, within
float32 summation order of torch's bf16 kernel (the weights' values are untouched: nothing is
quantised).

oneDNN JIT-compiles a kernel for every new (rows, out, in) shape it sees, which costs 1-9 ms
each time: more than the matmul itself at serving sizes, where the number of rows (tokens in a
step, or tokens routed to one expert) is different almost every step. So the CPU matmuls run at
a bounded set of row counts (`bucket_rows`), padding the input with zero rows and dropping
their outputs; each output row depends only on its input row, so the rows kept are unchanged.

Batch invariance (`--deterministic`): oneDNN picks its matmul kernel by the shape, row count
included, and kernels sum in different orders: at 48+ rows some rows of a packed bf16 matmul
come out differently in the last bit than the same rows computed alone (measured on every
projection of the `small` model), and even between 1 and 32 rows a batched matmul differs on
rare inputs (2 rows in 1,600 on the `tiny` model's absorbed-attention shape). So a
batch-invariant matmul always runs exactly `BATCH_INVARIANT_ROWS` rows per call (`fixed_rows`:
split, the last part padded with zero rows): one kernel for every call, so a row's result
cannot depend on what else shares its step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mci.kernels import cpu_kernels

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


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


BATCH_INVARIANT_ROWS = 32
# Fewest rows a widened bf16 weight (see above) is read in float32 for: below, torch's bf16
# kernel reads half the bytes and wins (measured on an AVX2 AMD EPYC over the `small` model's
# weight shapes, 1 / 2 / 4 rows: bf16 53-827 / 108-1,120 / 156-2,233 us, float32 66-1,434 /
# 127-2,772 / 157-3,625 us; at 8 rows float32 took 0.25-0.8x bf16's time, at 32 0.25-0.45x).
WIDENED_MIN_ROWS = 3


def bucket_rows(rows: int) -> int:
    """The row count a CPU matmul over `rows` rows runs at: exact up to 16 (decode steps and
    small expert batches), a multiple of 16 up to 256, then 8 sizes per doubling (at most 1/8
    padding): 71 shapes in all up to 8,192 rows."""
    if rows <= 16:
        return rows
    step = 16 if rows <= 256 else 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def bucket_sizes(max_rows: int) -> list[int]:
    """Every row count `bucket_rows` gives for 1..max_rows, ascending."""
    sizes, rows = [], 1
    while rows <= max_rows:
        sizes.append(bucket_rows(rows))
        rows = sizes[-1] + 1
    return sizes


def empty_rows(
    rows: int, *shape: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """An uninitialised [rows, *shape] tensor whose storage holds `bucket_rows(rows)` rows:
    `pad_rows` hands a CPU matmul the extra rows in place instead of copying x (for a
    layer's activations that feed a packed matmul: a norm's output, a cast, silu * up)."""
    return torch.empty((bucket_rows(rows), *shape), dtype=dtype, device=device)[:rows]


def pad_rows(x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """x [n, ...] at `rows` rows (default `bucket_rows(n)`) for a row-wise fn whose extra
    rows' results are dropped: x itself when it has them already; the rows that follow x in
    its own storage when there are enough of them (`empty_rows` leaves them: no copy), any
    values they hold reaching only their own, dropped, results; else x with zero rows
    appended (a copy of x: a 1,056-row prefill's input to each matmul, 3.8% of a
    shared-prefix burst's wall time before its producers left room)."""
    n = x.shape[0]
    target = bucket_rows(n) if rows is None else rows
    extra = target - n
    if not extra:
        return x
    if x.is_contiguous():
        end = (x.storage_offset() + target * math.prod(x.shape[1:])) * x.element_size()
        if x.untyped_storage().nbytes() >= end:
            return x.as_strided((target,) + x.shape[1:], x.stride())
    return torch.cat((x, x.new_zeros((extra,) + x.shape[1:])))


def fixed_rows(fn, x: torch.Tensor, rows: int) -> torch.Tensor:
    """fn applied to x [n, ...] in calls of exactly `rows` rows (the last part padded with zero
    rows), results concatenated and cut back to n rows. For a row-wise fn, row i's result then
    never depends on how many rows x has (batch invariance)."""
    n = x.shape[0]
    parts = [fn(pad_rows(part, rows)) for part in x.split(rows)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:n]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, rows: int | None) -> torch.Tensor:
    """x [..., in] @ a oneDNN-packed weight -> [..., out]: at bucketed row counts, or in calls
    of exactly `rows` rows when given (batch invariance)."""
    x2d = x.reshape(-1, x.shape[-1])

    def matmul(part: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(part, packed, None, "none", [], "")

    if rows is not None:
        out = fixed_rows(matmul, x2d, rows)
    else:
        out = matmul(pad_rows(x2d))[: x2d.shape[0]]
    return out.view(x.shape[:-1] + out.shape[-1:])


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` applies: a CPU tensor with oneDNN available, and for bf16 a CPU
    oneDNN runs bf16 matmuls on (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere its packing
    raises, and the layer keeps torch's own matmul)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or bf16_matmuls_supported()


def bf16_matmuls_supported() -> bool:
    """Whether oneDNN runs bf16 matmuls on this CPU (packing and the batch-invariant mode
    need it)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a CPU weight [out, in], for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class Linear(nn.Module):
    """y = x W^T (no bias: DeepSeek-V3 has none), W the parts stacked along the output dim."""

    def __init__(
        self,
        in_features: int,
        part_sizes: tuple[int, ...],
        dtype: torch.dtype,
        fp8_block: tuple[int, int] | None = None,
        num_experts: int = 0,
    ):
        super().__init__()
        self.in_features, self.part_sizes = in_features, tuple(part_sizes)
        self.out_features = sum(part_sizes)
        self.block = fp8_block
        lead = (num_experts,) if num_experts else ()
        wdtype = FP8_DTYPE if fp8_block else dtype
        weight = torch.empty(*lead, self.out_features, in_features, dtype=wdtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self._packed: list[torch.Tensor] | None = None  # oneDNN copy, per expert when stacked
        self.matvec: cpu_kernels.CpuKernels | None = None  # skinny-matmul kernels (CPU)
        self.kernel: cpu_kernels.KernelWeight | None = None  # the weight as they read it
        self.kernel_rows = 0  # most rows of a call on them (`linear_max_rows`, set with them)
        self.fixed_rows: int | None = None  # rows per call, for batch invariance (see above)
        self.widened: torch.Tensor | None = None  # float32 copy of a bf16 weight (see above)
        # bf16 on AMX: a copy packed for the kernels' AMX expert kernel, which runs the calls
        # past `kernel_rows` (`CpuKernels.amx_linear_weight`; None where oneDNN keeps them)
        self.amx_packed: torch.Tensor | None = None
        if fp8_block is None:
            return
        bo, bi = fp8_block
        part_blocks = [math.ceil(n / bo) for n in part_sizes]
        scale = torch.empty(*lead, sum(part_blocks), math.ceil(in_features / bi))
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        rows, base = [], 0
        for n, nb in zip(part_sizes, part_blocks, strict=True):
            rows.append(base + torch.arange(n) // bo)
            base += nb
        self.register_buffer("row_block", torch.cat(rows), persistent=False)
        self.register_buffer("col_block", torch.arange(in_features) // bi, persistent=False)

    def part_rows(self, part: int, scale: bool) -> slice:
        """Rows of `weight` (or of `weight_scale_inv`) that checkpoint part `part` fills."""
        sizes = self.part_sizes
        if scale:
            sizes = tuple(math.ceil(n / self.block[0]) for n in sizes)
        start = sum(sizes[:part])
        return slice(start, start + sizes[part])

    def dense_weight(self, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        """[out, in] in `dtype` (of one expert when stacked); FP8 is dequantised here."""
        weight = self.weight if expert is None else self.weight[expert]
        if self.block is None:
            return weight if weight.dtype == dtype else weight.to(dtype)
        scale = self.weight_scale_inv if expert is None else self.weight_scale_inv[expert]
        full_scale = scale[self.row_block][:, self.col_block]  # [out, in]
        return (weight.to(torch.float32) * full_scale).to(dtype)

    def pack_for_cpu(self, skinny_kernels: bool = True) -> bool:
        """Prepare for inference on the CPU. bf16: keep a oneDNN-packed copy of the weight for
        `forward` (one more copy of it), and with `skinny_kernels` use
        mci/kernels/cpu_kernels.py for calls of a few rows where it runs. FP8 (128x128
        blocks): with `skinny_kernels`, every call reads the FP8 weight in place through the
        kernels where they run, else it is dequantised at use. Returns whether it prepared
        anything."""
        w = self.weight
        if w.device.type != "cpu":
            return False
        kernels = cpu_kernels.load() if skinny_kernels else None
        self.amx_packed = None
        if self.block is not None:
            self.matvec = self.kernel = None
            if kernels is None or not kernels.fp8 or self.block != (128, 128):
                return False
            self.matvec, self.kernel_rows = kernels, kernels.linear_max_rows(self.in_features, True)
            scale = self.weight_scale_inv
            self.kernel = cpu_kernels.KernelWeight(w.contiguous(), scale, self.row_block)
            self.kernel.set_skinny_order(self.fixed_rows is not None)
            return True
        if w.dtype != torch.bfloat16:
            return False
        if not can_pack(w):  # no bf16 matmul instructions: float32 matmuls (see above)
            if self.widened is None:
                self.widened = w.float()
        elif self._packed is None:
            self._packed = [pack_weight(r) for r in ([w] if w.dim() == 2 else list(w))]
        # the kernels' skinny matmuls at a few rows (their AVX2 build where oneDNN has no bf16)
        self.matvec = kernels
        self.kernel = cpu_kernels.KernelWeight(w.contiguous()) if kernels is not None else None
        if self.kernel is not None:  # AMX where it runs, but one kernel in batch invariance
            self.kernel.set_amx_rows(0 if self.fixed_rows is not None else kernels.amx_rows)
            self.kernel_rows = kernels.linear_max_rows(self.in_features, False)
            self.amx_packed = kernels.amx_linear_weight(w)
        return True

    def matmul_weight(self) -> torch.Tensor:
        """The weight [(E,) out, in] batched matmuls read: the float32 copy where bf16 is
        widened (see above), else `weight`. Callers cast their input to its dtype and the
        result back to theirs."""
        return self.weight if self.widened is None else self.widened

    def warm_up(self, max_rows: int) -> int:
        """Run this layer's packed matmul once at every row count it can be called with
        (`bucket_sizes`, or the batch-invariant count) and oneDNN takes (not `skinny`), so
        that oneDNN compiles those kernels now rather than during a request. Returns the
        number of calls (0 when not packed)."""
        if self._packed is None:
            return 0
        sizes = [self.fixed_rows] if self.fixed_rows is not None else bucket_sizes(max_rows)
        sizes = [rows for rows in sizes if self.skinny(rows) is None]
        if self._amx_past_kernels():  # oneDNN runs only the calls of more rows
            sizes = [rows for rows in sizes if rows > cpu_kernels.AMX_PACKED_MAX_ROWS]
        for rows in sizes:
            packed_linear(self.weight.new_zeros(rows, self.in_features), self._packed[0], None)
        return len(sizes)

    def set_batch_invariant(self, enabled: bool) -> None:
        """Run every packed matmul at exactly `BATCH_INVARIANT_ROWS` rows (see above); FP8 on
        the kernels sums in one order at every row count instead."""
        self.fixed_rows = BATCH_INVARIANT_ROWS if enabled else None
        if self.kernel is not None and self.kernel.fp8:
            self.kernel.set_skinny_order(enabled)
        elif self.kernel is not None:
            self.kernel.set_amx_rows(0 if enabled else self.matvec.amx_rows)

    def skinny(self, rows: int, expert_rows: bool = False):
        """The skinny-matmul kernels (a `cpu_kernels.CpuKernels`) when a call of `rows` rows
        should use them: packed for the CPU, at most `kernel_rows` (a routed expert's
        `expert_max_rows` with `expert_rows`), and not batch-invariant (that mode keeps one
        kernel, oneDNN's, for every row count); else None."""
        matvec = self.matvec
        if matvec is None or self.fixed_rows is not None:
            return None
        limit = matvec.expert_max_rows if expert_rows else self.kernel_rows
        return matvec if rows <= limit else None

    def _amx_past_kernels(self) -> bool:
        """Whether calls past `kernel_rows` run on the AMX expert kernel (`amx_packed`), not
        oneDNN: not in batch invariance, which keeps oneDNN's one kernel."""
        return self.amx_packed is not None and self.fixed_rows is None

    def forward(self, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        if self.kernel is not None and x.dtype == torch.bfloat16 and not x.requires_grad:
            rows = x.numel() // x.shape[-1]
            # FP8: the kernels at every row count (see the module docstring)
            matvec = self.matvec if self.kernel.fp8 else self.skinny(rows)
            if matvec is not None:
                out = matvec.linear(x.reshape(rows, x.shape[-1]), self.kernel, expert)
                return out.view(x.shape[:-1] + out.shape[-1:])
            if (
                expert is None
                and self._amx_past_kernels()
                and rows <= cpu_kernels.AMX_PACKED_MAX_ROWS
            ):
                out = self.matvec.amx_packed_linear(x.reshape(rows, x.shape[-1]), self.amx_packed)
                return out.view(x.shape[:-1] + out.shape[-1:])
        widen = self.widened is not None and x.numel() >= WIDENED_MIN_ROWS * x.shape[-1]
        if widen and x.dtype == self.weight.dtype and not x.requires_grad:
            wide = self.widened if expert is None else self.widened[expert]
            return F.linear(x.float(), wide).to(x.dtype)
        if self._packed is not None and x.dtype == self.weight.dtype and not x.requires_grad:
            packed = self._packed[0 if expert is None else expert]
            return packed_linear(x, packed, self.fixed_rows)
        return F.linear(x, self.dense_weight(x.dtype, expert))


def make_linear(
    in_features: int, out_features: int, dtype: torch.dtype, fp8_block: tuple[int, int] | None
) -> Linear:
    """A single-part linear; FP8 when the checkpoint quantises this projection."""
    return Linear(in_features, (out_features,), dtype, fp8_block)
