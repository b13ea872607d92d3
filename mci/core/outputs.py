"""What the engine reports about a request after a step."""

from __future__ import annotations

from dataclasses import dataclass, field

# errors the engine ends a request with on its own (the server maps them to HTTP statuses)
REQUEST_TIMEOUT = "request timed out"  # its timeout passed (504)
QUEUE_TIMEOUT = "request waited too long in the queue"  # --max-queue-time, not started (503)


@dataclass
class RequestOutput:
    """A request's progress: the new tokens/text of this step and the totals so far."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    cached_tokens_details: dict | None = None  # by cache tier (with --enable-hierarchical-cache)
    logprobs: list = field(default_factory=list)  # at the end, all: (logprob, [(id, lp), ...])
    new_logprobs: list = field(default_factory=list)  # this step's tokens' logprobs
    # per prompt position (None first), when asked: with the first output that has tokens
    # and with the final one
    prompt_logprobs: list | None = None
    queue_time_s: float | None = None  # arrival -> first scheduled
    error: str | None = None  # set when the engine failed the request

    @classmethod
    def aborted(cls, request_id: str, error: str) -> RequestOutput:
        """The final output of a request that ended without the engine finishing it (engine
        shut down or died, request rejected)."""
        return cls(request_id, [], "", finished=True, finish_reason="abort", error=error)
