"""The multi-token-prediction (MTP) module of DeepSeek-V3.

For position i it combines the previous depth's hidden state h_i with the embedding of the
known next token t_{i+1} and predicts t_{i+2}:

    x      = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])        [T, 2*hidden] -> [T, hidden]
    h'_i   = decoder_block(x)                                      a full MLA + MoE block
    logits = shared_head.head(shared_head.norm(h'_i))

Its weights sit in the checkpoint under `model.layers.{num_hidden_layers}.*`, with the block's
own tensors (`self_attn.*`, `mlp.*`, layer norms) named exactly as in a main layer. The block
attends over its own latent cache row, so it is a decoder layer with extra inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from mci.layers.embedding import VocabEmbedding, VocabHead
from mci.layers.linear import make_linear
from mci.layers.norm import RMSNorm
from mci.model_config import ModelConfig
from mci.models.decoder_layer import DecoderLayer
from mci.parallel.context import ParallelContext


class SharedHead(nn.Module):
    """The MTP module's output norm and vocabulary projection."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, parallel: ParallelContext):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.head = VocabHead(cfg.hidden_size, cfg.vocab_size, dtype, parallel)


class MTPLayer(DecoderLayer):
    """One MTP depth: a decoder block (same tensor names as a main layer) with extra inputs."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, parallel: ParallelContext | None = None
    ):
        parallel = parallel or ParallelContext.single()
        super().__init__(cfg, moe=cfg.n_routed_experts > 0, dtype=dtype, parallel=parallel)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.eh_proj = make_linear(2 * cfg.hidden_size, cfg.hidden_size, dtype, None)  # plain
        self.shared_head = SharedHead(cfg, dtype, parallel)

    def forward(
        self, next_ids, hidden, meta, rope_cos_sin, kv_cache, absorbed: tuple[bool, ...]
    ) -> torch.Tensor:
        """next_ids: [T], hidden: [T, hidden] -> the block's output, float32 [T, hidden]."""
        x = torch.cat((self.enorm(self.embed_tokens(next_ids)), self.hnorm(hidden)), dim=-1)
        x = self.eh_proj(x).float()  # the block's residual stream is float32
        return super().forward(x, meta, rope_cos_sin, kv_cache, absorbed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> float32 logits [T, vocab] for the token after next."""
        return self.shared_head.head.logits(self.shared_head.norm(hidden))
