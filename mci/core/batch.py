"""The scheduler's plan for one step (plain Python; the runner turns it into tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mci.core.request import Request


@dataclass(frozen=True)
class ScheduledItem:
    """Compute `num_new` tokens of `request` (positions num_computed .. num_computed+num_new-1);
    `sample` when they are all its remaining known tokens, so the step yields its next token."""

    request: Request
    num_new: int

    @property
    def sample(self) -> bool:
        req = self.request
        return (
            req.num_computed_tokens + self.num_new == req.num_tokens
            and req.params.max_new_tokens > 0
        )

    @property
    def scored_positions(self) -> range:
        """Positions of this chunk whose logits score the next prompt token (prompt logprobs).

        Position j scores prompt token j + 1; token k's score is due once the k - 1 before it
        are recorded, so a chunk recomputed after preemption never scores a token twice.
        """
        req = self.request
        if req.prompt_logprobs is None:
            return range(0)
        start = max(req.num_computed_tokens, len(req.prompt_logprobs) - 1)
        end = min(req.num_computed_tokens + self.num_new, req.num_prompt_tokens - 1)
        return range(start, max(start, end))


@dataclass
class ScheduledBatch:
    """All work of one step, plus what the scheduler did to make room."""

    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new for item in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)
