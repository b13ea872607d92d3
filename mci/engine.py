"""`mci.Engine`: the in-process API (generate, stream, abort, shutdown) over the scheduler.

The scheduler and model run on one background thread, the engine loop; callers on any thread
(or an asyncio loop) talk to it through a command queue, and receive `RequestOutput`s through
per-request sinks. Only the loop thread touches scheduler state.

    caller ──add/abort──> commands queue ──> loop: drain commands, scheduler.step(), dispatch
    caller <──outputs──── per-request sink (callback / asyncio queue) <──────────┘
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from mci.cache.kv_manager import KVCacheManager
from mci.cache.radix_cache import RadixCache
from mci.cache.sizing import kv_pool_tokens
from mci.cache.slot_pool import SlotPool
from mci.core.outputs import RequestOutput
from mci.core.request import Request
from mci.core.sampling_params import SamplingParams
from mci.engine_config import EngineConfig
from mci.errors import UserError
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.models.loader import load_model
from mci.runner.model_runner import ModelRunner
from mci.scheduler.output_processor import OutputProcessor
from mci.scheduler.scheduler import Scheduler
from mci.tokenizer import TextTokenizer

log = logging.getLogger("mci")

Sink = Callable[[RequestOutput], None]


@dataclass
class GenerateResult:
    """One prompt's result: its token ids and one output per sample (n of them)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[RequestOutput]


def build_scheduler(
    config: EngineConfig, model: DeepseekV3ForCausalLM, tokenizer: TextTokenizer
) -> Scheduler:
    """Size the KV pool and assemble pool, radix cache, runner and scheduler for `model`."""
    cfg = model.cfg
    eos_ids = tuple(cfg.eos_token_ids)
    per_token = cfg.kv_latent_dim * model.num_cache_layers * model.dtype.itemsize
    cap = config.scheduler.max_running_requests * cfg.max_position_embeddings
    device = torch.device(config.model.device)
    num_slots = kv_pool_tokens(config.cache, per_token, device, cap)
    pool = SlotPool(num_slots)
    radix = None if config.cache.disable_radix_cache else RadixCache(pool)
    log.info(
        "%d tokens of KV (%.1f MB), radix cache %s",
        num_slots,
        num_slots * per_token / 1e6,
        "off" if radix is None else "on",
    )
    return Scheduler(
        config.scheduler,
        KVCacheManager(pool, radix),
        ModelRunner(model, num_slots),
        OutputProcessor(tokenizer, eos_ids),
        eos_ids,
        config.check_integrity,
    )


