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
        return self.request.num_computed_tokens + self.num_new == self.request.num_tokens


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
