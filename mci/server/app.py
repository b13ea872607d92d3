"""The OpenAI-compatible HTTP front end (FastAPI). No model code runs here.

Every request: guard (size limit, API key) -> parse and validate (400 names the parameter)
-> admission (503 while draining or without an engine, 429 with Retry-After when the queue is
full) -> tokenize -> submit to the engine process -> stream or collect outputs. A client that
disconnects has its samples aborted at once (the engine frees their KV slots in its next step).
With --otlp-traces-endpoint each sample's spans join the request's W3C `traceparent`
(submission.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.context import Context
from prometheus_client import CONTENT_TYPE_LATEST

from mci import __version__
from mci.cache.tiers import shared_store
from mci.core.outputs import RequestOutput
from mci.core.request_ids import new_request_id
from mci.core.sampling_params import SamplingParams
from mci.server import requests, responses
from mci.server.errors import RETRY_AFTER_S, HTTPError, install_error_handlers
from mci.server.guard import GuardMiddleware
from mci.server.handoff import bootstrap_address, handoff_of
from mci.server.openai_types import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    ModelCard,
    ModelList,
)
from mci.server.state import ServerState
from mci.server.streaming import (
    StreamContext,
    stream_chat,
    stream_completion,
    stream_native,
    streaming_response,
)
from mci.server.submission import Submission
from mci.server.tool_calls import plan_tools
from mci.tenancy.tenants import Tenant

log = logging.getLogger("mci")


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise HTTPError(
            400,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _admit(state: ServerState, request: Request, num_samples: int, prompt_tokens: int) -> Tenant:
    """The request's tenant, once its tenant's quotas and then the server's bounds admit it
    (403 for a model the tenant may not use, 429 over a quota: Retry-After from the tenant's
    own budget; the server's own bound is the last line)."""
    tenant = request.state.tenant
    if not tenant.allows_model(state.model_name):
        raise HTTPError(
            403,
            f"tenant {tenant.name} may not use model {state.model_name!r}",
            "permission_error",
            "model",
            "model_not_allowed",
        )
    if state.draining or not state.engine.ready:
        _admit_server(state, num_samples)  # 503s before any quota is taken
    refusal = state.quotas.admit(tenant, num_samples, prompt_tokens)
    if refusal is not None:
        state.metrics.rejected.inc()
        state.metrics.tenants.rejected.labels(tenant=tenant.name, reason=refusal.reason).inc()
        raise HTTPError(
            429,
            refusal.message,
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(refusal.retry_after_s)},
        )
    try:
        _admit_server(state, num_samples)
    except HTTPError:
        for _ in range(num_samples):
            state.quotas.finished(tenant.name, started=False)
        state.metrics.tenants.rejected.labels(tenant=tenant.name, reason="server").inc()
        raise
    return tenant


def _admit_server(state: ServerState, num_samples: int) -> None:
    if state.draining:
        state.metrics.rejected.inc()
        raise HTTPError(503, "server is shutting down", "service_unavailable")
    if not state.engine.ready:
        state.metrics.rejected.inc()
        raise HTTPError(503, "engine is not running", "service_unavailable")
    queued = max(0, state.engine.num_in_flight - state.max_running)
    if queued + num_samples > state.config.max_queued_requests:
        state.metrics.rejected.inc()
        raise HTTPError(
            429,
            f"server is at capacity ({queued} requests queued); retry later",
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": RETRY_AFTER_S},
        )


@dataclass(frozen=True)
class PromptIds:
    """A request's prompts as given (`ids`, for echo) and as computed (`computed`: token
    healing may have backed them off), and each prompt's params."""

    ids: list[list[int]]
    computed: list[list[int]]
    params: list[SamplingParams]


