"""ScheduledBatch -> tensors -> one forward -> sampled tokens (and the logprobs asked for).

Holds the latent KV cache tensor (assembly sizes it). The per-step Python here is
O(requests), never O(tokens): input ids are gathered per request slice, slot lists are slices
of each request's buffer.
"""

from __future__ import annotations

import torch

from mci.core.batch import SampleResult, ScheduledBatch
from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.runner.sampler import sample, score_prompts


class ModelRunner:
    """Runs the model on scheduled batches over a latent cache (`allocate_kv_cache`'s layout)
    and samples their next tokens.

    Reads each item's request (token ids, slots, sampling state); writes nothing but the KV
    cache and the requests' generators. `eos_ids` feed the min-tokens rule of the sampler.
    """

    def __init__(
        self, model: DeepseekV3ForCausalLM, kv_cache: torch.Tensor, eos_ids: tuple[int, ...]
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.eos_ids = eos_ids
        self.device = model.lm_head.weight.device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SampleResult:
        """Forward the batch, then sample each sampling item and score each scoring item.

        Logits are computed only for the rows that need them, laid out as

            [ scored prompt positions of every scoring item... | last row of every sampling item ]
        """
        chunks, ids, score_rows, sample_rows = [], [], [], []
        offset = 0  # the item's first row among the step's flat tokens
        for item in batch.items:
            req, start, n = item.request, item.start, item.num_new
            chunks.append(SequenceChunk(req.slots[: start + n], n))
            ids.extend(req.token_ids[start : start + n])
            scored = item.scored_positions
            score_rows.extend(range(offset + scored.start - start, offset + scored.stop - start))
            offset += n
            if item.sample:
                sample_rows.append(offset - 1)
        meta = AttentionMetadata.build(chunks, self.device, self.model.attention_key_multiple)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta, self.kv_cache)
        rows = score_rows + sample_rows
        if not rows:
            return SampleResult([], [])
        if len(rows) < hidden.shape[0] or score_rows:
            hidden = hidden.index_select(0, torch.tensor(rows, device=self.device))
        logits = self.model.logits(hidden).cpu()
        num_scored = len(score_rows)
        sampled = sample(
            logits[num_scored:], [item.request for item in batch.sampling_items], self.eos_ids
        )
        if not num_scored:
            return sampled
        scores = score_prompts(logits[:num_scored], batch.scoring_items)
        return SampleResult(sampled.token_ids, sampled.logprobs, scores)
