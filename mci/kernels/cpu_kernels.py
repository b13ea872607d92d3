"""Skinny matmuls on the CPU (decode sizes: up to 64 rows; bf16 on AMX up to 512) over bf16
weights or FP8 e4m3 block-scaled weights read in place (cpu_fp8.c: the FP8 matmuls take any
number of rows, up to 16 bit for bit the bf16 skinny kernel's result on the dequantised
weight), a GEMM for many rows (cpu_gemm.c: busy routed experts), decode attention over the
latent cache read in place, and the small per-token steps around them (RMSNorm, rope, the
latent cache write), from cpu_matvec.c; the gated MLP and the whole MoE block at those sizes
in one call each, from cpu_moe.c; prefill attention's scores and softmax, from
cpu_prefill_attention.c.

At a few rows oneDNN's bf16 matmul is call-overhead and kernel bound, far below the memory
bandwidth a weight read needs (measured on a 512x512 weight: ~60 us, against ~7 us for this
kernel with the weight in cache, ~26 us streamed from L3). A single-stream decode step is
~100 such calls, so this is where its time went.

This module is their bindings: the C sources are compiled once per machine (build.py), then
loaded with ctypes, which releases the GIL during each call. A CPU with AVX2 and FMA but not
AVX512-BF16 gets the AVX2 build (cpu_avx2.h: the same sums lane for lane, no FP8, no AMX, and
prefill attention left to torch's flash kernel, faster there). `load()` returns None, and
callers keep oneDNN (or float32 matmuls on widened weights), when the CPU has neither, there is
no C compiler, the build fails, or `MCI_CPU_MATVEC=0`.

On a CPU with AMX-BF16, bf16 linears of 2 rows or more run on AMX tiles with the weight read in
place (cpu_amx.c's mci_amx_rows_range: `CpuKernels.amx_rows`, `MCI_CPU_AMX=0` turns AMX off):
within float32 summation order of the skinny kernels, so there a sequence decoded alone (one
row, the skinny kernels) and beside others can differ by a bf16 step; batch invariance keeps one
kernel for every row count. Prefill attention runs there on AMX too where its head dims are
multiples of 32 (scores, softmax and P V in one call: cpu_prefill_attention.c's
mci_amx_prefill_attention), except in batch invariance; and decode attention, for each sequence
of up to 4,096 keys, whatever the batch (cpu_mla.c's amx_attend_one, or amx_attend_split for a
sequence alone: P rounded to bf16 before P V; a sequence's bits never depend on its batch).

Results match oneDNN's packed bf16 matmul (float32 sums of exact bf16 products, rounded once
to nearest even; measured equal on all but a few elements in 10,000, by one bf16 ulp), and a
row's result never depends on the other rows of the call (see the C file), as long as the call
stays on one side of `amx_rows`, of the linear's `kernel_rows` (the in-place AMX matmul below,
the packed AMX expert kernel above: the same sums but for results below float32's normal
range, which the expert kernel flushes to zero) and of AMX_PACKED_MAX_ROWS (oneDNN above).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from typing import Protocol

import torch
import torch.nn.functional as F

from mci.kernels.build import built_library, cpu_flags, cpu_isa, cpu_supports_fp8

log = logging.getLogger(__name__)

# Most rows a call takes the kernels with, per build. AVX-512: since the kernels read a weight
# one row at a time in address order, they beat oneDNN at every decode size measured up to 64
# rows, with the steps' other calls (attention, the MoE, the norms) in one kernel call per
# sublayer once every linear runs on them: the `small` model's whole decode step, three
# engine cores alternating in one process on a 2-core Zen 4 EPYC (medians, 128-token
# prompts), up to 16 / 32 / 64 rows: 24.7 / 16.5 / 16.6 ms at 24 requests, 34.3 / 33.2 /
# 28.1 ms at 48, 53.0 / 51.3 / 46.3 ms at 64; at 96 and 128 requests, 128 rows against 64
# gained 3-4%, within the noise. AVX2 (against float32 matmuls on widened weights,
# layers/linear.py): the `small` model's 32-request step took a median 47-60 ms with the
# kernels up to 32 rows against 61-67 ms up to 16 (two sweeps on an AVX2 EPYC; 64 rows
# gained nothing more).
MAX_ROWS = {"avx512": 64, "avx2": 32}
# Most rows of a bf16 linear on the kernels where they run it on AMX tiles (`amx_rows`): the
# in-place AMX matmul beats oneDNN's well past decode sizes. Measured on a 2-core Xeon with
# AMX-BF16, the `small` model, one prompt prefilled beside 2 decoding requests, every linear
# of up to N rows on AMX (the shared experts then inside the one-call MoE) against oneDNN,
# alternating in one process (median ms a step): 130 rows 15.1 -> 13.0, 258 rows 21.7 ->
# 18.9, 512 rows 37.2 -> 32.8, 642 rows 44.6 -> 41.2, 770 rows 47.2 -> 46.8, and slower at
# ~1,000 (a shared-prefix burst's 993-row step 86.6 -> 93.7); whole decode steps of 128 and
# 256 requests (every layer in one C call from 65 rows on) 20.5-21.3 -> 14.7-16.9 and
# 32.0-32.7 -> 26.0-26.1 ms, alternating processes.
AMX_MAX_ROWS = 512
# ... for a weight of k inputs (a multiple of 32; bf16) while a call's x, which the in-place
# AMX matmul packs whole for each thread and reads again for every 32 weight rows, takes at
# most half a core's L2 (2 MB on the Xeon measured), the weight's tiles streaming through the
# rest: the measurements above are there (k <= 512: 0.5 MB at 512 rows; `small`'s one
# k = 1,536 weight, its dense MLP's down projection, stops at 341 rows). DeepSeek-V3's
# weights of k = 7,168 (its hidden size) stop at 73 rows and its o_proj (k = 16,384) at the
# decode sizes' 64, so its one-call decode steps (every linear of a layer on the kernels) keep
# their old bound.
AMX_PACKED_X_BYTES = 1 << 20
# Past a bf16 linear's bound on the kernels (`linear_max_rows`), a weight of at most this many
# bytes runs on the routed experts' AMX kernel from a packed copy (`amx_linear_weight`,
# `amx_packed_linear`: one segment of every row, each thread taking its own blocks of 32 rows
# through the whole weight, which stays in its L2) instead of oneDNN. Measured on a 2-core
# Xeon with AMX-BF16, `small`'s weights, each of 8 layers' in turn (median us a call, oneDNN
# -> AMX) at 600 / 1,056 rows: fused_qkv_a 416 x 512 241 / 240 -> 110 / 156, q_b 768 x 256
# 148 / 225 -> 87 / 152, kv_b 1,024 x 128 145 / 250 -> 74 / 120, o_proj 512 x 512 289 / 290
# -> 129 / 197. Past L2 the kernel reads the weight again for every block of rows and loses
# (the kernel's first form, the threads splitting the columns, one weight hot: the dense MLP's
# gate_up, 3 MB, 1,226 -> 1,310 us at 1,056 rows; the LM head, 8 MB, 3,011 -> 5,045). Outputs
# equal to oneDNN's in every case measured but one (that gate_up at 600 rows, which this bound
# leaves on oneDNN).
AMX_PACKED_WEIGHT_BYTES = 2 << 20
# ... up to this many rows: past it oneDNN is level or faster (the four attention weights
# above, each thread taking its own blocks of rows: 1,536 rows 203-293 -> 193-281 us, 2,048
# rows 252-366 -> 262-368 us).
AMX_PACKED_MAX_ROWS = 1536
# Routed experts gain up to more rows per expert: the kernels read only the active experts'
# weights in two calls, where oneDNN loops or runs a batched matmul over every expert
# (measured on the `small` model's MoE layer: 0.9 vs 1.5 ms at 16 tokens, up to 5 per expert;
# 1.1 vs 1.5 ms at 24 tokens, up to 8; and the whole 32-request decode step, alternating in
# one process: median 31.8 ms with up to 16 rows per expert here, 36.8 ms with up to 8).
EXPERT_MAX_ROWS = {"avx512": 16, "avx2": 32}
# Fewest rows a bf16 linear runs on AMX tiles with, where the CPU has AMX (cpu_amx.c's
# mci_amx_rows_range). Two: on a 2-core Xeon with AMX-BF16, cold weights (one call per
# weight, median us, skinny -> AMX) 1,536 x 512 at 1 / 2 / 8 / 32 rows 77-79 -> 71,
# 93-94 -> 69-72, 203-234 -> 72-74, 273-276 -> 92-94, the LM head (8,192 x 512) 398-423 ->
# 327-350 at one row; but weights in L3, as a one-request step's are there (480 MB), read
# faster on the skinny kernels at one row (the LM head 153-159 -> 188-209 us), and the
# one-request step was level or slower on AMX (2.17-2.38 -> 2.26-2.43 ms, alternating blocks).
# At two rows AMX was level or faster hot too, faster from 4 (vdpbf16ps, one port a core,
# bounds the skinny kernels there): the 32-request step 21.5-25.4 -> 13.8-17.2 ms.
AMX_ROWS = 2
# Most bytes of prefill attention's probabilities P held at once: query rows go through
# `CpuKernels.prefill_attention` in chunks of this size (a 2,048-token chunk of
# DeepSeek-V3's 128 heads would otherwise hold 1 GiB).
PREFILL_PROBS_BYTES = 64 << 20
# Widest latent (kv_lora_rank) the decode attention kernel takes: cpu_matvec.c's MAX_LATENT
# (its per-head float32 accumulators live on the stack). DeepSeek-V3 has 512.
MAX_LATENT = 1024


@functools.lru_cache(maxsize=1)
def load() -> CpuKernels | None:
    """The compiled kernels, or None where they cannot run here (see the module docstring)."""
    isa = cpu_isa()
    if os.environ.get("MCI_CPU_MATVEC", "1") == "0" or isa is None:
        return None
    try:
        lib = ctypes.CDLL(str(built_library(isa)))
        # AMX only where the CPU has it and the kernel grants this process its tile state
        amx = (
            isa == "avx512"
            and " amx_bf16" in cpu_flags()
            and os.environ.get("MCI_CPU_AMX", "1") != "0"
            and lib.mci_amx_init() == 0
        )
        return CpuKernels(lib, isa, amx, fp8=isa == "avx512" and cpu_supports_fp8())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels unavailable (%s); using oneDNN", exc)
        return None


def _output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A kernel's output tensor: `out` when the caller gives one (checked: the kernels write
    it through its data pointer as a contiguous block), else a new one."""
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: want {shape} {dtype}, contiguous")
    return out


