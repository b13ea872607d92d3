"""OpenTelemetry traces (--otlp-traces-endpoint): `mci serve` and `mci router` export their
spans over OTLP/HTTP to a real receiver, joining the W3C traceparent a request came with."""

from __future__ import annotations

import json
import secrets
import time
from types import SimpleNamespace

import httpx
import pytest
from opentelemetry.context import Context
from otlp_receiver import OtlpReceiver
from server_helpers import LiveServer

from mci.core.outputs import RequestOutput
from mci.server.submission import Submission, _Tracker
from mci.tracing import Tracing

STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
PHASES = ("mci.queue", "mci.prefill", "mci.decode")


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def server(checkpoint, receiver):
    with LiveServer(checkpoint(), "--otlp-traces-endpoint", receiver.endpoint) as s:
        yield s


@pytest.fixture(scope="module")
def router(server, receiver):
    with LiveServer(
        None,
        "--worker-urls",
        server.url,
        "--otlp-traces-endpoint",
        receiver.endpoint,
        "--health-check-interval",
        "0.2",
        command="router",
    ) as r:
        yield r


def made_up_parent() -> tuple[str, str, str]:
    """(traceparent header, its trace id, its span id): a caller's span that mci joins."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def complete(url: str, stream: bool, headers: dict) -> dict:
    """A greedy 6-token completion; streamed, the usage chunk and the id of its chunks."""
    body = {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return {"id": events[0]["id"], "usage": events[-1]["usage"]}


def spans_with(receiver: OtlpReceiver, value: str, key: str = "mci.request_id") -> list[dict]:
    """The `mci.request` spans whose attribute `key` is `value`, once one has arrived."""

    def mine(spans):
        return [s for s in spans if s["attributes"].get(key) == value]

    return mine(receiver.wait_for(mine))


def request_span(
    receiver: OtlpReceiver, value: str, key: str = "mci.request_id"
) -> tuple[dict, dict[str, dict]]:
    """The one sample's `mci.request` span (n = 1) and its children by name, once all four
    have arrived."""

    def find(spans):
        mine = [s for s in spans if s["attributes"].get(key) == value]
        if not mine:
            return None
        children = {s["name"]: s for s in spans if s["parent_span_id"] == mine[0]["span_id"]}
        return (mine[0], children) if set(PHASES) <= set(children) else None

    found = find(receiver.wait_for(find))
    assert found is not None, f"no complete mci.request for {value}"
    return found


def check_sample_spans(span: dict, children: dict[str, dict], usage: dict) -> None:
    """Token counts as the response's usage; queue -> prefill -> decode tile the request."""
    assert span["service"] == "mci-serve"
    attrs = span["attributes"]
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert attrs["mci.finish_reason"] == "length"
    assert 0 < attrs["mci.ttft_s"] < (span["end_ns"] - span["start_ns"]) / 1e9
    queue, prefill, decode = (children[name] for name in PHASES)
    assert all(c["trace_id"] == span["trace_id"] for c in (queue, prefill, decode))
    assert span["start_ns"] == queue["start_ns"] <= queue["end_ns"]
    assert queue["end_ns"] == prefill["start_ns"] <= prefill["end_ns"]
    assert prefill["end_ns"] == decode["start_ns"] <= decode["end_ns"] == span["end_ns"]
    ttft_ns = prefill["end_ns"] - span["start_ns"]
    assert abs(ttft_ns / 1e9 - attrs["mci.ttft_s"]) < 1e-5


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_server_joins_the_incoming_trace(server, receiver, stream):
    header, trace_id, parent_id = made_up_parent()
    response = complete(server.url, stream, {"traceparent": header})
    span, children = request_span(receiver, response["id"])
    assert span["trace_id"] == trace_id and span["parent_span_id"] == parent_id
    check_sample_spans(span, children, response["usage"])


