"""`python -O` strips every `assert`: the engine must not depend on one (ruff's S101 keeps them
out of the package). Here the engine runs under -O through admission, chunking, the prefix
cache and preemption, and must give exactly the outputs it gives without -O."""

from __future__ import annotations

import json
import subprocess
import sys

from mci.cache.config import CacheConfig
from mci.core.sampling_params import SamplingParams
from mci.engine.config import EngineConfig, ModelPlacement
from mci.engine.engine import Engine

SCRIPT = """
import json, sys
assert False  # under -O this line does nothing
from mci.core.sampling_params import SamplingParams
from mci.engine.engine import Engine
from mci.cache.config import CacheConfig
from mci.engine.config import EngineConfig, ModelPlacement
from mci.scheduler.config import SchedulerConfig

path, prompts = sys.argv[1], json.loads(sys.argv[2])
engine = Engine(
    EngineConfig(
        model=ModelPlacement(model_path=path, dtype="float32", skip_kernel_warmup=True),
        cache=CacheConfig(max_total_tokens=96),
        scheduler=SchedulerConfig(chunked_prefill_size=8, decode_reserve_tokens=1),
        check_integrity=True,
    ),
    background=False,
)
params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
results = engine.generate(prompts, params)
engine.check_idle_integrity()
print(json.dumps({
    "optimize": sys.flags.optimize,
    "outputs": [r.outputs[0].output_token_ids for r in results],
    "preemptions": engine.core.counters["preemptions"],
    "free": engine.kv.available == engine.kv.pool.num_slots,
}))
engine.shutdown()
"""


def _prompts() -> list[list[int]]:
    shared = list(range(10, 30))
    return [shared + [40 + i] * (3 + i) for i in range(6)]


def test_engine_runs_the_same_under_python_O(checkpoint):
    path = checkpoint()
    prompts = _prompts()
    done = subprocess.run(
        [sys.executable, "-O", "-c", SCRIPT, str(path), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["optimize"] == 1
    assert got["preemptions"] > 0 and got["free"]

    engine = Engine(
        EngineConfig(
            model=ModelPlacement(model_path=path, dtype="float32", skip_kernel_warmup=True),
            cache=CacheConfig(max_total_tokens=8192),
        ),
        background=False,
    )
    try:
        params = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
        expected = [r.outputs[0].output_token_ids for r in engine.generate(prompts, params)]
    finally:
        engine.shutdown()
    assert got["outputs"] == expected
