"""The engine process: scheduler and model in the main thread of their own process.

The HTTP front end never runs model code, so request parsing and streaming never stall a
step, and the model loop keeps torch's thread pool on the main thread (see mci.engine).
Messages over one duplex pipe (our own processes; the pickled objects are our dataclasses):

    front end -> engine:  ("add", rid, prompt_ids, SamplingParams, priority, timeout_s)
                          ("abort", rid) | ("state", token) | ("shutdown", None)
    engine -> front end:  ("ready", info) | ("outputs", [RequestOutput], stats)
                          ("state", token, state) | ("rejected", rid, message)

The engine exits when the pipe closes: a dead front end never leaves an orphan behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from mci.engine import Engine
from mci.engine_config import EngineConfig
from mci.errors import UserError

log = logging.getLogger("mci")


def _state(engine: Engine) -> dict:
    state = engine.stats()
    try:
        engine.check_integrity_now()
        state["integrity_ok"] = True
    except AssertionError as exc:
        state["integrity_ok"] = False
        state["integrity_error"] = str(exc)
    return state


def engine_main(config: EngineConfig, conn) -> None:
    """Entry point of the engine process."""
    logging.basicConfig(level=logging.INFO, format="mci[engine]: %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = Engine(config, background=False)
    except UserError as exc:
        conn.send(("failed", str(exc)))
        return
    outbox: list = []
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    conn.send(("ready", {"pid": os.getpid(), "weight_bytes": weight_bytes, **engine.stats()}))
    while True:
        idle = not engine.scheduler.has_work
        try:
            timeout = 0.05 if idle else 0
            while conn.poll(timeout):
                timeout = 0
                msg = conn.recv()
                kind = msg[0]
                if kind == "add":
                    _, rid, ids, params, priority, timeout_s = msg
                    try:
                        engine.submit_ids(ids, params, outbox.append, rid, priority, timeout_s)
                    except Exception as exc:  # noqa: BLE001 - a bad request never kills us
                        if not isinstance(exc, UserError):
                            log.exception("rejecting request %s", rid)
                        conn.send(("rejected", rid, str(exc)))
                elif kind == "abort":
                    engine.abort(msg[1])
                elif kind == "state":
                    engine.run_once()  # apply queued commands first
                    conn.send(("state", msg[1], _state(engine)))
                elif kind == "shutdown":
                    engine.shutdown()
                    if outbox:
                        conn.send(("outputs", outbox, engine.stats()))
                    return
            engine.run_once()
            if outbox:
                conn.send(("outputs", outbox, engine.stats()))  # pickled now: safe to clear
                outbox.clear()  # the sinks hold this list's append
        except (EOFError, OSError, BrokenPipeError):
            log.info("front end gone; engine exiting")
            return
