"""Token embeddings and vocabulary projections, whole or split by vocabulary across
tensor-parallel ranks (mci/parallel/context.py).

A vocabulary-parallel embedding holds rows [start, stop) of the table; each rank looks up the
ids it holds (zero elsewhere) and an all-reduce assembles the rows. Exactly one rank contributes
each value, so the sum equals the single-process lookup bit for bit. A vocabulary-parallel head
computes its rows' logits and all-gathers them in rank order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mci.layers.linear import Linear
from mci.parallel.context import ParallelContext


def vocab_shard(vocab_size: int, parallel: ParallelContext) -> tuple[int, int]:
    """[start, stop) of the vocabulary this rank holds."""
    return parallel.split(vocab_size, parallel.tp_size, parallel.tp_rank, "vocab_size")


class VocabEmbedding(nn.Module):
    """ids [T] -> embeddings [T, hidden] in the table's dtype."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, parallel: ParallelContext):
        super().__init__()
        self.parallel = parallel
        self.start, self.stop = vocab_shard(vocab_size, parallel)
        weight = torch.empty(self.stop - self.start, hidden, dtype=dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        held = (ids >= self.start) & (ids < self.stop)
        local = torch.where(held, ids - self.start, 0)
        rows = F.embedding(local, self.weight) * held[:, None]
        return self.parallel.all_reduce(rows).to(self.weight.dtype)


class VocabHead(Linear):
    """hidden [N, hidden] -> float32 logits [N, vocab]; never FP8."""

    def __init__(self, hidden: int, vocab_size: int, dtype: torch.dtype, parallel: ParallelContext):
        start, stop = vocab_shard(vocab_size, parallel)
        super().__init__(hidden, (stop - start,), dtype)
        self.parallel = parallel

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_gather_columns(self(hidden).float())
