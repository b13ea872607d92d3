"""Reasoning output (`--reasoning-parser deepseek-r1`): the text of a DeepSeek-R1-style model
before `</think>` is `reasoning_content`, the rest is `content`, as SGLang and vLLM report it.

R1's chat template opens the `<think>` block in the prompt, so an output starts inside it: all
of it is reasoning until `</think>` (an output that never closes it is all reasoning); a
leading `<think>` the model writes itself is dropped.
"""

from __future__ import annotations

PARSERS = ("deepseek-r1",)
START, END = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; None for an empty part."""
    text = text.removeprefix(START)
    reasoning, sep, content = text.partition(END)
    if not sep:
        return reasoning or None, None
    return reasoning or None, content.lstrip("\n") or None


class ReasoningStream:
    """Splits one sample's streamed deltas. A tail that could be the start of `</think>` is
    held back until the next delta shows whether it is."""

    def __init__(self):
        self._pending = ""
        self._in_reasoning = True
        self._at_start = True
        self._content_started = False  # newlines right after </think> are dropped

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """(reasoning delta, content delta) for this text delta."""
        text = self._pending + delta
        self._pending = ""
        if self._at_start:
            if START.startswith(text) and not final:
                self._pending = text  # maybe a leading <think>, not complete yet
                return "", ""
            text = text.removeprefix(START)
            self._at_start = False
        if not self._in_reasoning:
            return "", self._content(text)
        before, sep, after = text.partition(END)
        if sep:
            self._in_reasoning = False
            return before, self._content(after)
        if not final:
            for n in range(min(len(END) - 1, len(text)), 0, -1):
                if END.startswith(text[-n:]):
                    self._pending = text[-n:]
                    text = text[:-n]
                    break
        return text, ""

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        return text
