"""Tool calling on chat completions: `tools` with `tool_choice` none, auto, required or a named
function, answered as OpenAI `tool_calls` with finish_reason "tool_calls".

The model writes calls in its format (server/tool_formats.py: DeepSeek-V3's native markup, or a
JSON envelope for models without one). With `required` or a named function the call is
grammar-constrained (the function's parameter schema for its arguments), so it always parses
and validates; with `auto` the model may answer in text, and calls are parsed from its output.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from mci.errors import InvalidParameter
from mci.grammar.constraint import Constraint
from mci.server.tool_formats import DeepSeekV3Markup, Function, JsonEnvelope

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its output: `mode` auto | required | named, the
    declared names, the format calls are written in, and the constraint (None for auto)."""

    mode: str
    names: tuple[str, ...]
    format: JsonEnvelope | DeepSeekV3Markup
    constraint: Constraint | None


def plan_tools(tools, tool_choice, fmt: JsonEnvelope | DeepSeekV3Markup) -> ToolPlan | None:
    """None when no tool can be called (no tools, or tool_choice "none")."""
    if not tools or tool_choice == "none":
        return None
    functions = [
        Function(t.function.name, t.function.parameters or {"type": "object"}) for t in tools
    ]
    names = tuple(f.name for f in functions)
    for i, name in enumerate(names):
        if not NAME.fullmatch(name):  # formats delimit names: a newline would break parsing
            raise InvalidParameter(
                f"tools[{i}].function.name must match {NAME.pattern} (OpenAI's rule)", "tools"
            )
    if len(set(names)) < len(names):
        raise InvalidParameter("tools declares a function name twice", "tools")
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", names, fmt, None)
    if tool_choice == "required":
        return ToolPlan("required", names, fmt, fmt.constraint(functions))
    name = _named(tool_choice)
    chosen = [f for f in functions if f.name == name]
    if not chosen:
        raise InvalidParameter(
            f"tool_choice names '{name}', which is not in 'tools'", "tool_choice"
        )
    return ToolPlan("named", (name,), fmt, fmt.constraint(chosen[:1]))


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


def parse_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool calls) of a finished output; no calls when it is plain text."""
    content, calls = plan.format.parse(text, plan.names)
    return content, [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]
