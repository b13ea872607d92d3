"""Tool calling: the two call formats (DeepSeek-V3's native markup, the JSON envelope) parsed and
constrained, and `tools` / `tool_choice` end to end through `mci serve` and the official client."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mci.grammar.cache import xgrammar_cache
from mci.server.tool_formats import (
    DeepSeekV3Markup,
    Function,
    JsonEnvelope,
    ParsedCall,
    tool_format_for,
)
from mci.tokenizer import TextTokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
NAMES = ("get_weather", "add")
M = DeepSeekV3Markup


def _native(*calls: tuple[str, str]) -> str:
    body = "".join(
        f"{M.CALL_BEGIN}function{M.SEP}{name}\n```json\n{args}\n```{M.CALL_END}"
        for name, args in calls
    )
    return f"{M.CALLS_BEGIN}{body}{M.CALLS_END}"


def test_native_markup_parses_calls_and_content():
    text = "Let me look." + _native(("get_weather", '{"city": "Oslo", "unit": "celsius"}'))
    assert M().parse(text, NAMES) == (
        "Let me look.",
        [ParsedCall("get_weather", '{"city": "Oslo", "unit": "celsius"}')],
    )
    two = _native(("add", '{"a": 1, "b": 2}'), ("add", '{"a":3,"b":4}'))
    assert M().parse(two, NAMES) == (
        None,
        [ParsedCall("add", '{"a": 1, "b": 2}'), ParsedCall("add", '{"a": 3, "b": 4}')],
    )
    broken = [
        _native(("nope", "{}")),  # undeclared
        _native(("add", "[1, 2]")),  # not an object
        _native(("add", '{"a": ')),  # not JSON
        _native(("add", "{}"))[: -len(M.CALLS_END)],  # unterminated
        _native(("add", "{}")) + " and more",
        "plain text",
    ]
    for text in broken:
        assert M().parse(text, NAMES) == (text, []), text


def test_json_envelope_parses_one_call():
    env = JsonEnvelope()
    assert env.parse('{"name": "add", "arguments": {"a": 1, "b": 2}}', NAMES) == (
        None,
        [ParsedCall("add", '{"a": 1, "b": 2}')],
    )
    for text in ('{"name": "nope", "arguments": {}}', '{"name": "add"}', "hi"):
        assert env.parse(text, NAMES) == (text, [])


@pytest.mark.parametrize("fmt", [DeepSeekV3Markup(), JsonEnvelope()], ids=lambda f: f.name)
def test_constrained_calls_parse_for_every_declared_function(checkpoint, fmt):
    """The constraint of a format admits exactly its own calls: text the format writes for a
    valid call is accepted token by token and parses back to that call."""
    tok = TextTokenizer.load(checkpoint(markup=True))
    cache = xgrammar_cache(tok, 2048, (1,))
    backend = cache.backend
    functions = [Function("get_weather", WEATHER), Function("add", ADD)]
    compiled = cache.compile_now(fmt.constraint(functions))
    args = {"get_weather": {"city": "Oslo", "unit": "celsius"}, "add": {"a": 1, "b": -2}}
    for name, value in args.items():
        if isinstance(fmt, DeepSeekV3Markup):
            text = _native((name, json.dumps(value)))
        else:
            text = json.dumps({"name": name, "arguments": value})
        matcher = backend.matcher(compiled)
        assert all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False))
        assert matcher.is_completed()
        assert fmt.parse(text, NAMES) == (None, [ParsedCall(name, json.dumps(value))])
    matcher = backend.matcher(compiled)
    bad = _native(("add", '{"a": "x", "b": 1}'))
    if isinstance(fmt, JsonEnvelope):
        bad = '{"name": "add", "arguments": {"a": "x", "b": 1}}'
    assert not all(matcher.accept(t) for t in tok.encode(bad, add_special_tokens=False))


def test_format_follows_the_tokenizer_unless_named(checkpoint):
    for markup, expected in ((True, DeepSeekV3Markup), (False, JsonEnvelope)):
        vocab = TextTokenizer.load(checkpoint(markup=markup)).backend.get_vocab()
        assert isinstance(tool_format_for(vocab, None), expected)
        assert isinstance(tool_format_for(vocab, "json"), JsonEnvelope)


def test_markup_template_renders_calls_and_results(checkpoint):
    tok = TextTokenizer.load(checkpoint(markup=True))
    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    text = tok.apply_chat_template(msgs, tools=TOOLS)
    assert _native(("add", "{}")) in text and '"get_weather"' in text
    assert "<｜tool▁output▁begin｜>3<｜tool▁output▁end｜>" in text
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.backend.token_to_id(M.CALLS_BEGIN) in ids  # one token, as DeepSeek's
    assert M.CALLS_BEGIN in tok.decode(ids)  # not special: stays in the text


@pytest.mark.parametrize("markup", [False, True], ids=["json-envelope", "deepseekv3-markup"])
def test_served_tool_calls(checkpoint, markup):
    """tool_choice required and named: the call always parses and validates against the
    function's parameters, streamed or not (finish_reason tool_calls); none and auto answer; a
    conversation carrying a call and its result renders. The markup checkpoint has DeepSeek-V3's
    tool tokens and template, so its calls are written (and constrained) in the native markup."""
    import openai
    from server_helpers import LiveServer

    schemas = {"get_weather": WEATHER, "add": ADD}
    path = checkpoint(markup=markup)
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    with LiveServer(path, "--served-model-name", "m") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        named = {"type": "function", "function": {"name": "get_weather"}}
        for seed, choice in enumerate(["required", named, "required"]):
            out = client.chat.completions.create(
                model="m",
                messages=msgs,
                tools=TOOLS,
                tool_choice=choice,
                max_tokens=400,  # a random model may spell the markup byte by byte
                seed=seed,
            ).choices[0]
            assert out.finish_reason == "tool_calls", out
            (call,) = out.message.tool_calls
            assert call.type == "function" and call.id
            if choice is named:
                assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        chunks = list(
            client.chat.completions.create(
                model="m",
                messages=msgs,
                tools=TOOLS,
                tool_choice=named,
                max_tokens=400,  # a random model may spell the markup byte by byte
                stream=True,
                seed=7,
            )
        )
        calls = [
            tc
            for c in chunks
            if c.choices and c.choices[0].delta.tool_calls
            for tc in c.choices[0].delta.tool_calls
        ]
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        cut = client.chat.completions.create(
            model="m", messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=6, seed=3
        ).choices[0]
        assert cut.finish_reason == "length"  # the raw text, in this checkpoint's format
        start = f"{M.CALLS_BEGIN}{M.CALL_BEGIN}function{M.SEP}" if markup else '{"'
        text = cut.message.content.rstrip("\ufffd")
        assert text.startswith(start) or start.startswith(text), text
        history = msgs + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "content": "sunny", "tool_call_id": call.id},
        ]
        for choice in ("none", "auto"):
            out = client.chat.completions.create(
                model="m", messages=history, tools=TOOLS, tool_choice=choice, max_tokens=8, seed=1
            ).choices[0]
            assert out.finish_reason in ("length", "stop", "tool_calls")
            assert out.message.content is not None or out.message.tool_calls
        with pytest.raises(openai.BadRequestError, match="tool_call_id"):
            client.chat.completions.create(
                model="m", messages=msgs + [{"role": "tool", "content": "x"}], max_tokens=1
            )
        state = server.wait_idle()
    assert state["free_slots"] + state["tree_tokens"] == state["num_slots"]


def test_tool_names_follow_openais_rule():
    from mci.errors import InvalidParameter
    from mci.server.openai_types import Tool
    from mci.server.tool_calls import plan_tools

    def tools(*names):
        return [Tool(type="function", function={"name": n}) for n in names]

    assert plan_tools(tools("get_weather", "add-2"), "auto", JsonEnvelope()).names == (
        "get_weather",
        "add-2",
    )
    for bad in (tools("two\nlines"), tools("a b"), tools("x" * 65), tools("f", "f")):
        with pytest.raises(InvalidParameter) as err:
            plan_tools(bad, "required", DeepSeekV3Markup())
        assert err.value.param == "tools"
