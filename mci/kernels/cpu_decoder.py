"""A decode step's decoder in one kernel call (cpu_decoder.c), where calling each layer's
kernels from Python took five calls and as many torch ops a layer.

* `DecoderSpans.step`: the embedding rows, every layer, and the final norm in one call. The
  routers' float32 matmuls run through the BLAS sgemm torch's `F.linear` calls (MKL's, found
  in libtorch_cpu: `blas_sgemm`), called as F.linear calls it; the expert choice rests on
  their bits, so the routers join only where sgemm gives F.linear's bits at the step's row
  count (`sgemm_is_linear`, once per router weight shape when a row count is first bound) and
  float32 matmuls keep the precision that check saw (`runs_whole`).
* `DecoderSpans.__call__`, where some router cannot (no MKL, a batch-invariant router): one
  call from one MoE router to the next, the routers (`TopKRouter.logits`) run by torch
  between them.

Same values as the layers' own forward, bit for bit (tests/test_cpu_kernels.py,
test_a_decode_step_of_bound_kernel_calls_is_the_layers_bit_for_bit).

Measured on `small` (8 layers, 7 of them MoE), a 2-core Zen 4 EPYC, one decoding request in
process: the Python between a step's kernel calls was ~0.33 ms of a ~2.8 ms step; old and new
alternating, the spans took the step 2.89 -> 2.78 and 3.04 -> 2.70 ms (p50). The whole step
in one call, against the spans, alternating blocks of 50 steps in one process: 2.45 -> 2.29
and 2.51 -> 2.34 ms (p50).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mci.kernels.cpu_kernels import BoundMLA, BoundMoE, KernelWeight

ptr, long, c_float, c_int = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int


class DecodeLayer(ctypes.Structure):
    """cpu_decoder.c's DecodeLayer: one layer's fixed arguments."""

    _fields_ = [
        ("norm_w", ptr), ("norm_eps", c_float), ("w_qkv_a", ptr), ("q_dim", long),
        ("q_norm_w", ptr), ("q_eps", c_float), ("w_q_b", ptr), ("heads", long), ("nope", long),
        ("r", long), ("c", long), ("v", long), ("kv_norm_w", ptr), ("kv_eps", c_float),
        ("interleave", c_int), ("w_uk_t", ptr), ("w_uv", ptr), ("scale", c_float),
        ("w_o", ptr), ("cache_row", long), ("ffn_norm_w", ptr), ("ffn_norm_eps", c_float),
        ("moe", c_int), ("w_gate_up", ptr), ("w_down", ptr), ("inter", long), ("bias", ptr),
        ("e", long), ("n_group", long), ("topk_group", long), ("top_k", long),
        ("norm_topk", c_int), ("scaling", c_float), ("amx_gate_up", ptr), ("amx_down", ptr),
        ("w_s_gate_up", ptr), ("w_s_down", ptr), ("amx_s_gate_up", ptr), ("amx_s_down", ptr),
        ("s_inter", long), ("max_rows", long),
        ("router_w", ptr),
    ]  # fmt: skip


class DecodeStep(ctypes.Structure):
    """cpu_decoder.c's DecodeStep: what changes from step to step."""

    _fields_ = [
        ("t", long), ("hidden", long), ("cos", ptr), ("sin", ptr), ("cache", ptr),
        ("cache_row_stride", long), ("write_slots", ptr), ("kv_slots", ptr), ("ld_slots", long),
        ("lens", ptr),
    ]  # fmt: skip


@dataclass(frozen=True)
class KernelLayer:
    """One decoder layer as the spans run it: its fields (by DecodeLayer's names) and, for a
    MoE layer, its router's matmul, and its float32 weight where the C code may run that
    matmul itself (BLAS's sgemm: `blas_sgemm`). `keep` holds what the fields' addresses point
    into. Made by `moe_layer` or `dense_layer`."""

    fields: dict[str, int | float | None]
    router: Callable[[torch.Tensor], torch.Tensor] | None
    keep: tuple
    router_weight: torch.Tensor | None = None


