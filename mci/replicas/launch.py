"""`mci serve --dp-size N`: N replicas of the server on the next N ports (loopback), and the
cache-aware router (mci/router/) on --port in front of them."""

from __future__ import annotations

import dataclasses
import os
import time

from mci.engine.config import EngineConfig
from mci.replicas.replica_process import ReplicaProcess
from mci.router.config import RouterConfig
from mci.router.launch import run_router
from mci.server.config import ServerConfig

REPLICA_START_S = 600.0


def serve_data_parallel(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """N replicas on ports port+1 .. port+N (loopback), the cache-aware router on `port`."""
    n = server_config.dp_size
    threads = max(1, (os.cpu_count() or 1) // n)
    replicas: list[ReplicaProcess] = []
    try:
        for i in range(n):
            config = dataclasses.replace(server_config, port=server_config.port + 1 + i)
            replicas.append(ReplicaProcess(engine_config, config, threads))
        deadline = time.monotonic() + REPLICA_START_S
        for replica in replicas:
            replica.wait_ready(deadline)
        router = RouterConfig(
            host=server_config.host,
            port=server_config.port,
            otlp_traces_endpoint=server_config.otlp_traces_endpoint,
            tenants=server_config.tenants,  # the replicas check them too
        )
        return run_router(router, [replica.url for replica in replicas])
    finally:
        for replica in replicas:  # all drain at once, then each stops its engine
            replica.signal_stop()
        for replica in replicas:
            replica.join()
