"""`--reasoning-parser deepseek-r1`: text before </think> is reasoning_content, after it content,
whole and streamed (whatever the delta boundaries)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from mci.grammar.cache import xgrammar_cache
from mci.grammar.constraint import Constraint
from mci.grammar.deferred import DeferredMatcher
from mci.server.reasoning import END, ReasoningStream, split_reasoning
from mci.tokenizer import TextTokenizer


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("let me see</think>\n\nthe answer", ("let me see", "the answer")),
        ("<think>hmm</think>42", ("hmm", "42")),
        ("still thinking", ("still thinking", None)),
        ("</think>direct", (None, "direct")),
        ("a</think>", ("a", None)),
    ],
)
def test_split_reasoning(text, want):
    assert split_reasoning(text) == want


def test_streamed_split_equals_whole_split():
    rng = random.Random(0)
    texts = [
        "<think>weigh a</thi and b</think>\nresult </think> kept",
        "no close <thin",
        "<thi",
        "x</think>",
        "</think></think>",
    ]
    for text in texts:
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 6))))
            parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            stream, thought, said = ReasoningStream(), "", ""
            for i, part in enumerate(parts):
                t, s = stream.feed(part, final=i == len(parts) - 1)
                thought, said = thought + t, said + s
            want = split_reasoning(text)
            assert (thought or None, said or None) == want, (text, parts)


def test_served_reasoning_content(checkpoint):
    import openai
    from server_helpers import LiveServer

    path = checkpoint()
    msgs = [{"role": "user", "content": "think"}]
    flags = ("--served-model-name", "m", "--reasoning-parser", "deepseek-r1")
    with LiveServer(path, *flags) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="m", messages=msgs, max_tokens=12, temperature=0)
        whole = client.chat.completions.create(**kw).choices[0].message
        thought = "".join(
            getattr(c.choices[0].delta, "reasoning_content", None) or ""
            for c in client.chat.completions.create(**kw, stream=True)
            if c.choices
        )
    reasoning = whole.model_extra.get("reasoning_content")
    assert reasoning and thought == reasoning  # no </think> from a random model: all reasoning
    assert whole.content is None


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_deferred_grammar_starts_after_its_token(checkpoint):
    """Tokens before the start token are free and the start token is the last free one; then
    the grammar holds; rolling back across the start frees the output again."""
    tok = TextTokenizer.load(checkpoint(markup=True))
    end = tok.backend.token_to_id(END)
    cache = xgrammar_cache(tok, 2048, (1,))
    window = lambda matcher, backend: DeferredMatcher(matcher, backend, end, (1,))  # noqa: E731
    state = cache.state(Constraint("regex", "[0-9]+"), window)
    cache.compile_now(Constraint("regex", "[0-9]+"))
    assert state.ready()
    m, backend = state.matcher, state.backend
    bitmask = backend.new_bitmask(1)
    free = tok.encode("anything at all", add_special_tokens=False)
    assert all(m.accept(t) for t in free) and m.fill_mask(bitmask, 0)
    allowed = [t for t in range(2048) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert 1 not in allowed and len(allowed) == 2047  # anything but the end, before </think>
    assert m.accept(end) and not m.is_completed()
    assert m.fill_mask(bitmask, 0)  # now masked: digits only
    letter, digit = (
        tok.encode("x", add_special_tokens=False),
        tok.encode("7", add_special_tokens=False),
    )
    assert not m.accept(letter[0])
    assert m.accept(digit[0]) and m.is_completed()
    m.rollback(2)  # the digit and </think>
    assert m.accept(letter[0]) and not m.is_completed()


def test_served_constraint_applies_after_reasoning(checkpoint):
    """With --reasoning-parser, response_format constrains the answer, not the thinking: the
    thinking is free text, the content after </think> validates. A tokenizer without a
    `</think>` token cannot place the start: a 400."""
    import openai
    from server_helpers import LiveServer

    path = checkpoint(markup=True)
    tok = TextTokenizer.load(path)
    end = tok.backend.token_to_id(END)
    msgs = [{"role": "user", "content": "think, then answer"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    flags = ("--served-model-name", "m", "--reasoning-parser", "deepseek-r1")
    with LiveServer(path, *flags) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for seed in range(3):
            # a random model: make it close its thinking after a few free tokens
            out = client.chat.completions.create(
                model="m",
                messages=msgs,
                response_format=fmt,
                logit_bias={str(end): 7},
                max_tokens=200,
                seed=seed,
            ).choices[0]
            assert out.finish_reason == "stop", out
            jsonschema.validate(json.loads(out.message.content), PERSON)
    with LiveServer(checkpoint(), *flags) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="</think>"):
            client.chat.completions.create(
                model="m", messages=msgs, response_format=fmt, max_tokens=4
            )
