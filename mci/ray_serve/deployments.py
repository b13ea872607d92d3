"""The two Ray Serve deployments of `mci serve-ray`.

    HTTP ─▶ Serve proxy ─▶ MciIngress ──handle, routing_key──▶ MciReplica × N (autoscaled)
                                         (CacheAwareRequestRouter)   └─ `mci serve` child process

MciReplica owns one `mci serve` replica in a child process on a loopback port
(server/replica_process.py), so a Ray replica is exactly an mci server: the same API, limits,
engine crash recovery and drain. Its methods stream the server's answer back: first a head
(status, content type, which replica), then the body's bytes as they come.

With --pd-disaggregation there are two replica deployments, mci-prefill and mci-decode, each
scaled on its own: for each attempt the ingress sends the request to a prefill replica first
(under a fresh room; its answer's head names the replica's bootstrap server), then to a
decode replica with that address, which reads the KV from it and answers the client
(router/pd.py describes the pairing; a failed prefill is tried again on another).

MciIngress is the OpenAI endpoint: it admits the request (ray_serve/residency.py: the
tenant's key, and whether the deployment's region and pool labels may serve it, else a
fail-closed 503), reads the body once, computes the prompt's routing key (router/app.py's
rule) for the request router, and relays the replica's answer unchanged.
Before the first byte, a replica that failed, or answered 500/502/503 without Retry-After
(an overload answer is the client's to act on), is excluded and another tried after a
jittered backoff; after it, a failure ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid

import httpx
from ray import serve
from ray.exceptions import RayError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mci.engine.config import EngineConfig
from mci.http_stream import ClosingStreamingResponse
from mci.loopback import free_loopback_port
from mci.ray_serve.residency import refusal
from mci.replicas.replica_process import ReplicaProcess
from mci.router.app import (
    PROXIED,
    error_response,
    load_tenants,
    read_proxied,
    retry_delay_s,
    routing_key,
)
from mci.router.pd import ADDR_HEADER, ROOM_HEADER, prefill_body
from mci.server.config import ServerConfig
from mci.server.handoff import bootstrap_address
from mci.tenancy.residency import Labels

log = logging.getLogger("mci")
REPLICA_START_S = 600.0
RETRY_STATUSES = (500, 502, 503)  # before the first byte: another replica may take it
HEALTH_TIMEOUT_S = 5.0


class MciReplica:
    """One `mci serve` replica (a child process) as a Ray Serve replica."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, threads: int):
        config = dataclasses.replace(server_config, port=free_loopback_port())
        self.bootstrap = None  # a prefill replica's bootstrap server: a port of its own
        handoff = engine_config.disaggregation
        if handoff.disaggregation_mode == "prefill":
            handoff = dataclasses.replace(
                handoff, disaggregation_bootstrap_port=free_loopback_port()
            )
            engine_config = dataclasses.replace(engine_config, disaggregation=handoff)
            self.bootstrap = bootstrap_address(handoff)
        self.replica = ReplicaProcess(engine_config, config, threads)
        try:
            self.replica.wait_ready(time.monotonic() + REPLICA_START_S)
        except BaseException:
            self.replica.stop()
            raise
        self.name = serve.get_replica_context().replica_id.unique_id
        self.client = httpx.AsyncClient(
            base_url=self.replica.url, timeout=httpx.Timeout(None, connect=5.0)
        )

    async def forward(self, path: str, body: bytes, routing_key, headers: dict, exclude=()):
        """Stream the replica server's answer: a head dict, then the body's bytes.
        (`routing_key` and `exclude` are for the request router.)"""
        async with self.client.stream("POST", path, content=body, headers=headers) as response:
            yield {
                "status": response.status_code,
                "content_type": response.headers.get("content-type", "application/json"),
                "retry_after": response.headers.get("retry-after"),
                "replica": self.name,
                "bootstrap": self.bootstrap,
            }
            async for chunk in response.aiter_raw():
                yield chunk

    async def get(self, path: str) -> tuple[int, str, bytes]:
        response = await self.client.get(path, timeout=HEALTH_TIMEOUT_S)
        return response.status_code, response.headers.get("content-type", ""), response.content

    async def check_health(self) -> None:
        """Ray Serve's health check, on the server's liveness: a replica whose server is gone,
        unreachable, or whose engine stays down (restart budget spent) is replaced. A server
        restarting its engine (which it does by itself) is live."""
        if not self.replica.alive():
            raise RuntimeError(f"the mci server of replica {self.name} exited")
        try:
            response = await self.client.get("/livez", timeout=HEALTH_TIMEOUT_S)
        except httpx.TransportError as exc:
            raise RuntimeError(f"the mci server of replica {self.name} is unreachable") from exc
        if response.status_code != 200:
            raise RuntimeError(f"the engine of replica {self.name} is down for good")

    def __del__(self):
        # Ray Serve calls this on graceful shutdown (after in-flight requests finish, up to its
        # timeout): the server drains, then stops its engine
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.stop()


