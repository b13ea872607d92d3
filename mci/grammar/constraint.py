"""What a request's output must match: a JSON Schema, any JSON, a regex, an EBNF grammar or one of
a list of strings. Plain, frozen and hashable: it travels with SamplingParams (through the
engine pipe) and keys the compile cache."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_schema", "regex", "ebnf", "choice")


@dataclass(frozen=True)
class Constraint:
    """`kind` one of KINDS; `spec`: the schema as JSON text (json_schema), the regex, the EBNF
    grammar (root rule `root`), the choices as a JSON list of strings, or "" (json: any JSON
    object)."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}")

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls("choice", json.dumps(list(options)))

    @property
    def options(self) -> list[str]:
        return json.loads(self.spec)
