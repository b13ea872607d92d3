"""`mci router`: one OpenAI endpoint over many `mci serve` replicas (docs/router.md).

For each request the policy (router/policy.py) picks an available replica and the body goes
there unchanged; the answer, streamed or not, comes back unchanged. Before the first byte a
failure (connection refused or reset, 5xx, 429) is retried on another replica after a jittered
backoff, so a replica that dies or drains loses no request that had not started. After the
first byte a stream whose replica dies is continued on another (router/resume.py).

With --otlp-traces-endpoint every proxied request gets a span, `mci.router.request`, in the
trace of its W3C `traceparent`, and the replica's request names that span as its parent.

Residency (mci/tenancy/residency.py): with --tenants a request's key names its tenant (an
unknown key is a 401), and only replicas whose labels (region, pool; read from /server_info
at the health checks) the tenant allows, narrowed by the request's X-Mci-Region, are ever
candidates: for the first attempt, the retries and a resumed stream's hops alike. When none
is available the request fails closed (503), never sent elsewhere.

With --pd-disaggregation the replicas are decode workers (--decode) and each attempt pairs one
with a prefill worker (--prefill; router/pd.py): the same retries, resumes and residency rules
hold for both kinds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.trace import SpanKind, Status, StatusCode

from mci.errors import UserError, error_body
from mci.http_stream import ClosingStreamingResponse
from mci.router.config import RouterConfig
from mci.router.metrics import RouterMetrics
from mci.router.pd import PDPairing, PrefillFailed
from mci.router.policy import make_policy
from mci.router.prefix_tree import PrefixTree
from mci.router.resume import StreamRelay
from mci.router.workers import Worker, WorkerPool
from mci.tenancy.residency import REGION_HEADER, Labels, Residency, narrowing_error
from mci.tenancy.tenants import TenantTable, bearer_token
from mci.tracing import Tracing, context_with_span

log = logging.getLogger("mci")

PROXIED = ("/v1/completions", "/v1/chat/completions", "/generate")
RETRY_STATUSES = (429, 500, 502, 503)  # not 504: the request's own timeout
BACKOFF_S = 0.05  # first retry's mean delay; doubles per attempt, jittered


def routing_key(path: str, body: dict):
    """What the cache-aware policy matches on: the prompt's text, or its token ids."""
    if path == "/v1/chat/completions":
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '') if isinstance(m, dict) else ''}:{content or ''}")
        return "\x00".join(parts)
    prompt = body.get("prompt") if path != "/generate" else body.get("text", body.get("input_ids"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, list):
        return tuple(prompt)
    return prompt if isinstance(prompt, str) else ""


def error_response(
    status: int, message: str, kind: str = "service_unavailable", code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code=code), status_code=status)


def load_tenants(path: str | None) -> TenantTable:
    """--tenants' table; without one, the open table (no key checked, no tenant pinned, so
    only a request's own X-Mci-Region narrows where it goes)."""
    return TenantTable.load(Path(path)) if path else TenantTable.single(None)


def _why(exc: Exception) -> str:
    """What is wrong with a tenants file, in one line without its contents: a UserError's
    first line (a YAML error's later lines quote the file, keys and all), else the type."""
    lines = str(exc).splitlines() if isinstance(exc, UserError) else []
    return lines[0][:300] if lines else type(exc).__name__


def admit(tenants: TenantTable, headers) -> Residency | JSONResponse:
    """Where a request may run: its tenant (`Authorization: Bearer KEY`) and the region its
    X-Mci-Region narrows that to. A 401 for an unknown key, a 403 for a header region its
    tenant does not allow. Keys are never logged or echoed."""
    tenant = tenants.resolve(bearer_token(headers.get("authorization")))
    if tenant is None:
        return error_response(
            401, "invalid API key", "authentication_error", code="invalid_api_key"
        )
    region = (headers.get(REGION_HEADER) or "").strip() or None
    refused = narrowing_error(tenant, region)
    if refused is not None:
        return error_response(403, refused, "permission_error", code="region_not_allowed")
    return Residency(tenant, region)


def retry_delay_s(attempt: int) -> float:
    """Before retry `attempt` (1, 2, ...): jittered exponential backoff."""
    return BACKOFF_S * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)


