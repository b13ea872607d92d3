"""Drafts from DeepSeek-V3's multi-token-prediction module, chained (SGLang's EAGLE path for
DeepSeek with topk 1): the one module predicts t+2 from the main model's state at t and token
t+1, then is fed its own output state and its own draft to go one further, k times.

The module attends over its own latent cache row. Its latent for position p is a function of
the main model's state at p *and of token p+1*, so it is stored in the slot of position p+1:

    slot of position:      0      1      2     ...   p+1
    main latent row:      m_0    m_1    m_2    ...  m_{p+1}
    MTP latent row:        -     u_0    u_1    ...  u_p       u_p = f(h_p, t_{p+1})

A slot then holds latents that depend only on the tokens up to its own position, so the radix
cache can share it between requests like any main latent. Invariant, after every step: a
request's MTP latents are written for every position before its last computed one (slots
1 .. num_computed_tokens - 1); the last one's latent needs the next position's slot, which
the next step allocates, so its main state waits on the request (`Request.mtp_pending`) and
is written then. A prefix-cache match leaves its last matched position to be computed again
(`KVCacheManager(match_margin=1)`): the request's first computed position then has a slot of
its own, which must hold the latent of the position before it; that latent depends only on
matched tokens, so it is copied from the tree's slot of the same position
(`Request.matched_next_slot`, kept alive by the request's lock).

Drafts run past the verified positions; the chain's latents go to scratch slots outside the
pool (`scratch`: a row of k slots per request of the step), read only by the chain itself.
"""

from __future__ import annotations

import torch

from mci.core.batch import ScheduledItem
from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM


class MTPDrafter:
    """Writes the MTP module's latents each step and drafts greedy chains from them."""

    def __init__(self, model: DeepseekV3ForCausalLM, kv_cache: torch.Tensor, scratch: torch.Tensor):
        if not len(model.mtp):
            raise ValueError("the checkpoint has no MTP module")
        self.model = model
        self.kv_cache = kv_cache
        self.scratch = scratch  # [rows, k] slot ids past the pool's
        self.device = model.lm_head.weight.device

    def propose(
        self,
        items: list[ScheduledItem],
        hidden: torch.Tensor,
        new_tokens: dict[int, list[int]],
        budgets: dict[int, int],
    ) -> dict[int, list[int]]:
        """The `Drafter` seam (see speculator.py)."""
        drafting = [i for i in new_tokens if budgets.get(i, 0) > 0]
        # The chain: depth d runs the module at position (last kept) + d - 1, from the main
        # state there and the token just sampled (depth 1, in the same forward as the latents
        # written this step), then from its own state and its last draft.
        state = self._write_latents(items, hidden, new_tokens, drafting)
        if not drafting:
            return {}
        drafts: dict[int, list[int]] = {i: [] for i in drafting}
        going = list(range(len(drafting)))  # indices into `drafting`, and scratch rows
        depth = 1
        while True:
            tokens = self.model.mtp_logits(0, state).argmax(dim=-1).tolist()
            for j, token in zip(going, tokens, strict=True):
                drafts[drafting[j]].append(token)
            keep = [k for k, j in enumerate(going) if budgets[drafting[j]] > depth]
            if not keep:
                return drafts
            depth += 1
            going, state = [going[k] for k in keep], state[keep]
            chunks = []
            for j in going:
                item = items[drafting[j]]
                end = item.start + _kept(item, new_tokens[drafting[j]])  # past the last kept
                slots = torch.cat((item.request.slots[1:end], self.scratch[j, :depth]))
                chunks.append(SequenceChunk(slots, 1))
            state = self._forward(chunks, [tokens[k] for k in keep], state)

    def _write_latents(self, items, hidden, new_tokens, drafting: list[int]) -> torch.Tensor:
        """Write the module's latents of every position whose next token and next slot both
        exist now, and leave each item's last kept position pending; for each item in
        `drafting` (indices into `items`), also run the module at that last position (its
        latent to the item's first scratch slot). Returns those runs' states, in order."""
        chunks, next_ids, rows, pending, draft_rows = [], [], [], [], []
        scratch_row = {i: j for j, i in enumerate(drafting)}
        offset = 0
        mtp_row = self.model.cfg.num_hidden_layers
        for i, item in enumerate(items):
            req, start = item.request, item.start
            if req.matched_next_slot is not None:  # first step after a prefix match
                self.model.copy_cache_slot(
                    self.kv_cache, mtp_row, int(req.slots[start]), int(req.matched_next_slot)
                )
                req.matched_next_slot = None
            kept = _kept(item, new_tokens.get(i))
            known = item.num_new - len(item.draft_ids)
            tokens = req.token_ids[: start + known] + new_tokens.get(i, [])
            first = start - 1 if req.mtp_pending is not None else start
            end = start + kept - 1  # positions first .. end - 1 get their latents now
            slots = req.slots[1 : end + 1]
            count = end - first
            if first < start:
                rows.append(hidden.shape[0] + len(pending))
                pending.append(req.mtp_pending)
            rows.extend(range(offset, offset + end - max(first, start)))
            next_ids.extend(tokens[first + 1 : end + 1])
            if i in scratch_row:  # the chain's first step, at position `end`
                slots = torch.cat((slots, self.scratch[scratch_row[i], :1]))
                count += 1
                rows.append(offset + kept - 1)
                next_ids.append(tokens[end + 1])
                draft_rows.append(len(rows) - 1)
            if count:
                chunks.append(SequenceChunk(slots, count))
            item.request.mtp_pending = hidden[offset + kept - 1].clone()
            offset += item.num_new
        if not chunks:
            return hidden[:0]
        states = torch.cat([hidden, *(p[None] for p in pending)]) if pending else hidden
        return self._forward(chunks, next_ids, states[rows])[draft_rows]

    def _forward(self, chunks, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        meta = AttentionMetadata.build(chunks, self.device, self.model.attention_layout)
        ids = torch.tensor(next_ids, dtype=torch.long, device=self.device)
        return self.model.mtp_hidden(0, ids, hidden, meta, self.kv_cache)


def _kept(item: ScheduledItem, new_tokens: list[int] | None) -> int:
    """Positions of the item whose main latents stay: its known tokens, plus the drafts
    accepted (all new tokens but the last)."""
    known = item.num_new - len(item.draft_ids)
    return known + (len(new_tokens) - 1 if new_tokens else 0)
