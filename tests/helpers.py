"""Small helpers shared by tests: run a whole prompt, or step token by token, through mci."""

from __future__ import annotations

import pytest
import torch

from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.layers.linear import bf16_matmuls_supported

# --deterministic needs oneDNN's bf16 matmuls (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); on a CPU
# without them the engine refuses the mode (tested), and its bit-exactness tests cannot run
needs_bf16_matmuls = pytest.mark.skipif(
    not bf16_matmuls_supported(), reason="this CPU runs no oneDNN bf16 matmuls"
)


def prefill_logits(model, ids: list[int], path: str = "auto") -> torch.Tensor:
    """Logits [len(ids), vocab] of a fresh sequence run in one forward on the model's device
    (returned on the CPU)."""
    device = model.lm_head.weight.device
    cache = model.allocate_kv_cache(len(ids) + 1, device)
    slots = torch.arange(len(ids), device=device)
    meta = AttentionMetadata.build([SequenceChunk(slots, len(ids))], device)
    return model.logits(model(torch.tensor(ids, device=device), meta, cache, path)).cpu()


def stepwise_logits(model, ids: list[int], path: str, first_chunk: int = 1) -> torch.Tensor:
    """The same logits, computed `first_chunk` tokens at once and then one token per step."""
    device = model.lm_head.weight.device
    cache = model.allocate_kv_cache(len(ids) + 1, device)
    slots = torch.arange(len(ids), device=device)
    out, length = [], 0
    while length < len(ids):
        n = first_chunk if length == 0 else 1
        length += n
        meta = AttentionMetadata.build([SequenceChunk(slots[:length], n)], device)
        step_ids = torch.tensor(ids[length - n : length], device=device)
        out.append(model.logits(model(step_ids, meta, cache, path)))
    return torch.cat(out).cpu()
