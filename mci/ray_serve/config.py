"""`mci serve-ray`'s settings: the Ray cluster and the deployment's autoscaling. Imports nothing
of Ray (the CLI builds its flags without the optional extra)."""

from __future__ import annotations

from dataclasses import dataclass

from mci.config_fields import check_choices, option
from mci.errors import UserError


@dataclass(frozen=True)
class RayServeConfig:
    """`mci serve-ray` (mci/ray_serve/): replicas as a Ray Serve deployment with autoscaling."""

    ray_address: str | None = option(
        None, "Ray cluster to join, e.g. auto or HOST:6379 (default: start a local one)"
    )
    min_replicas: int = option(1, "autoscaling: fewest replicas")
    max_replicas: int = option(4, "autoscaling: most replicas")
    target_ongoing_requests: float = option(
        16.0, "autoscaling: requests in flight per replica that the replica count aims at"
    )
    upscale_delay_s: float = option(30.0, "autoscaling: seconds of demand before adding replicas")
    downscale_delay_s: float = option(
        600.0, "autoscaling: seconds of low demand before removing replicas"
    )
    max_ongoing_requests: int = option(
        256, "requests one replica takes at once (Ray Serve queues the rest)"
    )
    cpus_per_replica: float = option(
        1.0, "CPUs Ray reserves per replica (also its OpenMP threads, at least 1)"
    )
    pd_disaggregation: bool = option(
        False,
        "prefill-decode disaggregation: a prefill deployment (--prefill-min/max-replicas) and "
        "a decode deployment (--min/max-replicas); the ingress pairs one of each per request",
    )
    prefill_min_replicas: int = option(1, "--pd-disaggregation: fewest prefill replicas")
    prefill_max_replicas: int = option(1, "--pd-disaggregation: most prefill replicas")
    request_router: str = option(
        "cache_aware",
        "which replica takes a request: mci's cache-aware policy, or Ray Serve's default",
        ["cache_aware", "power_of_two"],
    )

    def __post_init__(self):
        check_choices(self)
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise UserError("need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1")
        if not 1 <= self.prefill_min_replicas <= self.prefill_max_replicas:
            raise UserError("need 1 <= --prefill-min-replicas <= --prefill-max-replicas")
        for name, value in (
            ("--target-ongoing-requests", self.target_ongoing_requests),
            ("--max-ongoing-requests", self.max_ongoing_requests),
            ("--cpus-per-replica", self.cpus_per_replica),
        ):
            if value <= 0:
                raise UserError(f"{name} must be > 0")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise UserError("--upscale-delay-s and --downscale-delay-s must be >= 0")
