"""`mci.Engine`: the in-process API (generate, add_request, stream, abort, shutdown).

The engine's parts come from `builder.build_engine`, prompts are checked by its
`RequestFront` before anything is queued, and an `EngineLoop` drives the core, on its own
background thread or, with `background=False`, on the caller's thread inside `generate()`.
Callers on any thread (or an asyncio loop) talk to the loop through a command inbox (the
vocabulary of engine/commands.py: AddRequest, AbortRequest) and receive `RequestOutput`s
through per-request sinks. Only the loop's thread touches engine state.

    caller ──AddRequest/AbortRequest──> QueueInbox ──> EngineLoop: apply, core.step(), dispatch
    caller <──outputs────────────────── per-request sink (callback / asyncio queue) <──┘
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from mci.core.outputs import RequestOutput
from mci.core.request_ids import new_request_id, sample_ids
from mci.core.sampling_params import SamplingParams
from mci.engine.builder import build_engine
from mci.engine.commands import AbortRequest, AddRequest
from mci.engine.config import EngineConfig
from mci.engine.loop import CallBetweenSteps, EngineLoop, QueueInbox, Sink
from mci.errors import EngineBroken, UserError
from mci.model_config import ModelConfig
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.tokenizer import TextTokenizer


@dataclass
class GenerateResult:
    """One prompt's result: its token ids and one output per sample (n of them)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[RequestOutput]


