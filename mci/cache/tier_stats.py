"""Counters of the lower cache tiers (mci/cache/hierarchy.py): traffic per tier and latency
histograms in Prometheus' shape, kept by the engine and exported at scrape time."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass
class LatencyHistogram:
    """Cumulative-bucket counts of durations (Prometheus' histogram shape)."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # one per bucket, then the overflow
    total_s: float = 0.0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.buckets, seconds)] += 1
        self.total_s += seconds

    def as_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.total_s}


@dataclass
class TierCounters:
    """One tier's traffic, in pages and bytes."""

    hit_pages: int = 0
    hit_tokens: int = 0
    bytes_loaded: int = 0
    stored_pages: int = 0
    bytes_stored: int = 0
    load_s: LatencyHistogram = field(default_factory=LatencyHistogram)
    store_s: LatencyHistogram = field(default_factory=LatencyHistogram)

    def as_dict(self) -> dict:
        out = {k: v for k, v in vars(self).items() if not isinstance(v, LatencyHistogram)}
        out.update(load_seconds=self.load_s.as_dict(), store_seconds=self.store_s.as_dict())
        return out
