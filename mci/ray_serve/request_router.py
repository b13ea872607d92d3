"""mci's cache-aware policy (mci/router/policy.py) as Ray Serve's request router.

Ray Serve calls `choose_replicas` for each request a handle sends to the replica deployment;
the ingress passes the prompt's routing key as the `routing_key` keyword argument, and on a
retry the replicas that failed it as `exclude` (left out unless nothing else is left). The policy
sees each replica as a `Worker`: its prefix tree of the prompts routed to it, its load from
Ray Serve's queue-length cache. The chosen replica is ranked first and the rest after it, least
loaded first, so that a full replica falls through to the next instead of stalling.

The trees live in each handle's process (the ingress replica): with one ingress, one view of
the fleet. Replicas that leave take their trees with them.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mci.router.config import RouterConfig
from mci.router.policy import CacheAware
from mci.router.workers import Worker

_DEFAULTS = RouterConfig()


class CacheAwareRequestRouter(RequestRouter):
    def initialize_state(
        self,
        cache_threshold: float = _DEFAULTS.cache_threshold,
        balance_abs_threshold: int = _DEFAULTS.balance_abs_threshold,
        balance_rel_threshold: float = _DEFAULTS.balance_rel_threshold,
    ) -> None:
        self.policy = CacheAware(cache_threshold, balance_abs_threshold, balance_rel_threshold)
        self.workers: dict[ReplicaID, Worker] = {}

    def _worker(self, replica: RunningReplica) -> Worker:
        worker = self.workers.get(replica.replica_id)
        if worker is None:
            worker = self.workers[replica.replica_id] = Worker(replica.replica_id.unique_id)
        worker.in_flight = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return worker

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request else {}
        excluded = set(kwargs.get("exclude") or ())
        others = [r for r in candidate_replicas if r.replica_id.unique_id not in excluded]
        candidate_replicas = others or candidate_replicas
        workers = [self._worker(r) for r in candidate_replicas]
        key = kwargs.get("routing_key")
        chosen = self.policy.choose(workers, key or "")
        if key:  # at once, so that requests arriving meanwhile follow this one
            chosen.tree.insert(key)
        first = candidate_replicas[workers.index(chosen)]
        rest = sorted(
            (r for r in candidate_replicas if r is not first),
            key=lambda r: self.workers[r.replica_id].in_flight,
        )
        return [[first], rest] if rest else [[first]]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in set(self.workers) - live:
            del self.workers[gone]
