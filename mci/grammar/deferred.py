"""A grammar that starts after a given token: a reasoning model's output is constrained only
once it has closed its thinking (`</think>`); what it thinks is free.

Before the start token every token but the stop tokens is allowed and none advances the grammar
(an output may not end before its constrained part: it would end unconstrained); the start
token itself is the last free one. The wrapper keeps the backend's invariant (it has accepted
exactly the request's output tokens) and rolls back across the start, so speculative drafts
that cross it verify like any others.
"""

from __future__ import annotations

import torch

from mci.grammar.backend import GrammarBackend, Matcher


class DeferredMatcher:
    def __init__(
        self,
        inner: Matcher,
        backend: GrammarBackend,
        start_token: int,
        stop_tokens: tuple[int, ...],
    ):
        self._inner = inner
        self._backend = backend
        self._start_token = start_token
        self._stop_tokens = stop_tokens
        self._started = False
        self._inner_tokens = 0  # accepted since the start (what `inner` has seen)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> bool:
        if self._started:
            return self._inner.fill_mask(bitmask, row)
        self._backend.fill_all_but(bitmask, row, self._stop_tokens)
        return True

    def accept(self, token: int) -> bool:
        if not self._started:
            self._started = token == self._start_token
            return True
        if not self._inner.accept(token):
            return False
        self._inner_tokens += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        inner = min(num_tokens, self._inner_tokens)
        self._inner.rollback(inner)
        self._inner_tokens -= inner
        if num_tokens > inner:  # back past the start token, the last free one
            self._started = False

    def is_terminated(self) -> bool:
        return self._started and self._inner.is_terminated()

    def is_completed(self) -> bool:
        return self._started and self._inner.is_completed()

    def find_jump_forward_string(self) -> str:
        return self._inner.find_jump_forward_string() if self._started else ""
