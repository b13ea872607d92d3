"""`--reasoning-parser deepseek-r1`: text before </think> is reasoning_content, after it content,
whole and streamed (whatever the delta boundaries)."""

from __future__ import annotations

import random

import pytest

from mci.server.reasoning import ReasoningStream, split_reasoning


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
