"""One engine step at a time: schedule -> execute -> update (vLLM's `EngineCore.step`).

`EngineCore` is the whole engine minus threads, queues and callers: whoever drives it (the
`EngineLoop`) calls it from a single thread. It also answers for the engine's state: stats
for metrics and the KV integrity checks.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from mci.cache.kv_manager import KVCacheManager
from mci.core.outputs import RequestOutput
from mci.core.request import Request
from mci.core.sampling_params import SamplingParams
from mci.grammar.cache import GrammarCache, Window
from mci.grammar.deferred import DeferredMatcher
from mci.grammar.healing import LeadingMatcher
from mci.runner.model_runner import ModelRunner
from mci.scheduler.scheduler import Scheduler

log = logging.getLogger("mci")
GRAMMAR_WAIT_S = 0.005  # longest an idle step waits for a compiling grammar


class EngineCore:
    """A scheduler and a model runner, stepped together. Not thread-safe: one driver."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        check_integrity: bool = False,
        grammar: GrammarCache | None = None,
    ):
        self.scheduler = scheduler
        self.runner = runner
        self.check_integrity_each_step = check_integrity
        self.grammar = grammar  # compiles constraints off this thread (None: no constraints)
        self.longest_step_s = 0.0  # what the front end's watchdog scales its timeout by

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    @property
    def counters(self) -> Counter[str]:
        return self.scheduler.counters

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.scheduler.prefix_cache_hit_rate

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, req: Request) -> RequestOutput | None:
        """Queue a request; returns its final output at once if it can never run. A
        constrained request starts compiling its grammar now (admitted once it is ready)."""
        constraint = req.params.constraint
        if constraint is not None:
            if self.grammar is None:
                raise RuntimeError("this engine has no grammar backend")
            stops = tuple(self.runner.eos_ids) + req.params.stop_token_ids
            req.grammar = self.grammar.state(constraint, _matcher_window(req.params, stops))
        return self.scheduler.add_request(req)

    def _wait_for_a_grammar(self) -> None:
        """Nothing could run: if a waiting request's grammar is still compiling, give the
        compile thread a moment (briefly: new requests may arrive) instead of spinning."""
        for req in self.scheduler.waiting:
            if req.grammar is not None and req.grammar.matcher is None:
                req.grammar.wait(GRAMMAR_WAIT_S)
                return

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.abort_request(request_id)

    def idle(self) -> None:
        """Called while there is no work (a parallel run keeps its ranks' collectives alive)."""
        self.runner.model.keepalive()

    def abort_all(self, error: str) -> list[RequestOutput]:
        return self.scheduler.abort_all(error)

    def step(self) -> list[RequestOutput]:
        """Advance every runnable request by one step; returns the step's outputs."""
        outputs = self.scheduler.expire_deadlines() + self.scheduler.reject_failed_grammars()
        batch = self.scheduler.schedule()
        if batch:
            start = time.monotonic()
            result = self.runner.execute(batch)
            self.longest_step_s = max(self.longest_step_s, time.monotonic() - start)
            outputs += self.scheduler.update(batch, result)
        else:
            self._wait_for_a_grammar()
        if self.check_integrity_each_step:
            self.check_integrity()
        return outputs

    # ---- state --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """A snapshot for metrics."""
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
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "longest_step_s": self.longest_step_s,
            "counters": dict(sched.counters),
        }

    def check_integrity(self) -> None:
        """Raise AssertionError unless every slot is free, the tree's, or exactly one running
        request's (requests in flight included)."""
        self.kv.check_integrity(self.scheduler.running)

    def check_idle_integrity(self) -> None:
        """Raise AssertionError unless, with nothing in flight, every slot is free or the
        tree's and no lock is held."""
        if self.has_work:
            raise AssertionError("requests still in flight")
        self.kv.check_integrity([])
        radix = self.kv.radix
        if radix is not None and radix.protected_tokens:
            raise AssertionError(f"a lock leaked: {radix.protected_tokens} tokens still locked")

    def state(self) -> dict:
        """Stats plus a live integrity check, for operators (`/internal/state`) and tests."""
        state = self.stats()
        try:
            self.check_integrity()
            state["integrity_ok"] = True
        except AssertionError as exc:
            state["integrity_ok"] = False
            state["integrity_error"] = str(exc)
        return state


def _matcher_window(params: SamplingParams, stops: tuple[int, ...]) -> Window | None:
    """Where in the output a request's grammar applies: after `</think>` (reasoning; the
    output may not stop before it), only at the start (token healing), or everywhere."""
    start = params.constraint_start_token_id
    if start is not None:
        return lambda matcher, backend: DeferredMatcher(matcher, backend, start, stops)
    if params.healed_text:
        return lambda matcher, backend: LeadingMatcher(matcher)
    return None
