"""Tool calling on chat completions: `tools` with `tool_choice` none, auto, required or a named
function, answered as OpenAI `tool_calls` with finish_reason "tool_calls".

The model calls a tool by writing a JSON envelope, `{"name": ..., "arguments": {...}}`. With
`required` or a named function the envelope is grammar-constrained (the function's parameter
schema for `arguments`), so the call always parses and validates; with `auto` the model may
answer in text, and an output that is such an envelope for a declared tool becomes a call.
(DeepSeek-V3's native `<｜tool▁calls▁begin｜>` markup is not parsed yet: the bundled model's
template has none.)
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from mci.errors import InvalidParameter
from mci.grammar.constraint import Constraint


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its output: `mode` auto | required | named, the
    declared names, and the constraint to apply (None for auto)."""

    mode: str
    names: tuple[str, ...]
    constraint: Constraint | None


def plan_tools(tools, tool_choice) -> ToolPlan | None:
    """None when no tool can be called (no tools, or tool_choice "none")."""
    if not tools or tool_choice == "none":
        return None
    names = tuple(t.function.name for t in tools)
    envelopes = {t.function.name: _envelope(t.function) for t in tools}
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", names, None)
    if tool_choice == "required":
        schema = (
            next(iter(envelopes.values()))
            if len(names) == 1
            else {"anyOf": list(envelopes.values())}
        )
        return ToolPlan("required", names, Constraint("json_schema", json.dumps(schema)))
    name = _named(tool_choice)
    if name not in envelopes:
        raise InvalidParameter(
            f"tool_choice names '{name}', which is not in 'tools'", "tool_choice"
        )
    return ToolPlan("named", (name,), Constraint("json_schema", json.dumps(envelopes[name])))


def _named(choice) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        choice.get("type") != "function"
        or not isinstance(function, dict)
        or not function.get("name")
    ):
        raise InvalidParameter(
            "tool_choice must be none, auto, required or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return function["name"]


def _envelope(function) -> dict:
    params = function.parameters or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"enum": [function.name]}, "arguments": params},
        "required": ["name", "arguments"],
    }


def parse_call(text: str, plan: ToolPlan) -> dict | None:
    """The OpenAI tool call an output is, or None when it is plain text (auto only)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in plan.names:
        return None
    if not isinstance(value.get("arguments"), dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])},
    }
