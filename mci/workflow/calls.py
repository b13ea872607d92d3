"""A call of a step, as its caller makes it: `StepHandle`, the same whether the step runs in
this process or in a Ray Serve replica (the `Transport` is what differs).

    caller ─call/stream─▶ StepHandle: input checked against the step's type,
                          span `step NAME`, deadline, retries with backoff
                              └─ Transport: one attempt (LocalTransport: the step's own
                                 object here; ray_app.RayTransport: a replica's method)

Invariants:
- the handle is the only place a step is retried, and only while the error is retryable and
  the step idempotent; a stream is retried only before its first item (what was sent stays
  sent);
- every attempt runs under the request's CallContext (the deadline, cut to the step's own
  `timeout_s`), and the handle stops waiting a few ms after the deadline, cancelling
  the attempt (and with it every call below it); inner handles stop first, so the error
  names the innermost step that was running;
- what leaves a handle is the step's output type, or a final WorkflowError.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from contextlib import aclosing

from opentelemetry import context as otel_context
from opentelemetry import trace
from pydantic import BaseModel, ValidationError

from mci.tracing import Tracing, context_with_span
from mci.workflow import context
from mci.workflow.context import CallContext, handle_grace_s
from mci.workflow.errors import WorkflowError
from mci.workflow.steps import StepSpec
from mci.workflow.streams import pipe


def as_type(model: type[BaseModel], value, kind: str, step: str) -> BaseModel:
    """`value` (the model itself, another pydantic model or a dict) as `model`."""
    if type(value) is model:
        return value
    try:
        if isinstance(value, BaseModel):
            value = value.model_dump()
        return model.model_validate(value)
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors()
        )
        raise WorkflowError(kind, step, f"not a {model.__name__}: {detail}") from None


@contextlib.contextmanager
def entered(call: CallContext, trace_context: otel_context.Context | None):
    """Run a step's code under `call` and with the caller's span as the current one."""
    token = context.CURRENT.set(call)
    trace_token = otel_context.attach(trace_context) if trace_context is not None else None
    try:
        yield
    finally:
        if trace_token is not None:
            otel_context.detach(trace_token)
        context.CURRENT.reset(token)


class Transport:
    """One attempt at a step's call: `call` returns its output (as the step's output type),
    `stream` yields its items; both raise WorkflowError for what failed."""

    async def call(self, x: BaseModel, call: CallContext, trace_context) -> BaseModel:
        raise NotImplementedError

    def stream(self, x: BaseModel, call: CallContext, trace_context) -> AsyncIterator[BaseModel]:
        raise NotImplementedError


class LocalTransport(Transport):
    """The step's object in this process."""

    def __init__(self, spec: StepSpec, instance):
        self.spec, self.instance = spec, instance

    async def call(self, x, call, trace_context):
        with entered(call, trace_context):
            try:
                out = await self.instance.run(x)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise WorkflowError.wrap(exc, self.spec.name) from None
        return as_type(self.spec.output_type, out, "invalid_output", self.spec.name)

    async def stream(self, x, call, trace_context):
        with entered(call, trace_context):
            try:
                async with aclosing(self.instance.run(x)) as items:
                    async for item in items:
                        yield as_type(self.spec.output_type, item, "invalid_output", self.spec.name)
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:
                raise WorkflowError.wrap(exc, self.spec.name) from None