# DecodeLayer's fields in groups, as the C struct orders them: the attention's (BoundMLA's
# `args`) come before `cache_row`, the MoE's (BoundMoE's `args`) from `w_gate_up` up to
# `router_w`
_NAMES = [name for name, _ in DecodeLayer._fields_]
_ATTENTION = set(_NAMES[: _NAMES.index("cache_row")])
_MOE = set(_NAMES[_NAMES.index("w_gate_up") : _NAMES.index("router_w")])


def _layer(attention: BoundMLA, norm: tuple[torch.Tensor, float], ffn: dict, router, keep,
           router_weight: torch.Tensor | None = None):  # fmt: skip
    if set(attention.args) != _ATTENTION:
        raise ValueError(f"decoder span: unexpected attention fields {sorted(attention.args)}")
    fields = {**attention.args, "ffn_norm_w": norm[0].data_ptr(), "ffn_norm_eps": norm[1], **ffn}
    fields["router_w"] = None if router_weight is None else router_weight.data_ptr()
    return KernelLayer(fields, router, (attention, norm[0], *keep), router_weight)


def moe_layer(
    attention: BoundMLA, norm: tuple[torch.Tensor, float], moe: BoundMoE, router,
    router_weight: torch.Tensor | None = None,
) -> KernelLayer:  # fmt: skip
    """A MoE layer: its attention, the feed-forward's RMSNorm (weight, eps), the one-call MoE
    (shared experts inside) and its router's matmul; `router_weight`: that matmul's float32
    weight [experts, hidden] where it is a plain `F.linear` on it (None: Python runs it)."""
    if set(moe.args) != _MOE:
        raise ValueError(f"decoder span: unexpected MoE fields {sorted(moe.args)}")
    shape = (moe.args["e"], norm[0].shape[0])  # [experts, hidden]
    if router_weight is not None and (
        router_weight.dtype != torch.float32
        or not router_weight.is_contiguous()
        or tuple(router_weight.shape) != shape
    ):
        raise ValueError(
            f"decoder span: a router's weight must be float32 {list(shape)}, contiguous"
        )
    return _layer(attention, norm, {**moe.args, "moe": 1}, router, (moe,), router_weight)


def dense_layer(
    attention: BoundMLA, norm: tuple[torch.Tensor, float], gate_up: KernelWeight,
    down: KernelWeight,
) -> KernelLayer:  # fmt: skip
    """A dense layer: its attention, the feed-forward's RMSNorm, the gated MLP's weights."""
    ffn = {"moe": 0, "w_gate_up": gate_up.address, "w_down": down.address, "inter": down.k}
    return _layer(attention, norm, ffn, None, (gate_up, down))


@functools.lru_cache(maxsize=1)
def blas_sgemm() -> int | None:
    """The address of the BLAS sgemm that torch's float32 `F.linear` calls on the CPU (MKL's,
    in libtorch_cpu), or None where torch has no MKL or that library has no such symbol."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


_SGEMM = ctypes.CFUNCTYPE(None, *[ptr] * 13)


def sgemm_linear(sgemm: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [t, k] @ weight [n, k]^T through `sgemm` as cpu_decoder.c's router_logits calls it
    (float32, both contiguous)."""
    (t, k), n = x.shape, weight.shape[0]
    out = torch.empty(t, n, dtype=torch.float32)
    m_, n_, k_ = ctypes.c_int(n), ctypes.c_int(t), ctypes.c_int(k)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    args = (b"T", b"N", m_, n_, k_, one, weight.data_ptr(), k_, x.data_ptr(), k_, zero)
    refs = [a if isinstance(a, (bytes, int)) else ctypes.byref(a) for a in args]
    _SGEMM(sgemm)(*refs, out.data_ptr(), ctypes.byref(m_))
    return out


