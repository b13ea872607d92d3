"""ScheduledBatch -> tensors -> one forward -> logits of the rows that sample.

Owns the latent KV cache tensor. The per-step Python here is O(requests), never O(tokens):
input ids are gathered per request slice, slot lists are slices of each request's buffer.
"""

from __future__ import annotations

import torch

from mci.core.batch import ScheduledBatch
from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM


class ModelRunner:
    """Runs the model on scheduled batches over a `num_slots`-token latent cache."""

    def __init__(self, model: DeepseekV3ForCausalLM, num_slots: int):
        self.model = model
        self.device = model.lm_head.weight.device
        self.kv_cache = model.allocate_kv_cache(num_slots, self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward the batch; returns float32 logits of the rows that need them, item by item:

            [ item 0: scored prompt positions..., sample row? | item 1: ... | ... ]

        (`ScheduledItem.scored_positions`, then the last position when `item.sample`).
        """
        chunks, ids, logit_rows = [], [], []
        offset = 0
        for item in batch.items:
            req, n = item.request, item.num_new
            start = req.num_computed_tokens
            chunks.append(SequenceChunk(req.slots[: start + n], n))
            ids.extend(req.token_ids[start : start + n])
            scored = item.scored_positions
            logit_rows.extend(range(offset + scored.start - start, offset + scored.stop - start))
            offset += n
            if item.sample:
                logit_rows.append(offset - 1)
        meta = AttentionMetadata.build(chunks, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta, self.kv_cache)
        if not logit_rows:
            return hidden.new_empty(0, self.model.cfg.vocab_size, dtype=torch.float32)
        rows = torch.tensor(logit_rows, device=self.device)
        return self.model.logits(hidden.index_select(0, rows)).cpu()
