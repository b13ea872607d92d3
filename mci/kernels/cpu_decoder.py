"""A decode step's decoder layers in a few kernel calls (cpu_decoder.c): one call from one MoE
router to the next, where calling each layer's kernels from Python took five calls and as
many torch ops a layer. The routers' float32 matmuls stay torch's (`TopKRouter.logits`): the
expert choice rests on their bits. Same values as the layers' own forward, bit for bit
(tests/test_cpu_kernels.py, test_a_decode_step_of_bound_kernel_calls_is_the_layers_bit_for_bit).

Measured on `small` (8 layers, 7 of them MoE), a 2-core Zen 4 EPYC, one decoding request in
process: the Python between a step's kernel calls was ~0.33 ms of a ~2.8 ms step; old and new
alternating, the step went 2.89 -> 2.78 and 3.04 -> 2.70 ms (p50).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

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
        ("w_s_gate_up", ptr), ("w_s_down", ptr), ("s_inter", long), ("max_rows", long),
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
    MoE layer, its router's matmul. `keep` holds what the fields' addresses point into. Made
    by `moe_layer` or `dense_layer`."""

    fields: dict[str, int | float | None]
    router: Callable[[torch.Tensor], torch.Tensor] | None
    keep: tuple


# DecodeLayer's fields in groups, as the C struct orders them: the attention's (BoundMLA's
# `args`) come before `cache_row`, the MoE's (BoundMoE's `args`) from `w_gate_up` on
_NAMES = [name for name, _ in DecodeLayer._fields_]
_ATTENTION = set(_NAMES[: _NAMES.index("cache_row")])
_MOE = set(_NAMES[_NAMES.index("w_gate_up") :])


def _layer(attention: BoundMLA, norm: tuple[torch.Tensor, float], ffn: dict, router, keep):
    if set(attention.args) != _ATTENTION:
        raise ValueError(f"decoder span: unexpected attention fields {sorted(attention.args)}")
    fields = {**attention.args, "ffn_norm_w": norm[0].data_ptr(), "ffn_norm_eps": norm[1], **ffn}
    return KernelLayer(fields, router, (attention, norm[0], *keep))


def moe_layer(
    attention: BoundMLA, norm: tuple[torch.Tensor, float], moe: BoundMoE, router
) -> KernelLayer:
    """A MoE layer: its attention, the feed-forward's RMSNorm (weight, eps), the one-call MoE
    (shared experts inside) and its router's matmul."""
    if set(moe.args) != _MOE:
        raise ValueError(f"decoder span: unexpected MoE fields {sorted(moe.args)}")
    return _layer(attention, norm, {**moe.args, "moe": 1}, router, (moe,))


def dense_layer(
    attention: BoundMLA, norm: tuple[torch.Tensor, float], gate_up: KernelWeight,
    down: KernelWeight,
) -> KernelLayer:  # fmt: skip
    """A dense layer: its attention, the feed-forward's RMSNorm, the gated MLP's weights."""
    ffn = {"moe": 0, "w_gate_up": gate_up.address, "w_down": down.address, "inter": down.k}
    return _layer(attention, norm, ffn, None, (gate_up, down))


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

    def __init__(self, kernels, layers: list[KernelLayer], rows: int):
        self._call = kernels._decoder_span
        self.rows = rows  # the step size the layers were bound at (their kernels' limits)
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

    def __call__(self, x, cos, sin, kv_cache, write_slots, kv_slots, lengths) -> torch.Tensor:
        t, hidden = x.shape
        if t != self.rows:
            raise ValueError(f"decoder spans bound for {self.rows} rows, called with {t}")
        if kv_slots.stride(1) != 1 or not kv_cache.is_contiguous():  # the caller checks
            raise ValueError("decoder spans: cache rows and slots must be contiguous")
        if x.dtype != torch.float32 or not x.is_contiguous():  # the calls update it in place
            raise ValueError("decoder spans: x must be float32 and contiguous")
        cos, sin = cos.contiguous(), sin.contiguous()
        h = torch.empty(t, hidden, dtype=torch.float32)
        normed = torch.empty(t, hidden, dtype=torch.float32)
        step = DecodeStep(
            t, hidden, cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0),
            write_slots.data_ptr(), kv_slots.data_ptr(), kv_slots.stride(0), lengths.data_ptr(),
        )  # fmt: skip
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
