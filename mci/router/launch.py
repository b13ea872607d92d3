"""Starting the router: `mci router --worker-urls ...` over running replicas, or
`mci serve --dp-size N`, which starts N replicas of itself on the next N ports and the router
on its own port."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import time

import httpx
import uvicorn

from mci.engine_config import EngineConfig, RouterConfig, ServerConfig
from mci.errors import UserError
from mci.router.app import Router, build_router_app

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
    log.info(
        "router on http://%s:%d over %d replica(s), policy %s",
        config.host,
        config.port,
        len(urls),
        config.policy,
    )
    uv = uvicorn.Config(
        build_router_app(router), host=config.host, port=config.port, log_level="warning"
    )
    server = _RouterServer(uv)
    server.run()
    if not server.started:
        raise UserError(f"could not listen on {config.host}:{config.port}")
    return 0


def _replica_main(engine_config: EngineConfig, server_config: ServerConfig, threads: int) -> None:
    from mci.server.launch import serve

    # replicas share the machine's cores: OpenMP teams spinning over the same cores slow
    # every replica badly; the engine process inherits this
    os.environ["OMP_NUM_THREADS"] = str(threads)
    logging.basicConfig(
        level=logging.INFO,
        format=f"mci[replica :{server_config.port}]: %(message)s",
        stream=sys.stderr,
    )
    try:
        sys.exit(serve(engine_config, server_config))
    except UserError as exc:
        log.error("%s", exc)
        sys.exit(2)


def serve_data_parallel(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """N replicas on ports port+1 .. port+N (loopback), the cache-aware router on `port`."""
    n = server_config.dp_size
    context = multiprocessing.get_context("spawn")
    replicas = []
    for i in range(n):
        config = dataclasses.replace(
            server_config, host="127.0.0.1", port=server_config.port + 1 + i, dp_size=1
        )
        threads = max(1, (os.cpu_count() or 1) // n)
        proc = context.Process(
            target=_replica_main, args=(engine_config, config, threads), name=f"mci-replica-{i}"
        )
        proc.start()
        replicas.append((proc, f"http://127.0.0.1:{config.port}"))
    try:
        deadline = time.monotonic() + REPLICA_START_S
        for proc, url in replicas:
            while True:
                if not proc.is_alive():
                    raise UserError(f"replica {url} exited while starting (see its log)")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise UserError(f"replica {url} did not start in time")
                time.sleep(0.2)
        router = RouterConfig(host=server_config.host, port=server_config.port)
        return run_router(router, [url for _, url in replicas])
    finally:
        for proc, _ in replicas:  # each drains, then stops its engine
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        for proc, _ in replicas:
            proc.join(timeout=server_config.drain_timeout + 10)
            if proc.is_alive():
                proc.kill()
