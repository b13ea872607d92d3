"""Prometheus metrics, named like vLLM's (with our `mci:` prefix) so dashboards port.

One registry per server (no module globals). Request-level timings are observed by the front
end from the outputs it streams; engine gauges come from the engine's latest stats snapshot,
read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics:
    """All metrics of one server; `render()` returns the Prometheus text format."""

    def __init__(
        self,
        stats: Callable[[], dict],
        restarts: Callable[[], int] = lambda: 0,
        hangs: Callable[[], int] = lambda: 0,
        front_memory: Callable[[], dict] = dict,
    ):
        self.registry = r = CollectorRegistry()
        self._stats = stats
        self.ttft = Histogram(
            "mci:time_to_first_token_seconds",
            "Time to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "mci:inter_token_latency_seconds",
            "Time between output tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "mci:e2e_request_latency_seconds",
            "Request latency end to end",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "mci:request_queue_time_seconds",
            "Time waiting before first scheduled",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("mci:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("mci:generation_tokens", "Tokens generated", registry=r)
        self.success = Counter(
            "mci:request_success", "Finished requests", ["finished_reason"], registry=r
        )
        self.rejected = Counter("mci:requests_rejected", "Requests refused (429/503)", registry=r)
        self.aborted = Counter(
            "mci:requests_aborted",
            "Requests aborted (client gone, timeout, engine error)",
            registry=r,
        )
        gauges = {
            "mci:num_requests_running": ("Requests in the running batch", "num_running"),
            "mci:num_requests_waiting": ("Requests waiting to be scheduled", "num_waiting"),
            "mci:kv_cache_usage_perc": ("KV slots held by requests (0-1)", "kv_cache_usage"),
            "mci:prefix_cache_hit_rate": (
                "Prompt tokens served from the prefix cache (0-1)",
                "prefix_cache_hit_rate",
            ),
            "mci:cpu_threads": (
                "CPU threads the engine computes with now (0: fixed by --cpu-threads or not "
                "on the CPU); fewer while other work takes cores",
                "cpu_threads",
            ),
        }
        for name, (doc, key) in gauges.items():
            Gauge(name, doc, registry=r).set_function(lambda k=key: float(self._stats().get(k, 0)))
        self.tenants = TenantMetrics(r)
        r.register(_SpecDecodeCollector(stats))
        r.register(_RestartCollector(restarts, hangs))
        r.register(_MemoryCollector(stats, front_memory))
        r.register(_HiCacheCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TenantMetrics:
    """Per-tenant series (`tenant` label): the label's values are the tenants file's names, so
    the series are bounded by the file, never by request data."""

    def __init__(self, r: CollectorRegistry):
        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["tenant"], buckets=LATENCY_BUCKETS, registry=r)

        self.requests = Counter(
            "mci:tenant_requests", "Finished requests", ["tenant", "finished_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "mci:tenant_prompt_tokens", "Prompt tokens admitted", ["tenant"], registry=r
        )
        self.generation_tokens = Counter(
            "mci:tenant_generation_tokens", "Tokens generated", ["tenant"], registry=r
        )
        self.rejected = Counter(
            "mci:tenant_requests_rejected",
            "Requests refused: over a tenant quota (queue, input_tokens, output_tokens) or "
            "the server's bound (server)",
            ["tenant", "reason"],
            registry=r,
        )
        self.queue = histogram("mci:tenant_request_queue_time_seconds", "Time before scheduled")
        self.ttft = histogram("mci:tenant_time_to_first_token_seconds", "Time to first token")
        self.tpot = histogram("mci:tenant_time_per_output_token_seconds", "Time between tokens")
        self._series: dict[str, TenantSeries] = {}

    def of(self, tenant: str) -> TenantSeries:
        """One tenant's children of the per-token series (a label lookup costs more than the
        observation: a submission takes them once)."""
        series = self._series.get(tenant)
        if series is None:
            series = self._series[tenant] = TenantSeries(
                *(
                    m.labels(tenant)
                    for m in (
                        self.prompt_tokens,
                        self.generation_tokens,
                        self.queue,
                        self.ttft,
                        self.tpot,
                    )
                )
            )
        return series


@dataclass(frozen=True)
class TenantSeries:
    prompt_tokens: Counter
    generation_tokens: Counter
    queue: Histogram
    ttft: Histogram
    tpot: Histogram


class _RestartCollector:
    """Engine restarts after a crash or a hang, and the hangs (the front end's own counts)."""

    def __init__(self, restarts: Callable[[], int], hangs: Callable[[], int]):
        self._restarts = restarts
        self._hangs = hangs

    def describe(self) -> list:
        return []

    def collect(self):
        doc = "Engine processes restarted after a crash or a hang"
        yield CounterMetricFamily("mci:engine_restarts", doc, value=self._restarts())
        doc = "Engine processes the watchdog found without progress and killed"
        yield CounterMetricFamily("mci:engine_hangs", doc, value=self._hangs())


class _SpecDecodeCollector:
    """Speculative decoding counters (vLLM's names), read from the engine's counters at scrape
    time: drafts verified, draft tokens proposed, draft tokens accepted (overall and by
    position in the draft). Acceptance rate = accepted / draft tokens; mean accepted length
    per verification = 1 + accepted / drafts."""

    PREFIX = "spec_decode_num_accepted_tokens_pos_"

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def describe(self) -> list:
        return []  # values are only known at scrape time

    def collect(self):
        counters = self._stats().get("counters", {})
        for key, doc in (
            ("spec_decode_num_drafts", "Requests verified with at least one draft token"),
            ("spec_decode_num_draft_tokens", "Draft tokens verified"),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
        ):
            yield CounterMetricFamily(f"mci:{key}", doc, value=counters.get(key, 0))
        per_pos = CounterMetricFamily(
            "mci:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft",
            labels=["position"],
        )
        for key, value in sorted(counters.items()):
            if key.startswith(self.PREFIX):
                per_pos.add_metric([key[len(self.PREFIX) :]], value)
        yield per_pos


class _MemoryCollector:
    """Memory as an operator sees it (mci/process_memory.py, mci/engine/memory_plan.py): each
    process's RSS and C heap (in use, and free but kept by malloc), the engine's planned
    peak, and every bounded cache's entries and capacity. `front_memory()`: the front end's
    own snapshot, with its caches under "caches"."""

    def __init__(self, stats: Callable[[], dict], front_memory: Callable[[], dict]):
        self._stats = stats
        self._front = front_memory

    def describe(self) -> list:
        return []

    def collect(self):
        stats, front = self._stats(), self._front()
        processes = {"engine": stats.get("memory", {}), "front_end": front}
        rss = GaugeMetricFamily(
            "mci:resident_memory_bytes", "Resident set size", labels=["process"]
        )
        heap = GaugeMetricFamily(
            "mci:heap_bytes",
            "C heap (glibc malloc): in use by the program, or free and kept for reuse",
            labels=["process", "state"],
        )
        for name, memory in processes.items():
            if "rss_bytes" in memory:
                rss.add_metric([name], memory["rss_bytes"])
            for state in ("in_use", "free"):
                if f"heap_{state}_bytes" in memory:
                    heap.add_metric([name, state], memory[f"heap_{state}_bytes"])
        yield rss
        yield heap
        yield CounterMetricFamily(
            "mci:engine_heap_trims",
            "Times the engine gave free heap memory back (past twice a step's transients)",
            value=stats.get("heap_trims", 0),
        )
        if stats.get("memory_plan_bytes"):
            yield GaugeMetricFamily(
                "mci:engine_memory_plan_bytes",
                "The engine's planned peak: weights, KV pool, oneDNN kernels, step transients",
                value=stats["memory_plan_bytes"],
            )
        entries = GaugeMetricFamily(
            "mci:cache_entries", "Entries a bounded cache holds now", labels=["cache"]
        )
        capacity = GaugeMetricFamily(
            "mci:cache_capacity", "Entries a bounded cache holds at most", labels=["cache"]
        )
        caches = {**stats.get("caches", {})}
        caches.update({f"front_end_{k}": v for k, v in front.get("caches", {}).items()})
        for name, cache in sorted(caches.items()):
            if cache.get("entries") is not None:
                entries.add_metric([name], cache["entries"])
            capacity.add_metric([name], cache["capacity"])
        yield entries
        yield capacity


class _HiCacheCollector:
    """The lower cache tiers (--enable-hierarchical-cache), by tier (host = L2, storage = L3):
    hits and bytes loaded, pages and bytes stored, load and store latencies, evictions and
    demotions, corrupt pages, disk failures, usage; nothing without the tiers."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def describe(self) -> list:
        return []

    def collect(self):
        hicache = self._stats().get("hicache")
        if not hicache:
            return
        tiers = hicache["tiers"]

        def per_tier(kind, name: str, doc: str, key: str, tiers_with=tuple(tiers)):
            family = kind(f"mci:hicache_{name}", doc, labels=["tier"])
            for tier in tiers_with:
                if key in tiers[tier]:
                    family.add_metric([tier], float(tiers[tier][key]))
            return family

        yield per_tier(
            CounterMetricFamily, "hit_tokens", "Prompt tokens loaded from a tier", "hit_tokens"
        )
        yield per_tier(CounterMetricFamily, "hit_pages", "Pages loaded from a tier", "hit_pages")
        yield per_tier(
            CounterMetricFamily, "loaded_bytes", "KV bytes loaded from a tier", "bytes_loaded"
        )
        yield per_tier(
            CounterMetricFamily, "stored_pages", "Pages written to a tier", "stored_pages"
        )
        yield per_tier(
            CounterMetricFamily, "stored_bytes", "KV bytes written to a tier", "bytes_stored"
        )
        yield per_tier(
            CounterMetricFamily,
            "evictions",
            "Pages a tier evicted (least recently used)",
            "evictions",
        )
        yield per_tier(GaugeMetricFamily, "used_bytes", "Bytes a tier holds now", "used_bytes")
        yield per_tier(
            GaugeMetricFamily, "capacity_bytes", "Bytes a tier may hold", "capacity_bytes"
        )
        yield CounterMetricFamily(
            "mci:hicache_demotions",
            "Pages the KV pool evicted into host memory",
            value=hicache["demotions"],
        )
        storage = tiers.get("storage")
        if storage is not None:
            yield CounterMetricFamily(
                "mci:hicache_corrupt_pages",
                "Stored pages that failed their checksum or were truncated (deleted, recomputed)",
                value=storage["corrupt"],
            )
            yield CounterMetricFamily(
                "mci:hicache_storage_write_failures",
                "Disk writes that failed (the first disables the storage tier)",
                value=storage["write_failures"],
            )
            yield CounterMetricFamily(
                "mci:hicache_storage_dropped_writes",
                "Pages not written to the store: its write queue was full",
                value=storage["dropped_writes"],
            )
            yield GaugeMetricFamily(
                "mci:hicache_storage_enabled",
                "1 while the storage tier works; 0 once a disk failure disabled it",
                value=1.0 if storage["enabled"] else 0.0,
            )
        for kind, doc in (
            ("load", "Time to load a page from a tier"),
            ("store", "Time to write a page to a tier"),
        ):
            family = HistogramMetricFamily(f"mci:hicache_{kind}_seconds", doc, labels=["tier"])
            for tier, entry in tiers.items():
                h = entry[f"{kind}_seconds"]
                cumulative, buckets = 0, []
                for bound, count in zip([*h["buckets"], float("inf")], h["counts"], strict=True):
                    cumulative += count
                    buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
                family.add_metric([tier], buckets, sum_value=h["sum"])
            yield family
