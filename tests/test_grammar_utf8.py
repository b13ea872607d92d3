"""Grammars never admit UTF-16 surrogates: bytes ED A0..BF xx are not UTF-8, yet xgrammar 0.2.9
lets a negated class or a regex `.` match them (found by the generated-schema test: a string
with maxLength 2 came out as ',' plus three U+FFFD)."""

from __future__ import annotations

import json

import pytest

from mci.grammar.constraint import Constraint
from mci.grammar.utf8_classes import _class_ranges, exclude_surrogates
from mci.grammar.xgrammar_backend import XGrammarBackend
from mci.tokenizer import TextTokenizer


def test_class_ranges_read_xgrammars_escapes():
    assert _class_ranges(r"a\-\]\\\t\0\x7f\u00e9\U0001f600-\U0010ffff") == [
        (ord("a"), ord("a")),
        (ord("-"), ord("-")),
        (ord("]"), ord("]")),
        (ord("\\"), ord("\\")),
        (9, 9),
        (0, 0),
        (0x7F, 0x7F),
        (0xE9, 0xE9),
        (0x1F600, 0x10FFFF),
    ]
    assert _class_ranges("-a-") == [(ord("-"),) * 2, (ord("a"),) * 2, (ord("-"),) * 2]


def test_rewrite_touches_classes_only():
    grammar = r'root ::= (("[^x]" [^\"\\] [\0-\U0010ffff] [a-z]))'
    assert exclude_surrogates(grammar) == (
        r'root ::= (("[^x]" [^\"\\\uD800-\uDFFF] [\U00000000-\U0000d7ff\U0000e000-\U0010ffff]'
        r" [a-z]))"
    )
    with pytest.raises(ValueError, match="surrogates"):
        exclude_surrogates(r"root ::= [\ud800-\udfff]")


@pytest.fixture(scope="module")
def backend(checkpoint):
    tok = TextTokenizer.load(checkpoint())
    return XGrammarBackend(tok, 2048, (1,)), tok


def _byte_token(tok, byte: int) -> int:
    """The byte-level BPE token of one raw byte (GPT-2's byte-to-unicode table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + extra.index(byte))
    token = tok.backend.token_to_id(char)
    assert token is not None
    return token


@pytest.mark.parametrize(
    "constraint, prefix",
    [
        (Constraint("json_schema", json.dumps({"type": "string", "maxLength": 2})), b'"'),
        (Constraint("json_schema", json.dumps({"type": "string"})), b'"'),
        (Constraint("json"), b'["'),
        (Constraint("regex", "a.b"), b"a"),
        (Constraint("ebnf", r'root ::= "a" [^x] "b"'), b"a"),
    ],
)
def test_surrogate_bytes_are_refused_valid_utf8_is_not(backend, constraint, prefix):
    xgb, tok = backend
    compiled = xgb.compile(constraint)

    def accepts(data: bytes) -> bool:
        matcher = xgb.matcher(compiled)
        return all(matcher.accept(_byte_token(tok, b)) for b in prefix + data)

    assert not accepts(b"\xed\xbb\xad")  # U+DEED, a surrogate
    assert not accepts(b"\xed\xa0\x80")  # U+D800
    for char in ("é", "\ud7ff", "\ue000", "😀"):
        assert accepts(char.encode()), char


def test_every_escape_xgrammar_prints_reads_back():
    """xgrammar writes U+0007 as \\a and U+001B as \\e; an unknown letter escape is an error,
    never a guess."""
    import xgrammar as xg

    for code in range(0x80):
        printed = str(xg.Grammar.from_ebnf(f"root ::= [\\x{code:02x}-\\U0010ffff]")).strip()
        body = printed[printed.index("[") + 1 : printed.rindex("]")]
        assert _class_ranges(body)[0][0] == code, printed
    with pytest.raises(ValueError, match="unknown escape"):
        _class_ranges(r"\q")


def test_non_ascii_literals_match(backend):
    """A literal above U+FFFF is written as itself (a JSON \\u pair would read as two lone
    surrogates): choices, tagged JSON and healing all match it."""
    from mci.grammar.healing import healing_constraint

    xgb, tok = backend
    for constraint, text in (
        (Constraint.choice(["🙂 ok", "no"]), "🙂 ok"),
        (Constraint.tagged_json([("<🙂>", {"type": "integer"}, "</🙂>")]), "<🙂>7</🙂>"),
        (healing_constraint("🙂 "), "🙂 hi"),
    ):
        matcher = xgb.matcher(xgb.compile(constraint))
        assert all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False)), text
