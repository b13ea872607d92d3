"""ASGI guard in front of every route: request size limit (413) and API key (401): the key
names the request's tenant (mci/tenancy/tenants.py), which the handlers find in
`request.state.tenant`."""

from __future__ import annotations

import json
from collections.abc import Callable

from mci.errors import error_body
from mci.server.config import ServerConfig
from mci.server.errors import HTTPError
from mci.tenancy.tenants import TenantTable, bearer_token

# probes, the replica's labels (the router's health checks) and the API's own description
# need no API key
OPEN_PATHS = (
    "/health",
    "/health_generate",
    "/metrics",
    "/server_info",
    "/openapi.json",
    "/docs",
    "/redoc",
)


class GuardMiddleware:
    """ASGI middleware: 413 for bodies over the limit, 401 for a key that is no tenant's.
    `tenants` gives the current table (a SIGHUP may replace it)."""

    def __init__(self, app, config: ServerConfig, tenants: Callable[[], TenantTable]):
        self.app, self.config, self.tenants = app, config, tenants

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not scope["path"].startswith(OPEN_PATHS):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            tenant = self.tenants().resolve(bearer_token(auth))
            if tenant is None:
                return await self._reply(
                    send,
                    HTTPError(
                        401, "invalid API key", "authentication_error", code="invalid_api_key"
                    ),
                )
            scope.setdefault("state", {})["tenant"] = tenant
        limit = self.config.max_request_bytes
        too_large = HTTPError(
            413,
            f"request body exceeds {limit} bytes",
            "invalid_request_error",
            code="request_too_large",
        )
        try:
            if int(headers.get(b"content-length", b"0")) > limit:
                return await self._reply(send, too_large)
        except ValueError:
            return await self._reply(
                send, HTTPError(400, "bad Content-Length", "invalid_request_error")
            )
        body, more = b"", True
        while more:  # buffer the body (JSON is parsed whole anyway), enforcing the limit
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await self._reply(send, too_large)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _reply(send, exc: HTTPError) -> None:
        payload = json.dumps(error_body(str(exc), exc.type, exc.param, exc.code)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": exc.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


# ---- request handling helpers -----------------------------------------------------------------
