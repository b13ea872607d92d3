"""Speculative decoding policy: which requests get drafts this step, how many, from whom.

    runner: forward -> sample every drafted position -> verify (verify.py)
            -> Speculator.propose(items, hidden, new tokens) -> drafts for the next step

A `Drafter` (MTP module: mtp.py; prompt lookup: ngram.py) makes the drafts; the policy here
bounds them: none for a request that opted out (`SamplingParams.speculative`), none past its
token limit, and none at all in a step with more sampling requests than
`SpeculativeConfig.max_drafting_batch`, where verifying k+1 positions per request costs more
than the accepted tokens save (measured on this project's CPU: see docs/speculative.md).
"""

from __future__ import annotations

from typing import Protocol

import torch

from mci.core.batch import ScheduledItem
from mci.speculative.config import SpeculativeConfig


class Drafter(Protocol):
    def propose(
        self,
        items: list[ScheduledItem],
        hidden: torch.Tensor,
        new_tokens: dict[int, list[int]],
        budgets: dict[int, int],
    ) -> dict[int, list[int]]:
        """Drafts (at most `budgets[i]` tokens) to follow each sampling item's new tokens.
        `items`: the step's items; `hidden`: the main model's final-norm states of the step's
        tokens in item order; `new_tokens` / `budgets`: by index into `items`."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter):
        self.config = config
        self.drafter = drafter

    def propose(
        self, items: list[ScheduledItem], hidden: torch.Tensor, new_tokens: dict[int, list[int]]
    ) -> dict[int, list[int]]:
        """Drafts by item index for the sampling items (`new_tokens`' keys)."""
        drafting = len(new_tokens) <= self.config.max_drafting_batch
        budgets = {}
        for i, tokens in new_tokens.items():
            req = items[i].request
            # The next step yields up to drafts + 1 tokens: never draft past the last allowed.
            left = req.params.max_new_tokens - len(req.output_ids) - len(tokens)
            allowed = drafting and req.params.speculative
            budgets[i] = max(0, min(self.config.num_steps, left - 1)) if allowed else 0
        return self.drafter.propose(items, hidden, new_tokens, budgets)
