"""The router's settings (`mci router`): which replica takes a request, health, retries."""

from __future__ import annotations

from dataclasses import dataclass

from mci.config_fields import check_choices, option
from mci.errors import UserError


@dataclass(frozen=True)
class RouterConfig:
    """`mci router` (mci/router/): replicas behind one OpenAI endpoint."""

    host: str = option("127.0.0.1", "address to bind (loopback by default)")
    port: int = option(30000, "port to listen on")
    policy: str = option(
        "cache_aware",
        "which replica takes a request",
        ["cache_aware", "round_robin", "least_load"],
    )
    cache_threshold: float = option(
        0.5, "cache_aware: the share of a prompt a replica must hold to take it by cache"
    )
    balance_abs_threshold: int = option(
        32, "cache_aware: balance by load when the busiest has this many more requests ..."
    )
    balance_rel_threshold: float = option(1.5, "... and this many times the idlest's")
    health_check_interval: float = option(1.0, "seconds between health checks of each replica")
    max_retries: int = option(3, "other replicas tried when one fails before the first byte")
    breaker_failures: int = option(3, "consecutive failures that eject a replica")
    breaker_cooldown: float = option(10.0, "seconds an ejected replica waits for a health check")
    disable_stream_resume: bool = option(
        False,
        "fail a stream whose replica dies mid-stream instead of continuing it on another "
        "replica (continuing is exact for greedy and seeded streams with n = 1)",
    )
    pd_disaggregation: bool = option(
        False,
        "prefill-decode disaggregation: pair a prefill worker (--prefill, cache-aware by "
        "--policy) with a decode worker (--decode, least loaded) for each request",
    )
    tenants: str | None = option(
        None,
        "tenants file (JSON or YAML, as mci serve's): API keys -> tenants; a tenant's requests "
        "go only to replicas in its regions and pools, failing closed (503) when none is "
        "available; reloaded on SIGHUP (default: no tenant checks)",
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "export OpenTelemetry traces over OTLP/HTTP to this URL (e.g. http://host:4318/v1/traces):"
        " a span per proxied request, joining its W3C traceparent and passed on to the replica",
    )

    def __post_init__(self):
        check_choices(self)
        problems = (
            (not 0 <= self.port <= 65535, "--port must be in 0..65535"),
            (not 0 <= self.cache_threshold <= 1, "--cache-threshold must be in [0, 1]"),
            (self.balance_abs_threshold < 0, "--balance-abs-threshold must be >= 0"),
            (self.balance_rel_threshold < 1, "--balance-rel-threshold must be >= 1"),
            (not self.health_check_interval > 0, "--health-check-interval must be > 0"),
            (self.max_retries < 0, "--max-retries must be >= 0"),
            (self.breaker_failures < 1, "--breaker-failures must be >= 1"),
            (self.breaker_cooldown < 0, "--breaker-cooldown must be >= 0"),
        )
        for bad, why in problems:
            if bad:
                raise UserError(why)
