"""Incremental detokenisation: text deltas that are right even when a character's UTF-8 bytes
are split across tokens.

Byte-level BPE tokens can end in the middle of a multi-byte character. Decoding a token alone
then gives U+FFFD; we hold such tokens back until the character completes:

    tokens:  [ ... | prefix_offset ... read_offset | new ... ]
    text of tokens[prefix_offset:] minus text of tokens[prefix_offset:read_offset] = delta

(The same scheme as vLLM's and HF's TextStreamer, re-derived.)
"""

from __future__ import annotations

from mci.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feeds output token ids, returns newly completed text."""

    def __init__(
        self, tokenizer: TextTokenizer, skip_special_tokens: bool = True, hidden_prefix: int = 0
    ):
        """`hidden_prefix`: characters at the start of the text that are not reported (token
        healing's backed-off prompt text, which the output is constrained to start with)."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._hidden = hidden_prefix
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _reported(self, text: str) -> str:
        hidden = min(self._hidden, len(text))
        self._hidden -= hidden
        return text[hidden:]

    def step(self, new_ids: list[int]) -> str:
        """Append tokens; return the text they complete (may be empty)."""
        self._ids.extend(new_ids)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return self._reported(full[len(prefix) :])
        return ""

    def flush(self) -> str:
        """At the end: whatever is held back, incomplete characters included."""
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._reported(full[len(prefix) :])
