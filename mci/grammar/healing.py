"""Token healing: a prompt that ends inside what the tokenizer would merge is continued as if it
had not been cut there.

`"def f(x):\n    "` encodes as `... "):" "\n" "    "`, but in running code the tokenizer writes
`"\n   "` then `" return"`: a model trained on such text has rarely seen a bare `"\n"` token
before indented code, and continues badly. Healing backs the prompt off by its last token (and
by the whitespace-only tokens before it, so `"\n"` + `"    "` go together) and makes the output
start with the removed text, by a grammar on the same mask machinery as structured output. The
model then picks the tokenisation of that text itself (`"\n   "`, `" return"`). The removed text
is not reported: the caller's prompt already has it.

The grammar constrains only the start: `LeadingMatcher` lets every token through once the removed
text has been written.
"""

from __future__ import annotations

import torch

from mci.grammar.backend import Matcher
from mci.grammar.constraint import Constraint, ebnf_string
from mci.tokenizer import TextTokenizer

MAX_HEALED_TOKENS = 8  # a longer whitespace run is left as it is


def heal_prompt(tokenizer: TextTokenizer, ids: list[int]) -> tuple[list[int], str]:
    """(the prompt without its healed tail, the tail's text); ("" when nothing is healed: a
    prompt of one token, a tail that is a special token, or one that ends mid-character)."""
    added = set(tokenizer.backend.get_added_tokens_decoder())
    cut = len(ids) - 1
    if cut < 1 or ids[cut] in added:
        return ids, ""
    while (
        cut > 1
        and len(ids) - cut < MAX_HEALED_TOKENS
        and ids[cut - 1] not in added
        and tokenizer.decode(ids[cut - 1 : cut]).isspace()
        and tokenizer.decode(ids[cut:]).isspace()
    ):
        cut -= 1
    tail = tokenizer.decode(ids[cut:])
    if not tail or tokenizer.decode(ids[:cut]) + tail != tokenizer.decode(ids):
        return ids, ""  # the cut splits a character (or the decoder joins differently)
    return ids[:cut], tail


def healing_constraint(text: str) -> Constraint:
    """Output that starts with `text` (then anything: LeadingMatcher stops looking there)."""
    return Constraint("ebnf", f"root ::= {ebnf_string(text)} [\\0-\\U0010ffff]*")


class LeadingMatcher:
    """Constrains the output only until its grammar is complete (healing: the removed text has
    been written, possibly inside a longer token); after that every token is free. Rollback
    back into the constrained part makes it constrained again."""

    def __init__(self, inner: Matcher):
        self._inner = inner
        self._free_tokens = 0  # accepted since the release (`inner` has seen the others)

    def _released(self) -> bool:
        return self._inner.is_completed()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> bool:
        return not self._released() and self._inner.fill_mask(bitmask, row)

    def accept(self, token: int) -> bool:
        if self._released():
            self._free_tokens += 1
            return True
        return self._inner.accept(token)

    def rollback(self, num_tokens: int) -> None:
        free = min(num_tokens, self._free_tokens)
        self._free_tokens -= free
        self._inner.rollback(num_tokens - free)

    def is_terminated(self) -> bool:
        return not self._released() and self._inner.is_terminated()

    def is_completed(self) -> bool:
        return self._released()

    def find_jump_forward_string(self) -> str:
        return ""  # forcing the removed text's own tokens is what healing exists to avoid