def _prompt_ids(
    state: ServerState, prompts, params: SamplingParams, names, heal: bool | None = None
) -> PromptIds:
    """Every prompt's ids and params, each checked with its completion against the context
    length, under the endpoint's names for the fields (400s before anything is queued).
    `heal`: the request's token_healing (None: the server's default, which gives way where
    healing cannot apply)."""
    asked = heal is not None
    heal = heal if asked else state.config.token_healing
    with requests.reported_as(names):
        encoded = [state.front.encode(p) for p in prompts]
        healed = [
            state.front.heal(ids, params, asked) if heal else (ids, params) for ids in encoded
        ]
        for ids, p in healed:
            state.front.check(ids, p)
    return PromptIds(encoded, [h[0] for h in healed], [h[1] for h in healed])


async def _check_constraints(state: ServerState, per_prompt: list[SamplingParams], names) -> None:
    """Compile the requests' output constraints (cached) off the event loop: a bad schema,
    regex or grammar is a 400 here, before anything is queued."""
    with requests.reported_as(names):
        for params in {p.constraint: p for p in per_prompt if p.constraint}.values():
            await asyncio.to_thread(state.front.check_constraint, params)


_ERRORS = {
    400: "bad input: the field is named in error.param",
    401: "missing or wrong API key",
    413: "request body too large",
    429: "queue full; retry after Retry-After seconds",
    503: "draining, or no engine",
    504: "request timed out",
}


