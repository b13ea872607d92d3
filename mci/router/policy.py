"""Which worker gets a request: round_robin, least_load, or cache_aware (SGLang's router's
rule, re-derived).

cache_aware: if the load is badly unbalanced (the busiest worker has more than
`balance_abs` requests more than the idlest, and more than `balance_rel` times as many), the
idlest worker takes it. Otherwise the worker whose tree holds the longest prefix of the prompt
takes it when that prefix is at least `cache_threshold` of the prompt; when none holds that
much, the worker with the smallest tree (the most cache room) does. The prompt then goes into
the chosen worker's tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from mci.router.workers import Worker

POLICIES = ("round_robin", "least_load", "cache_aware")


class RoundRobin:
    def __init__(self):
        self._next = itertools.count()

    def choose(self, workers: list[Worker], prompt: Sequence) -> Worker:
        return workers[next(self._next) % len(workers)]


class LeastLoad:
    def choose(self, workers: list[Worker], prompt: Sequence) -> Worker:
        return min(workers, key=lambda w: w.in_flight)


class CacheAware:
    def __init__(self, cache_threshold: float, balance_abs: int, balance_rel: float):
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def choose(self, workers: list[Worker], prompt: Sequence) -> Worker:
        loads = [w.in_flight for w in workers]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > self.balance_abs and busiest > self.balance_rel * idlest:
            return min(workers, key=lambda w: w.in_flight)
        matches = [w.tree.match(prompt) for w in workers]
        best = max(range(len(workers)), key=lambda i: (matches[i], -workers[i].in_flight))
        if prompt and matches[best] >= self.cache_threshold * len(prompt):
            return workers[best]
        return min(workers, key=lambda w: (w.tree.size, w.in_flight))


def make_policy(name: str, cache_threshold: float, balance_abs: int, balance_rel: float):
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    return CacheAware(cache_threshold, balance_abs, balance_rel)
