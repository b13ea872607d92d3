"""The front end's requests in the engine: where each sample's outputs go, what to send again.

Each `AddRequest` the front end sends is an entry until its last sample's final output has
been delivered. Outputs arrive on the engine reader's thread and go to the asyncio queue of
their sample (on that queue's own event loop, thread-safe). The table also answers the
questions an engine's death asks (server/engine_supervisor.py): which requests can be sent
again unchanged (none of their samples has produced output), which must fail, and which have
waited past their queue bound while no engine ran.

Thread-safe: one lock over the table. Invariant: a sample is in the table exactly while its
request is, and a request leaves once it has no sample left.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from mci.core.outputs import RequestOutput
from mci.core.request_ids import sample_ids
from mci.engine.commands import AddRequest


@dataclass
class InFlight:
    """One AddRequest in the engine."""

    command: AddRequest
    sent_at: float  # time.monotonic() of the first send: its time bounds count from here
    samples: list[str]  # its samples still in flight
    started: bool = False  # some sample has received output
    survived_hang: bool = False  # it was in flight when an engine hung, and was sent again


@dataclass(frozen=True)
class _Target:
    """Where a sample's outputs go: its request, and the queue on its event loop."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(frozen=True)
class Casualties:
    """The samples an engine's death ends: `failed` (their request had started, or there
    will be no new engine) and `failed_twice` (in flight through a second hang)."""

    failed: list[str]
    failed_twice: list[str]
    num_kept: int  # requests kept for the next engine


class InFlightTable:
    """Requests in flight, by request id, and their samples' output queues."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: dict[str, InFlight] = {}
        self._targets: dict[str, _Target] = {}  # by sample id

    def __len__(self) -> int:
        """Samples in flight."""
        return len(self._targets)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._targets

    def add(
        self, command: AddRequest, queue: asyncio.Queue | None = None
    ) -> list[tuple[str, asyncio.Queue]]:
        """Enter a request about to be sent; (sample id, output queue) per sample, all on
        `queue` when given. Call from the event loop the queues belong to."""
        loop = asyncio.get_running_loop()
        ids = sample_ids(command.request_id, command.params.n)
        out = []
        with self._lock:
            for sid in ids:
                q: asyncio.Queue = queue or asyncio.Queue()
                self._targets[sid] = _Target(command.request_id, loop, q)
                out.append((sid, q))
            self._requests[command.request_id] = InFlight(command, time.monotonic(), list(ids))
        return out

    def forget_sample(self, sample_id: str) -> None:
        """Drop a sample's whole request (no engine will end it: it is not sent again)."""
        with self._lock:
            target = self._targets.get(sample_id)
            if target is not None:
                self._forget(target.request_id)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._forget(request_id)

    def _forget(self, rid: str) -> None:
        entry = self._requests.pop(rid, None)
        for sid in entry.samples if entry else ():
            self._targets.pop(sid, None)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their queues: one wake-up of each event loop per call, not one per
        output (a step of 32 requests is one syscall, not 32)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                target = self._targets.get(out.request_id)
                if target is None:
                    continue
                entry = self._requests[target.request_id]
                entry.started = True
                if out.finished:
                    entry.samples.remove(out.request_id)
                    self._targets.pop(out.request_id)
                    if not entry.samples:
                        self._requests.pop(target.request_id)
                by_loop.setdefault(target.loop, []).append((target.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed (shutting down)
                pass

    def fail(self, sample_ids_: list[str], error: str) -> None:
        self.deliver([RequestOutput.aborted(sid, error) for sid in sample_ids_])

    # ---- an engine's death --------------------------------------------------------------------
    def settle_death(self, restart: bool, hung: bool) -> Casualties:
        """Which samples the death ends. With a restart, a request none of whose samples has
        output is kept (sent again), unless it was kept through a hang before and this death
        is a hang too: one request that wedges every engine must not spend the restart budget."""
        with self._lock:
            failed = [e for e in self._requests.values() if not restart or e.started]
            twice = []
            if restart and hung:
                twice = [e for e in self._requests.values() if e.survived_hang and not e.started]
                for entry in self._requests.values():
                    entry.survived_hang = True
            return Casualties(
                [sid for e in failed for sid in e.samples],
                [sid for e in twice for sid in e.samples],
                len(self._requests) - len(failed) - len(twice),
            )

    def to_resend(self) -> list[AddRequest]:
        """The kept requests' commands for a new engine, their time bounds counting from when
        they were first sent."""
        now = time.monotonic()
        with self._lock:
            return [e.command.aged(now - e.sent_at) for e in self._requests.values()]

    def past_queue_bound(self) -> list[str]:
        """Samples of requests not started whose queue bound has passed (no engine is running
        to expire them)."""
        now = time.monotonic()
        with self._lock:
            return [
                sid
                for e in self._requests.values()
                if e.command.queue_timeout_s is not None
                and e.sent_at + e.command.queue_timeout_s < now
                and not e.started
                for sid in e.samples
            ]

    def all_samples(self) -> list[str]:
        with self._lock:
            return [sid for e in self._requests.values() for sid in e.samples]


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