def _pairs_aligned(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] bf16 as the prefill attention kernels read it in place: each row's element
    pairs 4-byte aligned (unit element stride, even strides and offset); else a contiguous
    copy."""
    if x.stride(-1) == 1 and x.data_ptr() % 4 == 0 and not any(s % 2 for s in x.stride()[:-1]):
        return x
    return x.clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation


class Sink(ctypes.Structure):
    """cpu_kernels.h's Sink: bf16 rows y [*, ldy] (acc, tok and wt NULL), or the weighted
    per-token float32 sum (y NULL)."""

    _fields_ = [
        ("y", ctypes.c_void_p),
        ("ldy", ctypes.c_long),
        ("acc", ctypes.c_void_p),
        ("tok", ctypes.c_void_p),
        ("wt", ctypes.c_void_p),
    ]


class _Weight(ctypes.Structure):
    """cpu_kernels.h's Weight."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("row_block", ctypes.c_void_p),
        ("scale_rows", ctypes.c_long),
        ("skinny_order", ctypes.c_int),
        ("amx_rows", ctypes.c_int),
    ]


class KernelWeight:
    """A weight as the kernels read it, in place: bf16 data [(E,) n, k], or FP8 e4m3 data with
    its 128x128 block scales, scale_inv float32 [(E,) scale_rows, ceil(k / 128)], and
    row_block int64 [n] (the scale row of each weight row: mci/layers/linear.py's Linear).
    Holds the tensors, so the addresses it hands the kernels stay valid while it lives."""

    def __init__(
        self,
        data: torch.Tensor,
        scale: torch.Tensor | None = None,
        row_block: torch.Tensor | None = None,
    ):
        fp8 = data.dtype == torch.float8_e4m3fn
        if not data.is_contiguous() or data.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError("KernelWeight: contiguous bf16 or float8_e4m3fn data")
        if fp8 != (scale is not None) or (scale is None) != (row_block is None):
            raise ValueError("KernelWeight: FP8 data takes scale_inv and row_block, bf16 neither")
        self.n, self.k = data.shape[-2], data.shape[-1]
        self.data, self.scale, self.row_block = data, scale, row_block
        self.fp8 = fp8
        if fp8:
            blocks = -(-self.k // 128)
            self.scale = scale = scale.float().contiguous()
            self.row_block = row_block = row_block.to(torch.long).contiguous()
            if scale.shape[-1] != blocks or row_block.shape != (self.n,):
                raise ValueError("KernelWeight: scales must be 128x128 blocks of the weight")
        self.struct = _Weight(
            data.data_ptr(),
            None if scale is None else scale.data_ptr(),
            None if row_block is None else row_block.data_ptr(),
            0 if scale is None else scale.shape[-2],
            0,
            0,
        )
        self.address = ctypes.addressof(self.struct)

    def set_skinny_order(self, enabled: bool) -> None:
        """FP8 calls of more rows than cpu_fp8.c's REGISTER_ROWS (`CpuKernels.fp8_skinny_rows`)
        sum in the skinny kernels' order (a row's result then never depends on the call's row
        count: batch invariance) instead of the GEMM's (faster; within float32 summation order
        of it). cpu_fp8.c."""
        self.struct.skinny_order = int(enabled)

    def set_amx_rows(self, rows: int) -> None:
        """bf16 calls of `rows` rows or more (0: none) run on AMX tiles (cpu_amx.c's
        mci_amx_rows_range), where k is a multiple of 32; the others on the skinny kernels."""
        self.struct.amx_rows = 0 if self.fp8 else rows


def kernel_weight(weight: torch.Tensor | KernelWeight) -> KernelWeight:
    """`weight` as a KernelWeight (a bf16 tensor is wrapped as it is)."""
    return weight if isinstance(weight, KernelWeight) else KernelWeight(weight.contiguous())


class MLAWeights(Protocol):
    """What `CpuKernels.mla_decode` reads of an attention layer (the projections bf16 or FP8,
    the rest bf16, contiguous; mci/layers/attention.py's MultiHeadLatentAttention and its
    norms)."""

    norm: tuple[torch.Tensor, float]  # the layer's input RMSNorm (weight, eps)
    qkv_a: KernelWeight  # [q_dim + c + r, hidden]
    q_dim: int
    q_norm: tuple[torch.Tensor, float] | None  # with q_lora: its RMSNorm
    q_b: KernelWeight | None  # with q_lora: [heads * (nope + r), q_dim]
    kv_norm: tuple[torch.Tensor, float]
    w_uk_t: KernelWeight  # bf16 [heads, c, nope]
    w_uv: KernelWeight  # bf16 [heads, v, c]
    o: KernelWeight  # [hidden, heads * v]
    heads: int
    nope: int
    rope: int
    interleave: bool
    scale: float


class MoERouting(Protocol):
    """What `CpuKernels.moe` reads of the router (mci/layers/moe.py's TopKRouter)."""

    bias: torch.Tensor  # float32 [E], contiguous
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float


class CpuKernels:
    """Typed entry points of the compiled library. Inputs: bf16 CPU tensors, activations with
    a unit last-dimension stride; matmul weights bf16 tensors (contiguous) or `KernelWeight`s
    (bf16 or FP8, FP8 only where `fp8`)."""

    def __init__(self, lib: ctypes.CDLL, isa: str, amx: bool, fp8: bool):
        self.isa = isa  # build.py's build: "avx512", or "avx2" (cpu_avx2.h)
        # most rows of a call on the kernels at decode sizes (see above); a linear's own
        # bound, up to AMX_MAX_ROWS on AMX: `linear_max_rows`
        self.max_rows = MAX_ROWS[isa]
        self.expert_max_rows = EXPERT_MAX_ROWS[isa]  # most rows of a routed expert
        self.amx = amx  # the AMX expert kernels run here (cpu_amx.c)
        # bf16 linears of this many rows or more run on AMX tiles (0: never; see AMX_ROWS)
        self.amx_rows = AMX_ROWS if amx else 0
        self.fp8 = fp8  # the FP8 matmuls run here (cpu_fp8.c: AVX512-VBMI)
        # the GEMM runs here (cpu_gemm.c): the one-call MoE takes experts of any row count
        self.gemm = isa == "avx512"
        self.fp8_skinny_rows = lib.mci_fp8_skinny_rows()  # FP8: the skinny order up to here
        ptr, long = ctypes.c_void_p, ctypes.c_long
        self._amx_pack = lib.mci_amx_pack
        self._amx_pack.argtypes = [ptr, long, long, long, ptr]
        self._amx_pack.restype = None
        self._linear = lib.mci_linear
        self._linear.argtypes = [ptr, long, ptr, ptr, long, long, long, long]
        self._linear.restype = None
        self._experts = lib.mci_expert_linear
        self._experts.argtypes = [ptr, long, ptr, ptr, long, ptr, ptr, ptr, long, long, long, long]
        self._experts.restype = None
        self._amx_linear = lib.mci_amx_packed_linear
        self._amx_linear.argtypes = [ptr, long, ptr, Sink, long, long, long, ctypes.c_int]
        self._amx_linear.restype = None
        self._combine = lib.mci_expert_linear_combine
        self._combine.argtypes = [ptr, long, ptr, ptr, ptr, ptr, ptr, ptr, ptr, long, long, long,
                                  long]  # fmt: skip
        self._combine.restype = None
        self._attention = lib.mci_bf16_latent_decode_attention
        self._attention.argtypes = [ptr, ptr, ptr, long, ptr, long, long, long, long,
                                    ctypes.c_float, ptr, ctypes.c_int]  # fmt: skip
        self._attention.restype = ctypes.c_int
        self._rms_norm = lib.mci_rms_norm
        self._rms_norm.argtypes = [ptr, long, ctypes.c_int, ptr, ptr, ctypes.c_int, long, long,
                                   ctypes.c_float]  # fmt: skip
        self._rms_norm.restype = None
        self._add_rms_norm = lib.mci_add_rms_norm
        self._add_rms_norm.argtypes = [ptr, long, ptr, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int,
                                       long, long, ctypes.c_float]  # fmt: skip
        self._add_rms_norm.restype = None
        self._merge = lib.mci_merge_partials
        self._merge.argtypes = [ptr, long, long, ptr, long, long, long, long, ptr, ptr, long, long,
                                long, ptr]  # fmt: skip
        self._merge.restype = None
        self._rope = lib.mci_rope_heads
        self._rope.argtypes = [ptr, long, long, ptr, ptr, long, long, long, ctypes.c_int, ptr]
        self._rope.restype = None
        self._latent = lib.mci_write_latent_rows
        self._latent.argtypes = [ptr, long, ptr, ctypes.c_float, ptr, ptr, ctypes.c_int, ptr,
                                 ptr, long, long, long]  # fmt: skip
        self._latent.restype = None
        self._gated_mlp = lib.mci_gated_mlp
        self._gated_mlp.argtypes = [ptr, long, ptr, ptr, long, long, long, ptr]
        self._gated_mlp.restype = None
        self._moe = lib.mci_moe
        self._moe.argtypes = [ptr, ptr, ptr, long, long, long, long, long, ctypes.c_int,
                              ctypes.c_float, ptr, ptr, ptr, ptr, ptr, ptr, long, long, ptr,
                              ptr, ptr, ptr, long, long, ptr]  # fmt: skip
        self._moe.restype = ctypes.c_int
        self._mla = lib.mci_mla_decode
        self._mla.argtypes = [ptr, long, long, ptr, ctypes.c_float, ptr, long, ptr,
                              ctypes.c_float, ptr, long, long, long, long, long, ptr,
                              ctypes.c_float, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, ptr, ptr,
                              long, ptr, ctypes.c_float, ptr, ptr]  # fmt: skip
        self._mla.restype = ctypes.c_int
        self._probs = lib.mci_bf16_prefill_attention_probs
        self._probs.argtypes = [ptr, long, long, long, ptr, ptr, long, long, long, long, long,
                                long, long, ctypes.c_float, ptr, ptr]  # fmt: skip
        self._probs.restype = ctypes.c_int
        self._amx_attention = lib.mci_amx_prefill_attention
        self._amx_attention.argtypes = [ptr, long, long, long, ptr, ptr, ptr, long, long, long,
                                        long, long, long, long, long, ctypes.c_float, ptr,
                                        ptr]  # fmt: skip
        self._amx_attention.restype = ctypes.c_int
        self._pack_values = lib.mci_pack_values
        self._pack_values.argtypes = [ptr, long, long, long, long, long, long, long, ptr]
        self._pack_values.restype = ctypes.c_int
        self._pack_keys = lib.mci_pack_keys
        self._pack_keys.argtypes = [ptr, long, long, long, long, long, long, long, ptr]
        self._pack_keys.restype = ctypes.c_int
        self._decoder_span = lib.mci_decoder_span  # cpu_decoder.py
        self._decoder_span.argtypes = [ptr, ptr, ptr, ptr, long, ptr, ptr, ptr]
        self._decoder_span.restype = ctypes.c_int
        self._decoder_step = lib.mci_decoder_step
        self._decoder_step.argtypes = [ptr, ptr, long, ptr, ptr, ptr, long, ptr, ptr, long,
                                       long, ptr, ptr, ctypes.c_float, ptr, ptr, ptr, ptr,
                                       ptr, ptr, long, ptr]  # fmt: skip
        self._decoder_step.restype = ctypes.c_int
        self._decode_steps = lib.mci_decode_steps
        self._decode_steps.argtypes = [*self._decoder_step.argtypes, ptr]
        self._decode_steps.restype = ctypes.c_int

    def prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        limits: torch.Tensor,
        scale: float,
        amx: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of many query rows (prefill chunks): q [B, H, Q, d], k [B, H, L, d],
        v [B, H, L, dv] bf16, limits int64 [B or 1, Q] (row r of sequence b sees keys
        0 .. limits[b, r] - 1, 1 <= limit <= L) -> (out [B, H, Q, dv] bf16, log-sum-exp
        float32 [B, H, Q]). Where `amx`, the CPU has AMX and d and dv are multiples of 32:
        the scores, the softmax and P V in one call on AMX tiles (`_amx_prefill_attention`).
        Else, per chunk of query rows: the scores and the softmax in one kernel call, in
        float32 (cpu_prefill_attention.c); P (rounded once to bf16) times V in oneDNN's bf16
        matmul, its float32 sums rounded once. Callers check d is even. A row's result
        depends only on its own query, keys and limit either way."""
        b, h, nq, d = q.shape
        length, dv = k.shape[2], v.shape[3]
        blocks = -(-length // 16)
        pad = blocks * 16 - length
        q, k = _pairs_aligned(q), _pairs_aligned(k)  # read in place, through their strides
        # keys pair-interleaved in blocks of 16, as vdpbf16ps takes them: [G, Lb, d/2, 16, 2]
        kp = torch.empty(b * h, blocks, d // 2, 16, 2, dtype=torch.bfloat16)
        if self._pack_keys(k.data_ptr(), *k.stride()[:3], b, h, length, d, kp.data_ptr()):
            raise ValueError(f"prefill_attention: keys of head dim {d} not taken (odd?)")
        if amx and self.amx and d % 32 == 0 and dv % 32 == 0:
            return self._amx_prefill_attention(q, kp, v, limits, scale)
        values = F.pad(v, (0, 0, 0, pad)).reshape(b * h, blocks * 16, dv)
        out = torch.empty(b * h, nq, dv, dtype=torch.bfloat16)
        lse = torch.empty(b * h, nq, dtype=torch.float32)
        # P is materialised a chunk of query rows at a time (at most PREFILL_PROBS_BYTES), each
        # chunk over the keys its rows see (causal rows skip the keys after them)
        step = max(8, PREFILL_PROBS_BYTES // (2 * b * h * blocks * 16)) // 8 * 8
        for start in range(0, nq, step):
            rows = slice(start, min(nq, start + step))
            lim = limits[:, rows].contiguous()
            width = -(-int(lim.max()) // 16) * 16  # P's columns: every key these rows see
            part = q[:, :, rows]  # [B, H, rows, d], read in place
            probs = torch.empty(b * h, part.shape[2], width, dtype=torch.bfloat16)
            part_lse = torch.empty(b * h, part.shape[2], dtype=torch.float32)
            status = self._probs(
                part.data_ptr(),
                *part.stride()[:3],
                kp.data_ptr(),
                lim.data_ptr(),
                part.shape[2] if lim.shape[0] > 1 else 0,
                b * h,
                h,
                part.shape[2],
                d,
                blocks,
                width,
                scale,
                probs.data_ptr(),
                part_lse.data_ptr(),
            )
            if status != 0:
                raise ValueError(f"prefill_attention: status {status} (head dim {d} odd?)")
            if self.isa == "avx2":  # no bf16 matmul instructions: exact float32 products
                out[:, rows] = torch.bmm(probs.float(), values[:, :width].float())
            else:  # P: 0 past each row's keys
                torch.bmm(probs, values[:, :width], out=out[:, rows])
            lse[:, rows] = part_lse
        return out.view(b, h, nq, dv), lse.view(b, h, nq)

    def _amx_prefill_attention(self, q, kp, v, limits, scale):
        """`prefill_attention` on AMX tiles: the scores, the softmax and P V in one call
        (cpu_prefill_attention.c's mci_amx_prefill_attention), P never leaving the cache."""
        b, h, nq, d = q.shape
        length, dv = v.shape[2], v.shape[3]
        chunks = -(-length // 32)
        # values pair-interleaved in chunks of 32 keys, as AMX's B operand takes them
        vp = torch.empty(b * h, dv // 16, chunks, 16, 16, 2, dtype=torch.bfloat16)
        if v.stride(-1) != 1:
            v = v.contiguous()
        if self._pack_values(v.data_ptr(), *v.stride()[:3], b, h, length, dv, vp.data_ptr()):
            raise ValueError(f"prefill_attention: values of head dim {dv} not taken")
        out = torch.empty(b * h, nq, dv, dtype=torch.bfloat16)
        lse = torch.empty(b * h, nq, dtype=torch.float32)
        limits = limits.contiguous()
        status = self._amx_attention(
            q.data_ptr(), *q.stride()[:3], kp.data_ptr(), vp.data_ptr(), limits.data_ptr(),
            nq if limits.shape[0] > 1 else 0, b * h, h, nq, d, dv, kp.shape[1], chunks, scale,
            out.data_ptr(), lse.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"prefill_attention: status {status} on AMX (head dims {d}, {dv})")
        return out.view(b, h, nq, dv), lse.view(b, h, nq)

    def linear_max_rows(self, k: int, fp8: bool) -> int:
        """Most rows a linear of k inputs takes the kernels with: the decode sizes' limit, or
        on AMX up to AMX_MAX_ROWS for a bf16 weight the in-place AMX matmul runs (k a
        multiple of 32) while its packed x fits in AMX_PACKED_X_BYTES (see above)."""
        if not self.amx or fp8 or k % 32:
            return self.max_rows
        return max(self.max_rows, min(AMX_MAX_ROWS, AMX_PACKED_X_BYTES // (2 * k)))

    def _check(self, weight: KernelWeight) -> KernelWeight:
        if weight.fp8 and not self.fp8:
            raise ValueError("the FP8 kernels need AVX512-VBMI, which this CPU lacks")
        return weight

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | KernelWeight, expert: int | None = None
    ) -> torch.Tensor:
        """x [m, k] @ weight [n, k]^T (of stacked weight [E, n, k]'s `expert`) -> [m, n],
        bf16."""
        m, k = x.shape
        if expert is not None:  # one segment of all the rows
            segments = torch.tensor([[expert], [0], [m]], dtype=torch.long)
            return self.expert_linear(x, weight, segments)
        weight = self._check(kernel_weight(weight))
        n = weight.n
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(m, n, dtype=torch.bfloat16)
        self._linear(x.data_ptr(), x.stride(0), weight.address, y.data_ptr(), n, m, n, k)
        return y

    def expert_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KernelWeight,
        segments: torch.Tensor,
        gemm_above: int | None = None,
    ) -> torch.Tensor:
        """x [A, k] (rows grouped by expert), stacked weight [E, n, k], segments int64 [3, S]
        (expert id, first row, row count of each group) -> [A, n], bf16: each group of rows
        through its expert; bf16 groups of more than `gemm_above` rows on the GEMM
        (cpu_gemm.c, where `gemm`; None: never), as the one-call MoE runs busy experts."""
        weight = self._check(kernel_weight(weight))
        a, k = x.shape
        n = weight.n
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(a, n, dtype=torch.bfloat16)
        ids, starts, counts = segments
        self._experts(
            x.data_ptr(),
            x.stride(0),
            weight.address,
            y.data_ptr(),
            n,
            ids.data_ptr(),
            starts.data_ptr(),
            counts.data_ptr(),
            segments.shape[1],
            n,
            k,
            self._gemm_above(gemm_above),
        )
        return y

    def _gemm_above(self, gemm_above: int | None) -> int:
        if gemm_above is None:
            return 2**62  # never
        if not self.gemm:
            raise ValueError("the bf16 GEMM is not in this build of the kernels")
        return gemm_above

    def expert_linear_combine(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KernelWeight,
        segments: torch.Tensor,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
        gemm_above: int | None = None,
    ) -> torch.Tensor:
        """`expert_linear`, each output row a then rounded to bf16, weighted and added into
        float32 `out` [*, n]: out[tokens[a]] += weights[a] * row a (tokens int64, weights
        float32, one per row of x), in row order. Returns `out`."""
        weight = self._check(kernel_weight(weight))
        k = x.shape[1]
        n = weight.n
        if x.stride(1) != 1:
            x = x.contiguous()
        tokens, weights = tokens.contiguous(), weights.contiguous().float()
        if not out.is_contiguous() or out.dtype != torch.float32 or out.shape[1] != n:
            raise ValueError("expert_linear_combine: out must be contiguous float32 [*, n]")
        ids, starts, counts = segments
        self._combine(
            x.data_ptr(),
            x.stride(0),
            weight.address,
            out.data_ptr(),
            tokens.data_ptr(),
            weights.data_ptr(),
            ids.data_ptr(),
            starts.data_ptr(),
            counts.data_ptr(),
            segments.shape[1],
            n,
            k,
            self._gemm_above(gemm_above),
        )
        return out

    def latent_decode_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        value_dim: int,
        scale: float,
        amx: bool = False,
    ) -> torch.Tensor:
        """Decode attention read through slot indices: q [B, H, d] (one query per sequence),
        cache [rows, d] (one layer's latent rows, key and value at once), slots [B, L] int64
        (sequence b's context is slots[b, :lengths[b]]) -> [B, H, value_dim], the softmax-
        weighted sum of each context row's first value_dim columns; bf16. value_dim is at
        most MAX_LATENT (callers check it first). With `amx`, where the CPU has AMX and d and
        value_dim are multiples of 32: on AMX tiles, P rounded to bf16 before P V (cpu_mla.c's
        amx_attend_one: within a bf16 step of a probability of the other path)."""
        batch, heads, d = q.shape
        q = q.contiguous()
        if cache.stride(1) != 1 or cache.stride(0) != d or slots.stride(1) != 1:
            raise ValueError("latent_decode_attention: cache rows and slots must be contiguous")
        out = torch.empty(batch, heads, value_dim, dtype=torch.bfloat16)
        status = self._attention(
            q.data_ptr(),
            cache.data_ptr(),
            slots.data_ptr(),
            slots.stride(0),
            lengths.data_ptr(),
            batch,
            heads,
            d,
            value_dim,
            scale,
            out.data_ptr(),
            int(amx and self.amx),
        )
        if status != 0:
            raise ValueError(f"latent_decode_attention: value_dim {value_dim} > {MAX_LATENT}")
        return out

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """mci/layers/norm.py's RMSNorm in one pass: x [rows, n] float32 or bf16 (any row
        stride), weight bf16 [n] -> [rows, n] in out_dtype (float32 or bf16), written into
        `out` when given (contiguous, that shape and dtype)."""
        rows, n = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        y = _output(out, (rows, n), out_dtype)
        self._rms_norm(
            x.data_ptr(),
            x.stride(0),
            int(x.dtype == torch.bfloat16),
            weight.data_ptr(),
            y.data_ptr(),
            int(out_dtype == torch.bfloat16),
            rows,
            n,
            eps,
        )
        return y

    def add_rms_norm(
        self,
        x: torch.Tensor,
        addend: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + addend, rms_norm(x + addend)) in one pass: x float32 [rows, n] (any row
        stride), addend bf16 or float32 [rows, n] -> (the sum float32 [rows, n], a new tensor;
        its norm in out_dtype, written into `out` when given), the same bits as `x + addend`
        and then `rms_norm`."""
        rows, n = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        addend = addend.contiguous()
        total = torch.empty(rows, n, dtype=torch.float32)
        y = _output(out, (rows, n), out_dtype)
        self._add_rms_norm(
            x.data_ptr(),
            x.stride(0),
            addend.data_ptr(),
            int(addend.dtype == torch.bfloat16),
            total.data_ptr(),
            weight.data_ptr(),
            y.data_ptr(),
            int(out_dtype == torch.bfloat16),
            rows,
            n,
            eps,
        )
        return total, y

    def merge_partials(
        self,
        first: torch.Tensor,
        second: torch.Tensor,
        w_first: torch.Tensor,
        w_second: torch.Tensor,
    ) -> torch.Tensor:
        """Cascade attention's merge of two partial results of the same N = B * Q query
        rows: first [1, H, N, dv] (over the shared prefix), second [B, H, Q, dv] (over each
        sequence's own positions), bf16 with unit element stride, weighted by w_first /
        w_second float32 [N, H] -> [N, H, dv] bf16, (first * w_first + second * w_second) /
        (w_first + w_second) with torch's float32 roundings (cpu_prefill_attention.c)."""
        _, heads, n, dv = first.shape
        b, _, q_len, _ = second.shape
        if (
            first.shape[0] != 1
            or second.shape[1] != heads
            or second.shape[3] != dv
            or b * q_len != n
            or first.dtype != torch.bfloat16
            or second.dtype != torch.bfloat16
            or w_first.shape != (n, heads)
            or w_second.shape != (n, heads)
            or w_first.dtype != torch.float32
            or w_second.dtype != torch.float32
        ):
            raise ValueError(
                f"merge_partials: first {tuple(first.shape)} {first.dtype}, second "
                f"{tuple(second.shape)} {second.dtype}, weights {tuple(w_first.shape)} "
                f"{tuple(w_second.shape)} do not fit [1, H, N, dv], [B, H, Q, dv], [N, H]"
            )
        if first.stride(-1) != 1:
            first = first.contiguous()
        if second.stride(-1) != 1:
            second = second.contiguous()
        w_first, w_second = w_first.contiguous(), w_second.contiguous()
        out = torch.empty(n, heads, dv, dtype=torch.bfloat16)
        self._merge(
            first.data_ptr(), first.stride(1), first.stride(2),
            second.data_ptr(), second.stride(0), second.stride(1), second.stride(2), q_len,
            w_first.data_ptr(), w_second.data_ptr(), n, heads, dv, out.data_ptr(),
        )  # fmt: skip
        return out

    def rope_heads(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
    ) -> torch.Tensor:
        """mci/layers/rotary.py's apply_rope on x [T, H, r] bf16 (any token and head strides,
        unit element stride) with cos/sin [T, r/2] float32, rounded once to bf16 ->
        [T, H, r] contiguous."""
        t, heads, r = x.shape
        if x.stride(2) != 1:
            x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty(t, heads, r, dtype=torch.bfloat16)
        self._rope(
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            cos.data_ptr(),
            sin.data_ptr(),
            t,
            heads,
            r,
            int(interleave),
            out.data_ptr(),
        )
        return out

    def write_latent_rows(
        self,
        latent: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        interleave: bool,
        cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Write a step's new MLA latent rows into one layer's cache [*, c + r] (bf16,
        contiguous): row slots[t] = [RMSNorm(latent[t, :c]) | rope(latent[t, c:])], each part
        rounded once to bf16: the rope part bit for bit the eager value, the norm as
        `rms_norm` (within float32 rounding of the eager one). latent [T, c + r] bf16 (any
        row stride), norm_weight bf16 [c], cos/sin [T, r/2] float32, slots int64 [T]."""
        t, d = latent.shape
        c = norm_weight.shape[0]
        if latent.stride(1) != 1:
            latent = latent.contiguous()
        if not cache.is_contiguous() or cache.shape[1] != d or cache.dtype != torch.bfloat16:
            raise ValueError("write_latent_rows: cache must be contiguous bf16 [*, c + r]")
        cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
        self._latent(
            latent.data_ptr(),
            latent.stride(0),
            norm_weight.data_ptr(),
            eps,
            cos.data_ptr(),
            sin.data_ptr(),
            int(interleave),
            cache.data_ptr(),
            slots.data_ptr(),
            t,
            c,
            d - c,
        )

    def gated_mlp(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor | KernelWeight,
        down: torch.Tensor | KernelWeight,
    ) -> torch.Tensor:
        """mci/layers/mlp.py's GatedMLP: x [m, hidden] bf16 (unit column stride), gate_up
        [2 * inter, hidden], down [hidden, inter] -> [m, hidden] bf16, the same roundings."""
        gate_up, down = self._check(kernel_weight(gate_up)), self._check(kernel_weight(down))
        m, hidden = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(m, hidden, dtype=torch.bfloat16)
        inter = down.k
        self._gated_mlp(
            x.data_ptr(), x.stride(0), gate_up.address, down.address, m, hidden, inter,
            y.data_ptr(),
        )  # fmt: skip
        return y

    def amx_pack(self, weight: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
        """Stacked bf16 weights [E, n, k] in the AMX tile layout (cpu_amx.c), or None where
        the AMX kernels do not run or n, k are not multiples of 32. `gated`: a gate_up weight
        (gate rows, then as many up rows), its rows interleaved 16 at a time first, as
        `mci_amx_gated_experts_into` (through `moe`) reads it (cpu_kernels.h)."""
        e, n, k = weight.shape
        if not self.amx or n % 32 or k % 32 or weight.dtype != torch.bfloat16:
            return None
        if gated:  # [E, 2, inter/16, 16, k] -> [E, inter/16, 2, 16, k]
            weight = weight.view(e, 2, n // 32, 16, k).transpose(1, 2).reshape(e, n, k)
        weight = weight.contiguous()
        out = torch.empty_like(weight)
        self._amx_pack(weight.data_ptr(), e, n, k, out.data_ptr())
        return out

    def amx_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A bf16 weight [n, k] `amx_pack`ed for `amx_packed_linear` where that runs it past its
        bound on the kernels (AMX, n and k multiples of 32, at most AMX_PACKED_WEIGHT_BYTES),
        else None."""
        if weight.dim() != 2 or weight.numel() * 2 > AMX_PACKED_WEIGHT_BYTES:
            return None
        return self.amx_pack(weight[None])

    def amx_packed_linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """x [m, k] bf16 (unit element stride) @ weight^T, from `amx_linear_weight`'s packed
        copy, on the experts' AMX kernel (cpu_amx.c): each output a float32 sum of exact
        products in AMX's order, rounded once to bf16 (below float32's normal range: zero);
        a row's result never depends on the other rows. -> [m, n] bf16."""
        m, k = x.shape
        n = packed.shape[1]
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(m, n, dtype=torch.bfloat16)
        sink = Sink(y.data_ptr(), n, None, None, None)
        self._amx_linear(x.data_ptr(), x.stride(0), packed.data_ptr(), sink, m, n, k, 0)
        return y

    def bind_moe(
        self,
        router: MoERouting,
        experts: tuple[torch.Tensor | KernelWeight, torch.Tensor | KernelWeight],
        amx: tuple[torch.Tensor, torch.Tensor] | None,
        shared: tuple[torch.Tensor | KernelWeight, torch.Tensor | KernelWeight] | None,
        max_rows: int,
        amx_shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> BoundMoE:
        """`moe`'s arguments that stay fixed for one MoE layer, converted once: a decode step
        calls it with only its rows (see BoundMoE). `amx_shared`: instead of `shared`, the
        shared experts' (gate_up, down) `amx_pack`ed as one expert each (gate_up `gated`),
        run on the AMX expert kernels at any row count."""
        return BoundMoE(self, router, experts, amx, shared, max_rows, amx_shared)

    def moe(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,
        router: MoERouting,
        experts: tuple[torch.Tensor | KernelWeight, torch.Tensor | KernelWeight],
        amx: tuple[torch.Tensor, torch.Tensor] | None,
        shared: tuple[torch.Tensor | KernelWeight, torch.Tensor | KernelWeight] | None,
        max_rows: int,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """mci/layers/moe.py's MoE after the router's matmul: x float32 [T, hidden], logits
        float32 [T, E]; the stacked experts' (gate_up [E, 2I, hidden], down [E, hidden, I]),
        the same `amx_pack`ed (gate_up with `gated`) or None; the shared experts' (gate_up,
        down) or None. Experts with up to `max_rows` tokens run on the skinny kernels, busier
        ones on AMX where packed for it, else on the GEMM (bf16: cpu_gemm.c; FP8:
        cpu_fp8.c's).
        -> (out float32 [T, hidden], or None when an expert has more than `max_rows` tokens
        in the AVX2 build (no GEMM there); routing weights float32 [T, K]; expert ids int64
        [T, K])."""
        return self.bind_moe(router, experts, amx, shared, max_rows)(x, logits)

    def bind_mla(self, layer: MLAWeights) -> BoundMLA:
        """`mla_decode`'s arguments that stay fixed for one attention layer, converted once
        (see BoundMLA)."""
        return BoundMLA(self, layer)

    def mla_decode(
        self,
        x: torch.Tensor,
        layer: MLAWeights | BoundMLA,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        write_slots: torch.Tensor,
        kv_slots: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        """x + the attention sublayer (input norm through o_proj) for a decode step in one
        call: x float32 [T, hidden] (the residual stream), T rows each attending over
        cache[kv_slots[t, :lengths[t]]] (one layer's latent rows, bf16 contiguous) after this
        step's latents are written to cache[write_slots]; cos/sin float32 [T, r/2].
        -> float32 [T, hidden]. The same steps as the layer's kernel path (cpu_mla.c)."""
        bound = layer if isinstance(layer, BoundMLA) else self.bind_mla(layer)
        return bound(x, cos, sin, cache, write_slots, kv_slots, lengths)


class BoundMoE:
    """One MoE layer's `CpuKernels.moe`, its fixed arguments converted once (weights'
    addresses, the router's constants): a call passes only the step's rows. Holds the
    weights' KernelWeights, so the addresses stay valid while it lives."""

    def __init__(
        self, kernels: CpuKernels, router: MoERouting, experts, amx, shared, max_rows,
        amx_shared=None,
    ):  # fmt: skip
        if shared is not None and amx_shared is not None:
            raise ValueError("the shared experts run on the kernels or on AMX tiles, not both")
        check = kernels._check
        gate_up, down = (check(kernel_weight(w)) for w in experts)
        amx_gate_up, amx_down = amx if amx is not None else (None, None)
        s_gate_up, s_down = (
            (check(kernel_weight(w)) for w in shared) if shared is not None else (None, None)
        )
        self._call = kernels._moe
        amx_s_gate_up, amx_s_down = amx_shared if amx_shared is not None else (None, None)
        self.weights = (gate_up, down, s_gate_up, s_down, amx, amx_shared, router.bias)
        self.top_k = router.top_k
        # each fixed argument by its name in cpu_decoder.c's DecodeLayer (`fields`); the call's
        # groups of them below in mci_moe's parameter order
        self.args = {
            "n_group": router.n_group, "topk_group": router.topk_group, "top_k": router.top_k,
            "norm_topk": int(router.norm_topk_prob), "scaling": router.scaling,
            "bias": router.bias.data_ptr(), "e": router.bias.shape[0],
            "w_gate_up": gate_up.address, "w_down": down.address,
            "amx_gate_up": None if amx_gate_up is None else amx_gate_up.data_ptr(),
            "amx_down": None if amx_down is None else amx_down.data_ptr(),
            "inter": down.k,
            "w_s_gate_up": None if s_gate_up is None else s_gate_up.address,
            "w_s_down": None if s_down is None else s_down.address,
            "amx_s_gate_up": None if amx_s_gate_up is None else amx_s_gate_up.data_ptr(),
            "amx_s_down": None if amx_s_down is None else amx_s_down.data_ptr(),
            "s_inter": (
                s_down.k if s_down is not None
                else amx_s_down.shape[-1] if amx_s_down is not None else 0
            ),
            "max_rows": max_rows,
        }  # fmt: skip
        named = self.args.__getitem__
        self._router = tuple(map(named, ("n_group", "topk_group", "top_k", "norm_topk", "scaling")))
        self._bias = self.args["bias"]
        self._experts = tuple(map(named, ("w_gate_up", "w_down", "amx_gate_up", "amx_down")))
        self._shared = tuple(
            map(
                named,
                (
                    "inter",
                    "w_s_gate_up",
                    "w_s_down",
                    "amx_s_gate_up",
                    "amx_s_down",
                    "s_inter",
                    "max_rows",
                ),
            )
        )

    def __call__(
        self, x: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """x float32 [T, hidden], logits float32 [T, E] -> `CpuKernels.moe`'s result."""
        t, hidden = x.shape
        x, logits = x.contiguous(), logits.contiguous()
        weights = torch.empty(t, self.top_k, dtype=torch.float32)
        ids = torch.empty(t, self.top_k, dtype=torch.long)
        out = torch.empty(t, hidden, dtype=torch.float32)
        status = self._call(
            x.data_ptr(), logits.data_ptr(), self._bias, t, logits.shape[1], *self._router,
            weights.data_ptr(), ids.data_ptr(), *self._experts, hidden, *self._shared,
            out.data_ptr(),
        )  # fmt: skip
        return (None if status else out), weights, ids


class BoundMLA:
    """One attention layer's `CpuKernels.mla_decode`, its fixed arguments converted once
    (weights' addresses, sizes, norms' constants): a call passes only the step's rows,
    rope tables, cache and slots. Holds the layer's weights, so the addresses stay valid."""

    def __init__(self, kernels: CpuKernels, layer: MLAWeights):
        for weight in (layer.qkv_a, layer.q_b, layer.o):
            if weight is not None:
                kernels._check(weight)
        if layer.w_uk_t.fp8 or layer.w_uv.fp8:
            raise ValueError("mla_decode: the absorbed per-head weights are bf16")
        c, v = layer.w_uv.k, layer.w_uv.n
        if c > MAX_LATENT:
            raise ValueError(f"mla_decode: kv_lora_rank {c} > {MAX_LATENT}")
        self._call = kernels._mla
        self.layer = layer
        q_norm, q_eps = layer.q_norm if layer.q_norm is not None else (None, 0.0)
        # each fixed argument by its name in cpu_decoder.c's DecodeLayer (`fields`); the call's
        # groups of them below in mci_mla_decode's parameter order
        self.args = {
            "norm_w": layer.norm[0].data_ptr(), "norm_eps": layer.norm[1],
            "w_qkv_a": layer.qkv_a.address, "q_dim": layer.q_dim,
            "q_norm_w": None if q_norm is None else q_norm.data_ptr(), "q_eps": q_eps,
            "w_q_b": None if layer.q_b is None else layer.q_b.address, "heads": layer.heads,
            "nope": layer.nope, "r": layer.rope, "c": c, "v": v,
            "kv_norm_w": layer.kv_norm[0].data_ptr(), "kv_eps": layer.kv_norm[1],
            "interleave": int(layer.interleave),
            "w_uk_t": layer.w_uk_t.address, "w_uv": layer.w_uv.address,
            "scale": layer.scale, "w_o": layer.o.address,
        }  # fmt: skip
        head = ("norm_w", "norm_eps", "w_qkv_a", "q_dim", "q_norm_w", "q_eps", "w_q_b", "heads",
                "nope", "r", "c", "v", "kv_norm_w", "kv_eps")  # fmt: skip
        self._head = tuple(map(self.args.__getitem__, head))
        self._interleave = self.args["interleave"]
        self._absorbed = (self.args["w_uk_t"], self.args["w_uv"])
        self._tail = (self.args["scale"], self.args["w_o"])

    def __call__(self, x, cos, sin, cache, write_slots, kv_slots, lengths) -> torch.Tensor:
        """`CpuKernels.mla_decode` with this layer's weights."""
        t, hidden = x.shape
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        if kv_slots.stride(1) != 1 or not cache.is_contiguous():
            raise ValueError("mla_decode: cache rows and slots must be contiguous")
        out = torch.empty(t, hidden, dtype=torch.float32)
        status = self._call(
            x.data_ptr(), t, hidden, *self._head, cos.data_ptr(), sin.data_ptr(),
            self._interleave, cache.data_ptr(), write_slots.data_ptr(), *self._absorbed,
            kv_slots.data_ptr(), kv_slots.stride(0), lengths.data_ptr(), *self._tail,
            out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"mla_decode: status {status}")
        return out
