"""`mci workflow serve` over real HTTP: the entry's types as the OpenAPI schema, typed errors
with their status, the deadline, a disconnect cancelling the tree down to the engine, and one
trace from the workflow's root span to the mci server's spans, at a real OTLP receiver."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from otlp_receiver import OtlpReceiver
from server_helpers import LiveServer

BASIC = Path(__file__).parent / "workflows" / "basic.py"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


def workflow_server(target: str, *flags: str, env: dict) -> LiveServer:
    """`mci workflow serve FILE:ENTRY` in a subprocess."""
    return LiveServer(None, *flags, command=("workflow", "serve", target), env=env)


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def model_server(checkpoint, receiver):
    server = LiveServer(checkpoint(), "--otlp-traces-endpoint", receiver.endpoint)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def workflow(model_server, receiver):
    env = {"MCI_TEST_MODEL_URL": model_server.url}
    flags = ("--otlp-traces-endpoint", receiver.endpoint)
    servers = {
        entry: workflow_server(f"{BASIC}:{entry}", *flags, env=env)
        for entry in ("Collect", "Write")
    }
    yield servers
    for server in servers.values():
        server.stop()


def test_the_openapi_schema_is_the_entry_steps_types(workflow):
    schema = httpx.get(workflow["Collect"].url + "/openapi.json").json()
    run = schema["paths"]["/run"]["post"]
    body_ref = run["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    answer_ref = run["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert body_ref.endswith("/Prompt") and answer_ref.endswith("/Piece")
    assert set(schema["components"]["schemas"]["Prompt"]["properties"]) >= {"text", "max_tokens"}


def test_calls_streams_and_typed_errors_over_http(workflow, model_server):
    body = {"text": "def f(x):", "max_tokens": 6}
    whole = httpx.post(workflow["Collect"].url + "/run", json=body, timeout=60)
    assert whole.status_code == 200
    direct = httpx.post(
        model_server.url + "/v1/completions",
        json={"prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        timeout=60,
    ).json()
    assert whole.json()["text"] == direct["choices"][0]["text"]

    with httpx.stream("POST", workflow["Write"].url + "/run", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["text"] for e in events[:-1]) == whole.json()["text"]

    bad = httpx.post(workflow["Collect"].url + "/run", json={"txt": 1}, timeout=10)
    assert bad.status_code == 422
    assert bad.json()["error"]["code"] == "invalid_input" and bad.json()["error"]["step"]


def test_the_deadline_fails_the_request_on_time_and_frees_the_servers_kv(workflow, model_server):
    start = time.monotonic()
    response = httpx.post(
        workflow["Collect"].url + "/run",
        json={"text": "x", "max_tokens": 500, "pause_s": 0.02},
        headers={"X-Request-Timeout": "0.6"},
        timeout=30,
    )
    took = time.monotonic() - start
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == "deadline_exceeded" and error["step"] in ("Write", "Collect")
    # on time: not before the deadline, and long before the 10 s the chain would take (a wide
    # margin after it: the server's first request warms it, and CI's machine is loaded)
    assert 0.55 < took < 1.5
    state = model_server.wait_idle(timeout_s=5)
    assert state["in_flight"] == 0 and state["num_running"] == 0


def test_a_client_that_disconnects_cancels_the_tree_down_to_the_engine(workflow, model_server):
    # Proven by the server's own count, not by a time bound: on a loaded machine a 2,000-token
    # request that ran on to its end would take about as long as a slow abort.
    before = model_server.metric("mci:requests_aborted_total ")
    body = {"text": "x", "max_tokens": 2000, "pause_s": 0.005}
    with httpx.stream("POST", workflow["Write"].url + "/run", json=body, timeout=30) as response:
        lines = response.iter_lines()
        next(lines)
        assert model_server.state()["num_running"] == 1
    state = model_server.wait_idle(timeout_s=10)
    assert state["num_running"] == 0 and state["in_flight"] == 0
    assert model_server.metric("mci:requests_aborted_total ") == before + 1


def test_one_trace_from_the_workflow_to_the_engine(workflow, receiver):
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN}-01"
    response = httpx.post(
        workflow["Collect"].url + "/run",
        json={"text": "def g():", "max_tokens": 5},
        headers={"traceparent": traceparent},
        timeout=60,
    )
    assert response.status_code == 200

    def names(spans):
        return {s["name"] for s in spans if s["trace_id"] == TRACE_ID}

    wanted = {"workflow Collect", "step Collect", "step Write", "mci.request", "mci.decode"}
    spans = receiver.wait_for(lambda s: wanted <= names(s))
    mine = {s["name"]: s for s in spans if s["trace_id"] == TRACE_ID}
    assert wanted <= set(mine), set(mine)
    model_span = next(s for n, s in mine.items() if n.startswith("model "))
    assert mine["workflow Collect"]["parent_span_id"] == PARENT_SPAN
    assert mine["step Collect"]["parent_span_id"] == mine["workflow Collect"]["span_id"]
    assert mine["step Write"]["parent_span_id"] == mine["step Collect"]["span_id"]
    assert model_span["parent_span_id"] == mine["step Write"]["span_id"]
    assert mine["mci.request"]["parent_span_id"] == model_span["span_id"]  # the server joined
    assert model_span["attributes"]["gen_ai.usage.output_tokens"] == 5
    assert model_span["attributes"]["mci.ttft_s"] > 0
    assert mine["workflow Collect"]["service"] == "mci-workflow"


def test_a_disconnect_before_the_first_item_cancels_the_tree(model_server, receiver):
    server = workflow_server(f"{BASIC}:SlowStart", env={"MCI_TEST_MODEL_URL": model_server.url})
    try:
        before = httpx.get(model_server.url + "/metrics").text
        body = {"text": "x", "max_tokens": 50, "pause_s": 1.0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/run", json=body, timeout=0.3)  # leaves before any item
        time.sleep(1.5)  # past the pause: a step still running would now call the model
        after = httpx.get(model_server.url + "/metrics").text
        assert _requests_seen(after) == _requests_seen(before)
    finally:
        server.stop()


def _requests_seen(metrics: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(("mci:request_success_total", "mci:requests_aborted_total"))
    )