def sgemm_is_linear(sgemm: int, weight: torch.Tensor, rows: int, trials: int = 4) -> bool:
    """Whether `sgemm` gives `F.linear`'s bits on `weight` at `rows` rows (seeded random rows,
    some scaled up): where it does, the C code may run that matmul itself."""
    gen = torch.Generator().manual_seed(rows)
    for i in range(trials):
        x = torch.randn(rows, weight.shape[1], generator=gen) * (1 + 7 * i)
        if not torch.equal(sgemm_linear(sgemm, x, weight), F.linear(x, weight)):
            return False
    return True


@dataclass(frozen=True)
class StepEnds:
    """What a whole decode step adds around the layers (`DecoderSpans.step`): the token
    embedding (bf16 [vocab, hidden], contiguous), the final RMSNorm (bf16 weight, eps), the
    BLAS sgemm the routers run through (`blas_sgemm`) and, where the step may end with the
    logits too, the LM head's bf16 weight as the kernels read it (None: it may not)."""

    embed: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    sgemm: int
    head: KernelWeight | None = None


class StepLoop(ctypes.Structure):
    """cpu_decoder.c's StepLoop: how far `mci_decode_steps` may run, and how far it ran."""

    _fields_ = [
        ("steps", long), ("stops", ptr), ("n_stops", long), ("wake_fd", c_int),
        ("budget_s", ctypes.c_double), ("tokens", ptr), ("ran", long),
    ]  # fmt: skip


class _StepCall(NamedTuple):
    args: tuple  # the C step's arguments, addresses into `out`, `head_out` and `buffers`
    out: torch.Tensor  # the final norm's bf16 [t, hidden]
    head_out: torch.Tensor | None  # the logits' float32 [t, vocab] room (None: no head)
    buffers: tuple  # the rest the addresses point into, alive as long as this is


class _Span(NamedTuple):
    finish: int | None  # the DecodeLayer address of the MoE layer finished first, or None
    router: int | None  # that layer's index (its router runs before the call)
    first: int  # the DecodeLayer address of the span's first layer
    count: int  # layers after the MoE


