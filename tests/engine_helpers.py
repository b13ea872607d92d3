"""Drive an EngineCore step by step (no thread), with requests arriving at chosen steps."""

from __future__ import annotations

import dataclasses

from mci.cache.config import CacheConfig
from mci.core.request import Request
from mci.core.sampling_params import SamplingParams
from mci.engine.builder import build_engine_core
from mci.engine.config import EngineConfig, ModelPlacement
from mci.scheduler.config import SchedulerConfig


def make_scheduler(model, tokenizer, path, *, max_total_tokens=4096, radix=True, **sched):
    config = EngineConfig(
        model=ModelPlacement(
            model_path=path,
            dtype="float32",
            device=str(model.lm_head.weight.device),
            skip_kernel_warmup=True,
        ),
        cache=CacheConfig(max_total_tokens=max_total_tokens, disable_radix_cache=not radix),
        scheduler=dataclasses.replace(SchedulerConfig(), **sched),
        check_integrity=True,
    )
    return build_engine_core(config, model, tokenizer)


def drive(scheduler, arrivals: dict[int, list[Request]], max_steps: int = 10_000) -> dict:
    """Run until every request has finished; returns request_id -> final RequestOutput."""
    finals, step = {}, 0
    pending = {k: list(v) for k, v in arrivals.items()}
    while pending or scheduler.has_work:
        for req in pending.pop(step, []):
            out = scheduler.add_request(req)
            if out is not None:
                finals[out.request_id] = out
        for out in scheduler.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        assert step < max_steps, "scheduler made no progress"
    scheduler.kv.check_integrity([])
    radix = scheduler.kv.radix
    assert radix is None or radix.protected_tokens == 0, "a radix lock leaked"
    if radix is None:
        assert scheduler.kv.pool.num_free == scheduler.kv.pool.num_slots
    return finals


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, **kw)


class OracleDrafter:
    """Drafts the true continuation (from a run without speculation), wrong at every
    `wrong_every`-th draft token: every accept length 0..k occurs."""

    def __init__(self, truth: dict[str, list[int]], wrong_every: int = 4):
        self.truth = truth
        self.wrong_every = wrong_every
        self.calls = 0

    def propose(self, items, hidden, new_tokens, budgets):
        drafts = {}
        for i, n in budgets.items():
            req = items[i].request
            done = len(req.output_ids) + len(new_tokens[i])
            draft = list(self.truth[req.request_id[1:]][done : done + n])
            for j in range(len(draft)):
                self.calls += 1
                if self.calls % self.wrong_every == 0:
                    draft[j] = (draft[j] + 1) % 1000
            drafts[i] = draft
        return drafts
