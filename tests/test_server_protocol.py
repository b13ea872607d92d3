"""Protocol fidelity of `mci serve`: echo with prompt logprobs (scoring), logit_bias, every
field either taking effect or rejected with a 400 naming it, bad text never a 500, OpenAI error
bodies for 404/405, and the OpenAPI contract being served."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
import torch
from conftest import load_hf_reference
from server_helpers import LiveServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(checkpoint):
    with LiveServer(checkpoint(), "--served-model-name", MODEL, "--max-total-tokens", "8192") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _post(server, path: str, body) -> httpx.Response:
    # json.dumps escapes lone surrogates as \udXXX, as a client in another language would send
    return httpx.post(
        server.url + path,
        content=json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=60,
    )


def test_echo_scores_the_prompt_like_transformers(server, client, checkpoint):
    ids = [5, 17, 99, 3, 250, 41, 8, 77]
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    hf = load_hf_reference(checkpoint())
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-4)
    assert choice.text == server_decode(server, ids)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def server_decode(server, ids):
    """The echo text of a token-id prompt (what the server's tokenizer decodes)."""
    body = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True})
    return body.json()["choices"][0]["text"]


def test_echo_with_generation_covers_prompt_then_completion(server, client):
    prompt = "def add(a, b):"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=5, echo=True, logprobs=1, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}
    full = client.completions.create(**kw).choices[0]
    plain = client.completions.create(**{**kw, "echo": False}).choices[0]
    assert full.text == prompt + plain.text
    lp, gen = full.logprobs, plain.logprobs
    n_prompt = len(lp.tokens) - len(gen.tokens)
    assert lp.tokens[n_prompt:] == gen.tokens
    assert lp.token_logprobs[n_prompt:] == pytest.approx(gen.token_logprobs, abs=1e-5)
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    # offsets index the choice's text: the completion starts after the prompt
    assert gen.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(prompt)
    assert [o - len(prompt) for o in lp.text_offset[n_prompt:]] == gen.text_offset
    # the stream says the same, chunk by chunk
    chunks = list(client.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices and c.choices[0].logprobs:
            for key in streamed:
                streamed[key] += getattr(c.choices[0].logprobs, key)
    assert text == full.text
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_logit_bias_forces_and_bans(client):
    kw = dict(model=MODEL, prompt="import os", max_tokens=4, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}
    plain = client.completions.create(**kw, logprobs=0).choices[0].logprobs.tokens
    forced = client.completions.create(**kw, logit_bias={"7": 100}, logprobs=0)
    ids = forced.choices[0].logprobs.tokens
    assert len(ids) == 4 and len(set(ids)) == 1
    banned = client.completions.create(**kw, logprobs=0, logit_bias={"7": 100, "8": -100})
    assert banned.choices[0].logprobs.tokens == ids  # the ban of another token changes nothing
    assert plain != ids
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kw, logit_bias={"7": 101})
    assert info.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kw, logit_bias={"10000000": 1})
    assert "logit_bias" in info.value.body["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        (
            "/v1/completions",
            {"resume_output_token_ids": []},
            "resume_output_token_ids",
            "no output",
        ),
        (
            "/v1/completions",
            {"resume_output_token_ids": [5], "n": 2},
            "resume_output_token_ids",
            "n must be 1",
        ),
        (
            "/v1/chat/completions",
            {"resume_output_token_ids": [5], "regex": "a+"},
            "resume_output_token_ids",
            "constraint",
        ),
        ("/v1/completions", {"resume_text_offset": 3}, "resume_text_offset", "needs"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
            "not in 'tools'",
        ),
        (
            "/v1/chat/completions",
            {"guided_json": "{not json"},
            "guided_json",
            "not valid JSON",
        ),
        ("/v1/completions", {"regex": "(("}, "regex", "invalid regex"),
        ("/v1/completions", {"guided_decoding_backend": "x"}, "guided_decoding_backend", "not"),
        ("/v1/completions", {"choice": ["a"], "ebnf": 'root ::= "a"'}, "choice", "at most one"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}]},
            "messages[0].content",
            "required",
        ),
        ("/v1/completions", {"suffix": "end"}, "suffix", "not supported"),
        ("/v1/completions", {"best_of": 3}, "best_of", "best_of"),
        (
            "/v1/completions",
            {"stream_options": {"include_usage": True}},
            "stream_options",
            "stream",
        ),
        ("/v1/completions", {"frobnicate": 1}, "frobnicate", "unknown field"),
        ("/v1/completions", {"temperature": "hot"}, "temperature", "number"),
        ("/v1/completions", {"max_tokens": True}, "max_tokens", "integer"),
        ("/v1/completions", {"prompt": []}, "prompt", "empty"),
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt", "surrogate"),
        ("/v1/completions", {"prompt": "nul\x00here"}, "prompt", "NUL"),
        ("/v1/chat/completions", {"stop": ["\udfff"]}, "stop[0]", "surrogate"),
        (
            "/generate",
            {"text": "x", "sampling_params": {"json_schema": "{bad"}},
            "sampling_params.json_schema",
            "not valid JSON",
        ),
        ("/generate", {"text": "x", "input_ids": [1]}, "text", "exactly one"),
    ],
)
def test_rejected_fields_are_400_naming_them(server, path, body, param, words):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {}
    if path == "/v1/completions":
        base = {"prompt": "hi"}
    r = _post(server, path, {**base, "max_tokens": 2, **body} if path != "/generate" else body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
    assert words.lower() in err["message"].lower(), err["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "limit_word"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 99_999}, "max_tokens", "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 99_999},
            "max_tokens",
            "max_tokens",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 99_999}},
            "max_new_tokens",
            "max_new_tokens",
        ),
        ("/v1/completions", {"prompt": [1, 2], "min_tokens": -1}, "min_tokens", "min_tokens"),
    ],
)
def test_engine_rules_are_reported_under_each_apis_names(server, path, body, param, limit_word):
    """One rule (RequestFront / SamplingParams), each API's name for the field."""
    err = _post(server, path, body).json()["error"]
    assert err["param"] == param and err["message"].startswith(("prompt (", f"{limit_word} ")), err
    assert limit_word in err["message"]
    if param != "min_tokens":
        assert err["code"] == "context_length_exceeded"


