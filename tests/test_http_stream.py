"""ClosingStreamingResponse: a streamed body's `finally` has run by the time the response
returns, when the client leaves while a chunk is being sent (Starlette's own StreamingResponse
leaves the body suspended at its `yield` until it is garbage-collected). Driven through
Starlette's real response over a scripted ASGI connection, both ways Starlette learns of the
disconnect: a cancelled send (ASGI spec 2.3, uvicorn's) and a send that raises (2.4)."""

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

    response = ClosingStreamingResponse(body())
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
    assert events == ["pulled", "closed"]


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

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    asyncio.run(ClosingStreamingResponse(body())(scope, receive, send))
    assert events == ["a", "b", "closed"]
