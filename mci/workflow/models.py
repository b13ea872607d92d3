"""Models as a step sees them: one client type, `ModelClient`, whether the model is an
in-process `mci.Engine` or an OpenAI-compatible server (`mci serve`, `mci router`, any other).

    step ─complete/stream─▶ ModelClient ─┬─ EngineModel (engine_model.py): Engine.stream here
                                         └─ ServerModel (server_model.py): {url}/v1/completions

Every call takes the workflow request's deadline (context.py) as its timeout: the engine
aborts the request at the deadline itself (its KV freed at once), a server's connection is
closed at it (the server aborts a request whose client left). A cancelled call (the workflow's
client left) ends the same way. Each call is a `model NAME` span with its TTFT, token counts
and finish reason; a server call carries the span as its `traceparent`, so `mci serve` joins
the trace. One ModelPool (model_pool.py) per process holds the clients.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry import trace

from mci.tracing import Tracing
from mci.workflow import context
from mci.workflow.context import CallContext
from mci.workflow.errors import WorkflowError

SAMPLING = ("max_tokens", "temperature", "top_p", "stop", "seed", "ignore_eos")


@dataclass(frozen=True)
class ModelSpec:
    """Which model: a checkpoint run in process (`path`, with engine settings) or a server
    (`url`, with the model name it serves). Equal specs are one model in a process."""

    path: str | None = None
    url: str | None = None
    name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    engine_flags: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, path, url, name, api_key, engine_flags: dict) -> ModelSpec:
        if path is not None and url is not None:
            raise ValueError("a model is a checkpoint path or a server url, not both")
        if url is not None and engine_flags:
            raise ValueError("engine settings apply to an in-process model (path), not a url")
        url = url.rstrip("/") if url else None
        return cls(path, url, name, api_key, tuple(sorted(engine_flags.items())))

    @property
    def label(self) -> str:
        if self.name or self.url:
            return self.name or self.url
        return Path(self.path).name if self.path else "default-model"


@dataclass
class Completion:
    """A model call's result."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None


@dataclass
class Delta:
    """A piece of a model's answer: new text, and whatever the backend knows so far (a
    finish reason, token counts; None where this piece does not say)."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class ModelClient:
    """One model, as steps call it. `complete` returns the whole text; `stream` yields text
    deltas as the model writes them. Sampling: max_tokens, temperature (0 = greedy), top_p,
    stop, seed, ignore_eos; anything else is a TypeError."""

    def __init__(self, spec: ModelSpec, tracing: Tracing):
        self.spec, self.tracing = spec, tracing

    @property
    def name(self) -> str:
        return self.spec.label

    async def complete(self, prompt: str, **sampling) -> Completion:
        parts: list[str] = []
        result: list[Completion] = []
        async with aclosing(self._traced(prompt, sampling, result)) as pieces:
            async for piece in pieces:
                parts.append(piece)
        done = result[0]
        done.text = "".join(parts)
        return done

    async def stream(self, prompt: str, **sampling) -> AsyncIterator[str]:
        async with aclosing(self._traced(prompt, sampling, [])) as pieces:
            async for piece in pieces:
                yield piece

    async def _traced(self, prompt, sampling, result: list) -> AsyncIterator[str]:
        """The call under its span and the deadline; appends a Completion to `result`."""
        unknown = set(sampling) - set(SAMPLING)
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        call = context.current()
        step = call.path[-1] if call.path else self.name
        if call.expired():
            raise WorkflowError("deadline_exceeded", step, f"deadline passed before {self.name}")
        span = self.tracing.tracer.start_span(
            f"model {self.name}",
            kind=trace.SpanKind.CLIENT,
            attributes={"mci.model": self.name, "mci.retries": 0},
        )
        start, ttft = time.monotonic(), None
        reason, prompt_tokens, completion_tokens = None, 0, 0
        deltas = self._deltas(prompt, sampling, call, step, span)
        try:
            async for delta in deltas:
                # pieces say different things (a usage chunk has no finish reason): merge them
                reason = delta.finish_reason or reason
                if delta.prompt_tokens is not None:
                    prompt_tokens = delta.prompt_tokens
                if delta.completion_tokens is not None:
                    completion_tokens = delta.completion_tokens
                if delta.text:
                    ttft = time.monotonic() - start if ttft is None else ttft
                    yield delta.text
        except GeneratorExit:  # the consumer stopped early: not an error of the call
            raise
        except BaseException as exc:
            span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
            raise
        finally:
            await deltas.aclose()  # here, not by the garbage collector in some other task
            span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": prompt_tokens,
                    "gen_ai.usage.output_tokens": completion_tokens,
                    "mci.ttft_s": ttft if ttft is not None else -1.0,
                    "mci.finish_reason": reason or "none",
                }
            )
            span.end()
        result.append(Completion("", reason, prompt_tokens, completion_tokens, ttft))

    def _deltas(
        self, prompt: str, sampling: dict, call: CallContext, step: str, span
    ) -> AsyncIterator[Delta]:
        """The backend's pieces of one call (an async generator)."""
        raise NotImplementedError

    async def close(self) -> None:
        pass
