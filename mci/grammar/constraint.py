"""What a request's output must match: a JSON Schema, any JSON, a regex, an EBNF grammar, one of
a list of strings, or JSON framed by fixed text (a tool call in a model's native markup). Plain,
frozen and hashable: it travels with SamplingParams (through the engine pipe) and keys the compile
cache."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_schema", "regex", "ebnf", "choice", "tagged_json")


@dataclass(frozen=True)
class Constraint:
    """`kind` one of KINDS; `spec`: the schema as JSON text (json_schema), the regex, the EBNF
    grammar (root rule `root`), the choices as a JSON list of strings, "" (json: any JSON
    object), or for tagged_json a JSON list of [begin, schema, end] alternatives: the output is
    one alternative's begin text, a JSON value its schema accepts, and its end text."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}")

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def tagged_json(cls, alternatives: list[tuple[str, dict, str]]) -> Constraint:
        return cls("tagged_json", json.dumps([list(a) for a in alternatives]))

    @property
    def options(self) -> list:
        """choice: the strings; tagged_json: the [begin, schema, end] alternatives."""
        return json.loads(self.spec)


def ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal: JSON's escapes, with non-ASCII characters written as
    themselves (JSON would write U+1F642 as the pair \\ud83d\\ude42, which the grammar reads
    as two lone surrogates that no valid UTF-8 output can match)."""
    return json.dumps(text, ensure_ascii=False)
