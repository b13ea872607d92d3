"""`mci serve`: start the engine process, then the HTTP front end; drain on SIGTERM.

SIGTERM: /health turns 503 and new requests get 503 at once, requests in flight run to
completion (up to --drain-timeout), then the server stops, the engine process is shut down,
and the command exits 0. A second signal (or SIGINT) stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import uvicorn

from mci.cache.tiers import shared_store_id
from mci.engine.builder import run_follower_node
from mci.engine.config import EngineConfig
from mci.errors import UserError
from mci.model_config import load_config
from mci.process_tuning import freeze_startup_objects
from mci.server.app import build_app
from mci.server.config import ServerConfig
from mci.server.engine_supervisor import EngineSupervisor
from mci.server.state import ServerState
from mci.tokenizer import TextTokenizer

log = logging.getLogger("mci")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM drains instead of closing connections."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            self.state.draining = True
            log.info(
                "SIGTERM: draining %d requests (up to %.0fs)",
                self.state.engine.num_in_flight,
                self.state.config.drain_timeout,
            )
            threading.Thread(target=self._drain, daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.state.config.drain_timeout
        while self.state.engine.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    path = Path(engine_config.model.model_path)
    if not path.is_dir():
        raise UserError(f"model directory {path} does not exist")
    if engine_config.parallel.node_rank > 0:  # a multi-node run's other machines compute only
        return run_follower_node(engine_config)
    if server_config.dp_size != 1:
        raise UserError("--dp-size N > 1 is served by mci.replicas.launch (mci serve)")
    model_config = load_config(path)  # the only read of config.json: the engine gets this one
    tokenizer = TextTokenizer.load(path)
    if (server_config.context_length or 0) > model_config.max_position_embeddings:
        raise UserError(f"--context-length must be in 1..{model_config.max_position_embeddings}")
    engine = EngineSupervisor(
        engine_config,
        model_config,
        max_restarts=server_config.max_engine_restarts,
        watchdog_timeout_s=server_config.watchdog_timeout,
    )
    info = engine.info
    name = server_config.served_model_name or path.name
    state = ServerState(
        engine,
        tokenizer,
        model_config,
        server_config,
        name,
        engine_config.scheduler.max_running_requests,
        hicache_store=shared_store_id(engine_config.cache),
        disaggregation=engine_config.disaggregation,
    )
    log.info(
        "model %s (%s) from %s: %.1f MB of weights",
        name,
        engine_config.model.dtype,
        path,
        info["weight_bytes"] / 1e6,
    )
    log.info(
        "%d tokens of KV; radix cache %s",
        info["num_slots"],
        "off" if engine_config.cache.disable_radix_cache else "on",
    )
    # loop and http stay "auto": uvloop and httptools, which pyproject installs (the front end's
    # CPU per streamed token is CPU the engine's threads lose on a small machine)
    uv = uvicorn.Config(
        build_app(state),
        host=server_config.host,
        port=server_config.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        lifespan="off",
    )
    server = DrainingServer(uv, state)
    signal.signal(signal.SIGHUP, lambda *_: state.reload_tenants())
    freeze_startup_objects()
    log.info(
        "serving on http://%s:%d (OpenAI API under /v1)", server_config.host, server_config.port
    )
    try:
        server.run()
    finally:
        engine.shutdown()
        state.tracing.shutdown()  # the last requests' spans leave before the process does
    if not server.started:
        raise UserError(f"could not listen on {server_config.host}:{server_config.port}")
    log.info("stopped")
    return 0
