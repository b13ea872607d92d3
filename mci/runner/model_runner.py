"""ScheduledBatch -> tensors -> one forward -> sampled tokens (and the logprobs asked for).

Holds the latent KV cache tensor (assembly sizes it). The per-step Python here is
O(requests), never O(tokens): input ids are gathered per request slice, slot lists are slices
of each request's buffer.
"""

from __future__ import annotations

import time

import torch

from mci.core.batch import SampleResult, ScheduledBatch
from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk, stack_slots
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.runner.sampler import SampleRow, sample, score_prompts
from mci.speculative.speculator import Speculator
from mci.speculative.verify import accepted_length

# A call of several decode steps ends after the step that passes this much time (the steps
# left are scheduled again): a lone stream that ended in the call on a stop string (the C loop
# does not see text) waits this long at most for its last output, and its extra steps cost
# no more; so does a deadline. `small`'s ~1 ms steps run 16 a call well inside it.
DECODE_CALL_BUDGET_S = 0.05


class ModelRunner:
    """Runs the model on scheduled batches over a latent cache (`allocate_kv_cache`'s layout)
    and samples their next tokens.

    Reads each item's request (token ids, slots, sampling state); writes nothing but the KV
    cache, the requests' generators and, when drafting with MTP, their pending MTP state
    (`Request.mtp_pending`, see mci/speculative/mtp.py). `eos_ids` feed the min-tokens rule of the
    sampler. With a `speculator`, each step also drafts tokens for the next one (mci/speculative/).
    """

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_cache: torch.Tensor,
        eos_ids: tuple[int, ...],
        speculator: Speculator | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.eos_ids = eos_ids
        self.speculator = speculator
        self.device = model.lm_head.weight.device
        self.forwards = 0  # main-model forwards run (data-parallel attention pairs them up)
        # readable while a command waits for the engine: a call of several decode steps ends
        # after the step in flight (None: it runs them all)
        self.wake_fd: int | None = None
        self.decode_call_budget_s = DECODE_CALL_BUDGET_S  # 0: a call ends by its steps only

    def execute(self, batch: ScheduledBatch) -> SampleResult:
        """Forward the batch, then sample each sampling item (verifying its drafts), score each
        scoring item, and draft for the next step when speculating.

        Logits are computed only for the rows that need them: the sampled rows of every
        sampling item (its last known position, then one per draft) in one call, and the
        scored prompt positions of every scoring item `SCORE_ROWS` rows at a time (echo with
        logprobs over a long prompt would otherwise hold [prompt, vocab] float32 at once).

        In torch's inference mode: the caller's (an engine step enters it once), else its own.
        """
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.execute(batch)
        chunks, ids, score_rows, sample_rows = [], [], [], []
        offset = 0  # the item's first row among the step's flat tokens
        for item in batch.items:
            req, start, n = item.request, item.start, item.num_new
            known = n - len(item.draft_ids)
            chunks.append(SequenceChunk(req.slots[: start + n], n))
            ids.extend(req.token_ids[start : start + known])
            ids.extend(item.draft_ids)
            scored = item.scored_positions
            score_rows.extend(range(offset + scored.start - start, offset + scored.stop - start))
            if item.sample:
                sample_rows.extend(range(offset + known - 1, offset + n))
            offset += n
        meta = AttentionMetadata.build(chunks, self.device, self.model.attention_layout)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        if not score_rows and self.speculator is None and len(sample_rows) == offset:
            if batch.decode_steps > 1:
                result = self._greedy_steps(batch, input_ids, meta)
                if result is not None:
                    return result
            # every row samples (a decode step): forward and logits in one kernel call
            logits = self.model.decode_logits(input_ids, meta, self.kv_cache)
            if logits is not None:  # on the CPU: the kernels ran it
                self.forwards += 1
                return self._sample_and_verify(batch, logits)
        hidden = self.model(input_ids, meta, self.kv_cache)
        self.forwards += 1
        if not score_rows and not sample_rows and self.speculator is None:
            return SampleResult([], [])
        logits = None
        if sample_rows:
            selected = hidden
            if len(sample_rows) < hidden.shape[0]:
                selected = hidden.index_select(0, torch.tensor(sample_rows, device=self.device))
            logits = self.model.logits(selected).cpu()
        result = self._sample_and_verify(batch, logits)
        if self.speculator is not None:
            sampling = [i for i, item in enumerate(batch.items) if item.sample]
            new_tokens = dict(zip(sampling, result.token_ids, strict=True))
            drafts = self.speculator.propose(batch.items, hidden, new_tokens)
            result.draft_ids.extend(drafts.get(i, []) for i in sampling)
        if score_rows:
            rows = torch.tensor(score_rows, device=self.device)

            def logits_of(part: slice) -> torch.Tensor:
                return self.model.logits(hidden.index_select(0, rows[part])).cpu()

            result.prompt_logprobs.extend(score_prompts(logits_of, batch.scoring_items))
        return result

    def _greedy_steps(self, batch: ScheduledBatch, input_ids, meta) -> SampleResult | None:
        """Up to `batch.decode_steps` decode steps in one kernel call (`decode_greedy`), each
        item's tokens one per step run; None where the model cannot (one step runs instead).
        The call ends early after a step that drew a token ending some item (a stop token, or
        EOS where it counts), once `wake_fd` is readable, or after the step that passes its
        time budget or an item's deadline."""
        steps, items = batch.decode_steps, batch.items
        slots = [item.request.slots[: item.start + steps] for item in items]
        ahead = stack_slots(slots, max(int(s.shape[0]) for s in slots))
        stops, budget = set(), self.decode_call_budget_s
        deadlines = [item.request.deadline for item in items if item.request.deadline]
        if deadlines:  # the first deadline ends the call too (past it: after one step)
            left = max(1e-6, min(deadlines) - time.monotonic())
            budget = left if budget == 0 else min(budget, left)
        for item in items:
            params = item.request.params
            stops.update(params.stop_token_ids, () if params.ignore_eos else self.eos_ids)
        tokens = self.model.decode_greedy(
            input_ids, meta, self.kv_cache, ahead, steps, tuple(sorted(stops)), self.wake_fd,
            budget,
        )  # fmt: skip
        if tokens is None:
            return None
        self.forwards += tokens.shape[0]
        per_item = tokens.t().tolist()
        return SampleResult(per_item, [[None] * len(t) for t in per_item])

    def _sample_and_verify(self, batch: ScheduledBatch, logits: torch.Tensor | None):
        """Sample every sampling row in one call (a drafted position as if the drafts before
        it were accepted), then keep each item's accepted drafts plus the next token."""
        items = batch.sampling_items
        if not items:
            return SampleResult([], [])
        rows = [
            SampleRow(item.request, item.draft_ids[:j])
            for item in items
            for j in range(len(item.draft_ids) + 1)
        ]
        draws = sample(logits, rows, self.eos_ids)
        tokens, logprobs, accepted, row = [], [], [], 0
        for item in items:
            drawn = draws.token_ids[row : row + len(item.draft_ids) + 1]
            n = accepted_length(item.draft_ids, drawn)
            tokens.append(drawn[: n + 1])
            logprobs.append(draws.logprobs[row : row + n + 1])
            accepted.append(n)
            row += len(item.draft_ids) + 1
        return SampleResult(tokens, logprobs, num_accepted=accepted)
