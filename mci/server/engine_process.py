"""The engine process: scheduler and model in the main thread of their own process.

The HTTP front end never runs model code, so request parsing and streaming never stall a
step, and the model loop keeps torch's thread pool on the main thread (see mci/engine/engine.py).
The same `EngineLoop` as the in-process engine drives it; its commands come from the pipe
(`PipeInbox`: the vocabulary of engine/commands.py) and its outputs go back in batches.

The engine exits when the pipe closes: a dead front end never leaves an orphan behind.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import time
from multiprocessing.connection import Connection

from mci.core.outputs import RequestOutput
from mci.engine import commands
from mci.engine.builder import EngineParts, build_engine
from mci.engine.config import EngineConfig
from mci.engine.loop import IDLE_WAIT_S, CallBetweenSteps, Delivery, EngineLoop
from mci.errors import EngineBroken, UserError
from mci.model_config import ModelConfig
from mci.process_tuning import freeze_startup_objects

log = logging.getLogger("mci")
HEARTBEAT_S = 0.5  # the longest silence of a live engine loop between steps


class PipeInbox:
    """Hands the pipe's commands to the loop, each with the outbox as its sink, and answers
    state queries between steps. Owns the outbox every request's outputs go to and the flag
    that ends the loop (shutdown asked, or the front end gone)."""

    def __init__(self, conn: Connection, parts: EngineParts):
        self.conn = conn
        # one poll object for the engine's life: Connection.poll builds and registers a
        # selector each call, every step (2.2 us against 0.3 here, measured alone)
        self.wake_fd = conn.fileno()  # readable while a command waits (Inbox)
        self._poller = select.poll()
        self._poller.register(self.wake_fd, select.POLLIN)
        self.parts = parts
        self.outbox: list[RequestOutput] = []
        self.stop = False  # the loop ends
        self.last_sent = time.monotonic()
        self.shutdown_asked = False  # ... because the front end asked (it is still listening)

    def take(self, wait: bool) -> list[Delivery]:
        deliveries: list[Delivery] = []
        timeout = IDLE_WAIT_S if wait else 0
        try:
            while not self.stop and self._poller.poll(timeout * 1000):  # readable or closed
                timeout = 0
                delivery = self._delivery(self.conn.recv())
                if delivery is not None:
                    deliveries.append(delivery)
        except (EOFError, OSError):
            log.info("front end gone; engine exiting")
            self.stop = True
        return deliveries

    def _delivery(self, msg) -> Delivery | None:
        if isinstance(msg, (commands.AddRequest, commands.AbortRequest)):
            return msg, self.outbox.append
        if isinstance(msg, commands.StateQuery):  # answered in order with the commands before it
            core = self.parts.core
            reply = lambda: self.send(commands.StateReply(msg.token, core.state()))  # noqa: E731
            return CallBetweenSteps(reply), None
        if isinstance(msg, commands.Shutdown):
            self.stop = self.shutdown_asked = True
            return None
        log.error("ignoring an unknown message from the front end: %r", msg)
        return None

    def send(self, msg) -> None:
        try:
            self.conn.send(msg)
            self.last_sent = time.monotonic()
        except (EOFError, OSError):
            self.stop = True

    def flush(self) -> None:
        """Send the outputs gathered since the last flush, with fresh stats; or, when nothing
        was sent for HEARTBEAT_S, a heartbeat (the loop runs at least every IDLE_WAIT_S)."""
        if self.outbox:
            self.send(commands.Outputs(list(self.outbox), self.parts.core.stats()))
            self.outbox.clear()  # the sinks hold this list's append
        elif time.monotonic() - self.last_sent > HEARTBEAT_S:
            self.send(commands.Heartbeat(self.parts.core.stats()))


def engine_main(config: EngineConfig, model_config: ModelConfig, conn: Connection) -> None:
    """Entry point of the engine process; `model_config`: config.json as the front end parsed
    it (the engine does not read it again)."""
    logging.basicConfig(level=logging.INFO, format="mci[engine]: %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        parts = build_engine(config, model_config=model_config)
    except UserError as exc:
        conn.send(commands.Failed(str(exc)))
        return
    info = {"pid": os.getpid(), "weight_bytes": parts.model.weight_bytes(), **parts.core.stats()}
    freeze_startup_objects()
    conn.send(commands.Ready(info))
    inbox = PipeInbox(conn, parts)
    parts.core.wake_on(inbox.wake_fd)
    loop = EngineLoop(parts.core)
    try:
        loop.run(inbox, lambda: inbox.stop, inbox.flush)
        if inbox.shutdown_asked:
            loop.stop("engine shut down")
            inbox.flush()
    except EngineBroken:
        inbox.flush()  # the in-flight requests' errors, before the process exits
        sys.exit(1)  # the front end sees the engine die: /health turns 503
    finally:
        parts.close()
