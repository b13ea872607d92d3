"""The front end's handle on the engine process: submit, abort, receive, health.

A reader thread receives the engine's messages and hands each output to its request's
asyncio queue (thread-safe). If the engine process dies, every request in flight gets an
error output at once and `alive` turns False, so `/health` fails and nothing hangs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
import time

from mci.core.outputs import RequestOutput
from mci.core.sampling_params import SamplingParams
from mci.engine_config import EngineConfig
from mci.errors import UserError
from mci.request_front import sample_ids
from mci.server import messages
from mci.server.engine_process import engine_main

log = logging.getLogger("mci")


class EngineDied(RuntimeError):
    """The engine process is gone."""


class EngineClient:
    """Starts the engine process and multiplexes requests over its pipe."""

    def __init__(self, config: EngineConfig, start_timeout_s: float = 600):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        # Not a daemon: in a parallel run the engine (rank 0) starts the other ranks itself.
        # It never outlives us: it exits when this pipe closes (mci.server.engine_process).
        self.process = ctx.Process(
            target=engine_main, args=(config, child), daemon=False, name="mci-engine"
        )
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.process.kill()
            raise UserError("engine did not start in time")
        msg = self._conn.recv()
        if isinstance(msg, messages.Failed):
            self.process.join(5)
            raise UserError(msg.message)
        self.info: dict = msg.info
        self.stats: dict = dict(self.info)
        self.alive = True
        self._closing = False
        self._send_lock = threading.Lock()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._state_waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tokens = itertools.count()
        self._reader = threading.Thread(target=self._read, name="mci-engine-reader", daemon=True)
        self._reader.start()

    # ---- sending ------------------------------------------------------------------------------
    def _send(self, msg: object) -> None:
        if not self.alive:
            raise EngineDied("the engine process is not running")
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, BrokenPipeError) as exc:
            self._mark_dead()
            raise EngineDied("the engine process is not running") from exc

    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        timeout_s: float | None = None,
        queue: asyncio.Queue | None = None,
    ) -> list[tuple[str, asyncio.Queue]]:
        """Queue a request; returns (sample id, output queue) per sample (n of them).

        Sample ids follow the engine's rule (`sample_ids`). Pass `queue` to receive every
        sample's outputs on one queue.
        """
        loop = asyncio.get_running_loop()
        ids = sample_ids(rid, params.n)
        out = []
        for sid in ids:
            q: asyncio.Queue = queue or asyncio.Queue()
            self._queues[sid] = (loop, q)
            out.append((sid, q))
        try:
            self._send(messages.AddRequest(rid, prompt_ids, params, priority, timeout_s))
        except EngineDied:
            for sid in ids:
                self._queues.pop(sid, None)
            raise
        return out

    def abort(self, sample_id: str) -> None:
        if self.alive and sample_id in self._queues:
            try:
                self._send(messages.AbortRequest(sample_id))
            except EngineDied:
                pass

    async def state(self, timeout_s: float = 10) -> dict:
        """The engine's stats plus a live integrity check of its slot accounting."""
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        fut = loop.create_future()
        self._state_waiters[token] = (loop, fut)
        self._send(messages.StateQuery(token))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._state_waiters.pop(token, None)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- receiving ----------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                self.process.join(timeout=5)  # reap it: an exited engine is no zombie
                self._mark_dead()
                return
            if isinstance(msg, messages.Outputs):
                self.stats = msg.stats
                self._deliver(msg.outputs)
            elif isinstance(msg, messages.Rejected):
                self._deliver([RequestOutput.aborted(sid, msg.message) for sid in msg.sample_ids])
            elif isinstance(msg, messages.StateReply):
                entry = self._state_waiters.get(msg.token)
                if entry:
                    loop, fut = entry
                    loop.call_soon_threadsafe(
                        lambda f=fut, s=msg.state: f.done() or f.set_result(s)
                    )

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their queues: one wake-up of each event loop per engine message,
        not one per output (a step of 32 requests is one syscall, not 32)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._queues.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                self._queues.pop(out.request_id, None)
            loop, q = entry
            by_loop.setdefault(loop, []).append((q, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed (shutting down)
                pass

    def _mark_dead(self) -> None:
        if not self.alive:
            return
        self.alive = False
        if not self._closing:
            log.error(
                "engine process exited (code %s); failing %d requests in flight",
                self.process.exitcode,
                len(self._queues),
            )
        self._deliver(
            [RequestOutput.aborted(sid, "engine process died") for sid in list(self._queues)]
        )

    def shutdown(self, timeout_s: float = 10) -> None:
        self._closing = True
        if self.alive:
            try:
                self._send(messages.Shutdown())
            except EngineDied:
                pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.alive = False
        deadline = time.monotonic() + 2
        while self._reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
