"""One `mci serve` replica in a child process: what `mci serve --dp-size N` and the Ray Serve
deployment (mci/ray_serve/) both start.

The child binds loopback only (its parent fronts it), uses `threads` OpenMP threads (replicas
sharing a machine's cores must not oversubscribe them; the engine process inherits the
setting), and stops itself if its parent dies without stopping it (a SIGKILLed Ray actor never
runs its cleanup): nothing else would ever free its memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time

import httpx

from mci.engine.config import EngineConfig
from mci.errors import UserError
from mci.server.config import ServerConfig

log = logging.getLogger("mci")
PARENT_POLL_S = 1.0


def _stop_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)  # drains like any SIGTERM, then stops the engine


def _replica_main(
    engine_config: EngineConfig, server_config: ServerConfig, threads: int, parent: int
) -> None:
    from mci.server.launch import serve

    os.environ["OMP_NUM_THREADS"] = str(threads)
    logging.basicConfig(
        level=logging.INFO,
        format=f"mci[replica :{server_config.port}]: %(message)s",
        stream=sys.stderr,
    )
    threading.Thread(target=_stop_when_orphaned, args=(parent,), daemon=True).start()
    try:
        sys.exit(serve(engine_config, server_config))
    except UserError as exc:
        log.error("%s", exc)
        sys.exit(2)


class ReplicaProcess:
    """A started replica: `url`, `wait_ready()`, `stop()`."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, threads: int):
        self.url = f"http://127.0.0.1:{server_config.port}"
        self.drain_timeout = server_config.drain_timeout
        config = _loopback(server_config)
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=_replica_main,
            args=(engine_config, config, threads, os.getpid()),
            name=f"mci-replica-{config.port}",
        )
        self.process.start()

    def alive(self) -> bool:
        return self.process.is_alive()

    def wait_ready(self, deadline: float) -> None:
        """Until its /health is 200; UserError if it exits or `deadline` (monotonic) passes."""
        while True:
            if not self.process.is_alive():
                raise UserError(f"replica {self.url} exited while starting (see its log)")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise UserError(f"replica {self.url} did not start in time")
            time.sleep(0.2)

    def signal_stop(self) -> None:
        """SIGTERM: the replica drains its requests, then stops its engine."""
        if self.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGTERM)

    def join(self) -> None:
        self.process.join(timeout=self.drain_timeout + 10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)

    def stop(self) -> None:
        self.signal_stop()
        self.join()


def _loopback(config: ServerConfig) -> ServerConfig:
    return dataclasses.replace(config, host="127.0.0.1", dp_size=1)
