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


def run_router(
    config: RouterConfig, urls: list[str], prefill: list[str] = (), decode: list[str] = ()
) -> int:
    """`urls`: the replicas; with --pd-disaggregation, `prefill` and `decode` workers instead."""
    if config.pd_disaggregation:
        if urls or not prefill or not decode:
            raise UserError(
                "mci router --pd-disaggregation takes --prefill URL ... and --decode URL ... "
                "(not --worker-urls)"
            )
        urls = list(decode)
    elif prefill or decode:
        raise UserError("--prefill and --decode need --pd-disaggregation")
    if not urls:
        raise UserError("mci router needs --worker-urls URL ... (or add them: POST /workers)")
    for url in [*urls, *prefill]:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"{url!r} is not an http(s) URL")
    router = Router(config, urls, list(prefill))
    if config.tenants is not None:  # uvicorn handles SIGINT/SIGTERM only: SIGHUP stays ours
        signal.signal(signal.SIGHUP, lambda *_: router.reload_tenants())
    log.info(
        "router on http://%s:%d over %d %s, policy %s%s",
        config.host,
        config.port,
        len(urls),
        f"decode worker(s) and {len(prefill)} prefill worker(s)" if prefill else "replica(s)",
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