class Engine:
    """Continuous-batching engine over one model. Thread-safe; `shutdown()` when done.

    `background=True` runs the loop on its own thread (needed for `stream`). With
    `background=False` the loop runs inside `generate()` on the caller's thread, as vLLM's
    offline `LLM.generate` does: torch's OpenMP pool is ~2x slower on a second thread once the
    main thread has its own pool (libgomp stops spin-waiting when teams oversubscribe the
    cores), so offline batch work should not hop threads. `model`/`tokenizer` may be passed in
    to share one loaded model between engines (tests).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        model: DeepseekV3ForCausalLM | None = None,
        tokenizer: TextTokenizer | None = None,
        background: bool = True,
    ):
        self.config = config or EngineConfig()
        placement = self.config.model
        self.model = model or load_model(placement.model_path, placement.dtype, placement.device)
        self.tokenizer = tokenizer or TextTokenizer.load(placement.model_path)
        log.info(
            "model %s: %s, %.1f MB of weights",
            placement.model_path,
            self.model.dtype,
            self._weight_bytes() / 1e6,
        )
        self.scheduler = build_scheduler(self.config, self.model, self.tokenizer)
        self.kv = self.scheduler.kv
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._stopped = threading.Event()
        self._ids = itertools.count()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="mci-engine", daemon=True)
            self._thread.start()

    def _weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # ---- requests ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise UserError("prompt is empty")
        vocab = self.model.cfg.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise UserError(f"prompt token ids must be in [0, {vocab})")
        limit = self.model.cfg.max_position_embeddings
        if len(ids) >= limit:
            raise UserError(f"prompt has {len(ids)} tokens; the context length is {limit}")
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        sink: Sink,
        request_id: str | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> list[str]:
        """Submit a prompt; `sink` receives every output of each of its `params.n` samples.

        Returns the sample request ids (`id` for n = 1, `id-0 .. id-(n-1)` otherwise).
        """
        base = request_id or f"req-{uuid.uuid4().hex[:12]}"
        return self.submit_ids(self.encode_prompt(prompt), params, sink, base, priority, timeout_s)

    def submit_ids(
        self,
        ids: list[int],
        params: SamplingParams,
        sink: Sink,
        base: str,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> list[str]:
        """`add_request` for an already tokenised, validated prompt (see `encode_prompt`)."""
        if self._stopped.is_set():
            raise RuntimeError("engine is shut down")
        limit = self.model.cfg.max_position_embeddings
        if len(ids) + params.max_new_tokens > limit:
            raise UserError(
                f"prompt ({len(ids)} tokens) + max_new_tokens "
                f"({params.max_new_tokens}) exceeds the context length {limit}"
            )
        params.check_vocab(self.model.cfg.vocab_size)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        reqs = []
        for i in range(params.n):
            p, rid = params, base
            if params.n > 1:  # each sample is its own request; seeds differ per sample
                seed = None if params.seed is None else params.seed + i
                p, rid = dataclasses.replace(params, n=1, seed=seed), f"{base}-{i}"
            # Samples share the prompt: the scheduler defers siblings until the first one's
            # prefill is in the prefix cache, then they reuse it.
            reqs.append(Request(rid, ids, p, priority=priority, deadline=deadline))
            self._sinks[rid] = sink
        self._commands.put(("add", reqs))
        return [r.request_id for r in reqs]

    def abort(self, request_id: str) -> None:
        """Abort a request (any sample id); its final output reports finish_reason 'abort'."""
        self._commands.put(("abort", request_id))

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

        encoded = [self.encode_prompt(p) for p in prompts]
        submitted = []
        for ids in encoded:
            base = f"gen-{next(self._ids)}"
            submitted.append((base, self.submit_ids(ids, params, sink, base, 0, timeout_s)))
        wanted = [rid for _, rids in submitted for rid in rids]
        with cond:
            self.run_until(lambda: all(r in done for r in wanted), cond)
        return [
            GenerateResult(
                base, ids, [done.get(r) or _aborted(r, "engine shut down") for r in rids]
            )
            for (base, rids), ids in zip(submitted, encoded, strict=True)
        ]

    def run_until(self, predicate: Callable[[], bool], cond: threading.Condition) -> None:
        """Return once `predicate()` holds (or the engine stops). The caller holds `cond`, which
        its sinks notify. Without a background thread the loop is driven here."""
        while not predicate() and not self._stopped.is_set():
            if self._thread is None:
                cond.release()
                try:
                    self._run_once(wait=False)
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
    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._run_once(wait=True)
        self._dispatch(self.scheduler.abort_all("engine shut down"))

    def stats(self) -> dict:
        """A snapshot for metrics (call on the loop thread, or with background=False)."""
        sched, kv = self.scheduler, self.kv
        radix = kv.radix
        in_use = kv.pool.num_slots - kv.available  # held by requests or locked in the tree
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_slots": kv.pool.num_slots,
            "free_slots": kv.pool.num_free,
            "tree_tokens": radix.total_tokens if radix else 0,
            "tree_locked_tokens": radix.protected_tokens if radix else 0,
            "kv_cache_usage": in_use / kv.pool.num_slots,
            "prefix_cache_hit_rate": sched.prefix_cache_hit_rate,
            "counters": dict(sched.counters),
        }

    def check_integrity_now(self) -> None:
        """Assert slot accounting right now, requests in flight included (loop thread only)."""
        self.kv.check_integrity(self.scheduler.running)

    def run_once(self, wait: bool = False) -> None:
        """One loop iteration on the caller's thread (background=False engines only)."""
        if self._thread is not None:
            raise RuntimeError("run_once() is for background=False engines")
        self._run_once(wait)

    def _run_once(self, wait: bool) -> None:
        """Take queued commands (waiting briefly when idle and `wait`), then step once."""
        idle = not self.scheduler.has_work
        try:
            first = (
                self._commands.get(timeout=0.05) if idle and wait else self._commands.get_nowait()
            )
            self._handle(first)
            while True:
                self._handle(self._commands.get_nowait())
        except queue.Empty:
            pass
        if not self.scheduler.has_work:
            return
        try:
            outputs = self.scheduler.step()
        except Exception as exc:  # a failed step must not kill the engine or hang callers
            log.exception("engine step failed; aborting in-flight requests")
            outputs = self.scheduler.abort_all(f"internal error: {exc}")
        self._dispatch(outputs)

    def _handle(self, command) -> None:
        kind, arg = command
        if kind == "add":
            for req in arg:
                out = self.scheduler.add_request(req)
                if out is not None:
                    self._dispatch([out])
        elif kind == "abort":
            out = self.scheduler.abort_request(arg)
            if out is not None:
                self._dispatch([out])
        elif kind == "call":  # run a function between steps (inspection)
            arg()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if sink is not None:
                try:
                    sink(out)
                except Exception:  # a broken consumer must not stop the loop
                    log.exception("output sink for %s failed", out.request_id)

    # ---- lifecycle --------------------------------------------------------------------------
    def check_idle_integrity(self) -> None:
        """Assert that, with no request in flight, every slot is free or the tree's (tests).

        Runs on the loop thread, between steps, so it sees consistent state.
        """
        done = threading.Event()
        errors: list[BaseException] = []

        def check():
            try:
                assert not self.scheduler.has_work, "requests still in flight"
                self.kv.check_integrity([])
                radix = self.kv.radix
                assert radix is None or radix.protected_tokens == 0, "a lock leaked"
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(exc)
            done.set()

        self._commands.put(("call", check))
        if self._thread is None:
            self._run_once(wait=False)
        done.wait(30)
        if errors:
            raise errors[0]

    def shutdown(self) -> None:
        """Stop the loop; unfinished requests get an aborted output."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        else:
            self._dispatch(self.scheduler.abort_all("engine shut down"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _aborted(request_id: str, error: str) -> RequestOutput:
    return RequestOutput(request_id, [], "", finished=True, finish_reason="abort", error=error)
