"""The two halves of the runner seam: the scheduler's plan for one step (plain Python) and
what the runner hands back (sampled tokens, logprobs).

    Scheduler.schedule() -> ScheduledBatch -> ModelRunner.execute() -> SampleResult
                                   └──────────── Scheduler.update(batch, result) ┘

Everything the runner needs to know about an item (where its chunk starts, whether it
samples, which prompt positions it scores) is fixed when the item is planned, so the batch
means the same thing before and after the request's accounting moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mci.core.request import Request


@dataclass(frozen=True)
class ScheduledItem:
    """Compute positions `start .. start + num_new - 1` of `request` this step.

    `sample`: they include all its remaining known tokens and it wants output, so the step
    yields its next token. `scored_positions`: positions of the chunk whose logits score the
    next prompt token (prompt logprobs). `draft_ids`: speculative tokens after the known ones
    (the last `len(draft_ids)` of the `num_new` positions); the step verifies them and yields
    the accepted ones plus one more.
    """

    request: Request
    num_new: int
    start: int
    sample: bool
    scored_positions: range
    draft_ids: tuple[int, ...] = ()

    @classmethod
    def plan(cls, request: Request, num_new: int, draft_ids=()) -> ScheduledItem:
        """The item for `num_new` more tokens of `request` (`draft_ids` among them, at the
        end), read from its state right now."""
        start = request.num_computed_tokens
        known = num_new - len(draft_ids)
        sample = start + known == request.num_tokens and request.params.max_new_tokens > 0
        if draft_ids and not sample:
            raise ValueError("drafts follow the last known token of a sampling request")
        scored = _scored_positions(request, start, known)
        return cls(request, num_new, start, sample, scored, tuple(draft_ids))


def _scored_positions(request: Request, start: int, num_new: int) -> range:
    """Position j scores prompt token j + 1; token k's score is due once the k - 1 before it
    are recorded, so a chunk recomputed after preemption never scores a token twice."""
    if request.prompt_logprobs is None:
        return range(0)
    first = max(start, len(request.prompt_logprobs) - 1)
    end = min(start + num_new, request.num_prompt_tokens - 1)
    return range(first, max(first, end))


@dataclass
class ScheduledBatch:
    """All work of one step, in the order the runner lays out its tokens.

    `decode_steps` > 1: the step may run up to that many decode steps, each one's greedy
    tokens the next one's input (Scheduler._plan_ahead); every item then decodes one known
    token of a `Request.greedy_as_is` request and has slots for `decode_steps` positions from
    its start. The runner may run fewer steps (down to one); it returns a token per item per
    step run."""

    items: list[ScheduledItem] = field(default_factory=list)
    decode_steps: int = 1

    @property
    def sampling_items(self) -> list[ScheduledItem]:
        return [item for item in self.items if item.sample]

    @property
    def scoring_items(self) -> list[ScheduledItem]:
        return [item for item in self.items if item.scored_positions]

    def drop(self, request: Request) -> None:
        """Remove the request's item (it was preempted while the batch was being built)."""
        self.items = [item for item in self.items if item.request is not request]

    def __bool__(self) -> bool:
        return bool(self.items)


# (logprob of the chosen token, [(token id, logprob), ...] best alternatives)
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class SampleResult:
    """What one step produced, one entry per sampling item in batch order:

    * `token_ids[i]`: its new tokens, in order: the accepted drafts, then one sampled token
      (just that one without drafts);
    * `logprobs[i]`: one entry per new token, each None unless the request asked for them;
    * `num_accepted[i]`: how many of its drafts were accepted (0 without drafts);
    * `draft_ids[i]`: tokens proposed to follow the new ones, for the next step to verify.

    `prompt_logprobs`: one list per scoring item, in batch order, an entry per position of its
    `scored_positions`."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]
    prompt_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    draft_ids: list[list[int]] = field(default_factory=list)
