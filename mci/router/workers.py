"""The router's view of its workers: load, health, a circuit breaker each.

A worker is *available* while it is healthy and its breaker is closed. The breaker opens after
`breaker_failures` consecutive failed attempts (connection refused or reset, or a 5xx before
the first byte) and stays open for `breaker_cooldown_s`; then one health check decides
(half-open): passing closes it (the worker is re-admitted), failing keeps it out. Health checks
(`GET /health`) also take a worker out when it turns 503 (draining, reloading its engine) and
put it back when it recovers. A passing health check also reads the worker's labels
(`GET /server_info`: region, pool) for the residency rule (mci/tenancy/residency.py), so a
replica is only ever re-admitted with the labels it has now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mci.router.prefix_tree import PrefixTree
from mci.tenancy.residency import Labels


@dataclass
class Worker:
    url: str
    tree: PrefixTree = field(default_factory=PrefixTree)
    in_flight: int = 0  # requests the router has open on it
    healthy: bool = True
    failures: int = 0  # consecutive failed attempts
    open_until: float = 0.0  # breaker open (ejected) until then
    requests: int = 0
    prompt_chars: int = 0  # of the prompts routed here
    matched_chars: int = 0  # ... that its tree had (the estimated cache hits)
    ejections: int = 0
    readmissions: int = 0
    labels: Labels = field(default_factory=Labels)  # none until its /server_info is read
    store: str | None = None  # the id of the shared KV store it uses (its /server_info)
    # a prefill worker's bootstrap server, host:port (its /server_info; PD disaggregation)
    bootstrap: str | None = None

    @property
    def estimated_cache_hit_rate(self) -> float:
        """The share of the prompt characters routed here that its tree held."""
        return self.matched_chars / self.prompt_chars if self.prompt_chars else 0.0

    @property
    def available(self) -> bool:
        return self.healthy and time.monotonic() >= self.open_until

    @property
    def ejected(self) -> bool:
        return self.open_until > 0.0 or not self.healthy


class WorkerPool:
    def __init__(self, urls: list[str], breaker_failures: int, breaker_cooldown_s: float):
        self.workers: dict[str, Worker] = {}
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        for url in urls:
            self.add(url)

    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        return self.workers.setdefault(url, Worker(url))

    def remove(self, url: str) -> bool:
        return self.workers.pop(url.rstrip("/"), None) is not None

    def available(self, exclude: set[str] = frozenset()) -> list[Worker]:
        return [w for w in self.workers.values() if w.available and w.url not in exclude]

    def succeeded(self, worker: Worker) -> None:
        worker.failures = 0

    def failed(self, worker: Worker) -> None:
        worker.failures += 1
        if worker.failures >= self.breaker_failures and worker.open_until == 0.0:
            worker.open_until = time.monotonic() + self.breaker_cooldown_s
            worker.ejections += 1

    @staticmethod
    def health(worker: Worker, ok: bool) -> None:
        """A health check's verdict."""
        if ok:
            if worker.ejected:
                worker.readmissions += 1
            worker.healthy, worker.open_until, worker.failures = True, 0.0, 0
        else:
            if worker.healthy and worker.open_until == 0.0:
                worker.ejections += 1
            worker.healthy = False
