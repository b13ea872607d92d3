"""A streamed HTTP response whose body is closed the moment the response ends, however it ends.

Every streamed body in mci is an async generator whose `finally` does work that must not wait:
the server aborts the request's samples (their KV slots are freed in the engine's next step),
a workflow cancels its tree of calls, the router and the Ray ingress close their upstream
streams (the router's count of a replica's requests in flight with them). Starlette runs a
StreamingResponse's sending loop in a task that it cancels when the client disconnects, and
two timings of that cancellation leave the `finally` unrun:

* it lands while a chunk is being sent (rather than while the body is being pulled): the
  generator stays suspended at its `yield`, and its `finally` runs only when the generator is
  garbage-collected, at once if nothing else holds it, else whenever the cyclic collector
  reaches it.
* the client had left before the response began, and uvicorn knew it already (say after the
  server's last check of a queued request and before its first output): the sending task is
  cancelled before it first runs, so the body never starts, and a generator that never
  started never runs its `finally` at all.

A third timing cut a `finally` short instead of leaving it unrun: under ASGI 2.3 Starlette
cancels the sending task through an anyio cancel scope, and such a scope cancels every await
made inside it, again and again, until the scope exits. A body whose `finally` awaited
(a workflow waiting for its tree of calls to unwind, the router closing its upstream stream
before it releases the replica's in-flight count) lost the rest of that `finally` at its first
await. (Seen in CI and caused on a loaded machine: the workflow's tree ran on, and its
`on_close` then found the stream still running and failed.)

Meanwhile the request runs on in the engine with nobody reading it. ClosingStreamingResponse
sends the body in a plain asyncio task and, when the client leaves, cancels that task once:
the body's `finally` can await what it must. It closes a started body when the response ends,
starts a body that never started just far enough to cancel it (its `finally` then runs as it
would for a client that left mid-stream), and then runs `on_close`, for cleanup that lives
outside the body.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """StreamingResponse over an async generator `content`; when the response ends, the
    body's `finally` has run (started or not) and then `on_close` (sync or async) has."""

    def __init__(
        self,
        content: AsyncIterator,
        *args,
        on_close: Callable[[], Awaitable[None] | None] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(content, *args, **kwargs)
        self.on_close, self.started = on_close, False

    async def stream_response(self, send: Send) -> None:
        """Starlette's, noting when the body is first asked for an item: nothing awaits
        between `started` and that ask, so a cancellation lands in the body or before it."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        self.started = True
        async for chunk in self.body_iterator:
            if not isinstance(chunk, bytes | memoryview):
                chunk = chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if scope["type"] != "http":  # a websocket's denial response: Starlette's own
                await super().__call__(scope, receive, send)
                return
            spec = tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))
            if spec >= (2, 4):  # a send to a gone client raises: nothing to listen for
                try:
                    await self.stream_response(send)
                except OSError:
                    raise ClientDisconnect() from None
            else:
                await _until_disconnect(self.stream_response(send), receive)
            if self.background is not None:
                await self.background()
        finally:
            try:
                if not self.started and inspect.isasyncgen(self.body_iterator):
                    await _start_and_cancel(self.body_iterator)
                elif hasattr(self.body_iterator, "aclose"):
                    await self.body_iterator.aclose()  # a no-op where it finished
            finally:
                if self.on_close is not None:
                    done = self.on_close()
                    if inspect.isawaitable(done):
                        await done


async def _until_disconnect(sending: Awaitable[None], receive: Receive) -> None:
    """Run `sending` until it ends or the client disconnects, whichever is first; on a
    disconnect, cancel it once (a plain asyncio cancellation: the body's `finally` may await)
    and wait until it has ended. Where the response itself is cancelled (a server shutting
    down), the body still ends first, and is cancelled only once however often that comes."""
    sender = asyncio.ensure_future(sending)
    listener = asyncio.ensure_future(disconnected(receive))
    interrupted = False
    try:
        await asyncio.wait({sender, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not sender.done() and not _cancelling(sender):
            sender.cancel()  # once: another cancellation would cut its `finally` short
        while not (sender.done() and listener.done()):
            try:
                await asyncio.wait({sender, listener})
            except asyncio.CancelledError:
                interrupted = True
    if interrupted:
        raise asyncio.CancelledError
    for task in (sender, listener):
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()


def _cancelling(task: asyncio.Task) -> int:
    """Cancellations of `task` under way (Python 3.11+; 0 where it cannot tell)."""
    cancelling = getattr(task, "cancelling", None)
    return cancelling() if cancelling is not None else 0


async def disconnected(receive: Receive) -> None:
    """Return when the client has gone (once the request's body was read, the next message
    is the end)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _start_and_cancel(body: AsyncIterator) -> None:
    """Run a generator that never started up to its first suspension, then end it there: a
    cancelled await, or a close at its first `yield`. Either way its `finally` runs."""
    first = asyncio.ensure_future(body.__anext__())
    await asyncio.sleep(0)  # one step of the task: the body runs to its first suspension
    first.cancel()
    await asyncio.wait({first})
    if not first.cancelled() and first.exception() is None:
        await body.aclose()  # it yielded: it waits at that yield
