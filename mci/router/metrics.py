"""The router's Prometheus metrics (`mci_router:` names): per replica requests, estimated
cache-hit rate, load, availability, ejections and re-admissions; retries, resumed streams, and
replicas left out of a routing decision by residency."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mci.router.workers import WorkerPool
from mci.tenancy.residency import REASONS


class RouterMetrics:
    def __init__(self, pools: list[WorkerPool]):
        """`pools`: every kind of worker (the replicas; or decode and prefill workers)."""
        self.registry = r = CollectorRegistry()
        self.retries = Counter(
            "mci_router:retries", "Attempts on another replica before the first byte", registry=r
        )
        self.resumed = Counter(
            "mci_router:streams_resumed", "Streams continued on another replica", registry=r
        )
        self.resume_failed = Counter(
            "mci_router:streams_failed",
            "Streams that broke and could not be continued",
            registry=r,
        )
        self.residency_rejections = Counter(
            "mci_router:residency_rejections",
            "Replicas left out of a routing decision by the request's residency",
            ["reason"],  # region | pool: bounded, whatever the tenants and labels
            registry=r,
        )
        for reason in REASONS:  # shown (as 0) before the first rejection
            self.residency_rejections.labels(reason)
        r.register(_PoolCollector(pools))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector:
    def __init__(self, pools: list[WorkerPool]):
        self._pools = pools

    def describe(self) -> list:
        return []

    def collect(self):
        workers = [w for pool in self._pools for w in pool.workers.values()]
        families = {
            "requests": CounterMetricFamily(
                "mci_router:requests", "Requests routed to the replica", labels=["worker"]
            ),
            "ejections": CounterMetricFamily(
                "mci_router:ejections", "Times the replica was taken out", labels=["worker"]
            ),
            "readmissions": CounterMetricFamily(
                "mci_router:readmissions", "Times it was put back", labels=["worker"]
            ),
            "hit": GaugeMetricFamily(
                "mci_router:estimated_cache_hit_rate",
                "Share of the prompt characters routed there that its tree held",
                labels=["worker"],
            ),
            "in_flight": GaugeMetricFamily(
                "mci_router:in_flight", "Requests open on the replica", labels=["worker"]
            ),
            "available": GaugeMetricFamily(
                "mci_router:worker_available",
                "1 while the replica takes requests",
                labels=["worker"],
            ),
        }
        for w in workers:
            families["requests"].add_metric([w.url], w.requests)
            families["ejections"].add_metric([w.url], w.ejections)
            families["readmissions"].add_metric([w.url], w.readmissions)
            families["hit"].add_metric([w.url], w.estimated_cache_hit_rate)
            families["in_flight"].add_metric([w.url], w.in_flight)
            families["available"].add_metric([w.url], 1.0 if w.available else 0.0)
        yield from families.values()
