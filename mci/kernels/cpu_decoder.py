"""A decode step's decoder layers in a few kernel calls (cpu_decoder.c): one call from one MoE
router to the next, where the per-layer path (models/decoder_layer.py) makes five calls and
as many torch ops a layer. The routers' float32 matmuls stay torch's (`TopKRouter.logits`):
the expert choice rests on their bits. Same values as the per-layer path, bit for bit
(tests/test_cpu_decoder.py).

Measured on `small` (8 layers, 7 of them MoE), a 2-core Zen 4 EPYC, one decoding request
in process: the Python between a step's kernel calls was ~0.33 ms of a ~2.8 ms step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    MoE layer, its router's matmul. `keep` holds what the fields' addresses point into."""

    fields: dict
    router: Callable[[torch.Tensor], torch.Tensor] | None = None
    keep: tuple = ()


class DecoderSpans:
    """Every decoder layer of a decode step: `__call__(x, cos, sin, kv_cache, write_slots,
    kv_slots, lengths)` -> the residual stream after the last layer, as the per-layer path
    computes it. A span runs from after one MoE layer's norm to the next MoE layer's norm;
    between spans, that layer's router."""

    def __init__(self, kernels, layers: list[KernelLayer]):
        self._call = kernels._decoder_span
        self._layers = layers  # keeps every address the structs hold alive
        self._structs = (DecodeLayer * len(layers))(
            *(DecodeLayer(cache_row=i, **layer.fields) for i, layer in enumerate(layers))
        )
        base, size = ctypes.addressof(self._structs), ctypes.sizeof(DecodeLayer)
        # (the MoE layer finished first or None, its router, first layer, count) per span
        self._spans = []
        finish, start = None, 0
        for i, layer in enumerate(layers):
            if layer.router is not None:  # a MoE layer ends its span after its norm
                self._spans.append((finish, start, i + 1 - start))
                finish, start = i, i + 1
        # the last MoE layer's block, then the dense layers after it (none in DeepSeek-V3)
        self._spans.append((finish, start, len(layers) - start))
        self._spans = [
            (None if f is None else base + f * size, f, base + s * size, n)
            for f, s, n in self._spans
        ]

    def __call__(self, x, cos, sin, kv_cache, write_slots, kv_slots, lengths) -> torch.Tensor:
        t, hidden = x.shape
        if kv_slots.stride(1) != 1 or not kv_cache.is_contiguous():
            raise ValueError("decoder spans: cache rows and slots must be contiguous")
        # the residual stream, updated in place by the calls: a copy, the caller's x untouched
        x = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        cos, sin = cos.contiguous(), sin.contiguous()
        h = torch.empty(t, hidden, dtype=torch.float32)
        normed = torch.empty(t, hidden, dtype=torch.float32)
        step = DecodeStep(
            t, hidden, cos.data_ptr(), sin.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0),
            write_slots.data_ptr(), kv_slots.data_ptr(), kv_slots.stride(0), lengths.data_ptr(),
        )  # fmt: skip
        step_ref, x_ptr, h_ptr = ctypes.byref(step), x.data_ptr(), h.data_ptr()
        normed_ptr = normed.data_ptr()
        for finish, index, first, count in self._spans:
            logits = None if finish is None else self._layers[index].router(normed)
            status = self._call(
                step_ref, finish, None if logits is None else logits.data_ptr(), first, count,
                x_ptr, h_ptr, normed_ptr,
            )  # fmt: skip
            if status != 0:  # never at the rows a layer binds at (decode_on_kernels)
                raise ValueError(f"decoder span: status {status}")
        return x
