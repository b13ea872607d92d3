"""ClosingStreamingResponse: a streamed body's `finally`, then `on_close`, have run by the time
the response returns, however the client left. Starlette's own StreamingResponse leaves a body
suspended at its `yield` until it is garbage-collected when the client leaves mid-send, and
never runs the `finally` of a body it never started (the client gone before the response
began). Driven through Starlette's real response over a scripted ASGI connection, both ways
Starlette learns of a disconnect: a cancelled send (ASGI spec 2.3, uvicorn's) and a send that
raises (2.4). Under 2.3 Starlette also cuts short a `finally` that awaits: its anyio cancel
scope cancels each of those awaits in turn."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from mci.http_stream import ClosingStreamingResponse


async def _respond(spec_version: str) -> tuple[list[str], list[str]]:
    """Serve an endless body to a client that leaves during the first chunk's send; the
    events the body saw by the time the response returned (a copy, taken while the response
    still holds the body: an unclosed body is finalized only after that), and the chunks
    sent."""
    events: list[str] = []
    sent: list[str] = []

    async def body():
        try:
            while True:
                events.append("pulled")
                yield "x"
        finally:
            events.append("closed")

    leaving = asyncio.Event()

    async def send(message):
        if message["type"] != "http.response.body":
            return
        sent.append(message["body"].decode())
        leaving.set()
        if spec_version == "2.4":
            raise OSError("client gone")
        await asyncio.Event().wait()  # a send that never completes: the socket is full

    async def receive():
        await leaving.wait()
        return {"type": "http.disconnect"}

    response = ClosingStreamingResponse(body(), on_close=lambda: events.append("on_close"))
    scope = {"type": "http", "asgi": {"spec_version": spec_version}}
    try:
        await response(scope, receive, send)
    except ClientDisconnect:
        assert spec_version == "2.4"
    return list(events), sent


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_the_body_is_closed_when_the_client_leaves_mid_send(spec_version):
    events, sent = asyncio.run(_respond(spec_version))
    assert sent == ["x"]
    assert events == ["pulled", "closed", "on_close"]


def test_a_finished_body_is_left_as_it_ended():
    events: list[str] = []

    async def body():
        try:
            yield "a"
            yield "b"
        finally:
            events.append("closed")

    async def send(message):
        if message["type"] == "http.response.body" and message["body"]:
            events.append(message["body"].decode())

    async def receive():
        await asyncio.Event().wait()

    async def on_close():
        events.append("on_close")

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    asyncio.run(ClosingStreamingResponse(body(), on_close=on_close)(scope, receive, send))
    assert events == ["a", "b", "closed", "on_close"]


async def _gone_before_the_start(spec_version: str, waits_first: bool) -> list[str]:
    """A client that left before the response began; the events the body saw by the time
    the response returned (a copy, taken while the response still holds the body)."""
    events: list[str] = []
    pending = asyncio.Event()

    async def body():
        try:
            events.append("started")
            if waits_first:  # as the server's stream waits for the engine's next output
                await pending.wait()
            yield "x"
        finally:
            events.append("closed")

    async def send(message):
        if spec_version == "2.4":
            raise OSError("client gone")
        await asyncio.sleep(0)

    async def receive():
        return {"type": "http.disconnect"}  # at once: the client is gone already

    response = ClosingStreamingResponse(body(), on_close=lambda: events.append("on_close"))
    try:
        await response({"type": "http", "asgi": {"spec_version": spec_version}}, receive, send)
    except ClientDisconnect:
        assert spec_version == "2.4"
    return list(events)


@pytest.mark.parametrize("waits_first", [True, False], ids=["awaits-first", "yields-first"])
@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_body_never_started_still_runs_its_finally(spec_version, waits_first):
    events = asyncio.run(_gone_before_the_start(spec_version, waits_first))
    assert events == ["started", "closed", "on_close"]


async def _left_while_the_body_waits(response_class) -> list[str]:
    """A client that leaves while the body waits for its next item (as a workflow's stream
    waits on its tree of calls); the body's `finally` awaits twice, as a workflow's does
    while its calls unwind. The events the body saw by the time the response returned."""
    events: list[str] = []
    waiting = asyncio.Event()

    async def body():
        try:
            yield "x"
            waiting.set()
            await asyncio.Event().wait()
        finally:
            events.append("finally")
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            events.append("closed")

    async def send(message):
        pass

    async def receive():
        await waiting.wait()
        return {"type": "http.disconnect"}

    response = response_class(body())
    await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    return list(events)


def test_a_finally_that_awaits_runs_to_its_end():
    events = asyncio.run(_left_while_the_body_waits(ClosingStreamingResponse))
    assert events == ["finally", "closed"]


async def _cancelled_twice() -> tuple[str, list[str]]:
    """The response itself cancelled (a server shutting down), and cancelled again while the
    body's `finally` awaits; what the response raised, and the events by then."""
    events: list[str] = []
    finishing = asyncio.Event()

    async def body():
        try:
            yield "x"
            await asyncio.Event().wait()
        finally:
            events.append("finally")
            finishing.set()
            for _ in range(5):
                await asyncio.sleep(0)
            events.append("closed")

    async def send(message):
        pass

    async def receive():
        await asyncio.Event().wait()  # the client stays

    response = ClosingStreamingResponse(body(), on_close=lambda: events.append("on_close"))
    task = asyncio.ensure_future(
        response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    )
    await asyncio.sleep(0.01)
    task.cancel()
    await finishing.wait()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled", events
    return "returned", events


def test_a_second_cancellation_neither_cuts_the_finally_nor_runs_on_close_early():
    raised, events = asyncio.run(_cancelled_twice())
    assert raised == "cancelled"
    assert events == ["finally", "closed", "on_close"]
