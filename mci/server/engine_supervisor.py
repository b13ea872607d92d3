"""The front end's handle on the engine process: start, submit, abort, health, restarts.

`EngineSupervisor` owns the engine process and its pipe; what is in flight lives in its
`InFlightTable` (server/in_flight.py). A reader thread receives the engine's messages and
hands each output to its request's asyncio queue through the table.

If the engine process dies (a crash, an out-of-memory kill, a broken parallel run) the
supervisor restarts it, with backoff, up to `max_restarts` times in `RESTART_WINDOW_S`:

* a request none of whose samples has received any output yet is kept and sent again to the
  new engine: its client never notices (beyond the delay);
* a request that has streamed something fails at once with a clear error (its text so far
  cannot be taken back, and a fresh start would repeat it);
* `alive` is False while the engine reloads (so /health is 503 only then); new requests are
  refused with 503 meanwhile.

Past the restart budget the engine stays down: every request fails, /health stays 503.

A *hung* engine (alive but silent: a deadlock, a stuck collective, SIGSTOP) is treated like a
dead one. The engine loop sends something at least every HEARTBEAT_S (outputs, or a
heartbeat); a watchdog thread here declares it hung when nothing came for the watchdog
timeout, reports not-ready at once (`ready`), SIGKILLs it (a stopped process dies too, so a
later SIGCONT finds nothing) and the death takes the restart path above, counted in `hangs`.

The watchdog's timeout (`watchdog_limit_s`) must exceed the longest legitimate step; by
default it is derived from the longest step seen (kept across restarts). A request resent
after a hang that is in flight at a second hang fails instead of being sent again, so one
request that wedges the engine cannot spend the whole restart budget. Before declaring a hang
the watchdog checks the pipe: a front end too busy to read is not a silent engine.

No request waits forever: one still unscheduled at its queue deadline ends with
QUEUE_TIMEOUT, in the engine or, while no engine runs, here. A request sent again to a new
engine keeps its bounds: they count from when it was first sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
import time
from collections import deque

from mci.core.outputs import QUEUE_TIMEOUT
from mci.engine import commands
from mci.engine.commands import AddRequest
from mci.engine.config import EngineConfig
from mci.errors import UserError
from mci.model_config import ModelConfig
from mci.process_tuning import engine_environment
from mci.server.engine_process import engine_main
from mci.server.in_flight import InFlightTable

log = logging.getLogger("mci")

# the errors of requests the engine's death ended (the router resumes such streams elsewhere)
ENGINE_DIED = "engine process died"
RESTARTED = "the engine restarted after a crash; this request had already produced output"
HUNG = (
    "the engine stopped making progress and was restarted; this request had already produced output"
)
ENGINE_DEATH_ERRORS = (ENGINE_DIED, RESTARTED, HUNG)
# A request in flight through two hangs may be what hangs the engine: it is not sent again.
HUNG_TWICE = "the engine stopped making progress twice with this request in flight; not retried"
RESTART_WINDOW_S = 600.0  # restarts counted against the budget over this long
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # before the 1st, 2nd, ... restart in the window
# The watchdog's default timeout: this long, or this many times the longest step the engine
# has taken, whichever is more (a step is the longest a live loop stays silent).
WATCHDOG_MIN_S = 30.0
WATCHDOG_STEP_FACTOR = 10.0
WATCH_INTERVAL_S = 0.1


class EngineDied(RuntimeError):
    """The engine process is gone."""


class EngineSupervisor:
    """Starts (and restarts) the engine process and multiplexes requests over its pipe."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        start_timeout_s: float = 600,
        max_restarts: int = 5,
        watchdog_timeout_s: float | None = None,
    ):
        self._config = config
        self._model_config = model_config
        self._start_timeout_s = start_timeout_s
        self.max_restarts = max_restarts
        self.watchdog_timeout_s = watchdog_timeout_s  # None: derived (`watchdog_limit_s`)
        self.in_flight = InFlightTable()
        self.restarts = 0  # engine restarts since the server started (a metric)
        self.hangs = 0  # engines killed by the watchdog (a metric)
        self._hung = False  # the current engine was declared hung
        self._longest_step_s = 0.0  # over every engine generation
        self.gave_up = False  # the restart budget is spent: the engine stays down
        self._last_heard = time.monotonic()  # the engine's last message
        self._recent_restarts: deque[float] = deque()
        self._lock = threading.Lock()  # engine generation, liveness, submissions
        self._send_lock = threading.Lock()
        self._state_waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tokens = itertools.count()
        self._closing = False
        self._generation = 0
        self.alive = False
        self._start()
        threading.Thread(target=self._watch, name="mci-engine-watchdog", daemon=True).start()

    def _start(self) -> None:
        """Start an engine process and wait until it is ready (UserError if it cannot). After
        a restart, the requests kept for it are sent before anything new can be (a submit
        needs `alive`, set only after), so none is sent twice."""
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe(duplex=True)
        # Not a daemon: in a parallel run the engine (rank 0) starts the other ranks itself.
        # It never outlives us: it exits when this pipe closes (mci.server.engine_process).
        process = ctx.Process(
            target=engine_main,
            args=(self._config, self._model_config, child),
            daemon=False,
            name="mci-engine",
        )
        with engine_environment():
            process.start()
        child.close()
        if not conn.poll(self._start_timeout_s):
            process.kill()
            raise UserError("engine did not start in time")
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            process.join(5)
            code = process.exitcode
            raise UserError(f"engine process exited while starting (code {code})") from None
        if isinstance(msg, commands.Failed):
            process.join(5)
            raise UserError(msg.message)
        with self._lock:
            kept = self.in_flight.to_resend()
            try:
                for command in kept:
                    conn.send(command)
            except (OSError, BrokenPipeError):
                process.kill()
                process.join(5)
                raise UserError("engine process died while taking its requests") from None
            self._generation += 1
            self.process, self._conn = process, conn
            self.info: dict = msg.info
            self.stats: dict = dict(self.info)
            self._last_heard = time.monotonic()
            self._hung = False
            self.alive = True
        if kept:
            log.info("resent %d request(s) to the new engine", len(kept))
        reader = threading.Thread(
            target=self._read,
            args=(conn, self._generation),
            name="mci-engine-reader",
            daemon=True,
        )
        reader.start()
        self._reader = reader

    # ---- sending ------------------------------------------------------------------------------
    def _send(self, msg: commands.Command) -> None:
        if not self.alive:
            raise EngineDied("the engine process is not running")
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, BrokenPipeError) as exc:
            raise EngineDied("the engine process is not running") from exc

    def submit(
        self, command: AddRequest, queue: asyncio.Queue | None = None
    ) -> list[tuple[str, asyncio.Queue]]:
        """Send a checked prompt; returns (sample id, output queue) per sample (n of them).
        Pass `queue` to receive every sample's outputs on one queue. Its time bounds hold
        across engine restarts."""
        with self._lock:
            if not self.ready:
                raise EngineDied("the engine process is not running")
            out = self.in_flight.add(command, queue)
        try:
            self._send(command)
        except EngineDied:
            self.in_flight.forget(command.request_id)
            raise
        return out

    def abort(self, sample_id: str) -> None:
        if sample_id not in self.in_flight:
            return
        if self.alive:
            try:
                self._send(commands.AbortRequest(sample_id))
                return
            except EngineDied:
                pass
        # no engine to abort it in (it reloads): drop it, so it is not sent again
        self.in_flight.forget_sample(sample_id)

    async def state(self, timeout_s: float = 10) -> dict:
        """The engine's stats plus a live integrity check of its slot accounting."""
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        fut = loop.create_future()
        self._state_waiters[token] = (loop, fut)
        try:
            self._send(commands.StateQuery(token))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._state_waiters.pop(token, None)

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    @property
    def ready(self) -> bool:
        """An engine is running and not declared hung (readiness)."""
        return self.alive and not self._hung

    def watchdog_limit_s(self) -> float:
        if self.watchdog_timeout_s is not None:
            return self.watchdog_timeout_s
        self._longest_step_s = max(
            self._longest_step_s, float(self.stats.get("longest_step_s", 0.0))
        )
        return max(WATCHDOG_MIN_S, WATCHDOG_STEP_FACTOR * self._longest_step_s)

    # ---- receiving ----------------------------------------------------------------------------
    def _read(self, conn, generation: int) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self._on_death(generation)
                return
            self._last_heard = time.monotonic()
            if isinstance(msg, commands.Heartbeat):
                self.stats = msg.stats
            elif isinstance(msg, commands.Outputs):
                self.stats = msg.stats
                self.in_flight.deliver(msg.outputs)
            elif isinstance(msg, commands.StateReply):
                entry = self._state_waiters.get(msg.token)
                if entry:
                    loop, fut = entry
                    loop.call_soon_threadsafe(
                        lambda f=fut, s=msg.state: f.done() or f.set_result(s)
                    )

    # ---- death and restarts -------------------------------------------------------------------
    def _on_death(self, generation: int) -> None:
        with self._lock:
            if generation != self._generation or not self.alive:
                return
            self.alive = False
            process = self.process
        process.join(timeout=5)  # reap it: an exited engine is no zombie
        restart = not self._closing and self._may_restart()
        self.gave_up = not restart and not self._closing
        ended = self.in_flight.settle_death(restart, self._hung)
        if not self._closing:
            log.error(
                "engine process exited (code %s); failing %d sample(s) that had started, %s",
                process.exitcode,
                len(ended.failed),
                f"retrying {ended.num_kept} request(s) after a restart"
                if restart
                else "no restart left",
            )
        reason = (HUNG if self._hung else RESTARTED) if restart else ENGINE_DIED
        self.in_flight.fail(ended.failed, reason)
        self.in_flight.fail(ended.failed_twice, HUNG_TWICE)
        for loop, fut in list(self._state_waiters.values()):
            loop.call_soon_threadsafe(
                lambda f=fut: f.done() or f.set_exception(EngineDied("engine restarting"))
            )
        if restart:
            threading.Thread(target=self._restart, name="mci-engine-restart", daemon=True).start()

    # ---- the watchdog -------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing:
            time.sleep(WATCH_INTERVAL_S)
            try:
                self._check_progress()
                self._expire_queued()
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one check
                log.exception("engine watchdog check failed")

    def _check_progress(self) -> None:
        limit = self.watchdog_limit_s()
        with self._lock:
            silent = time.monotonic() - self._last_heard
            if not self.alive or self._hung or silent <= limit:
                return
            if self._conn.poll(0):  # the engine spoke; the reader is behind (a busy front end)
                return
            self._hung = True
            process = self.process
        self.hangs += 1
        log.error(
            "engine made no progress for %.1fs (watchdog timeout %.1fs): killing it (pid %s)",
            silent,
            limit,
            process.pid,
        )
        process.kill()  # its pipe closes: the reader takes the death (and restart) path

    def _expire_queued(self) -> None:
        """While no engine runs, end the requests kept for the next one whose queue bound
        passed (a running engine expires its own)."""
        if self.ready:
            return
        expired = self.in_flight.past_queue_bound()
        if expired:
            self.in_flight.fail(expired, QUEUE_TIMEOUT)

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self._recent_restarts and now - self._recent_restarts[0] > RESTART_WINDOW_S:
            self._recent_restarts.popleft()
        return len(self._recent_restarts) < self.max_restarts

    def _restart(self) -> None:
        """Start a new engine after a backoff (it takes the requests kept for it)."""
        while not self._closing:
            attempt = len(self._recent_restarts)
            time.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            if self._closing:
                return
            self._recent_restarts.append(time.monotonic())
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - UserError, or OSError after an OOM kill
                log.error("engine restart failed: %s", exc)
                if self._may_restart():
                    continue
                self._give_up()
                return
            self.restarts += 1
            log.info("engine restarted (%d so far)", self.restarts)
            if self._closing:  # shut down while it started: stop it too
                self.shutdown()
            return

    def _give_up(self) -> None:
        self.gave_up = True
        log.error("engine restart budget spent; the engine stays down")
        self.in_flight.fail(self.in_flight.all_samples(), ENGINE_DIED)

    def shutdown(self, timeout_s: float = 10) -> None:
        self._closing = True
        if self.alive:
            try:
                self._send(commands.Shutdown())
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