class Engine:
    """Continuous-batching engine over one model. Thread-safe; `shutdown()` when done.

    `background=True` runs the loop on its own thread (needed for `stream`). With
    `background=False` the loop runs inside `generate()` on the caller's thread, as vLLM's
    offline `LLM.generate` does: torch's OpenMP pool is ~2x slower on a second thread once the
    main thread has its own pool (libgomp stops spin-waiting when teams oversubscribe the
    cores), so offline batch work should not hop threads. `model`/`tokenizer` may be passed in
    to share one loaded model between engines (tests); `model_config`, the checkpoint's
    config.json when the caller has parsed it already.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        model: DeepseekV3ForCausalLM | None = None,
        tokenizer: TextTokenizer | None = None,
        background: bool = True,
        model_config: ModelConfig | None = None,
    ):
        self.config = config or EngineConfig()
        start_loop = None
        if background and self.config.parallel.world_size == 1:
            parts, start_loop = self._build_on_loop_thread(model, tokenizer, model_config)
        else:
            parts = build_engine(self.config, model, tokenizer, model_config)
        self._parts = parts
        self.model, self.tokenizer, self.front = parts.model, parts.tokenizer, parts.front
        self.core = parts.core
        self.scheduler = self.core.scheduler
        self.kv = self.core.kv
        self._loop = EngineLoop(self.core)
        self._inbox = QueueInbox()
        self.core.wake_on(self._inbox.wake_fd)
        self._stopped = threading.Event()
        self._ids = itertools.count()
        self._thread = None
        if start_loop is not None:
            self._thread = start_loop()
        elif background:
            self._thread = threading.Thread(target=self._run, name="mci-engine", daemon=True)
            self._thread.start()

    def _build_on_loop_thread(self, model, tokenizer, model_config):
        """Build the engine on the thread that will run its loop; returns the parts and a
        function that starts the loop there (returning the thread). Why: OpenMP keeps a thread
        pool per thread that ever ran a parallel region, and once the pools' threads outnumber
        the CPUs, libgomp stops spinning between regions and every region waits on a futex
        wake-up. Building (load, packing, warm-up) on the caller's thread left it a pool
        beside the loop thread's: measured on the `small` model, background decode took 6.4
        ms/token against 2.9 with the loop on the building thread."""
        built: dict = {}
        ready, go = threading.Event(), threading.Event()

        def thread_main() -> None:
            try:
                built["parts"] = build_engine(self.config, model, tokenizer, model_config)
            except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
                built["error"] = exc
            ready.set()
            if "parts" in built:
                go.wait()
                self._run()

        thread = threading.Thread(target=thread_main, name="mci-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in built:
            raise built["error"]

        def start_loop() -> threading.Thread:
            go.set()
            return thread

        return built["parts"], start_loop

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        sink: Sink,
        request_id: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
        queue_timeout_s: float | None = None,
    ) -> list[str]:
        """Submit a prompt; `sink` receives every output of each of its `params.n` samples.
        `timeout_s`: aborted (REQUEST_TIMEOUT) that long after submission; `queue_timeout_s`:
        ended with QUEUE_TIMEOUT if none of its samples is scheduled by then.

        Returns the sample request ids (`id` for n = 1, `id-0 .. id-(n-1)` otherwise).
        """
        base = request_id or new_request_id("req")
        command = self.command(base, prompt, params, priority, timeout_s, queue_timeout_s)
        return self.submit(command, sink)

    def command(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        timeout_s: float | None = None,
        queue_timeout_s: float | None = None,
    ) -> AddRequest:
        """The prompt checked (tokenised, fits the context, constraint compiled) as a command
        for `submit`; an InvalidParameter here, before anything is queued."""
        ids = self.front.encode(prompt)
        self.front.check_constraint(params)
        self.front.check(ids, params)
        return AddRequest(
            request_id, ids, params, priority, timeout_s, queue_timeout_s=queue_timeout_s
        )

    def submit(self, command: AddRequest, sink: Sink) -> list[str]:
        """Queue a checked command (`command()`); returns its sample ids."""
        if self._stopped.is_set():
            raise RuntimeError("engine is shut down")
        self._inbox.put(command, sink)
        return sample_ids(command.request_id, command.params.n)

    def abort(self, request_id: str) -> None:
        """Abort a request (any sample id); its final output reports finish_reason 'abort'."""
        self._inbox.put(AbortRequest(request_id))

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams,
        timeout_s: float | None = None,
    ) -> list[GenerateResult]:
        """Blocking batch generation: every prompt is queued at once; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        done: dict[str, RequestOutput] = {}
        cond = threading.Condition()

        def sink(out: RequestOutput) -> None:
            if out.finished:
                with cond:
                    done[out.request_id] = out
                    cond.notify_all()

        # every prompt is checked before any is queued
        commands = [
            self.command(f"gen-{next(self._ids)}", p, params, timeout_s=timeout_s) for p in prompts
        ]
        submitted = [self.submit(command, sink) for command in commands]
        wanted = [rid for rids in submitted for rid in rids]
        with cond:
            self.run_until(lambda: all(r in done for r in wanted), cond)
        return [
            GenerateResult(
                command.request_id,
                command.prompt_ids,
                [done.get(r) or RequestOutput.aborted(r, "engine shut down") for r in rids],
            )
            for command, rids in zip(commands, submitted, strict=True)
        ]

    def run_until(self, predicate: Callable[[], bool], cond: threading.Condition) -> None:
        """Return once `predicate()` holds (or the engine stops). The caller holds `cond`, which
        its sinks notify. Without a background thread the loop is driven here."""
        while not predicate() and not self._stopped.is_set():
            if self._thread is None:
                cond.release()
                try:
                    self._loop.run_once(self._inbox)
                finally:
                    cond.acquire()
            else:
                cond.wait(timeout=0.1)

    async def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield each step's output of a single-sample request; aborts it if the consumer stops."""
        if params.n != 1:
            raise UserError("stream() takes n = 1; submit samples separately")
        if self._thread is None:
            raise RuntimeError("stream() needs an Engine with background=True")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = self.add_request(
            prompt,
            params,
            lambda o: loop.call_soon_threadsafe(outputs.put_nowait, o),
            request_id,
            priority,
            timeout_s,
        )[0]
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(rid)

    # ---- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop.run(self._inbox, self._stopped.is_set)
        except EngineBroken:  # in-flight requests have their error; refuse new ones
            self._stopped.set()
            return
        self._loop.stop("engine shut down")

    def run_once(self) -> None:
        """One loop iteration on the caller's thread (background=False engines only)."""
        if self._thread is not None:
            raise RuntimeError("run_once() is for background=False engines")
        self._loop.run_once(self._inbox)

    def between_steps(self, fn: Callable[[], object]):
        """Run `fn` between steps and return its result (or raise), for inspection (stats,
        integrity, where a request runs): on the loop's thread when one runs, after every
        command queued before it; directly when the caller is the loop (a sink,
        background=False) or the loop has stopped."""
        if (
            self._thread is None
            or threading.current_thread() is self._thread
            or not self._thread.is_alive()
        ):
            return fn()
        done = threading.Event()
        result: list = []
        errors: list[BaseException] = []

        def call():
            try:
                result.append(fn())
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(exc)
            done.set()

        self._inbox.put(CallBetweenSteps(call))
        if not done.wait(30):
            raise TimeoutError("the engine loop did not answer in 30 s")
        if errors:
            raise errors[0]
        return result[0]

    def stats(self) -> dict:
        """A snapshot for metrics, taken between steps (with background=False: call it from
        the thread that drives the engine)."""
        return self.between_steps(self.core.stats)

    def state(self) -> dict:
        """Stats plus a live integrity check, taken between steps."""
        return self.between_steps(self.core.state)

    def check_integrity_now(self) -> None:
        """Assert slot accounting between steps, requests in flight included."""
        self.between_steps(self.core.check_integrity)

    def check_idle_integrity(self) -> None:
        """Assert that, with no request in flight, every slot is free or the tree's (tests)."""
        self.between_steps(self.core.check_idle_integrity)

    # ---- lifecycle --------------------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        """The engine takes no more requests (shut down, or its loop broke)."""
        return self._stopped.is_set()

    def shutdown(self) -> None:
        """Stop the loop; unfinished requests get an aborted output."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        else:
            self._loop.stop("engine shut down")
        self.core.wake_on(None)  # the inbox's descriptor closes with it
        self._parts.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
