"""The engine loop's inspection hooks: stats and integrity checks answer from any thread,
never step the model themselves, and never wait on the loop from inside it."""

from __future__ import annotations

import threading
import time

from mci.cache.config import CacheConfig
from mci.core.sampling_params import SamplingParams
from mci.engine.config import EngineConfig, ModelPlacement
from mci.engine.engine import Engine


def _config(path) -> EngineConfig:
    return EngineConfig(
        model=ModelPlacement(model_path=path, dtype="float32", skip_kernel_warmup=True),
        cache=CacheConfig(max_total_tokens=2048),
    )


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def test_stats_from_a_sink_and_after_shutdown(checkpoint):
    engine = Engine(_config(checkpoint()))
    seen, done = [], threading.Event()

    def sink(out):  # runs on the loop's thread: must not wait on the loop
        seen.append(engine.stats()["num_running"])
        if out.finished:
            done.set()

    start = time.monotonic()
    engine.add_request([5, 6, 7], _greedy(3), sink)
    assert done.wait(20) and time.monotonic() - start < 10
    assert seen and all(n >= 0 for n in seen)
    engine.shutdown()
    start = time.monotonic()
    assert engine.stats()["num_running"] == 0
    engine.check_idle_integrity()
    assert time.monotonic() - start < 1


def test_stats_never_steps_a_caller_driven_engine(checkpoint):
    engine = Engine(_config(checkpoint()), background=False)
    outputs = []
    engine.add_request([5, 6, 7], _greedy(2), outputs.append)
    engine.stats()
    engine.check_integrity_now()
    assert outputs == []  # nothing ran: the request is still queued
    engine.run_once()
    assert outputs  # the caller's own iteration ran it
    engine.shutdown()
    assert outputs[-1].finished