# One server-sent event of a stream: `data` is a JSON chunk (the 200 body's chunk form), an
# error body, or the final `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def _responses(ok_model=None, stream: bool = False, errors=(400, 401, 413, 429, 503, 504)):
    """OpenAPI responses of a route: its body, and OpenAI error bodies for each failure."""
    out: dict = {code: {"model": ErrorResponse, "description": _ERRORS[code]} for code in errors}
    if ok_model is not None:
        out[200] = {"model": ok_model}
        if stream:
            out[200]["content"] = {"text/event-stream": {"schema": _SSE_EVENT}}
    return out


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application over a running engine client."""
    app = FastAPI(
        title="mci",
        version=__version__,
        description="OpenAI-compatible API of mci (mission-critical inference)",
    )
    app.state.mci = state
    app.add_middleware(GuardMiddleware, config=state.config, tenants=lambda: state.tenants)
    install_error_handlers(app)
    _document_400_not_422(app)

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health():
        """Readiness: an engine is running and making progress (or idle), and the server is
        not draining. 503 while the engine restarts after a crash or a hang."""
        if state.draining or not state.engine.ready:
            return JSONResponse({"status": "unavailable"}, 503)
        return {"status": "ok"}

    @app.get("/readyz", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def readyz():
        """Readiness (Kubernetes' name): the same as /health."""
        return await health()

    @app.get("/livez", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def livez():
        """Liveness: this process answers and can still serve. 200 while the engine restarts
        (the server heals itself; restarting the pod would lose the requests kept for the new
        engine); 503 once the restart budget is spent and the engine stays down."""
        if state.engine.gave_up:
            return JSONResponse({"status": "engine down for good"}, 503)
        return {"status": "ok"}

    @app.get(
        "/health_generate",
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse}},
    )
    async def health_generate():
        """Generates one token through the engine."""
        if state.draining or not state.engine.ready:
            return JSONResponse({"status": "unavailable"}, 503)
        params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        ids = [state.model_config.bos_token_id or 0]
        try:
            sub = Submission(state, new_request_id("health"), [ids], params, -1)
        except HTTPError:
            return JSONResponse({"status": "unavailable"}, 503)
        try:
            out = await asyncio.wait_for(sub.next(), state.config.health_generate_timeout)
            while not out.finished:
                out = await asyncio.wait_for(sub.next(), state.config.health_generate_timeout)
        except asyncio.TimeoutError:
            sub.abort()
            return JSONResponse({"status": "engine not generating"}, 503)
        if out.error:
            return JSONResponse({"status": out.error}, 503)
        return {"status": "ok"}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
    )
    async def metrics():
        """Prometheus metrics (vLLM's names with an `mci:` prefix)."""
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info", include_in_schema=False)
    async def server_info():
        """This replica's labels, model and shared KV store: what the router's residency rule
        and its cache-aware policy read."""
        return {
            "region": state.config.region,
            "pool": state.config.pool,
            "model": state.model_name,
            "hicache_store": shared_store(state.hicache_store, state.engine.stats.get("hicache")),
            "disaggregation_mode": state.disaggregation.disaggregation_mode,
            "disaggregation_bootstrap": bootstrap_address(state.disaggregation),
        }

    @app.get("/internal/state", include_in_schema=False)
    async def internal_state():
        """Engine stats and a live KV integrity check (operators and tests)."""
        if not state.engine.ready:
            raise HTTPError(503, "engine is not running", "service_unavailable")
        return {
            **await state.engine.state(),
            "in_flight": state.engine.num_in_flight,
            "engine_pid": state.engine.process.pid,
            "front_end": {"pid": os.getpid(), "memory": state.memory()},
            "tenant_quotas": state.quotas.snapshot(),  # the engine's "tenants": their shares
        }

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "mci",
            "max_model_len": state.context_length,
        }

    @app.get("/v1/models", response_model=ModelList, responses=_responses(errors=(401,)))
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=ModelCard,
        responses=_responses(errors=(401,))
        | {404: {"model": ErrorResponse, "description": "no such model"}},
    )
    async def retrieve_model(model_id: str):
        if model_id != state.model_name:
            raise HTTPError(
                404,
                f"model {model_id!r} does not exist; this server serves {state.model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return model_card()

    @app.post("/v1/completions", responses=_responses(CompletionResponse, stream=True))
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        handoff = handoff_of(request.headers, state.disaggregation)
        params = requests.completion_params(body)
        texts = requests.completion_prompts(body)
        got = _prompt_ids(state, texts, params, requests.COMPLETION_NAMES, body.token_healing)
        await _check_constraints(state, got.params, requests.COMPLETION_NAMES)
        prompts = list(zip(texts, got.ids, strict=True))  # as given: what echo repeats
        with requests.reported_as(requests.COMPLETION_NAMES):
            resume = requests.resume_of(body, len(prompts))
            if resume is not None:
                state.front.check_resume(params, resume)
        tenant = _admit(state, request, len(prompts) * params.n, _tokens(got.computed, params))
        rid = new_request_id("cmpl")
        trace = _trace_parent(state, request)
        priority = _priority(body.priority, tenant)
        sub = Submission(
            state, rid, got.computed, got.params, priority, resume, trace, tenant, handoff
        )
        ctx = StreamContext(
            state,
            sub,
            rid,
            prompts,
            params,
            bool(body.echo),
            _include_usage(body),
            return_token_ids=bool(body.return_token_ids),
            resumed_tokens=len(resume.output_ids) if resume else 0,
        )
        if body.stream:
            return await streaming_response(stream_completion(ctx), ctx, request)
        finals = await sub.collect(request)
        results = _group(finals, sub, len(prompts), params.n)
        response = responses.completion_response(
            state.model_name, state.tokenizer, prompts, results, params, ctx.echo, rid
        )
        return _with_token_ids(response, results, body.return_token_ids)

    @app.post("/v1/chat/completions", responses=_responses(ChatCompletionResponse, stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        handoff = handoff_of(request.headers, state.disaggregation)
        with requests.reported_as(requests.CHAT_NAMES):
            tools = plan_tools(body.tools, body.tool_choice, state.tool_format)
        reasoning = state.config.reasoning_parser is not None
        params = requests.chat_params(body, tools, reasoning, state.think_end_id)
        ids = requests.chat_prompt_ids(state.tokenizer, body)
        got = _prompt_ids(state, [ids], params, requests.CHAT_NAMES, heal=False)
        await _check_constraints(state, got.params, requests.CHAT_NAMES)
        with requests.reported_as(requests.CHAT_NAMES):
            resume = requests.resume_of(body, 1)
            if resume is not None:
                state.front.check_resume(params, resume)
        tenant = _admit(state, request, params.n, _tokens([ids], params))
        rid = new_request_id("chatcmpl")
        trace = _trace_parent(state, request)
        priority = _priority(body.priority, tenant)
        sub = Submission(state, rid, [ids], params, priority, resume, trace, tenant, handoff)
        if body.stream:
            ctx = StreamContext(
                state,
                sub,
                rid,
                [(None, ids)],
                params,
                include_usage=_include_usage(body),
                tools=tools,
                reasoning=reasoning,
                return_token_ids=bool(body.return_token_ids),
                resumed_tokens=len(resume.output_ids) if resume else 0,
            )
            return await streaming_response(stream_chat(ctx), ctx, request)
        finals = await sub.collect(request)
        outs = _group(finals, sub, 1, params.n)[0]
        response = responses.chat_response(
            state.model_name, state.tokenizer, len(ids), outs, rid, tools, reasoning
        )
        return _with_token_ids(response, [outs], body.return_token_ids)

    @app.post(
        "/generate",
        responses=_responses(GenerateResponse | list[GenerateResponse], stream=True),
    )
    async def native_generate(body: GenerateRequest, request: Request):
        """SGLang's native API: text or input_ids, sampling_params, stream."""
        handoff = handoff_of(request.headers, state.disaggregation)
        params = requests.native_params(body.sampling_params)
        prompts = requests.generate_prompts(body)
        single = isinstance(body.text, str) or (
            body.input_ids is not None and isinstance(body.input_ids[0], int)
        )
        heal = body.sampling_params.token_healing if body.sampling_params else None
        got = _prompt_ids(state, prompts, params, requests.NATIVE_NAMES, heal)
        encoded = got.ids  # as given (prompt lengths in the responses)
        await _check_constraints(state, got.params, requests.NATIVE_NAMES)
        tenant = _admit(state, request, len(prompts) * params.n, _tokens(got.computed, params))
        rid = new_request_id("gen")
        trace = _trace_parent(state, request)
        priority = _priority(body.priority, tenant)
        sub = Submission(
            state,
            rid,
            got.computed,
            got.params,
            priority,
            trace=trace,
            tenant=tenant,
            handoff=handoff,
        )
        if body.stream:
            ctx = StreamContext(state, sub, rid, list(zip(prompts, encoded)), params)
            return await streaming_response(stream_native(ctx), ctx, request)
        finals = await sub.collect(request)
        results = [
            responses.native_response(out, len(encoded[i // params.n]))
            for i, out in enumerate(
                o for grp in _group(finals, sub, len(prompts), params.n) for o in grp
            )
        ]
        return results[0] if single and params.n == 1 else results

    return app


# ---- small helpers ----------------------------------------------------------------------------
def _with_token_ids(response: dict, results: list[list[RequestOutput]], wanted) -> dict:
    """`return_token_ids`: each choice gets its output's token ids (choices run over prompts,
    then samples, as `results`)."""
    if wanted:
        outs = [out for group in results for out in group]
        for choice, out in zip(response["choices"], outs, strict=True):
            choice["token_ids"] = list(out.output_token_ids)
    return response


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; validation errors are 400s here, so drop it."""
    generate_schema = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate_schema()
            for item in schema["paths"].values():
                for operation in item.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi


def _tokens(prompts: list[list[int]], params: SamplingParams) -> int:
    """Prompt tokens a request puts through the engine (each sample's prompt counts)."""
    return sum(len(ids) for ids in prompts) * params.n


def _priority(asked: int | None, tenant: Tenant) -> int:
    """A request's own priority, else its tenant's (the outer class before fairness)."""
    return tenant.priority if asked is None else asked


def _trace_parent(state: ServerState, request: Request) -> Context | None:
    """The parent of a request's spans: its W3C traceparent (without one, a new trace). None
    while tracing is off: no spans, and no header parsed."""
    return state.tracing.extract(request.headers) if state.tracing.enabled else None


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _group(finals: dict[str, RequestOutput], sub: Submission, num_prompts: int, n: int):
    ordered = sorted(finals.values(), key=lambda o: sub.index[o.request_id])
    return [ordered[k * n : (k + 1) * n] for k in range(num_prompts)]
