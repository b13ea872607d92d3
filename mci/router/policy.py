"""Which worker gets a request: round_robin, least_load, or cache_aware (SGLang's router's
rule, re-derived).

cache_aware: if the load is badly unbalanced (the busiest worker has more than
`balance_abs` requests more than the idlest, and more than `balance_rel` times as many), the
idlest worker takes it. Otherwise the worker whose tree holds the longest prefix of the prompt
takes it when that prefix is at least `cache_threshold` of the prompt; when none holds that
much, the worker with the smallest tree (the most cache room) does. The prompt then goes into
the chosen worker's tree.

Replicas that share a KV store (--hicache-storage-dir; the store's id in their /server_info)
can all load a prefix one of them computed: the prompts routed to any of them go into their
store's tree too. A worker's own tree still comes first (its prefix is in its KV pool); when
no worker's own tree holds enough, a store's tree that does makes the least loaded of its
workers the choice (a hit there, from the store), not the one with the most cache room.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from mci.router.prefix_tree import PrefixTree
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
    def __init__(
        self,
        cache_threshold: float,
        balance_abs: int,
        balance_rel: float,
        store_trees: dict[str, PrefixTree] | None = None,
    ):
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.store_trees = {} if store_trees is None else store_trees

    def choose(self, workers: list[Worker], prompt: Sequence) -> Worker:
        loads = [w.in_flight for w in workers]
        busiest, idlest = max(loads), min(loads)
        if busiest - idlest > self.balance_abs and busiest > self.balance_rel * idlest:
            return min(workers, key=lambda w: w.in_flight)
        matches = [w.tree.match(prompt) for w in workers]
        best = max(range(len(workers)), key=lambda i: (matches[i], -workers[i].in_flight))
        enough = self.cache_threshold * len(prompt)
        if prompt and matches[best] >= enough:
            return workers[best]
        shared = self._store_hit(workers, prompt, enough)
        if shared:
            return min(shared, key=lambda w: w.in_flight)
        return min(workers, key=lambda w: (w.tree.size, w.in_flight))

    def _store_hit(self, workers: list[Worker], prompt: Sequence, enough: float) -> list[Worker]:
        """The workers of the store whose tree holds the longest prefix, if it is enough."""
        stores = {w.store for w in workers if w.store is not None}
        if not prompt or not stores:
            return []
        length = {s: self.store_trees[s].match(prompt) for s in stores if s in self.store_trees}
        best = max(length, key=length.get, default=None)
        if best is None or length[best] < enough:
            return []
        return [w for w in workers if w.store == best]


def make_policy(
    name: str,
    cache_threshold: float,
    balance_abs: int,
    balance_rel: float,
    store_trees: dict[str, PrefixTree] | None = None,
):
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    return CacheAware(cache_threshold, balance_abs, balance_rel, store_trees)
