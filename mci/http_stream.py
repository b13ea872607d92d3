"""A streamed HTTP response whose body is closed the moment the response ends, however it ends.

Every streamed body in mci is an async generator whose `finally` does work that must not wait:
the server aborts the request's samples (their KV slots are freed in the engine's next step),
a workflow cancels its tree of calls, the router and the Ray ingress close their upstream
streams. Starlette runs a StreamingResponse's sending loop in a task that it cancels when the
client disconnects. If the cancellation lands while a chunk is being sent (rather than while
the body is being pulled), the generator is left suspended at its `yield`, and its `finally`
runs only when the generator is garbage-collected: at once if nothing else holds it, but
whenever the cyclic collector next reaches it if the cancellation's traceback holds it in a
cycle. Meanwhile the request runs on to its end in the engine, with nobody reading it. (Seen in
CI: a workflow whose client had left ran its 2,000-token model call to the end.)
"""

from __future__ import annotations

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    """StreamingResponse, then `aclose()` of its body (a no-op for one already finished):
    the body's `finally` has run when the response returns."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
