"""Verification of drafted tokens: which of them the target model would have produced itself.

The runner samples the target's token at every drafted position in one call, position j as if
drafts 0 .. j-1 had been accepted (`SampleRow.assumed`), with the random stream of that output
position (`Request.generator_for_output`). Draft j is accepted while every earlier one was and
the target's token there equals it; the first differing target token, or the one after the
last draft, ends the step's tokens.

This is exactly lossless. Each position's token is the function of (the logits there, the
request's sampling state, the noise of that output position) that non-speculative decoding
computes, and the logits at position j are the ones it would see as long as the drafts before
j matched; so with the same seed the tokens are the very ones decoding one at a time yields,
greedy or sampled. For a random draw this is speculative rejection sampling (Leviathan et al.,
Chen et al.) with a deterministic draft q = one-hot(d): it accepts d with probability
min(1, p(d) / q(d)) = p(d), and on rejection the token comes from p with d excluded,
renormalised — the residual max(p - q, 0) — exactly as the coupled draw here does.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_length(drafts: Sequence[int], target: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens; `target` has one more entry than
    `drafts` (the token after the last draft)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return accepted
