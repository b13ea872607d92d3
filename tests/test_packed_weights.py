"""oneDNN-packed weights (the CPU engine's matmuls) give bitwise the same logits as aten's."""

from __future__ import annotations

import torch
from helpers import prefill_logits, stepwise_logits

from mci.models.loader import load_model


def test_packed_model_gives_identical_logits(checkpoint):
    model = load_model(checkpoint(dtype="bfloat16"), "bfloat16")
    ids = torch.randint(0, 2048, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = prefill_logits(model, ids), stepwise_logits(model, ids[:12], "auto", first_chunk=5)
    assert model.pack_for_cpu() > 0
    packed = prefill_logits(model, ids), stepwise_logits(model, ids[:12], "auto", first_chunk=5)
    for a, b in zip(plain, packed, strict=True):
        assert torch.equal(a, b)


def test_float32_float16_and_fp8_weights_are_never_packed(checkpoint):
    assert load_model(checkpoint(), "float32").pack_for_cpu() == 0
    assert load_model(checkpoint(dtype="bfloat16"), "float16").pack_for_cpu() == 0
    model = load_model(checkpoint(fp8=True, dtype="bfloat16"), "bfloat16")
    model.pack_for_cpu()
    assert all(
        m._packed is None
        for m in model.modules()
        if hasattr(m, "weight_scale_inv")  # FP8 linears keep one byte per parameter
    )
