"""The samples of one HTTP request inside the engine, their latency metrics, and their spans
(--otlp-traces-endpoint): each sample's, recorded once it ends."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from mci.core.outputs import QUEUE_TIMEOUT, REQUEST_TIMEOUT, RequestOutput
from mci.core.request import KVHandoff, Resume, TenantShare
from mci.core.request_ids import prompt_request_id
from mci.core.sampling_params import SamplingParams
from mci.engine.commands import AddRequest
from mci.server.engine_supervisor import EngineDied
from mci.server.errors import RETRY_AFTER_S, HTTPError
from mci.server.state import ServerState
from mci.tenancy.tenants import DEFAULT_TENANT, Tenant
from mci.tracing import context_with_span, wall_ns


@dataclass
class _Tracker:
    """Per-sample timing (monotonic seconds) for the latency histograms and the spans."""

    prompt_tokens: int
    start: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    queue_time_s: float | None = None  # the engine's: arrival -> first scheduled
    output_tokens: int = 0  # generated here (a resumed request's earlier tokens not counted)


class Submission:
    """The samples of one HTTP request in the engine, sharing one output queue."""

    def __init__(
        self,
        state: ServerState,
        rid: str,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        priority: int,
        resume: Resume | None = None,
        trace: Context | None = None,
        tenant: Tenant | None = None,
        handoff: KVHandoff | None = None,
    ):
        """`params`: for every prompt, or one each (token healing makes them differ).
        `trace`: the parent of the samples' spans (the request's traceparent; an empty
        context starts a trace), None for no spans (tracing off, health probes).
        `tenant`: whose it is, admitted against its quotas (None: a health probe's).
        `handoff`: the request's room in a disaggregated pair (prompt k's is `room-pk`)."""
        self.state = state
        self.rid = rid
        self.trace = trace
        self.tenant = tenant
        self.tenant_name = tenant.name if tenant else DEFAULT_TENANT
        # the tenant's series, looked up once: outputs arrive per token
        self.series = state.metrics.tenants.of(self.tenant_name)
        # output tokens are counted against a budget only where the tenant has one
        self.charges_output = tenant is not None and tenant.output_tokens_per_minute is not None
        share = (
            TenantShare(tenant.name, tenant.weight, tenant.max_running_requests)
            if tenant
            else TenantShare()
        )
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.index: dict[str, int] = {}
        self.trackers: dict[str, _Tracker] = {}
        self.remaining: set[str] = set()
        self._held: list[RequestOutput] = []  # taken by wait_started, not yet by next()
        timeout = state.config.request_timeout
        queue_timeout = state.config.max_queue_time or None  # 0: no bound
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        try:
            for k, (ids, p) in enumerate(zip(prompts, per_prompt, strict=True)):
                command = AddRequest(
                    prompt_request_id(rid, k),
                    ids,
                    p,
                    priority,
                    timeout,
                    resume,
                    queue_timeout,
                    share,
                    None if handoff is None else handoff.for_prompt(k),
                )
                for sid, _ in state.engine.submit(command, queue=self.queue):
                    self.index[sid] = len(self.index)
                    self.trackers[sid] = _Tracker(len(ids))
                    self.remaining.add(sid)
                state.metrics.prompt_tokens.inc(len(ids))
                self.series.prompt_tokens.inc(len(ids) * p.n)
        except EngineDied:
            self.abort()
            if tenant is not None:  # the samples never submitted leave the tenant's queue too
                for _ in range(sum(p.n for p in per_prompt) - len(self.trackers)):
                    state.quotas.finished(tenant.name, started=False)
            raise HTTPError(503, "engine is not running", "service_unavailable") from None

    async def next(self) -> RequestOutput:
        out = self._held.pop() if self._held else await self.queue.get()
        self._observe(out)
        return out

    async def wait_started(self, request: Request) -> None:
        """Until the first output (kept for next()). A request that ends in error before any
        output raises its HTTP error; a client that leaves meanwhile aborts it."""
        first = asyncio.ensure_future(self.queue.get())
        try:
            await self._unless_disconnected(first, request)
        finally:
            if not first.done():
                first.cancel()
        out = first.result()
        if out.finished and out.error:
            self._observe(out)
            self.abort()
            raise http_error(out.error)
        self._held.append(out)

    async def _unless_disconnected(self, task: asyncio.Future, request: Request) -> None:
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                self.abort()
                raise HTTPError(499, "client disconnected", "invalid_request_error")

    def _observe(self, out: RequestOutput) -> None:
        m, tracker = self.state.metrics, self.trackers.get(out.request_id)
        if tracker is None:
            return
        now = time.monotonic()
        if tracker.queue_time_s is None:
            tracker.queue_time_s = out.queue_time_s
        t = self.series
        if out.new_token_ids:
            n = len(out.new_token_ids)
            m.generation_tokens.inc(n)
            t.generation_tokens.inc(n)
            tracker.output_tokens += n
            if tracker.last_token is None:
                tracker.first_token = now
                m.ttft.observe(now - tracker.start)
                t.ttft.observe(now - tracker.start)
                if out.queue_time_s is not None:
                    m.queue.observe(out.queue_time_s)
                    t.queue.observe(out.queue_time_s)
                if self.tenant is not None:
                    self.state.quotas.started(self.tenant_name)
            else:
                m.itl.observe((now - tracker.last_token) / n)
                t.tpot.observe((now - tracker.last_token) / n)
            if self.charges_output:
                self.state.quotas.generated(self.tenant_name, n)
            tracker.last_token = now
        if out.finished:
            self.remaining.discard(out.request_id)
            m.e2e.observe(now - tracker.start)
            if self.tenant is not None:
                self.state.quotas.finished(self.tenant_name, tracker.first_token is not None)
            m.tenants.requests.labels(self.tenant_name, out.finish_reason or "abort").inc()
            if out.finish_reason == "abort":
                m.aborted.inc()
            else:
                m.success.labels(finished_reason=out.finish_reason).inc()
            if self.trace is not None:
                self._record_spans(out.request_id, tracker, now, out)

    def abort(self) -> None:
        """Abort every unfinished sample (client gone); counted here, since nobody will read
        their final outputs."""
        for sid in list(self.remaining):
            self.state.engine.abort(sid)
            tracker, now = self.trackers.pop(sid), time.monotonic()
            if self.tenant is not None:
                self.state.quotas.finished(self.tenant_name, tracker.first_token is not None)
            self.state.metrics.tenants.requests.labels(self.tenant_name, "abort").inc()
            self.state.metrics.aborted.inc()
            self.state.metrics.e2e.observe(now - tracker.start)
            if self.trace is not None:
                self._record_spans(sid, tracker, now)
        self.remaining.clear()

    def _record_spans(
        self, sid: str, tracker: _Tracker, end: float, final: RequestOutput | None = None
    ) -> None:
        """A sample's spans, after the fact: `mci.request` (submission -> end) and its phases
        `mci.queue` (-> first scheduled), `mci.prefill` (-> first token), `mci.decode` (-> end);
        a phase the sample never reached is left out. `final`: its last output (None: aborted
        here, the client gone)."""
        end_ns = wall_ns(end)

        def ns(t: float) -> int:  # one clock reading for all: the times keep their order
            return end_ns - int((end - t) * 1e9)

        first = tracker.first_token
        reached = first if first is not None else end
        queued = tracker.queue_time_s
        scheduled = reached if queued is None else min(tracker.start + queued, reached)
        attributes = {
            "mci.request_id": self.rid,  # the response's id
            "mci.sample_id": sid,  # the engine's (and /generate's meta_info.id)
            "mci.choice_index": self.index[sid],
            "gen_ai.usage.input_tokens": tracker.prompt_tokens,
            "gen_ai.usage.output_tokens": tracker.output_tokens,
            "mci.finish_reason": "abort",
        }
        if first is not None:
            attributes["mci.ttft_s"] = first - tracker.start
        if final is not None:
            attributes["mci.finish_reason"] = final.finish_reason or "abort"
            attributes["mci.cached_tokens"] = final.num_cached_tokens
            if final.output_token_ids:  # the response's count (a resumed request's included)
                attributes["gen_ai.usage.output_tokens"] = len(final.output_token_ids)
            if final.error:
                attributes["mci.error"] = final.error
        tracing = self.state.tracing
        span = tracing.tracer.start_span(
            "mci.request",
            context=self.trace,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=ns(tracker.start),
        )
        if final is not None and final.error:
            span.set_status(Status(StatusCode.ERROR, final.error))
        inside = context_with_span(span, self.trace)
        tracing.span_between("mci.queue", ns(tracker.start), ns(scheduled), inside)
        if queued is not None or first is not None:
            tracing.span_between("mci.prefill", ns(scheduled), ns(reached), inside)
        if first is not None:
            tracing.span_between("mci.decode", ns(first), end_ns, inside)
        span.end(end_time=end_ns)

    async def collect(self, request: Request) -> dict[str, RequestOutput]:
        """Wait for every sample to finish; abort them all if the client goes away."""
        finals: dict[str, RequestOutput] = {}

        async def gather():
            while self.remaining:
                out = await self.next()
                if out.finished:
                    finals[out.request_id] = out

        task = asyncio.ensure_future(gather())
        try:
            await self._unless_disconnected(task, request)
        finally:
            if not task.done():
                task.cancel()
        errors = [o.error for o in finals.values() if o.error]
        if errors:
            raise http_error(errors[0])
        return finals


def http_error(error: str) -> HTTPError:
    """The HTTP answer to a request the engine ended with `error` (before anything was sent)."""
    if error == REQUEST_TIMEOUT:
        return HTTPError(504, error, "timeout")
    if error == QUEUE_TIMEOUT:
        return HTTPError(503, error, "service_unavailable", headers={"Retry-After": RETRY_AFTER_S})
    return HTTPError(503, error, "server_error")