def test_chat_and_generate_are_traced(server, receiver):
    header, trace_id, parent_id = made_up_parent()
    chat = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        headers={"traceparent": header},
        timeout=60,
    ).json()
    native = httpx.post(
        server.url + "/generate",
        json={"text": "hi", "sampling_params": {"max_new_tokens": 3}},
        headers={"traceparent": header},
        timeout=60,
    ).json()
    for (key, value), usage in (
        (("mci.request_id", chat["id"]), chat["usage"]),
        (("mci.sample_id", native["meta_info"]["id"]), native["meta_info"]),
    ):
        span, _ = request_span(receiver, value, key)
        assert span["trace_id"] == trace_id and span["parent_span_id"] == parent_id
        assert span["attributes"]["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert span["attributes"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"]


def test_without_traceparent_a_new_trace_starts(server, receiver):
    response = complete(server.url, False, {})
    span, children = request_span(receiver, response["id"])
    assert span["parent_span_id"] == "" and int(span["trace_id"], 16) != 0
    assert all(c["trace_id"] == span["trace_id"] for c in children.values())
    others = [s for s in receiver.spans if s["name"] == "mci.request" and s is not span]
    assert span["trace_id"] not in {s["trace_id"] for s in others}  # a trace of its own


def test_a_stream_the_client_leaves_still_gets_its_span(server, receiver):
    header, trace_id, _ = made_up_parent()
    body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers={"traceparent": header}
    ) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    (span,) = spans_with(receiver, json.loads(first[6:])["id"])
    assert span["trace_id"] == trace_id and span["attributes"]["mci.finish_reason"] == "abort"
    assert 0 < span["attributes"]["gen_ai.usage.output_tokens"] < 1500
    assert span["status_code"] != STATUS_ERROR  # the client's choice, not a failure


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_router_span_sits_between_caller_and_server(router, server, receiver, stream):
    header, trace_id, parent_id = made_up_parent()
    response = complete(router.url, stream, {"traceparent": header})
    span, children = request_span(receiver, response["id"])
    spans = receiver.wait_for(
        lambda spans: any(s["span_id"] == span["parent_span_id"] for s in spans)
    )
    hop = next(s for s in spans if s["span_id"] == span["parent_span_id"])
    assert hop["name"] == "mci.router.request" and hop["service"] == "mci-router"
    assert hop["trace_id"] == span["trace_id"] == trace_id and hop["parent_span_id"] == parent_id
    assert hop["attributes"]["mci.replica"] == server.url
    assert hop["attributes"]["mci.retries"] == 0
    assert hop["attributes"]["http.response.status_code"] == 200
    slack_ns = 5_000_000  # two processes' clocks, each read through its own monotonic anchor
    assert hop["start_ns"] - slack_ns <= span["start_ns"] <= span["end_ns"]
    assert span["end_ns"] <= hop["end_ns"] + slack_ns
    check_sample_spans(span, children, response["usage"])


def test_an_errored_sample_has_an_error_span(receiver):
    """In process: a sample the engine failed before it was scheduled (its engine died) gets
    its request span with status ERROR, and only the phase it reached."""
    tracing = Tracing(receiver.endpoint, "mci-unit")
    sub = Submission.__new__(Submission)  # only what span recording reads
    sub.state, sub.trace = SimpleNamespace(tracing=tracing), Context()
    sub.rid, sub.index = "unit-error", {"unit-error-p0": 0}
    start = time.monotonic()
    final = RequestOutput.aborted("unit-error-p0", "engine died")
    sub._record_spans("unit-error-p0", _Tracker(5, start=start), start + 0.25, final)
    tracing.shutdown()
    (span,) = spans_with(receiver, "unit-error")
    children = [s for s in receiver.spans if s["parent_span_id"] == span["span_id"]]
    attrs = span["attributes"]
    assert span["status_code"] == STATUS_ERROR and attrs["mci.error"] == "engine died"
    assert attrs["mci.finish_reason"] == "abort" and "mci.ttft_s" not in attrs
    assert attrs["gen_ai.usage.input_tokens"] == 5 and attrs["gen_ai.usage.output_tokens"] == 0
    assert [c["name"] for c in children] == ["mci.queue"]
    assert children[0]["start_ns"] == span["start_ns"] and children[0]["end_ns"] == span["end_ns"]
    assert span["end_ns"] - span["start_ns"] == pytest.approx(0.25e9, abs=1e3)
