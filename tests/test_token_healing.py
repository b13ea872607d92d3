"""Token healing: a prompt ending inside what the tokenizer would merge is backed off and the
output constrained to start with the removed text (opt-in), through `mci serve` and
`mci generate`, on the bundled model whose BPE never saw a bare newline before indented code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mci.engine.config import DEFAULT_MODEL
from mci.grammar.cache import xgrammar_cache
from mci.grammar.healing import LeadingMatcher, heal_prompt, healing_constraint
from mci.tokenizer import TextTokenizer

CODE = "def parse_args(argv):\n    "


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.load(DEFAULT_MODEL)


@pytest.mark.parametrize(
    ("prompt", "healed"),
    [
        (CODE, "\n    "),  # "\n" and "    ": the whitespace run goes together
        ("x = 1 ", " "),
        ("import o", " o"),  # mid-word
        ("a é", ""),  # the last token ends a character the one before began: left alone
    ],
)
def test_heal_prompt(tok, prompt, healed):
    ids = tok.encode(prompt)
    kept, text = heal_prompt(tok, ids)
    assert text == healed
    assert tok.decode(kept) + text == tok.decode(ids)
    assert len(kept) < len(ids) or not healed
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert heal_prompt(tok, chat) == (chat, "")  # ends in a special token


def test_leading_matcher_frees_the_output_once_the_text_is_written(tok):
    cache = xgrammar_cache(tok, 4096, (1,))
    constraint = healing_constraint("\n    ")
    compiled = cache.compile_now(constraint)
    m = LeadingMatcher(cache.backend.matcher(compiled))
    bitmask = cache.backend.new_bitmask(1)
    assert m.fill_mask(bitmask, 0) and not m.is_completed()
    (word,) = tok.encode("return", add_bos=False)
    assert not m.accept(word)  # must start with the healed text
    for t in tok.encode("\n    return", add_bos=False):  # "\n   ", " return"
        assert m.accept(t)
    assert m.is_completed() and not m.fill_mask(bitmask, 0)  # free from here
    assert m.accept(tok.encode("!", add_bos=False)[0]) and m.find_jump_forward_string() == ""
    m.rollback(3)  # "!", " return" and "\n   ": constrained again
    assert not m.is_completed() and m.fill_mask(bitmask, 0) and not m.accept(word)


def test_served_token_healing(tok):
    """On: the continuation of an indented line is code on that line (greedy). Off (or the
    field absent): the same tokens as before healing existed. Per prompt in a batch; the
    native /generate spelling; 400s for what it cannot combine with."""
    import openai
    import requests
    from server_helpers import LiveServer

    with LiveServer(None, "--served-model-name", "m") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="m", max_tokens=12, temperature=0)
        plain = client.completions.create(prompt=CODE, **kw).choices[0].text
        off = client.completions.create(prompt=CODE, extra_body={"token_healing": False}, **kw)
        assert off.choices[0].text == plain
        both = client.completions.create(
            prompt=[CODE, "import o"], extra_body={"token_healing": True}, **kw
        ).choices
        healed = both[0].text
        assert healed != plain and healed[:1].isidentifier(), (plain, healed)
        first_line = (CODE + healed).split("\n")[1]
        assert first_line.startswith("    ") and first_line.strip(), first_line
        alone = client.completions.create(
            prompt="import o", extra_body={"token_healing": True}, **kw
        ).choices[0]
        assert both[1].text == alone.text  # each prompt of a batch healed on its own
        native = requests.post(
            server.url + "/generate",
            json={
                "text": CODE,
                "sampling_params": {"max_new_tokens": 12, "temperature": 0, "token_healing": True},
            },
        ).json()
        assert native["text"] == healed
        for extra in ({"regex": "[a-z]+"}, {"logprobs": 1}):
            with pytest.raises(openai.BadRequestError, match="token_healing"):
                client.completions.create(
                    prompt=CODE, extra_body={"token_healing": True, **extra}, **kw
                )
        state = server.wait_idle()
    assert state["free_slots"] + state["tree_tokens"] == state["num_slots"]


def test_generate_cli_token_healing():
    def run(*flags):
        cmd = [sys.executable, "-m", "mci", "generate", "--prompt", CODE, "--max-new-tokens", "8"]
        return subprocess.run(cmd + list(flags), capture_output=True, text=True, check=True).stdout

    healed = run("--token-healing")
    assert healed.startswith(CODE) and healed[len(CODE) : len(CODE) + 1].isidentifier(), healed


def test_server_default_heals_what_it_can(tok):
    """`mci serve --token-healing`: a plain request is healed as if it asked; one that cannot
    be (a constraint) is served unhealed instead of refused; echo of a token-id prompt repeats
    the prompt as given."""
    import openai
    from server_helpers import LiveServer

    with LiveServer(None, "--served-model-name", "m", "--token-healing") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="m", max_tokens=12, temperature=0)
        by_default = client.completions.create(prompt=CODE, **kw).choices[0].text
        asked = client.completions.create(prompt=CODE, extra_body={"token_healing": True}, **kw)
        assert by_default == asked.choices[0].text
        constrained = client.completions.create(
            prompt=CODE, extra_body={"regex": "[a-z]{2,5}"}, **kw
        ).choices[0]
        assert constrained.finish_reason == "stop" and constrained.text.isalpha()
        ids = tok.encode(CODE)
        echoed = client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
        assert echoed == tok.decode(ids) + by_default
