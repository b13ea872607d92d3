"""Keep UTF-16 surrogates (U+D800..U+DFFF) out of every character class of an xgrammar grammar.

Why: xgrammar 0.2.9 decodes the bytes ED A0..BF xx as a code point in the surrogate range and lets
a class such as `[^"\\]` (or a regex `.`, printed `[\\0-\\U0010ffff]`) match it. Those bytes are
not UTF-8. A byte-level tokenizer spells them from single-byte tokens (0xED, 0xBB, 0xAD), the
detokenised text then holds three U+FFFD where the grammar counted one character, and a string
with maxLength 2 came out four characters long. Every other invalid sequence (overlong forms,
bytes past U+10FFFF, stray continuation bytes) xgrammar already refuses.

The input is a grammar as xgrammar prints it (`str(xg.Grammar)`): string literals in double
quotes, character classes in brackets with xgrammar's escapes (`\\n`, `\\xHH`, `\\uHHHH`,
`\\UHHHHHHHH`, `\\]`, ...). Literals are left alone; a negated class gets the surrogate range added
to its exclusions; a positive class whose ranges reach into it is rewritten without it.
"""

from __future__ import annotations

import re

SURROGATE_LO, SURROGATE_HI = 0xD800, 0xDFFF
# a string literal or a character class, each with backslash escapes
_LITERAL_OR_CLASS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]', re.S)
_NAMED_ESCAPES = {
    "0": "\0",
    "a": "\a",
    "b": "\b",
    "t": "\t",
    "n": "\n",
    "v": "\v",
    "f": "\f",
    "r": "\r",
    "e": "\x1b",
}
_HEX_ESCAPE_DIGITS = {"x": 2, "u": 4, "U": 8}


def exclude_surrogates(grammar: str) -> str:
    return _LITERAL_OR_CLASS.sub(_rewrite, grammar)


def _rewrite(match: re.Match) -> str:
    text = match.group(0)
    if text.startswith('"'):
        return text
    if text.startswith("[^"):
        return text[:-1] + r"\uD800-\uDFFF]"
    ranges = _class_ranges(text[1:-1])
    if not any(lo <= SURROGATE_HI and hi >= SURROGATE_LO for lo, hi in ranges):
        return text
    kept = []
    for lo, hi in ranges:
        if lo < SURROGATE_LO:
            kept.append((lo, min(hi, SURROGATE_LO - 1)))
        if hi > SURROGATE_HI:
            kept.append((max(lo, SURROGATE_HI + 1), hi))
    if not kept:  # only surrogates: a class nothing valid can match
        raise ValueError("a character class matches only UTF-16 surrogates, which are not UTF-8")
    return "[" + "".join(rf"\U{lo:08x}-\U{hi:08x}" for lo, hi in kept) + "]"


def _class_ranges(body: str) -> list[tuple[int, int]]:
    """The code point ranges of a positive class body: items, and `a-b` between two items."""
    items: list[int | None] = []  # None stands for an unescaped '-'
    i = 0
    while i < len(body):
        char = body[i]
        if char == "-":
            items.append(None)
            i += 1
        elif char != "\\":
            items.append(ord(char))
            i += 1
        elif body[i + 1] in _HEX_ESCAPE_DIGITS:
            digits = _HEX_ESCAPE_DIGITS[body[i + 1]]
            items.append(int(body[i + 2 : i + 2 + digits], 16))
            i += 2 + digits
        elif body[i + 1] in _NAMED_ESCAPES:
            items.append(ord(_NAMED_ESCAPES[body[i + 1]]))
            i += 2
        elif body[i + 1].isalnum():  # an escape this reader does not know: never guess
            raise ValueError(f"unknown escape \\{body[i + 1]} in a character class")
        else:  # \], \-, \\, \" ...: the character itself
            items.append(ord(body[i + 1]))
            i += 2
    ranges = []
    k = 0
    while k < len(items):
        lo = items[k]
        if (
            lo is not None
            and k + 2 < len(items)
            and items[k + 1] is None
            and items[k + 2] is not None
        ):
            ranges.append((lo, items[k + 2]))
            k += 3
        else:  # a lone '-' at either end is the character itself
            point = ord("-") if lo is None else lo
            ranges.append((point, point))
            k += 1
    return ranges
