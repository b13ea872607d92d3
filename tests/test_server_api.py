"""The official openai client against a live `mci serve`: API shapes and every error path."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import LiveServer

from mci.process_tuning import ENGINE_SPIN_COUNT

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(checkpoint):
    with LiveServer(
        checkpoint(),
        "--served-model-name",
        MODEL,
        "--max-total-tokens",
        "16384",
        "--max-request-bytes",
        "200000",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_and_usage(client):
    r = client.completions.create(
        model=MODEL,
        prompt="def f(x):",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].index == 0 and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completion_prompt_forms_and_n(client):
    r = client.completions.create(
        model=MODEL, prompt=["a", "b"], max_tokens=3, n=2, seed=1, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    ids = client.completions.create(
        model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_streaming_completion_matches_non_streaming(client):
    kwargs = dict(
        model=MODEL,
        prompt="import os\n",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_and_seed(client):
    base = dict(
        model=MODEL,
        prompt="class A:",
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**base).choices[0].text
    stop = full[5:8]
    cut = client.completions.create(stop=[stop], **base).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    sampled = dict(
        model=MODEL,
        prompt="x",
        max_tokens=12,
        temperature=1.0,
        seed=42,
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**sampled).choices[0].text
    assert a == client.completions.create(**sampled).choices[0].text


def test_chat_stream_and_logprobs(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=5,
        logprobs=True,
        top_logprobs=2,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and len(r.choices) == 2
    assert r.choices[0].message.role == "assistant"
    assert len(r.choices[0].logprobs.content) == 5
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            stream=True,
            temperature=0,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 6
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert streamed == plain.choices[0].message.content


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 5000}, "max_tokens"),  # beyond the context length
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"extra_body": {"top_k": "many"}}, "top_k"),
        ({"extra_body": {"stop": [1, 2]}}, "stop[0]"),  # the first bad element
    ],
)
def test_bad_parameters_are_400_with_param(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", **kwargs)
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == param and err["message"]
    assert err["type"] == "invalid_request_error"


def test_unknown_model_and_malformed_json(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="gpt-9", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    raw = httpx.post(
        server.url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert raw.status_code == 400 and "malformed JSON" in raw.json()["error"]["message"]
    wrong = httpx.post(server.url + "/v1/chat/completions", json={"messages": "hi"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "messages"
    bad_ids = httpx.post(server.url + "/v1/completions", json={"prompt": [10**9]})
    assert bad_ids.status_code == 400


def test_body_over_limit_is_413(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x" * 300_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_native_generate_health_and_metrics(server):
    r = httpx.post(
        server.url + "/generate",
        json={"text": "def", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
    )
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "mci:time_to_first_token_seconds",
        "mci:inter_token_latency_seconds",
        "mci:e2e_request_latency_seconds",
        "mci:request_queue_time_seconds",
        "mci:prompt_tokens_total",
        "mci:generation_tokens_total",
        "mci:request_success_total",
        "mci:requests_rejected_total",
        "mci:requests_aborted_total",
        "mci:num_requests_running",
        "mci:num_requests_waiting",
        "mci:kv_cache_usage_perc",
        "mci:prefix_cache_hit_rate",
    ):
        assert name in text, name
    state = server.wait_idle()
    assert state["integrity_ok"] and state["kv_cache_usage"] == 0


def test_metrics_right_after_a_stream_show_its_end(server):
    """A request's last output carries the engine's stats after it: as soon as a stream has
    ended, /metrics shows nothing running and no KV held by a request."""
    body = {"prompt": "def", "max_tokens": 48, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data:")]
    assert chunks[-1] == "data: [DONE]" and len(chunks) > 10
    text = httpx.get(server.url + "/metrics").text
    assert _gauge(text, "mci:num_requests_running") == 0
    assert _gauge(text, "mci:kv_cache_usage_perc") == 0


def _gauge(text: str, name: str) -> float:
    """The value of the sample named exactly `name` (labels included) in /metrics' text."""
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def test_the_engine_process_has_the_short_spin_count_and_the_front_end_does_not(server):
    """`mci serve` starts its engine process inside `engine_environment`: the engine's OpenMP
    threads sleep after GOMP_SPINCOUNT spins (a user's own value wins), the front end keeps
    its environment as it was."""

    def environment(pid: int) -> dict[str, str]:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(item.decode().split("=", 1) for item in raw if b"=" in item)

    engine = environment(server.wait_idle()["engine_pid"])
    front_end = environment(server.proc.pid)
    users = os.environ.get("GOMP_SPINCOUNT")
    wanted = users or (None if "OMP_WAIT_POLICY" in os.environ else ENGINE_SPIN_COUNT)
    assert engine.get("GOMP_SPINCOUNT") == wanted
    assert front_end.get("GOMP_SPINCOUNT") == users


