"""The OpenAI-compatible HTTP front end (FastAPI). No model code runs here.

Every request: guard (size limit, API key) -> parse and validate (400 names the parameter)
-> admission (503 while draining or without an engine, 429 with Retry-After when the queue is
full) -> tokenize -> submit to the engine process -> stream or collect outputs. A client that
disconnects has its samples aborted at once (the engine frees their KV slots in its next step).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from mci.config import ModelConfig
from mci.core.outputs import RequestOutput
from mci.core.sampling_params import SamplingParams
from mci.engine_config import ServerConfig
from mci.errors import UserError
from mci.server import protocol
from mci.server.engine_client import EngineClient
from mci.server.errors import HTTPError, error_response
from mci.server.guard import GuardMiddleware
from mci.server.metrics import ServerMetrics
from mci.server.streaming import (
    native_finish_reason,
    stream_chat,
    stream_completion,
    stream_native,
    streaming_response,
)
from mci.server.submission import Submission
from mci.tokenizer import TextTokenizer

log = logging.getLogger("mci")


@dataclass
class ServerState:
    """What the handlers share: the engine handle, tokenizer, limits, metrics, drain flag."""

    client: EngineClient
    tokenizer: TextTokenizer
    model_config: ModelConfig
    config: ServerConfig
    model_name: str
    max_running: int
    metrics: ServerMetrics = field(init=False)
    draining: bool = False

    def __post_init__(self):
        self.metrics = ServerMetrics(lambda: self.client.stats)

    @property
    def context_length(self) -> int:
        return self.config.context_length or self.model_config.max_position_embeddings


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"malformed JSON body: {exc}", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object", "invalid_request_error")
    return body


def _check_model(state: ServerState, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise HTTPError(
            400,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _admit(state: ServerState, num_samples: int) -> None:
    if state.draining:
        state.metrics.rejected.inc()
        raise HTTPError(503, "server is shutting down", "service_unavailable")
    if not state.client.alive:
        state.metrics.rejected.inc()
        raise HTTPError(503, "engine is not running", "service_unavailable")
    queued = max(0, state.client.num_in_flight - state.max_running)
    if queued + num_samples > state.config.max_queued_requests:
        state.metrics.rejected.inc()
        raise HTTPError(
            429,
            f"server is at capacity ({queued} requests queued); retry later",
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )


def _check_length(state: ServerState, ids: list[int], params: SamplingParams) -> None:
    if len(ids) + params.max_new_tokens > state.context_length:
        raise HTTPError(
            400,
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_new_tokens})"
            f" exceeds the context length {state.context_length}",
            "invalid_request_error",
            "max_tokens",
            "context_length_exceeded",
        )


def _encode(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = state.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        vocab = state.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise HTTPError(
                400, f"token ids must be in [0, {vocab})", "invalid_request_error", "prompt"
            )
    if not ids:
        raise HTTPError(400, "prompt is empty", "invalid_request_error", "prompt")
    return ids


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application over a running engine client."""
    app = FastAPI(title="mci", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.mci = state
    app.add_middleware(GuardMiddleware, config=state.config)

    @app.exception_handler(HTTPError)
    async def _http_error(_, exc: HTTPError):
        return error_response(exc)

    @app.exception_handler(protocol.InvalidRequest)
    async def _invalid(_, exc: protocol.InvalidRequest):
        return error_response(HTTPError(400, str(exc), "invalid_request_error", exc.param))

    @app.exception_handler(UserError)
    async def _user_error(_, exc: UserError):
        return error_response(HTTPError(400, str(exc), "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):
        log.exception("internal error")
        return error_response(HTTPError(500, "internal server error", "server_error"))

    @app.get("/health")
    async def health():
        if state.draining or not state.client.alive:
            return JSONResponse({"status": "unavailable"}, 503)
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        if state.draining or not state.client.alive:
            return JSONResponse({"status": "unavailable"}, 503)
        params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        ids = [state.model_config.bos_token_id or 0]
        try:
            sub = Submission(state, protocol.new_id("health"), [ids], params, -1)
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

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/internal/state")
    async def internal_state():
        """Engine stats and a live KV integrity check (operators and tests)."""
        if not state.client.alive:
            raise HTTPError(503, "engine is not running", "service_unavailable")
        return {
            **await state.client.state(),
            "in_flight": state.client.num_in_flight,
            "engine_pid": state.client.process.pid,
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "mci",
                    "max_model_len": state.context_length,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        _check_model(state, body)
        params = protocol.sampling_params(body, chat=False)
        stream = _flag(body, "stream")
        prompts = [(p, _encode(state, p)) for p in protocol.completion_prompts(body)]
        for _, ids in prompts:
            _check_length(state, ids, params)
        _admit(state, len(prompts) * params.n)
        rid = protocol.new_id("cmpl")
        sub = Submission(state, rid, [ids for _, ids in prompts], params, _priority(body))
        echo = _flag(body, "echo")
        if stream:
            return streaming_response(
                stream_completion(state, sub, rid, prompts, params, echo, _include_usage(body)),
                sub,
            )
        finals = await sub.collect(request)
        results = _group(finals, sub, len(prompts), params.n)
        return protocol.completion_response(
            state.model_name, state.tokenizer, prompts, results, echo=echo, request_id=rid
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        _check_model(state, body)
        params = protocol.sampling_params(body, chat=True)
        stream = _flag(body, "stream")
        ids = protocol.chat_prompt_ids(state.tokenizer, body)
        _check_length(state, ids, params)
        _admit(state, params.n)
        rid = protocol.new_id("chatcmpl")
        sub = Submission(state, rid, [ids], params, _priority(body))
        if stream:
            return streaming_response(
                stream_chat(state, sub, rid, len(ids), _include_usage(body)), sub
            )
        finals = await sub.collect(request)
        outs = _group(finals, sub, 1, params.n)[0]
        return protocol.chat_response(state.model_name, state.tokenizer, len(ids), outs, rid)

    @app.post("/generate")
    async def generate(request: Request):
        """SGLang's native API: text or input_ids, sampling_params, stream."""
        body = await _json_body(request)
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise HTTPError(
                400,
                "'sampling_params' must be an object",
                "invalid_request_error",
                "sampling_params",
            )
        renamed = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
        params = protocol.sampling_params({renamed.get(k, k): v for k, v in sp.items()}, chat=False)
        if (body.get("text") is None) == (body.get("input_ids") is None):
            raise HTTPError(
                400, "give exactly one of 'text' or 'input_ids'", "invalid_request_error", "text"
            )
        single = isinstance(body.get("text"), str) or (
            isinstance(body.get("input_ids"), list)
            and body["input_ids"]
            and isinstance(body["input_ids"][0], int)
        )
        raw = body.get("text") if body.get("text") is not None else body.get("input_ids")
        prompts = protocol.completion_prompts({"prompt": raw})
        encoded = [_encode(state, p) for p in prompts]
        for ids in encoded:
            _check_length(state, ids, params)
        _admit(state, len(prompts) * params.n)
        rid = protocol.new_id("gen")
        sub = Submission(state, rid, encoded, params, _priority(body))
        if _flag(body, "stream"):
            return streaming_response(stream_native(sub, encoded), sub)
        finals = await sub.collect(request)
        results = [
            _native(out, len(encoded[i // params.n]))
            for i, out in enumerate(
                o for grp in _group(finals, sub, len(prompts), params.n) for o in grp
            )
        ]
        return results[0] if single and params.n == 1 else results

    return app


# ---- small helpers ----------------------------------------------------------------------------
def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HTTPError(400, f"'{name}' must be a boolean", "invalid_request_error", name)
    return value


def _priority(body: dict) -> int:
    value = body.get("priority", 0)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise HTTPError(400, "'priority' must be an integer", "invalid_request_error", "priority")
    return value


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HTTPError(
            400, "'stream_options' must be an object", "invalid_request_error", "stream_options"
        )
    return bool(options.get("include_usage"))


def _group(finals: dict[str, RequestOutput], sub: Submission, num_prompts: int, n: int):
    ordered = sorted(finals.values(), key=lambda o: sub.index[o.request_id])
    return [ordered[k * n : (k + 1) * n] for k in range(num_prompts)]


def _native(out: RequestOutput, prompt_len: int) -> dict:
    return {
        "text": out.text,
        "output_ids": out.output_token_ids,
        "meta_info": {
            "id": out.request_id,
            "finish_reason": native_finish_reason(out),
            "prompt_tokens": prompt_len,
            "completion_tokens": len(out.output_token_ids),
            "cached_tokens": out.num_cached_tokens,
        },
    }
