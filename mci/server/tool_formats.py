"""How a model writes a tool call: the wire formats mci reads (auto) and constrains (required or
a named function).

- `deepseekv3`, DeepSeek-V3's native markup (the format of SGLang's `deepseekv3` parser):
  `<｜tool▁calls▁begin｜>` then, per call, `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`,
  the arguments as a ```json fenced block, `<｜tool▁call▁end｜>`; then `<｜tool▁calls▁end｜>`.
  Text before the markup is the message's content.
- `json`, for models without such markup (the bundled model): the whole output is one
  `{"name": ..., "arguments": {...}}` envelope.

A constrained call is exactly one call (under either format) whose arguments the function's
parameter schema accepts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mci.grammar.constraint import Constraint


@dataclass(frozen=True)
class Function:
    """A declared tool: its name and its parameters' JSON Schema."""

    name: str
    parameters: dict


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


class JsonEnvelope:
    name = "json"

    def constraint(self, functions: list[Function]) -> Constraint:
        envelopes = [_envelope(f) for f in functions]
        schema = envelopes[0] if len(envelopes) == 1 else {"anyOf": envelopes}
        return Constraint("json_schema", json.dumps(schema))

    def parse(self, text: str, names: tuple[str, ...]) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls): an output that is an envelope for a declared tool is one call;
        anything else is content."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(value, dict) or value.get("name") not in names:
            return text, []
        if not isinstance(value.get("arguments"), dict):
            return text, []
        return None, [ParsedCall(value["name"], json.dumps(value["arguments"]))]


class DeepSeekV3Markup:
    name = "deepseekv3"
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    _CALL = re.compile(
        re.escape(CALL_BEGIN)
        + r"function"
        + re.escape(SEP)
        + r"(?P<name>[^\n]*)\n```json\n(?P<args>.*?)\n```"
        + re.escape(CALL_END),
        re.S,
    )

    def constraint(self, functions: list[Function]) -> Constraint:
        return Constraint.tagged_json(
            [
                (
                    f"{self.CALLS_BEGIN}{self.CALL_BEGIN}function{self.SEP}{f.name}\n```json\n",
                    f.parameters,
                    f"\n```{self.CALL_END}{self.CALLS_END}",
                )
                for f in functions
            ]
        )

    def parse(self, text: str, names: tuple[str, ...]) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls): the calls of well-formed markup naming declared tools with object
        arguments, the text before it as content; output with no or broken markup is all
        content (nothing the model wrote is dropped)."""
        content, begin, rest = text.partition(self.CALLS_BEGIN)
        if not begin:
            return text, []
        body, end, tail = rest.partition(self.CALLS_END)
        if not end or tail.strip():
            return text, []
        calls, position = [], 0
        for match in self._CALL.finditer(body):
            if body[position : match.start()].strip():
                return text, []
            position = match.end()
            try:
                arguments = json.loads(match["args"])
            except json.JSONDecodeError:
                return text, []
            if match["name"] not in names or not isinstance(arguments, dict):
                return text, []
            calls.append(ParsedCall(match["name"], json.dumps(arguments)))
        if not calls or body[position:].strip():
            return text, []
        return content or None, calls


FORMATS = {f.name: f for f in (DeepSeekV3Markup(), JsonEnvelope())}


def tool_format_for(vocab: dict[str, int], name: str | None) -> JsonEnvelope | DeepSeekV3Markup:
    """The format named by --tool-call-parser, else the native markup when the tokenizer has
    its tokens, else the JSON envelope."""
    if name is not None:
        return FORMATS[name]
    if DeepSeekV3Markup.CALLS_BEGIN in vocab:
        return FORMATS["deepseekv3"]
    return FORMATS["json"]


def _envelope(function: Function) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"enum": [function.name]}, "arguments": function.parameters},
        "required": ["name", "arguments"],
    }
