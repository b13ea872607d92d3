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
    """Logits [len(ids), vocab] of a fresh sequence run in one forward."""
    cache = model.allocate_kv_cache(len(ids) + 1)
    meta = AttentionMetadata.build([SequenceChunk(torch.arange(len(ids)), len(ids))])
    return model.logits(model(torch.tensor(ids), meta, cache, path))


def stepwise_logits(model, ids: list[int], path: str, first_chunk: int = 1) -> torch.Tensor:
    """The same logits, computed `first_chunk` tokens at once and then one token per step."""
    cache = model.allocate_kv_cache(len(ids) + 1)
    slots = torch.arange(len(ids))
    out, length = [], 0
    while length < len(ids):
        n = first_chunk if length == 0 else 1
        length += n
        meta = AttentionMetadata.build([SequenceChunk(slots[:length], n)])
        out.append(model.logits(model(torch.tensor(ids[length - n : length]), meta, cache, path)))
    return torch.cat(out)