async def read_proxied(request: Request) -> tuple[bytes, dict, dict] | JSONResponse:
    """A proxied request's raw body, its parsed JSON object and the headers to forward (the
    API key included); a 400 response when the body is not a JSON object."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(400, "the body is not valid JSON", "invalid_request_error")
    if not isinstance(body, dict):
        return error_response(400, "the body must be a JSON object", "invalid_request_error")
    headers = {"content-type": "application/json"}
    if "authorization" in request.headers:
        headers["authorization"] = request.headers["authorization"]
    return raw, body, headers


class ProxySpan:
    """A proxied request's span, `mci.router.request` (a child of its traceparent), from its
    arrival until its answer or stream ends: the replica that answered (`mci.replica`: the last
    one, for a resumed stream), the retries before a first byte over all its hops
    (`mci.retries`), and a broken stream's resumes (`mci.resumes`). The hops to the replicas
    carry it as their parent. Without tracing the span is a no-op one that still passes the
    incoming trace on."""

    def __init__(self, tracing: Tracing, headers, path: str):
        parent = tracing.extract(headers)
        self.span = tracing.tracer.start_span(
            "mci.router.request", parent, kind=SpanKind.SERVER, attributes={"http.route": path}
        )
        self.context = context_with_span(self.span, parent)
        self.retries = 0
        self.resumes = 0
        self.error: str | None = None  # why the request failed, if it did

    def forward(self, headers: dict) -> dict:
        """`headers` with this span as the next hop's parent (`traceparent`)."""
        return Tracing.inject(headers, self.context)

    def answered(self, worker: Worker) -> None:
        self.span.set_attribute("mci.replica", worker.url)

    def failed(self, why: str) -> None:
        self.error = self.error or why  # the first cause, not what it led to

    def end(self, status_code: int | None = None) -> None:
        self.span.set_attribute("mci.retries", self.retries)
        if self.resumes:
            self.span.set_attribute("mci.resumes", self.resumes)
        if status_code is not None:
            self.span.set_attribute("http.response.status_code", status_code)
            if status_code >= 500:
                self.failed(f"answered {status_code}")
        if self.error is not None:
            self.span.set_status(Status(StatusCode.ERROR, self.error))
        self.span.end()

    async def until_done(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`stream`, ending the span when it ends (done, broken, or the client gone)."""
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()
            self.end(200)


class Router:
    def __init__(self, config: RouterConfig, urls: list[str], prefill_urls: list[str] = ()):
        """`urls`: the replicas (with --pd-disaggregation, the decode workers);
        `prefill_urls`: the prefill workers (--pd-disaggregation only)."""
        self.config = config
        self.tracing = Tracing(config.otlp_traces_endpoint, "mci-router")
        self.pool = WorkerPool(urls, config.breaker_failures, config.breaker_cooldown)
        # the prompts routed to the replicas of each shared KV store (by its id)
        self.store_trees: dict[str, PrefixTree] = {}
        self.policy = self._policy(config.policy, self.store_trees)
        self.pd: PDPairing | None = None
        pools = [self.pool]
        if config.pd_disaggregation:
            # decode workers by load; prefill workers by --policy (their prompt caches)
            self.policy = make_policy("least_load", 0, 0, 1)
            prefill = WorkerPool(prefill_urls, config.breaker_failures, config.breaker_cooldown)
            self.pd = PDPairing(prefill, None, self._allowed)
            self.pd.policy = self._policy(config.policy, self.pd.store_trees)
            pools.append(prefill)
        self.metrics = RouterMetrics(pools)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.tenants = load_tenants(config.tenants)

    def _policy(self, name: str, store_trees: dict[str, PrefixTree]):
        cfg = self.config
        return make_policy(
            name,
            cfg.cache_threshold,
            cfg.balance_abs_threshold,
            cfg.balance_rel_threshold,
            store_trees,
        )

    def reload_tenants(self) -> None:
        """SIGHUP: read the tenants file again. A broken file keeps the table in force (a
        router must not lose its tenants to a typo) and says so in one line, without keys."""
        try:
            table = load_tenants(self.config.tenants)
        except Exception as exc:  # noqa: BLE001 - a signal handler must not stop the router
            log.warning("tenants file not reloaded, keeping the previous one: %s", _why(exc))
            return
        self.tenants = table
        log.info("tenants file reloaded: %d tenant(s)", len(table.tenants))

    # ---- dispatch -----------------------------------------------------------------------------
    async def open(
        self,
        path: str,
        raw: bytes,
        key,
        headers: dict,
        exclude: set[str] = frozenset(),
        span: ProxySpan | None = None,
        *,
        residency: Residency,
    ) -> tuple[Worker, httpx.Response] | Response:
        """Send the request to a replica and return its response, headers read and body not;
        retried on others before the first byte. An error response when none can take it.
        `span`: the request's, told of the retries and of the replica that answered. Only
        replicas `residency` allows are candidates, at every attempt (required: no caller may
        forget it); when none of them can take it, a 503 that names the constraint."""
        tried = set(exclude)
        tried_prefill: set[str] = set()  # prefill workers that failed an attempt
        last = None
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self.metrics.retries.inc()
                if span is not None:
                    span.retries += 1
                await asyncio.sleep(retry_delay_s(attempt))
            candidates = self._allowed(self.pool.available(tried), residency)
            if not candidates:
                break
            worker = self.policy.choose(candidates, key)
            tried.add(worker.url)
            if key:  # at once, so the requests arriving meanwhile follow this one
                worker.prompt_chars += len(key)
                worker.matched_chars += worker.tree.match(key)
                worker.tree.insert(key)
                if worker.store is not None:  # a hit on every replica sharing the store
                    self.store_trees.setdefault(worker.store, PrefixTree()).insert(key)
            prefill = None
            if self.pd is not None:
                prefill = self.pd.choose(key, residency, tried_prefill)
            worker.in_flight += 1
            try:
                if self.pd is None:
                    request = self.client.build_request(
                        "POST", worker.url + path, content=raw, headers=headers
                    )
                    upstream = await self.client.send(request, stream=True)
                else:
                    upstream = await self.pd.open(self.client, path, raw, headers, worker, prefill)
            except PrefillFailed as exc:  # the decode worker did nothing wrong: it may retry
                worker.in_flight -= 1
                tried.discard(worker.url)
                tried_prefill.add(exc.worker.url)
                if exc.client_error is not None:  # the request's own fault: no retry helps
                    answer = exc.client_error
                    return Response(
                        answer.content,
                        status_code=answer.status_code,
                        media_type=answer.headers.get("content-type"),
                    )
                self.pd.pool.failed(exc.worker)
                self.pd.prefill_failures += 1
                last = str(exc)
                continue
            except httpx.TransportError as exc:
                worker.in_flight -= 1
                self.pool.failed(worker)
                last = f"replica {worker.url} failed: {type(exc).__name__}"
                continue
            except BaseException:  # cancelled (the client left): nothing is open any more
                worker.in_flight -= 1
                raise
            if upstream.status_code in RETRY_STATUSES:
                worker.in_flight -= 1
                try:
                    detail = (await upstream.aread()).decode(errors="replace")[:200]
                except httpx.TransportError:
                    detail = "(no body)"
                finally:
                    await upstream.aclose()
                if upstream.status_code >= 500:
                    self.pool.failed(worker)
                last = f"replica {worker.url} answered {upstream.status_code}: {detail}"
                continue
            self.pool.succeeded(worker)
            worker.requests += 1
            if span is not None:
                span.answered(worker)
            return worker, upstream
        if residency.restricted:
            message = residency.unavailable(last)
        else:
            message = f"no replica could take the request ({last or 'no replica is available'})"
        if span is not None:
            span.failed(message)
        return error_response(503, message)

    def _allowed(self, workers: list[Worker], residency: Residency) -> list[Worker]:
        """The workers `residency` allows; each one it leaves out is counted, by reason."""
        if not residency.restricted:
            return workers
        kept = []
        for worker in workers:
            reason = residency.rejects(worker.labels)
            if reason is None:
                kept.append(worker)
            else:
                self.metrics.residency_rejections.labels(reason).inc()
        return kept

    async def proxy(self, path: str, request: Request) -> Response:
        span = ProxySpan(self.tracing, request.headers, path)
        try:
            response = await self._answer(path, request, span)
        except BaseException:  # cancelled (the client left): the span ends all the same
            span.end()
            raise
        if not isinstance(response, ClosingStreamingResponse):  # a stream ends the span at its end
            span.end(response.status_code)
        return response

    async def _answer(self, path: str, request: Request, span: ProxySpan) -> Response:
        residency = admit(self.tenants, request.headers)
        if isinstance(residency, JSONResponse):
            return residency
        parsed = await read_proxied(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        raw, body, headers = parsed
        span.forward(headers)  # the replica's spans are children of the router's
        key = routing_key(path, body)
        relay = None
        if body.get("stream") and not self.config.disable_stream_resume:
            relay = StreamRelay.maybe(path, body)
            if relay is not None:
                raw = relay.first_body()
        opened = await self.open(path, raw, key, headers, span=span, residency=residency)
        if isinstance(opened, Response):
            return opened
        worker, upstream = opened
        if not body.get("stream") or upstream.status_code != 200:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
                worker.in_flight -= 1
            return Response(
                content,
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type"),
            )
        if relay is None:
            stream = self._plain_stream(worker, upstream, span)
        else:
            stream = relay.run(
                self, path, key, headers, worker, upstream, span, residency=residency
            )
        return ClosingStreamingResponse(span.until_done(stream), media_type="text/event-stream")

    async def _plain_stream(
        self, worker: Worker, upstream: httpx.Response, span: ProxySpan
    ) -> AsyncIterator:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError:
            self.pool.failed(worker)
            span.failed(f"replica {worker.url} failed mid-stream")
            error = {"error": {"message": f"replica {worker.url} failed mid-stream"}}
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()
            worker.in_flight -= 1

    # ---- health -------------------------------------------------------------------------------
    async def check_health(self) -> None:
        async def one(worker: Worker) -> None:
            try:
                r = await self.client.get(worker.url + "/health", timeout=2.0)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:  # before any re-admission: a replica comes back with its labels of now
                worker.labels, worker.store, worker.bootstrap = await self._info(worker)
            if worker.open_until and (not ok or time.monotonic() < worker.open_until):
                if not ok:  # else its cooldown's end alone would let requests in again
                    worker.healthy = False
                return  # ejected: out for its cooldown, then until a check passes
            WorkerPool.health(worker, ok)

        workers = list(self.pool.workers.values())
        if self.pd is not None:
            workers += list(self.pd.pool.workers.values())
        await asyncio.gather(*(one(w) for w in workers))

    async def _info(self, worker: Worker) -> tuple[Labels, str | None, str | None]:
        """The worker's labels, shared store and (a prefill worker's) bootstrap address from
        its /server_info. None when it has none or did not say (an older server, a timeout):
        then it is outside every region and pool until a check reads them, while its health,
        and so unrestricted traffic, stays /health's verdict; its cache is its own; and it
        cannot be a prefill worker."""
        try:
            r = await self.client.get(worker.url + "/server_info", timeout=2.0)
            info = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info = None
        info = info if isinstance(info, dict) else {}
        store, bootstrap = info.get("hicache_store"), info.get("disaggregation_bootstrap")
        return (
            Labels.from_info(info or None),
            store if isinstance(store, str) and store else None,
            bootstrap if isinstance(bootstrap, str) and bootstrap else None,
        )

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.config.health_check_interval)


def build_router_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.check_health()  # the replicas' labels, before the first request
        task = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await router.client.aclose()

    app = FastAPI(title="mci router", lifespan=lifespan)

    for path in PROXIED:

        async def proxied(request: Request, path: str = path) -> Response:
            return await router.proxy(path, request)

        app.add_api_route(path, proxied, methods=["POST"], name=path)

    @app.get("/health")
    async def health():
        if router.pool.available():
            return Response("ok")
        return error_response(503, "no replica is available")

    @app.get("/v1/models")
    async def models(request: Request):
        admitted = admit(router.tenants, request.headers)  # a known key, as for the API
        if isinstance(admitted, JSONResponse):
            return admitted
        for worker in router.pool.available():
            try:
                r = await router.client.get(worker.url + "/v1/models", timeout=5.0)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return error_response(503, "no replica is available")

    @app.get("/workers")
    async def workers():
        roles = [("decode" if router.pd else "replica", router.pool)]
        if router.pd is not None:
            roles.append(("prefill", router.pd.pool))
        return {
            "workers": [
                {
                    "url": w.url,
                    "role": role,
                    "bootstrap": w.bootstrap,
                    "region": w.labels.region,
                    "pool": w.labels.pool,
                    "hicache_store": w.store,
                    "available": w.available,
                    "in_flight": w.in_flight,
                    "requests": w.requests,
                    "estimated_cache_hit_rate": w.estimated_cache_hit_rate,
                    "ejections": w.ejections,
                    "readmissions": w.readmissions,
                }
                for role, pool in roles
                for w in pool.workers.values()
            ],
            **(
                {"pd": {"fallbacks": router.pd.fallbacks, "failures": router.pd.prefill_failures}}
                if router.pd is not None
                else {}
            ),
        }

    @app.post("/workers")
    async def add_worker(request: Request):
        body = await request.json()
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return error_response(400, "give {'url': 'http://host:port'}", "invalid_request_error")
        router.pool.add(url)
        await router.check_health()
        return {"added": url.rstrip("/")}

    @app.delete("/workers")
    async def remove_worker(request: Request):
        body = await request.json()
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not router.pool.remove(url):
            return error_response(404, f"no worker {url!r}", "invalid_request_error")
        return {"removed": url.rstrip("/")}

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
