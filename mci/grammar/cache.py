"""Compiled constraints by value, and each constrained request's grammar state.

Compiling a JSON Schema can take tens of milliseconds or more; the engine thread never waits
for it. `GrammarCache.submit` compiles on a worker thread, and a request is admitted only once
its grammar is ready (`GrammarState.ready`), so the others keep running meanwhile. The HTTP
front end compiles synchronously (`compile_now`, off its event loop) to turn a bad constraint
into a 400 before the request is queued.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from mci.grammar.backend import GrammarBackend, Matcher
from mci.grammar.constraint import Constraint

# Wraps a request's matcher to apply its grammar to part of the output (grammar/deferred.py,
# grammar/healing.py); gets the backend for masks of its own.
Window = Callable[[Matcher, GrammarBackend], Matcher]
CACHE_ENTRIES = 256  # distinct constraints kept compiled (least recently used dropped)


class GrammarCache:
    """`make_backend` runs on first use, on the worker thread (building a tokenizer's grammar
    tables takes time, and an engine that never sees a constraint never pays it)."""

    def __init__(self, make_backend: Callable[[], GrammarBackend]):
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._futures: OrderedDict[Constraint, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mci-grammar")

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def _compile(self, constraint: Constraint) -> object:
        return self.backend.compile(constraint)

    def submit(self, constraint: Constraint) -> Future:
        """The compiled constraint, as a future (the same one for equal constraints)."""
        with self._lock:
            future = self._futures.get(constraint)
            if future is None:
                future = self._pool.submit(self._compile, constraint)
                self._futures[constraint] = future
                while len(self._futures) > CACHE_ENTRIES:
                    self._futures.popitem(last=False)
            self._futures.move_to_end(constraint)
            return future

    def size(self) -> dict:
        """Compiled constraints kept, and the bound."""
        with self._lock:
            return {"entries": len(self._futures), "capacity": CACHE_ENTRIES}

    def compile_now(self, constraint: Constraint) -> object:
        """Compile (or reuse) and wait; raises the backend's InvalidParameter."""
        return self.submit(constraint).result()

    def state(self, constraint: Constraint, window: Window | None = None) -> GrammarState:
        """A request's state; `window` wraps its matcher to apply the grammar to part of the
        output (grammar/deferred.py, grammar/healing.py)."""
        return GrammarState(self, self.submit(constraint), window)


def xgrammar_cache(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> GrammarCache:
    """A cache over the xgrammar backend for this tokenizer and model vocabulary; xgrammar is
    imported on the first constraint, not before."""

    def make() -> GrammarBackend:
        from mci.grammar.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_ids)

    return GrammarCache(make)


class GrammarState:
    """One request's progress through its grammar. The matcher exists once compiled."""

    def __init__(
        self,
        cache: GrammarCache,
        compiled: Future,
        window: Window | None = None,
    ):
        self._cache = cache
        self._compiled = compiled
        self._window = window
        self.matcher: Matcher | None = None

    def ready(self) -> bool:
        """Whether the grammar is compiled (then the matcher exists); raises the compile
        error if compiling failed."""
        if self.matcher is None and self._compiled.done():
            matcher = self.backend.matcher(self._compiled.result())
            self.matcher = matcher if self._window is None else self._window(matcher, self.backend)
        return self.matcher is not None

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for the compile to finish (an engine with nothing else to
        run waits here instead of spinning)."""
        wait([self._compiled], timeout=timeout_s)

    @property
    def backend(self) -> GrammarBackend:
        return self._cache.backend
