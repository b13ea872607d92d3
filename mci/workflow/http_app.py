"""A workflow's HTTP endpoint, the same app in `mci workflow serve` and as the Ray Serve
ingress of `mci workflow deploy`.

    POST /run        body: the entry step's input type; answer: its output type, or for a
                     streaming entry `text/event-stream` events, one item each, then
                     `data: [DONE]` (the OpenAPI schema is the entry's types)
    GET  /health     200 once the workflow is up

`X-Request-Timeout: SECONDS` (or the server's --default-timeout) sets the end-to-end deadline;
a `traceparent` header makes the request's spans part of the caller's trace. Errors are
OpenAI error bodies naming the failing step, with its status (422 input, 502 a step or model
failed, 503 a replica died, 504 the deadline). A client that disconnects cancels the whole
tree of calls (the engines free their KV).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from contextlib import aclosing

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from mci.errors import error_body
from mci.http_stream import ClosingStreamingResponse, disconnected
from mci.tracing import Tracing
from mci.workflow.calls import EntryPoint
from mci.workflow.errors import WorkflowError
from mci.workflow.streams import pipe

DISCONNECT_POLL_S = 0.1


def _timeout(header: str | None, default: float | None) -> float | None:
    if header is None:
        return default
    try:
        value = float(header)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise WorkflowError("invalid_input", "(request)", "X-Request-Timeout must be > 0 seconds")
    return value


def build_app(entry: EntryPoint, default_timeout_s: float | None = None, ready=None) -> FastAPI:
    """The app of `entry`. `ready`: a function saying whether the workflow is up (/health)."""
    spec = entry.spec
    app = FastAPI(
        title=f"workflow {spec.name}",
        description=(spec.cls.__doc__ or "").strip() or None,
        version="1",
    )

    async def run(body, request: Request, x_request_timeout: str | None = Header(None)):
        try:
            timeout_s = _timeout(x_request_timeout, default_timeout_s)
            parent = Tracing.extract(request.headers)
            if spec.streaming:
                return await _stream(entry, body, timeout_s, parent, request)
            return await _call(entry, body, timeout_s, parent, request)
        except WorkflowError as err:
            return JSONResponse(err.to_body(), status_code=err.status)

    # the endpoint's signature carries the entry's own types: FastAPI validates the body and
    # writes the OpenAPI schema from them
    run.__signature__ = inspect.Signature(
        [
            inspect.Parameter(
                "body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=spec.input_type
            ),
            *list(inspect.signature(run).parameters.values())[1:],
        ]
    )
    doc = "Runs the workflow" + (
        ": a text/event-stream of items, each one of the response schema" if spec.streaming else ""
    )
    app.add_api_route(
        "/run", run, methods=["POST"], response_model=spec.output_type, description=doc
    )

    @app.get("/health")
    async def health():
        if ready is not None and not ready():
            return JSONResponse(error_body("starting", "service_unavailable"), status_code=503)
        return {"status": "ok", "workflow": spec.name}

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        error = WorkflowError("invalid_input", spec.name, detail or "invalid body")
        return JSONResponse(error.to_body(), status_code=422)

    return app


async def _watched(awaitable, request: Request, step: str):
    """`awaitable`'s result; cancelled (and with it the tree of calls below) if the client
    leaves meanwhile."""
    task = asyncio.ensure_future(awaitable)
    try:
        while not task.done():
            await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise WorkflowError("cancelled", step, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
    return task.result()


async def _call(entry: EntryPoint, body, timeout_s, parent, request: Request) -> JSONResponse:
    """The entry's output; the tree of calls is cancelled if the client leaves."""
    out = await _watched(entry.call(body, timeout_s, parent), request, entry.spec.name)
    return JSONResponse(out.model_dump(mode="json"))


async def _stream(entry: EntryPoint, body, timeout_s, parent, request: Request):
    """An SSE response, begun once the first item is there (an error before it gets its
    status). The items are pulled through a one-item pipe while the client's connection is
    watched: its leaving cancels the pipe's producer, and with it every call below it (a write
    to a gone client does not fail at once, so waiting for one would let the tree run on)."""
    items = entry.stream(body, timeout_s, parent)
    try:
        first = await _watched(items.__anext__(), request, entry.spec.name)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await items.aclose()
        raise

    async def source():
        if first is not None:
            yield first
            async with aclosing(items):
                async for item in items:
                    yield item

    async def events():
        feed = pipe(source(), 1)
        gone = asyncio.ensure_future(disconnected(request.receive))
        pulled = None
        try:
            while True:
                pulled = asyncio.ensure_future(feed.__anext__())
                await asyncio.wait({pulled, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not pulled.done():
                    return
                try:
                    item = pulled.result()
                except StopAsyncIteration:
                    break
                except WorkflowError as err:
                    yield f"data: {json.dumps(err.to_body())}\n\n"
                    break
                yield f"data: {item.model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            gone.cancel()
            if pulled is not None and not pulled.done():
                pulled.cancel()  # its cancellation runs pipe's cleanup: the producer is cancelled
                await asyncio.wait({pulled})
            await feed.aclose()

    # `items` is closed here too: `source` may never have started (the client gone first)
    return ClosingStreamingResponse(events(), media_type="text/event-stream", on_close=items.aclose)