class MciIngress:
    """The OpenAI endpoint in front of the MciReplica deployment."""

    def __init__(
        self,
        replicas,
        server_config: ServerConfig | None = None,
        max_retries: int = 3,
        prefill=None,
    ):
        """`replicas`: the replica deployment (with `prefill`, the decode replicas)."""
        self.replicas = replicas
        self.prefill = prefill  # --pd-disaggregation: the prefill replicas
        self.max_retries = max_retries
        config = server_config or ServerConfig()
        # the file is read here, on the ingress's node: no key travels through Ray's store
        self.tenants = load_tenants(config.tenants)
        self.labels = Labels(config.region, config.pool)  # every replica's: one deployment

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "POST" and path in PROXIED:
            return await self._proxy(path, request)
        if request.method == "GET" and path in ("/health", "/readyz", "/livez", "/v1/models"):
            return await self._get(path)
        if request.method == "GET" and path == "/ray/status":
            return JSONResponse(await asyncio.to_thread(_deployment_status))
        return error_response(404, f"no route {request.method} {path}", "not_found_error")

    async def _get(self, path: str) -> Response:
        try:
            status, content_type, content = await self.replicas.get.remote(path)
        except RayError:
            return error_response(503, "no replica is available")
        return Response(content, status_code=status, media_type=content_type or None)

    async def _proxy(self, path: str, request: Request) -> Response:
        refused = refusal(self.tenants, request.headers, self.labels)
        if refused is not None:
            return refused
        parsed = await read_proxied(request)
        if isinstance(parsed, JSONResponse):
            return parsed
        raw, body, headers = parsed
        key = routing_key(path, body)
        last, tried, tried_prefill = "no replica is available", [], []
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(retry_delay_s(attempt))
            hop = headers
            if self.prefill is not None:
                paired = await self._prefill(path, raw, key, headers, tried_prefill)
                if isinstance(paired, Response):
                    return paired  # the request's own error
                if isinstance(paired, str):
                    last = paired
                    continue
                hop = paired
            stream = self.replicas.options(stream=True).forward.remote(
                path=path, body=raw, routing_key=key, headers=hop, exclude=tuple(tried)
            )
            try:
                head = await stream.__anext__()
            except RayError as exc:  # the replica actor, or its call to its server, failed
                last = f"replica failed: {type(exc).__name__}"
                continue
            except StopAsyncIteration:
                last = "replica answered nothing"
                continue
            if head["status"] in RETRY_STATUSES and not head["retry_after"]:
                stream.cancel()
                tried.append(head["replica"])
                last = f"replica {head['replica']} answered {head['status']}"
                continue
            return _relay(stream, head)
        response = error_response(503, f"no replica could take the request ({last})")
        response.headers["Retry-After"] = "1"
        return response

    async def _prefill(self, path: str, raw: bytes, key, headers: dict, tried: list):
        """A prefill replica computes the prompt under a fresh room and holds its KV: the
        decode hop's headers (the room, the replica's bootstrap server); or why it failed
        (a str: try again, that replica excluded), or the request's own error (a Response)."""
        room = uuid.uuid4().hex
        stream = self.prefill.options(stream=True).forward.remote(
            path=path,
            body=prefill_body(raw),
            routing_key=key,
            headers={**headers, ROOM_HEADER: room},
            exclude=tuple(tried),
        )
        try:
            head = await stream.__anext__()
            body = b"".join([chunk async for chunk in stream])
        except (RayError, StopAsyncIteration) as exc:
            return f"prefill replica failed: {type(exc).__name__}"
        if head["status"] == 200 and head["bootstrap"]:
            return {**headers, ROOM_HEADER: room, ADDR_HEADER: head["bootstrap"]}
        tried.append(head["replica"])
        if 400 <= head["status"] < 500 and head["status"] != 429:
            return Response(body, status_code=head["status"], media_type=head["content_type"])
        return f"prefill replica {head['replica']} answered {head['status']}"


def _relay(stream, head: dict) -> ClosingStreamingResponse:
    async def body():
        try:
            async for chunk in stream:
                yield chunk
        except RayError:
            if head["content_type"].startswith("text/event-stream"):
                error = {"error": {"message": f"replica {head['replica']} failed mid-stream"}}
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            stream.cancel()  # the client left: the replica's server sees it and frees the KV

    headers = {"x-mci-replica": head["replica"]}
    if head["retry_after"]:
        headers["retry-after"] = head["retry_after"]
    return ClosingStreamingResponse(
        body(), status_code=head["status"], media_type=head["content_type"], headers=headers
    )


def _deployment_status() -> dict:
    """Each deployment's status and its replicas by state (for operators and the tests)."""
    status = serve.status()
    return {
        app_name: {
            name: {"status": str(d.status), "replica_states": dict(d.replica_states)}
            for name, d in app.deployments.items()
        }
        for app_name, app in status.applications.items()
    }
