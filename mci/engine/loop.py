"""The engine loop: apply commands between steps, step, hand each output to its request's sink.

One loop drives an `EngineCore` wherever it runs: the in-process `Engine`'s background
thread, its caller's thread (`background=False`), and the main thread of `mci serve`'s engine
process. They differ only in where commands come from (an `Inbox`) and what a sink does with
an output (a callback, an asyncio queue, the pipe's outbox).

    inbox.take() ──commands──> apply: add / abort / call
                               core.step() ──outputs──> sink of each request
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mci.core.outputs import RequestOutput
from mci.core.request import Request
from mci.engine.core import EngineCore
from mci.errors import EngineBroken

log = logging.getLogger("mci")

Sink = Callable[[RequestOutput], None]
IDLE_WAIT_S = 0.05  # how long an idle loop waits for a command before checking its stop flag


@dataclass(frozen=True)
class AddRequests:
    """Queue these requests (a prompt's samples); `sink` receives every output of each."""

    requests: list[Request]
    sink: Sink


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request; its final output reports finish_reason 'abort'."""

    request_id: str


@dataclass(frozen=True)
class CallBetweenSteps:
    """Run `fn` on the loop's thread between steps (inspection: stats, integrity checks)."""

    fn: Callable[[], None]


Command = AddRequests | AbortRequest | CallBetweenSteps


class Inbox(Protocol):
    def take(self, wait: bool) -> list[Command]:
        """Commands that arrived since the last call; with `wait`, block briefly for one."""


class QueueInbox:
    """Commands from any thread, through a thread-safe queue."""

    def __init__(self):
        self._queue: queue.Queue[Command] = queue.Queue()

    def put(self, command: Command) -> None:
        self._queue.put(command)

    def take(self, wait: bool) -> list[Command]:
        commands = []
        try:
            commands.append(
                self._queue.get(timeout=IDLE_WAIT_S) if wait else self._queue.get_nowait()
            )
            while True:
                commands.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return commands


class EngineLoop:
    """Drives one `EngineCore`; only the thread running the loop touches engine state.

    Invariant: every request added through the loop has a sink until its final output has
    been handed to it, then none.
    """

    def __init__(self, core: EngineCore):
        self.core = core
        self._sinks: dict[str, Sink] = {}

    def run_once(self, inbox: Inbox, wait: bool = False, should_stop=None) -> None:
        """Apply the commands waiting in `inbox` (with `wait` and nothing to do, block briefly
        for one), then step once if there is work and the loop is not stopping."""
        for command in inbox.take(wait and not self.core.has_work):
            self.apply(command)
        if should_stop is not None and should_stop():
            return
        if not self.core.has_work:
            self.core.idle()
            return
        try:
            outputs = self.core.step()
        except EngineBroken as exc:  # no later step can succeed: fail everything, stop
            log.error("engine broken: %s", exc)
            self.dispatch(self.core.abort_all(f"engine failed: {exc}"))
            raise
        except Exception as exc:  # a failed step must not kill the engine or hang callers
            log.exception("engine step failed; aborting in-flight requests")
            outputs = self.core.abort_all(f"internal error: {exc}")
        self.dispatch(outputs)

    def run(self, inbox: Inbox, should_stop: Callable[[], bool], after_each=None) -> None:
        """Loop until `should_stop()`; `after_each()` runs after every iteration."""
        while not should_stop():
            self.run_once(inbox, wait=True, should_stop=should_stop)
            if after_each is not None:
                after_each()

    def apply(self, command: Command) -> None:
        if isinstance(command, AddRequests):
            for req in command.requests:
                self._sinks[req.request_id] = command.sink
                out = self.core.add_request(req)
                if out is not None:
                    self.dispatch([out])
        elif isinstance(command, AbortRequest):
            out = self.core.abort_request(command.request_id)
            if out is not None:
                self.dispatch([out])
        elif isinstance(command, CallBetweenSteps):
            command.fn()
        else:
            raise TypeError(f"unknown engine command {command!r}")

    def stop(self, error: str) -> None:
        """Fail every request still in flight (shutdown); each gets its aborted output."""
        self.dispatch(self.core.abort_all(error))

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if sink is not None:
                try:
                    sink(out)
                except Exception:  # a broken consumer must not stop the loop
                    log.exception("output sink for %s failed", out.request_id)
