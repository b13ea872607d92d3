"""The grammar seam: compile a `Constraint` to something that yields token masks, and follow one
request's output through it. xgrammar implements it (xgrammar_backend.py); llguidance or
outlines could, behind the same two protocols.

Invariant kept by the engine: a request's matcher has accepted exactly the request's output
tokens (plus, inside one sampling call, the drafts being verified, rolled back before it
returns).
"""

from __future__ import annotations

from typing import Protocol

import torch

from mci.grammar.constraint import Constraint


class Matcher(Protocol):
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the tokens allowed next into row `row` of a `new_bitmask` tensor; False when
        every token is allowed (the row needs no masking)."""

    def accept(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its end (a stop token)."""

    def is_completed(self) -> bool:
        """The output so far is a complete match (only a stop token may follow)."""

    def find_jump_forward_string(self) -> str:
        """The longest text every continuation allowed from here starts with ("" if none)."""


class GrammarBackend(Protocol):
    def compile(self, constraint: Constraint) -> object:
        """The compiled form (cached by the caller); raises InvalidParameter when the
        constraint is malformed or unsupported."""

    def matcher(self, compiled: object) -> Matcher:
        """A fresh matcher at the start of the grammar; it can roll back at least as many
        tokens as a request drafts in one step (--speculative-num-steps, at most 16)."""

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """An empty mask for `rows` rows."""

    def fill_all_but(self, bitmask: torch.Tensor, row: int, tokens: tuple[int, ...]) -> None:
        """Allow every token in row `row` except `tokens`."""

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the disallowed tokens of each logits[r], r in `rows`, to -inf (bitmask row r;
        bitmask has a row per logits row)."""