def test_fields_that_cannot_change_output_are_accepted(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        user="u1",
        metadata={"k": "v"},
        store=False,
        response_format={"type": "text"},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="none",
    )
    assert out.choices[0].message.role == "assistant"


def test_bad_bytes_and_huge_tokens_are_400_never_500(server):
    raw = b'{"prompt": "\xff\xfe bad utf8", "max_tokens": 1}'
    r = httpx.post(
        server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    surrogate = b'{"prompt": "\\ud800", "max_tokens": 1}'  # escaped lone surrogate in JSON
    r = httpx.post(
        server.url + "/v1/completions",
        content=surrogate,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    long_word = _post(server, "/v1/completions", {"prompt": "a" * 60_000, "max_tokens": 1})
    assert long_word.status_code == 400 and "context length" in long_word.json()["error"]["message"]
    for body in (
        {"prompt": "x", "\ud800": 1},  # a field name that cannot be encoded back
        {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"\udc00": 1}}}],
            "tool_choice": "none",
        },
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = _post(server, path, body)
        # 400, or 200 where the text never reaches the tokenizer (a template without tools)
        assert r.status_code in (200, 400), r.text
    huge_id = _post(server, "/v1/completions", {"prompt": [10**30], "max_tokens": 1})
    assert huge_id.status_code == 400
    assert _post(server, "/v1/completions", [1, 2]).status_code == 400
    state = server.wait_idle()
    assert state["kv_cache_usage"] == 0 and state["integrity_ok"]


def test_not_found_and_wrong_method_are_openai_errors(server, client):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"


def test_openapi_contract_is_served(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    paths = spec["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/generate", "/health"):
        assert path in paths, path
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name in ("tools", "tool_choice", "response_format", "logit_bias"):
        assert name in chat
    assert "422" not in json.dumps(paths["/v1/completions"]["post"]["responses"])
    assert httpx.get(server.url + "/docs").status_code == 200


def test_extreme_values_never_fail_other_requests(server):
    """Values at the edges of their types are a 400 or served, and never fail the step that
    other requests share (an out-of-range id there would abort the whole batch)."""
    normal = {"prompt": "import os", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    extremes = [
        {"top_k": 2**62},
        {"stop_token_ids": [10**12], "min_tokens": 3},
        {"logit_bias": {str(2**40): 5}},
        {"priority": 10**30},
        {"min_tokens": 10**12, "max_tokens": 2},
        {"temperature": 1e308, "top_p": 1e-300},
        {"repetition_penalty": 1e308, "frequency_penalty": 2},
        {"max_tokens": 2**63},
        {"n": 10**9},
        {"logprobs": 10**9},
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = pool.submit(_post, server, "/v1/completions", normal)
        odd = [
            pool.submit(_post, server, "/v1/completions", {"prompt": "x", **e}) for e in extremes
        ]
        codes = [f.result().status_code for f in odd]
        done = first.result()
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 40
    assert set(codes) <= {200, 400}, codes
    state = server.wait_idle()
    assert state["kv_cache_usage"] == 0 and state["integrity_ok"]
