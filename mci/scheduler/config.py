"""The scheduler's settings: how big a step may be and in what order requests are admitted."""

from __future__ import annotations

from dataclasses import dataclass

from mci.config_fields import check_choices, option
from mci.errors import UserError


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching policy of the scheduler loop."""

    max_running_requests: int = option(256, "most requests decoding at once")
    max_prefill_tokens: int = option(8192, "most prompt tokens computed in one step")
    chunked_prefill_size: int = option(2048, "most tokens of one prompt per step; -1 disables")
    schedule_policy: str = option(
        "lpm",
        "admission order: lpm (longest cached prefix first), fcfs, or fair (tenants by their "
        "weighted service so far: the Virtual Token Counter; docs/tenancy.md)",
        ["lpm", "fcfs", "fair"],
    )
    decode_reserve_tokens: int = option(16, "KV tokens kept free per running request at admission")
    num_scheduler_steps: int = option(
        16,
        "most decode steps run in one kernel call when every running request decodes greedily "
        "and none waits (their tokens streamed together; a new command ends the call after "
        "the step in flight); 1 disables",
    )
    enable_jump_forward: bool = option(
        False,
        "structured output: append the text a grammar forces (e.g. a fixed key) without a "
        "model step per token; computed in the next step like a prompt chunk",
    )

    def __post_init__(self):
        check_choices(self)
        if self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise UserError("--max-running-requests and --max-prefill-tokens must be >= 1")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise UserError("--chunked-prefill-size must be positive, or -1 to disable")
        if self.num_scheduler_steps < 1:
            raise UserError("--num-scheduler-steps must be >= 1")
        if self.decode_reserve_tokens < 0:
            raise UserError("--decode-reserve-tokens must be >= 0")

    @property
    def chunk_limit(self) -> int | None:
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size
