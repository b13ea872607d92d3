"""Starting the router: `mci router --worker-urls ...` over running replicas (`mci serve
--dp-size N` starts its own: mci/server/data_parallel.py)."""

from __future__ import annotations

import logging
import signal

import uvicorn

from mci.errors import UserError
from mci.router.app import Router, build_router_app
from mci.router.config import RouterConfig

log = logging.getLogger("mci")
REPLICA_START_S = 600.0


class _RouterServer(uvicorn.Server):
    """Stops gracefully on SIGTERM/SIGINT and exits 0 (uvicorn re-raises the signal)."""

    def handle_exit(self, sig: int, frame) -> None:
        self.should_exit = True


def run_router(config: RouterConfig, urls: list[str]) -> int:
    if not urls:
        raise UserError("mci router needs --worker-urls URL ... (or add them: POST /workers)")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--worker-urls: {url!r} is not an http(s) URL")
    router = Router(config, urls)
    if config.tenants is not None:  # uvicorn handles SIGINT/SIGTERM only: SIGHUP stays ours
        signal.signal(signal.SIGHUP, lambda *_: router.reload_tenants())
    log.info(
        "router on http://%s:%d over %d replica(s), policy %s%s",
        config.host,
        config.port,
        len(urls),
        config.policy,
        f", {len(router.tenants.tenants)} tenant(s)" if config.tenants else "",
    )
    uv = uvicorn.Config(
        build_router_app(router), host=config.host, port=config.port, log_level="warning"
    )
    server = _RouterServer(uv)
    try:
        server.run()
    finally:
        router.tracing.shutdown()  # the last requests' spans leave before the process does
    if not server.started:
        raise UserError(f"could not listen on {config.host}:{config.port}")
    return 0