class DecoderSpans:
    """Every decoder layer of a decode step: `__call__(x, cos, sin, kv_cache, write_slots,
    kv_slots, lengths)` -> the residual stream after the last layer, as the per-layer path
    computes it, written over x (float32 [rows, hidden] contiguous, the caller's own). A
    span runs from after one MoE layer's norm to the next MoE layer's norm; between spans,
    that layer's router."""

    def __init__(self, kernels, layers: list[KernelLayer], rows: int, ends: StepEnds | None = None):
        self._call = kernels._decoder_span
        self._step = kernels._decoder_step
        self._steps = kernels._decode_steps
        self.rows = rows  # the step size the layers were bound at (their kernels' limits)
        # `step` runs (one C call a step) where every router's matmul can go through `ends`'
        # sgemm with F.linear's bits at this row count (checked once per weight shape), while
        # float32 matmuls keep the precision they had then (another lets F.linear leave MKL)
        routers = [layer.router_weight for layer in layers if layer.router is not None]
        self.ends = ends
        shapes = {tuple(w.shape): w for w in routers if w is not None}
        self.whole_step = (
            ends is not None
            and None not in routers
            and all(sgemm_is_linear(ends.sgemm, w, rows) for w in shapes.values())
        )
        self._precision = torch.get_float32_matmul_precision()
        self._experts = max((w.shape[0] for w in routers if w is not None), default=1)
        self._layers = layers  # keeps every address the structs hold alive
        self._structs = (DecodeLayer * len(layers))(
            *(DecodeLayer(cache_row=i, **layer.fields) for i, layer in enumerate(layers))
        )
        base, size = ctypes.addressof(self._structs), ctypes.sizeof(DecodeLayer)
        bounds = []  # (the MoE layer finished first or None, first layer, count) per span
        finish, start = None, 0
        for i, layer in enumerate(layers):
            if layer.router is not None:  # a MoE layer ends its span after its norm
                bounds.append((finish, start, i + 1 - start))
                finish, start = i, i + 1
        # the last MoE layer's block, then the dense layers after it (none in DeepSeek-V3)
        bounds.append((finish, start, len(layers) - start))
        self._spans = [
            _Span(None if f is None else base + f * size, f, base + first * size, n)
            for f, first, n in bounds
        ]

    def runs_whole(self) -> bool:
        """Whether `step` may run now: bound for it, and float32 matmuls at the precision
        its sgemm check saw."""
        return self.whole_step and torch.get_float32_matmul_precision() == self._precision

    def step(self, ids, positions, cos_table, sin_table, kv_cache, write_slots, kv_slots,
             lengths, logits: bool = False):  # fmt: skip
        """The whole decoder of a decode step in one C call (`whole_step` only): ids [t] ->
        the final norm's bf16 [t, hidden], as the model's forward computes it (embedding rows,
        `__call__`'s layers with the routers in C, the final RMSNorm); the rope rows are
        looked up in the float32 tables [positions, rope/2] at `positions` [t]. With
        `logits` (only where `ends.head` is set): (hidden, the LM head's logits float32
        [t, vocab], lm_head.logits's values)."""
        head = self._head(logits)
        call = self._step_call(ids, positions, cos_table, sin_table, kv_cache, write_slots,
                               kv_slots, lengths, head)  # fmt: skip
        self._status(self._step(*call.args))
        return call.out if head is None else (call.out, call.head_out)

    def greedy_steps(self, ids, positions, cos_table, sin_table, kv_cache, write_slots,
                     kv_slots, lengths, steps: int, stop_ids: tuple[int, ...] = (),
                     wake_fd: int | None = None,
                     budget_s: float = 0.0) -> torch.Tensor:  # fmt: skip
        """Up to `steps` whole steps in one C call (`step`'s arguments; the LM head bound),
        each row's next id its greedy token (the logits' first maximum, as the sampler draws
        at temperature 0), each row one position further and its latent in the next slot of
        `kv_slots` ([t, >= lengths + steps - 1]). It ends early after a step that drew one of
        `stop_ids` in any row, once `wake_fd` turns readable, or once `budget_s` seconds have
        passed since it began (0: no limit). -> int64 [steps run, t],
        the same tokens and latents as that many `step` calls sampled greedily."""
        head = self._head(True)
        if steps < 1:
            raise ValueError(f"decoder spans: {steps} steps")
        t = ids.shape[0]
        if t and kv_slots.shape[1] < int(lengths.max()) + steps - 1:
            raise ValueError("decoder spans: the slot table has no room for the steps ahead")
        call = self._step_call(ids, positions, cos_table, sin_table, kv_cache, write_slots,
                               kv_slots, lengths, head)  # fmt: skip
        stops = torch.tensor(stop_ids, dtype=torch.long)
        tokens = torch.empty(steps, t, dtype=torch.long)
        fd = -1 if wake_fd is None else wake_fd
        loop = StepLoop(steps, stops.data_ptr(), len(stop_ids), fd, budget_s, tokens.data_ptr())
        self._status(self._steps(*call.args, ctypes.byref(loop)))
        return tokens[: loop.ran]

    def _head(self, logits: bool) -> KernelWeight | None:
        if not self.runs_whole():
            raise ValueError("decoder spans: a router's matmul cannot run in C")
        if logits and self.ends.head is None:
            raise ValueError("decoder spans: no LM head bound")
        return self.ends.head if logits else None

    def _step_call(self, ids, positions, cos_table, sin_table, kv_cache, write_slots,
                   kv_slots, lengths, head: KernelWeight | None) -> _StepCall:  # fmt: skip
        """The C step's arguments and the buffers they point into (the caller holds the
        result until the call returns)."""
        t, ends = ids.shape[0], self.ends
        self._check(t, kv_cache, kv_slots)
        ids, positions = ids.to(torch.long).contiguous(), positions.to(torch.long).contiguous()
        vocab, hidden = ends.embed.shape
        x, h, normed = (torch.empty(t, hidden, dtype=torch.float32) for _ in range(3))
        router_logits = torch.empty(t, self._experts, dtype=torch.float32)
        out = torch.empty(t, hidden, dtype=ends.embed.dtype)
        head_out = None if head is None else torch.empty(t, head.n, dtype=torch.float32)
        step = self._step_struct(t, hidden, kv_cache, write_slots, kv_slots, lengths)
        args = (
            ctypes.byref(step), self._structs, len(self._layers), ends.sgemm, ids.data_ptr(),
            ends.embed.data_ptr(), vocab, cos_table.data_ptr(), sin_table.data_ptr(),
            cos_table.shape[0], cos_table.shape[1], positions.data_ptr(),
            ends.norm_weight.data_ptr(), ends.norm_eps, out.data_ptr(), x.data_ptr(),
            h.data_ptr(), normed.data_ptr(), router_logits.data_ptr(),
            None if head is None else head.address, 0 if head is None else head.n,
            None if head_out is None else head_out.data_ptr(),
        )  # fmt: skip
        buffers = (ids, positions, x, h, normed, router_logits, step)
        return _StepCall(args, out, head_out, buffers)

    @staticmethod
    def _status(status: int) -> None:
        if status == -2:
            raise IndexError("decoder spans: a token id outside the vocabulary or a position "
                             "outside the rope tables")  # fmt: skip
        if status != 0:  # never at the rows a layer binds at (decode_on_kernels)
            raise ValueError(f"decoder step: status {status}")

    def _check(self, t: int, kv_cache, kv_slots) -> None:
        if t != self.rows:
            raise ValueError(f"decoder spans bound for {self.rows} rows, called with {t}")
        if kv_slots.stride(1) != 1 or not kv_cache.is_contiguous():  # the caller checks
            raise ValueError("decoder spans: cache rows and slots must be contiguous")

    @staticmethod
    def _step_struct(t, hidden, kv_cache, write_slots, kv_slots, lengths, cos=None, sin=None):
        return DecodeStep(
            t, hidden, None if cos is None else cos.data_ptr(),
            None if sin is None else sin.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0),
            write_slots.data_ptr(), kv_slots.data_ptr(), kv_slots.stride(0), lengths.data_ptr(),
        )  # fmt: skip

    def __call__(self, x, cos, sin, kv_cache, write_slots, kv_slots, lengths) -> torch.Tensor:
        t, hidden = x.shape
        self._check(t, kv_cache, kv_slots)
        if x.dtype != torch.float32 or not x.is_contiguous():  # the calls update it in place
            raise ValueError("decoder spans: x must be float32 and contiguous")
        cos, sin = cos.contiguous(), sin.contiguous()
        h = torch.empty(t, hidden, dtype=torch.float32)
        normed = torch.empty(t, hidden, dtype=torch.float32)
        step = self._step_struct(t, hidden, kv_cache, write_slots, kv_slots, lengths, cos, sin)
        step_ref, x_ptr, h_ptr = ctypes.byref(step), x.data_ptr(), h.data_ptr()
        normed_ptr = normed.data_ptr()
        for span in self._spans:
            logits = None
            if span.router is not None:  # float32 [t, E], as the C code reads it
                logits = self._layers[span.router].router(normed).float().contiguous()
            status = self._call(
                step_ref, span.finish, None if logits is None else logits.data_ptr(), span.first,
                span.count, x_ptr, h_ptr, normed_ptr,
            )  # fmt: skip
            if status != 0:  # never at the rows a layer binds at (decode_on_kernels)
                raise ValueError(f"decoder span: status {status}")
        return x
