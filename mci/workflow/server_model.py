"""A model behind an OpenAI-compatible server: `POST {url}/v1/completions`, streamed (SSE).

The call's deadline bounds every wait (the response's head, each line); at the deadline the
connection is closed, which makes the server abort the request. A server that refuses the call
before answering anything (connection refused, 429, 502, 503) is tried again, at most
SERVER_RETRIES times and never past the deadline; once any text has arrived the call is never
sent again (that would repeat the text), so a later failure is the step's to handle.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from mci.tracing import Tracing, context_with_span
from mci.workflow.context import CallContext
from mci.workflow.errors import WorkflowError
from mci.workflow.models import Delta, ModelClient, ModelSpec

CONNECT_TIMEOUT_S = 5.0
SERVER_RETRIES = 2
REFUSALS = (429, 502, 503)  # the server took nothing: another try may succeed


class ServerModel(ModelClient):
    """An OpenAI-compatible server's completions endpoint."""

    def __init__(self, spec: ModelSpec, tracing: Tracing, transport=None):
        super().__init__(spec, tracing)
        headers = {"authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=spec.url,
            headers=headers,
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            transport=transport,  # tests: an httpx.MockTransport
        )
        self._served_name = spec.name

    async def _model_name(self, call: CallContext, step: str) -> str:
        if self._served_name is None:
            response = await _until(call, self._client.get("/v1/models"), step, self.name)
            try:
                response.raise_for_status()
                self._served_name = response.json()["data"][0]["id"]
            except (httpx.HTTPStatusError, KeyError, IndexError, ValueError) as exc:
                raise WorkflowError(
                    "model_error", step, f"{self.name}: /v1/models: {exc}"
                ) from None
        return self._served_name

    def _body(self, prompt: str, sampling: dict) -> dict:
        body = {
            "prompt": prompt,
            "max_tokens": sampling.get("max_tokens", 64),
            "temperature": sampling.get("temperature", 0.0),
            "top_p": sampling.get("top_p", 1.0),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for key in ("stop", "seed", "ignore_eos"):
            if sampling.get(key) is not None:
                body[key] = sampling[key]
        return body

    async def _deltas(self, prompt, sampling, call, step, span):
        body = self._body(prompt, sampling)
        headers = Tracing.inject({}, context_with_span(span))
        for attempt in range(SERVER_RETRIES + 1):
            span.set_attribute("mci.retries", attempt)
            last_try = attempt == SERVER_RETRIES
            try:
                body["model"] = await self._model_name(call, step)
                request = self._client.build_request(
                    "POST", "/v1/completions", json=body, headers=headers
                )
                response = await _until(
                    call, self._client.send(request, stream=True), step, self.name
                )
            except httpx.TransportError as exc:  # nothing was taken: try again
                if last_try or call.expired():
                    raise self._failed(step, f"{type(exc).__name__}: {exc}") from None
                await _backoff(attempt, call)
                continue
            try:
                if response.status_code in REFUSALS and not last_try:
                    await _backoff(attempt, call)
                    continue
                if response.status_code != 200:
                    raw = await _until(call, response.aread(), step, self.name)
                    code = response.status_code
                    message = f"answered {code}: {raw.decode(errors='replace')[:300]}"
                    # a 4xx other than 429 is the request's fault: another try would fail too
                    raise self._failed(step, message, retryable=code >= 500 or code == 429)
                lines = response.aiter_lines()
                while True:
                    try:
                        line = await _until(call, lines.__anext__(), step, self.name)
                    except StopAsyncIteration:
                        return
                    except httpx.TransportError as exc:  # mid-answer: never sent again
                        raise self._failed(step, f"{type(exc).__name__}: {exc}") from None
                    delta = _parse_sse(line, step, self.name)
                    if delta is not None:
                        yield delta
            finally:
                await response.aclose()  # at the deadline too: the server aborts the request

    def _failed(self, step: str, message: str, retryable: bool = True) -> WorkflowError:
        return WorkflowError("model_error", step, f"{self.name}: {message}", retryable=retryable)

    async def close(self) -> None:
        await self._client.aclose()


def _parse_sse(line: str, step: str, name: str) -> Delta | None:
    """One SSE line of a completions stream (None: not a data event, or [DONE])."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    event = json.loads(line[6:])
    if "error" in event:
        error = event["error"]
        message = error.get("message") if isinstance(error, dict) else str(error)
        raise WorkflowError("model_error", step, f"{name}: {message}")
    usage = event.get("usage") or {}
    choice = (event.get("choices") or [{}])[0]
    return Delta(
        choice.get("text", ""),
        choice.get("finish_reason"),
        usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
    )


async def _backoff(attempt: int, call: CallContext) -> None:
    delay = 0.05 * 2**attempt
    remaining = call.remaining_s()
    await asyncio.sleep(delay if remaining is None else max(0.0, min(delay, remaining)))


async def _until(call: CallContext, awaitable, step: str, name: str):
    """`awaitable`, cut at the call's deadline (its task cancelled: the caller then closes
    the response, and the server sees the client leave)."""
    remaining = call.remaining_s()
    if remaining is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, max(remaining, 0.0))
    except asyncio.TimeoutError:
        raise WorkflowError("deadline_exceeded", step, f"{name} passed the deadline") from None
