"""OpenTelemetry traces: one `Tracing` per process part that emits spans (a server's front end,
the router, a workflow runner), exporting over OTLP/HTTP to `--otlp-traces-endpoint` (vLLM's
and SGLang's flag name).

Nothing here is global: a `Tracing` owns its TracerProvider and never installs it as the
process's default, so two parts in one process (tests, a workflow beside an in-process engine)
keep their own service names and exporters. Without an endpoint the tracer is OpenTelemetry's
no-op one: spans cost nothing, and a W3C `traceparent` that arrived still propagates onward
(a no-op span carries its parent's context), so a hop that does not record never breaks a
trace.

The SDK and exporter are imported only when an endpoint is given.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

OTLP_TRACES_PATH = "/v1/traces"
EXPORT_DELAY_MS = 500  # spans leave within half a second (the SDK's default is 5 s)
_PROPAGATOR = TraceContextTextMapPropagator()  # stateless: W3C traceparent / tracestate


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: an endpoint given as a bare host:port (or with no path) gets
    the standard `/v1/traces` path, as OpenTelemetry's own OTEL_EXPORTER_OTLP_ENDPOINT does."""
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    return (
        endpoint
        if urlsplit(endpoint).path not in ("", "/")
        else endpoint.rstrip("/") + (OTLP_TRACES_PATH)
    )


class Tracing:
    """A tracer for one service, exporting to an OTLP/HTTP endpoint (or a no-op one)."""

    def __init__(self, endpoint: str | None, service_name: str):
        self.endpoint = traces_url(endpoint) if endpoint else None
        self._provider = None
        if self.endpoint is None:
            self.tracer = trace.NoOpTracer()
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=self.endpoint), schedule_delay_millis=EXPORT_DELAY_MS
            )
        )
        self.tracer = self._provider.get_tracer("mci")

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    @staticmethod
    def extract(headers: Mapping[str, str]) -> otel_context.Context:
        """The trace context a request's `traceparent` header carries (an empty context if
        none): the parent of the spans this hop makes."""
        return _PROPAGATOR.extract(carrier={k.lower(): v for k, v in headers.items()})

    @staticmethod
    def inject(headers: dict, context: otel_context.Context | None = None) -> dict:
        """Add `traceparent` (and `tracestate`) for `context` (default: the current one) to
        `headers`, so the next hop joins the trace. Returns `headers`."""
        _PROPAGATOR.inject(carrier=headers, context=context)
        return headers

    def span_between(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        parent: otel_context.Context | None = None,
        attributes: Mapping | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    ) -> trace.Span:
        """A span recorded after the fact, between two wall-clock times (ns since the epoch):
        the engine's phases are known only once a request has passed them."""
        span = self.tracer.start_span(
            name, context=parent, kind=kind, attributes=dict(attributes or {}), start_time=start_ns
        )
        span.end(end_time=end_ns)
        return span

    def shutdown(self) -> None:
        """Export what is pending and stop (at a process's exit)."""
        if self._provider is not None:
            self._provider.shutdown()


def wall_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as wall-clock ns since the epoch (spans take wall times;
    durations are measured on the monotonic clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def context_with_span(span: trace.Span, parent: otel_context.Context | None = None):
    """`parent` (default: the current context) with `span` as the active span: the context to
    give a child span or to inject into a call's headers."""
    return trace.set_span_in_context(span, parent)
