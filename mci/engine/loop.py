"""The engine loop: apply commands between steps, step, hand each output to its request's sink.

One loop drives a `StepCore` wherever it runs: the in-process `Engine`'s background thread,
its caller's thread (`background=False`), and the main thread of `mci serve`'s engine process.
They differ only in where commands come from (an `Inbox`) and what a sink does with an output
(a callback, an asyncio queue, the pipe's outbox). The commands are engine/commands.py's
vocabulary, each with the sink its outputs go to; `CallBetweenSteps` is the only command that
never leaves the process (it carries a function).

    inbox.take() ──(command, sink)──> apply: add / abort / call
                                      core.step() ──outputs──> sink of each request
"""

from __future__ import annotations

import logging
import os
import queue
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mci.core.outputs import RequestOutput
from mci.core.request_ids import sample_ids
from mci.engine.commands import AbortRequest, AddRequest
from mci.engine.core import StepCore
from mci.errors import EngineBroken

log = logging.getLogger("mci")

Sink = Callable[[RequestOutput], None]
IDLE_WAIT_S = 0.05  # how long an idle loop waits for a command before checking its stop flag


@dataclass(frozen=True)
class CallBetweenSteps:
    """Run `fn` on the loop's thread between steps (inspection: stats, integrity checks)."""

    fn: Callable[[], None]


LoopCommand = AddRequest | AbortRequest | CallBetweenSteps
# a command and where the outputs it causes go (None: a command without outputs of its own)
Delivery = tuple[LoopCommand, Sink | None]


class Inbox(Protocol):
    # readable whenever a command waits to be taken (None: no such descriptor): a step that
    # runs several decode steps ends early on it (`StepCore.wake_on`)
    wake_fd: int | None

    def take(self, wait: bool) -> list[Delivery]:
        """Commands that arrived since the last call; with `wait`, block briefly for one."""


class QueueInbox:
    """Commands from any thread, through a thread-safe queue; an eventfd counts them in, so
    that `wake_fd` is readable while one waits (None where the system has no eventfd)."""

    def __init__(self):
        self._queue: queue.Queue[Delivery] = queue.Queue()
        self.wake_fd: int | None = None
        if hasattr(os, "eventfd"):  # Linux
            self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            weakref.finalize(self, os.close, self.wake_fd)  # open as long as the inbox is

    def put(self, command: LoopCommand, sink: Sink | None = None) -> None:
        self._queue.put((command, sink))  # queued before it is counted: `take` sees it
        if self.wake_fd is not None:
            os.eventfd_write(self.wake_fd, 1)

    def take(self, wait: bool) -> list[Delivery]:
        self._uncount()
        deliveries = []
        try:
            if wait:  # counted while blocked: taken now, so uncounted
                deliveries.append(self._queue.get(timeout=IDLE_WAIT_S))
                self._uncount()
            while True:
                deliveries.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return deliveries

    def _uncount(self) -> None:
        """Zero the count before draining the queue: a command put after this stays
        counted, and one put before is drained."""
        if self.wake_fd is not None:
            try:
                os.eventfd_read(self.wake_fd)
            except BlockingIOError:
                pass


class EngineLoop:
    """Drives one `StepCore`; only the thread running the loop touches engine state.

    Invariant: every sample added through the loop has a sink until its final output has
    been handed to it, then none.
    """

    def __init__(self, core: StepCore):
        self.core = core
        self._sinks: dict[str, Sink] = {}

    def run_once(self, inbox: Inbox, wait: bool = False, should_stop=None) -> None:
        """Apply the commands waiting in `inbox` (with `wait` and nothing to do, block briefly
        for one), then step once if there is work and the loop is not stopping."""
        for command, sink in inbox.take(wait and not self.core.has_work):
            self.apply(command, sink)
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

    def apply(self, command: LoopCommand, sink: Sink | None = None) -> None:
        if isinstance(command, AddRequest):
            if sink is None:
                raise ValueError(f"request {command.request_id} has nowhere to send outputs")
            for sid in sample_ids(command.request_id, command.params.n):
                self._sinks[sid] = sink
            self.dispatch(self.core.add(command))
        elif isinstance(command, AbortRequest):
            self.dispatch(self.core.abort(command.request_id))
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
