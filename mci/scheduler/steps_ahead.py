"""How many decode steps one engine step may run (vLLM's multi-step scheduling).

A lone stream's step spent ~0.2 ms of ~1.4 in Python (scheduling, metadata, sampling, the
output side) and the hand-off to the front end (measured on `small`, a 2-core EPYC); a step
that runs several decode steps in one kernel call pays them once. The tokens are the same:
each step is the same kernel call on the same inputs, its greedy token the next input.

Where it may: every item of the step decodes one known token of a request past its first
token (a first token, the TTFT, waits for nothing) that decodes greedily as it is
(`Request.greedy_as_is`); in a batch of several, none may end on a stop string, which the
kernel call cannot see (it would go on computing that row, and in a batch a row's values may
depend on how many rows share the step). Up to the fewest tokens any item has left, and to
the slots the pool has free for every item (never evicting or preempting for them).
"""

from __future__ import annotations

from mci.core.batch import ScheduledItem


def steps_ahead(items: list[ScheduledItem], most: int, free_slots: int) -> int:
    """The decode steps a step of `items` may run in one call (1: one step, as always), at
    most `most`, with `free_slots` free for the slots of the steps past the first."""
    if not items or most <= 1:
        return 1
    steps = most
    for item in items:
        req = item.request
        if item.num_new != 1 or not item.sample or not req.output_ids:
            return 1  # a prompt chunk, or a first token
        if not req.greedy_as_is or (len(items) > 1 and req.params.stop):
            return 1
        steps = min(steps, req.params.max_new_tokens - len(req.output_ids))
    return max(1, min(steps, 1 + free_slots // len(items)))
