"""The engine process: scheduler and model in the main thread of their own process.

The HTTP front end never runs model code, so request parsing and streaming never stall a
step, and the model loop keeps torch's thread pool on the main thread (see mci.engine.engine). The
same `EngineLoop` as the in-process engine drives it; its commands come from the pipe
(`PipeInbox`, messages in `server/messages.py`) and its outputs go back in batches.

The engine exits when the pipe closes: a dead front end never leaves an orphan behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from multiprocessing.connection import Connection

from mci.core.outputs import RequestOutput
from mci.engine import commands as messages
from mci.engine.config import EngineConfig
from mci.engine.loop import (
    IDLE_WAIT_S,
    AbortRequest,
    AddRequests,
    CallBetweenSteps,
    Command,
    EngineLoop,
)
from mci.engine.request_front import sample_ids
from mci.engine_assembly import EngineParts, assemble
from mci.errors import EngineBroken, UserError
from mci.process_tuning import freeze_startup_objects

log = logging.getLogger("mci")
HEARTBEAT_S = 0.5  # the longest silence of a live engine loop between steps


class PipeInbox:
    """Turns pipe messages into loop commands. Owns the outbox every request's outputs go to
    and the flag that ends the loop (shutdown asked, or the front end gone)."""

    def __init__(self, conn: Connection, parts: EngineParts):
        self.conn = conn
        self.parts = parts
        self.outbox: list[RequestOutput] = []
        self.stop = False  # the loop ends
        self.last_sent = time.monotonic()
        self.shutdown_asked = False  # ... because the front end asked (it is still listening)

    def take(self, wait: bool) -> list[Command]:
        commands: list[Command] = []
        timeout = IDLE_WAIT_S if wait else 0
        try:
            while not self.stop and self.conn.poll(timeout):
                timeout = 0
                command = self._command(self.conn.recv())
                if command is not None:
                    commands.append(command)
        except (EOFError, OSError):
            log.info("front end gone; engine exiting")
            self.stop = True
        return commands

    def _command(self, msg) -> Command | None:
        if isinstance(msg, messages.AddRequest):
            try:
                reqs = self.parts.front.requests(
                    msg.request_id,
                    msg.prompt_ids,
                    msg.params,
                    msg.priority,
                    msg.timeout_s,
                    msg.resume,
                    msg.queue_deadline,
                )
            except Exception as exc:  # noqa: BLE001 - a bad request never kills the engine
                if not isinstance(exc, UserError):
                    log.exception("rejecting request %s", msg.request_id)
                rejected = sample_ids(msg.request_id, msg.params.n)
                self.send(messages.Rejected(rejected, str(exc)))
                return None
            return AddRequests(reqs, self.outbox.append)
        if isinstance(msg, messages.AbortRequest):
            return AbortRequest(msg.sample_id)
        if isinstance(msg, messages.StateQuery):  # answered in order with the commands before it
            core = self.parts.core
            return CallBetweenSteps(lambda: self.send(messages.StateReply(msg.token, core.state())))
        if isinstance(msg, messages.Shutdown):
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
            self.send(messages.Outputs(list(self.outbox), self.parts.core.stats()))
            self.outbox.clear()  # the sinks hold this list's append
        elif time.monotonic() - self.last_sent > HEARTBEAT_S:
            self.send(messages.Heartbeat(self.parts.core.stats()))


def engine_main(config: EngineConfig, conn: Connection) -> None:
    """Entry point of the engine process."""
    logging.basicConfig(level=logging.INFO, format="mci[engine]: %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        parts = assemble(config)
    except UserError as exc:
        conn.send(messages.Failed(str(exc)))
        return
    info = {"pid": os.getpid(), "weight_bytes": parts.model.weight_bytes(), **parts.core.stats()}
    freeze_startup_objects()
    conn.send(messages.Ready(info))
    inbox = PipeInbox(conn, parts)
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