class StepHandle:
    """What a step holds for each step it depends on: `await h.call(x)` (or `await h(x)`)
    and `async for item in h.stream(x)`; `x` may be the input model or a dict of it."""

    def __init__(self, spec: StepSpec, transport: Transport, tracing: Tracing):
        self.spec, self.transport, self.tracing = spec, transport, tracing
        self.name = spec.name

    def _begin(self, x, within: CallContext | None) -> tuple[BaseModel, CallContext]:
        caller = within if within is not None else context.current()
        if within is not None or not caller.path:  # the request's own input: the client's fault
            value = as_type(self.spec.input_type, x, "invalid_input", self.name)
        else:  # a step passed a wrong input: that step's bug, not the client's
            try:
                value = as_type(self.spec.input_type, x, "invalid_input", self.name)
            except WorkflowError as err:
                message = f"called {self.name} with an input that is {err.message}"
                raise WorkflowError("step_error", caller.path[-1], message, False) from None
        return value, caller.within(self.spec.config.timeout_s).entering(self.name)

    def _deadline_error(self) -> WorkflowError:
        return WorkflowError("deadline_exceeded", self.name, "the deadline passed")

    async def _bounded(self, awaitable, call: CallContext):
        remaining = call.remaining_s()
        if remaining is None:
            return await awaitable
        try:
            grace = handle_grace_s(len(call.path))
            return await asyncio.wait_for(awaitable, max(remaining + grace, 0.0))
        except asyncio.TimeoutError:
            raise self._deadline_error() from None

    async def _retry_or_raise(self, err: WorkflowError, attempt: int, call, span) -> None:
        """Back off before the next attempt, or raise `err` as final."""
        config = self.spec.config
        last = attempt + 1 >= config.attempts
        delay = config.retry_backoff_s * 2**attempt * random.uniform(0.5, 1.0)
        remaining = call.remaining_s()
        if not err.retryable or last or (remaining is not None and remaining <= delay):
            span.set_status(trace.StatusCode.ERROR, err.kind)
            span.set_attributes({"mci.error.kind": err.kind, "mci.error.step": err.step})
            raise err.final()
        span.add_event("retry", {"mci.attempt": attempt + 1, "mci.error": err.message[:200]})
        await asyncio.sleep(delay)

    def _span(self, kind: str, trace_parent):
        return self.tracing.tracer.start_span(
            f"step {self.name}",
            context=trace_parent,
            attributes={"mci.step": self.name, "mci.call": kind},
        )

    async def call(self, x, *, within: CallContext | None = None, trace_parent=None) -> BaseModel:
        """The step's output. `within` / `trace_parent`: the call context and trace parent
        (default: the caller's own; a workflow's entry point gives them explicitly)."""
        if self.spec.streaming:
            raise TypeError(f"step {self.name} streams: use .stream()")
        value, call = self._begin(x, within)
        span = self._span("call", trace_parent)
        try:
            for attempt in range(self.spec.config.attempts):
                span.set_attribute("mci.retries", attempt)
                if call.expired():
                    raise self._deadline_error()
                try:
                    attempt_call = self.transport.call(value, call, context_with_span(span))
                    return await self._bounded(attempt_call, call)
                except WorkflowError as err:
                    await self._retry_or_raise(err, attempt, call, span)
                except Exception as exc:  # a transport's own failure, typed here
                    await self._retry_or_raise(
                        WorkflowError.wrap(exc, self.name), attempt, call, span
                    )
        except WorkflowError as err:
            span.set_status(trace.StatusCode.ERROR, err.kind)
            raise err.final() from None
        finally:
            span.end()
        raise AssertionError("unreachable")  # pragma: no cover

    __call__ = call

    async def stream(
        self, x, *, within: CallContext | None = None, trace_parent=None
    ) -> AsyncIterator[BaseModel]:
        """The step's items as they come (`within` / `trace_parent` as for `call`)."""
        if not self.spec.streaming:
            raise TypeError(f"step {self.name} does not stream: use .call()")
        value, call = self._begin(x, within)
        span = self._span("stream", trace_parent)
        sent = 0
        try:
            for attempt in range(self.spec.config.attempts):
                span.set_attribute("mci.retries", attempt)
                if call.expired():
                    raise self._deadline_error()
                # the transport's generator runs in pipe's producer task: its context is its own
                source = self.transport.stream(value, call, context_with_span(span))
                items = pipe(source, self.spec.config.stream_buffer)
                try:
                    while True:
                        try:
                            item = await self._bounded(items.__anext__(), call)
                        except StopAsyncIteration:
                            span.set_attribute("mci.items", sent)
                            return
                        sent += 1
                        yield item
                except Exception as exc:
                    err = WorkflowError.wrap(exc, self.name)  # a transport's own failure typed
                    if sent:
                        err.retryable = False  # what was sent stays sent
                    await self._retry_or_raise(err, attempt, call, span)
                finally:
                    await items.aclose()
        except WorkflowError as err:
            span.set_status(trace.StatusCode.ERROR, err.kind)
            raise err.final() from None
        finally:
            span.end()


class EntryPoint:
    """The root of each workflow request: its deadline (`timeout_s` from now) and its
    `workflow NAME` span, a child of the trace the request arrived with (if any)."""

    def __init__(self, handle: StepHandle, tracing: Tracing):
        self.handle, self.tracing = handle, tracing
        self.spec = handle.spec

    def _root(self, timeout_s, trace_parent):
        span = self.tracing.tracer.start_span(
            f"workflow {self.spec.name}",
            context=trace_parent,
            kind=trace.SpanKind.SERVER,
            attributes={"mci.workflow": self.spec.name},
        )
        return CallContext().within(timeout_s), span

    async def call(self, x, timeout_s: float | None = None, trace_parent=None) -> BaseModel:
        root, span = self._root(timeout_s, trace_parent)
        try:
            return await self.handle.call(
                x, within=root, trace_parent=context_with_span(span, trace_parent)
            )
        except WorkflowError as err:
            span.set_status(trace.StatusCode.ERROR, err.kind)
            raise
        finally:
            span.end()

    async def stream(
        self, x, timeout_s: float | None = None, trace_parent=None
    ) -> AsyncIterator[BaseModel]:
        root, span = self._root(timeout_s, trace_parent)
        try:
            items = self.handle.stream(
                x, within=root, trace_parent=context_with_span(span, trace_parent)
            )
            async with aclosing(items):
                async for item in items:
                    yield item
        except WorkflowError as err:
            span.set_status(trace.StatusCode.ERROR, err.kind)
            raise
        finally:
            span.end()