def test_memory_is_exported(server):
    """Each process's RSS and heap, the engine's plan and the bounded caches, in /metrics and
    /internal/state, agreeing with what /proc says of the processes."""
    state = server.wait_idle()
    engine_rss = int(Path(f"/proc/{state['engine_pid']}/statm").read_text().split()[1])
    engine_rss *= os.sysconf("SC_PAGE_SIZE")
    memory = state["memory"]
    assert 0.5 < memory["rss_bytes"] / engine_rss < 2  # read at most a second ago
    assert memory["heap_in_use_bytes"] > 0 and memory["heap_free_bytes"] >= 0
    plan = state["memory_plan"]
    assert plan["total_bytes"] == sum(
        plan[k] for k in ("weight_bytes", "kv_pool_bytes", "kernel_bytes", "transient_bytes")
    )
    assert plan["kv_pool_bytes"] > 0 and plan["kernel_capacity"] > 0
    caches = state["caches"]
    assert caches["radix_tokens"]["capacity"] == state["num_slots"]
    assert caches["grammars"]["capacity"] > 0
    front = state["front_end"]["memory"]
    assert front["rss_bytes"] > 0 and "grammars" in front["caches"]
    text = httpx.get(server.url + "/metrics").text
    assert _gauge(text, 'mci:resident_memory_bytes{process="engine"}') > 0
    assert _gauge(text, 'mci:resident_memory_bytes{process="front_end"}') > 0
    assert _gauge(text, 'mci:heap_bytes{process="engine",state="in_use"}') > 0
    assert _gauge(text, "mci:engine_memory_plan_bytes") == plan["total_bytes"]
    assert _gauge(text, "mci:engine_heap_trims_total") >= 0
    for cache in ("radix_tokens", "grammars", "onednn_kernels", "front_end_grammars"):
        assert _gauge(text, f'mci:cache_capacity{{cache="{cache}"}}') > 0, cache
    assert _gauge(text, 'mci:cache_entries{cache="radix_tokens"}') == state["tree_tokens"]


def test_api_key(checkpoint):
    with LiveServer(checkpoint(), "--api-key", "s3cret", "--max-total-tokens", "2048") as s:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401
        assert httpx.get(s.url + "/v1/models").status_code == 401  # no header at all
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert (
            good.completions.create(
                model=good.models.list().data[0].id, prompt="x", max_tokens=2
            ).usage.completion_tokens
            >= 1
        )
        assert httpx.get(s.url + "/health").status_code == 200  # probes need no key


def test_request_timeout_is_504_and_frees_kv(checkpoint):
    with LiveServer(checkpoint(), "--request-timeout", "0.3", "--max-total-tokens", "4096") as s:
        r = httpx.post(
            s.url + "/v1/completions",
            timeout=30,
            json={"prompt": "x", "max_tokens": 1500, "ignore_eos": True},
        )
        assert r.status_code == 504 and r.json()["error"]["message"] == "request timed out"
        huge_seed = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "seed": 2**70})
        assert huge_seed.status_code == 400 and huge_seed.json()["error"]["param"] == "seed"
        state = s.wait_idle()
        assert state["kv_cache_usage"] == 0 and state["integrity_ok"]
