"""N-gram drafts (prompt lookup): propose what followed the last occurrence of the sequence's
current suffix earlier in its own tokens (prompt and output).

Works with any model, no weights: code editing, summaries and retrieval answers repeat long
stretches of their prompt, and those stretches are drafted for free.
"""

from __future__ import annotations

import torch

from mci.core.batch import ScheduledItem


class NgramDrafter:
    """Longest suffix first: of `max_window` .. `min_window` tokens, the first suffix found
    earlier in the sequence (its most recent occurrence) proposes the tokens after it."""

    def __init__(self, min_window: int, max_window: int):
        self.min_window, self.max_window = min_window, max_window

    def lookup(self, tokens: list[int], num_tokens: int) -> list[int]:
        n = len(tokens)
        for window in range(min(self.max_window, n - 1), self.min_window - 1, -1):
            suffix = tokens[n - window :]
            first = suffix[0]
            # the most recent earlier occurrence is the likeliest to continue the same way
            for at in range(n - window - 1, -1, -1):
                if tokens[at] == first and tokens[at : at + window] == suffix:
                    return tokens[at + window : at + window + num_tokens]
        return []

    def propose(
        self,
        items: list[ScheduledItem],
        hidden: torch.Tensor,
        new_tokens: dict[int, list[int]],
        budgets: dict[int, int],
    ) -> dict[int, list[int]]:
        """The `Drafter` seam (see speculator.py); needs the tokens only."""
        return {
            i: self.lookup(items[i].request.token_ids + new_tokens[i], n)
            for i, n in budgets.items()
            if n > 0
        }
