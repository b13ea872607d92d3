"""`mci serve --dp-size N`: N replicas of the server on the next N ports (loopback), and the
cache-aware router (mci/router/) on --port in front of them."""

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

from mci.engine_config import EngineConfig, RouterConfig, ServerConfig
from mci.errors import UserError
from mci.router.launch import run_router
from mci.server.launch import serve

log = logging.getLogger("mci")
REPLICA_START_S = 600.0


def _replica_main(engine_config: EngineConfig, server_config: ServerConfig, threads: int) -> None:
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
