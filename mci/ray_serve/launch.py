"""`mci serve-ray`: mci replicas as a Ray Serve application (docs/ray-serve.md).

Joins the Ray cluster at --ray-address (or starts a local one), deploys MciIngress on
--host/--port in front of MciReplica, autoscaled between --min-replicas and --max-replicas on
ongoing requests and routed by the cache-aware request router; then waits for SIGTERM/SIGINT,
removes the application (replicas finish their requests, then their servers drain and stop)
and leaves the cluster. The same command runs on a multi-node cluster: replicas go wherever
Ray places them, so the model path must exist on every node.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading

from mci.engine.config import EngineConfig
from mci.errors import UserError
from mci.ray_serve.config import RayServeConfig
from mci.router.config import RouterConfig
from mci.server.config import ServerConfig

log = logging.getLogger("mci")
APP_NAME = "mci"
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 30.0


def build_application(
    engine_config: EngineConfig, server_config: ServerConfig, ray_config: RayServeConfig
):
    """The Serve application: the ingress bound to the autoscaled replica deployment."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from mci.ray_serve.deployments import MciIngress, MciReplica
    from mci.ray_serve.request_router import CacheAwareRequestRouter

    if ray_config.request_router == "cache_aware":
        defaults = RouterConfig()
        router = RequestRouterConfig(
            request_router_class=CacheAwareRequestRouter,
            request_router_kwargs={
                "cache_threshold": defaults.cache_threshold,
                "balance_abs_threshold": defaults.balance_abs_threshold,
                "balance_rel_threshold": defaults.balance_rel_threshold,
            },
        )
    else:
        router = RequestRouterConfig()  # Ray Serve's power of two choices

    def replicas(name: str, least: int, most: int):
        return serve.deployment(MciReplica).options(
            name=name,
            autoscaling_config={
                "min_replicas": least,
                "initial_replicas": max(1, least),
                "max_replicas": most,
                "target_ongoing_requests": ray_config.target_ongoing_requests,
                "upscale_delay_s": ray_config.upscale_delay_s,
                "downscale_delay_s": ray_config.downscale_delay_s,
            },
            max_ongoing_requests=ray_config.max_ongoing_requests,
            ray_actor_options={"num_cpus": ray_config.cpus_per_replica},
            request_router_config=router,
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
            graceful_shutdown_timeout_s=server_config.drain_timeout,
        )

    ingress = serve.deployment(MciIngress).options(
        name="mci-ingress",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,  # the replicas bound the load; the ingress only relays
    )
    threads = max(1, int(ray_config.cpus_per_replica))
    least, most = ray_config.min_replicas, ray_config.max_replicas
    if not ray_config.pd_disaggregation:
        replica = replicas("mci-replica", least, most)
        return ingress.bind(replica.bind(engine_config, server_config, threads), server_config)
    # two roles, two deployments, each scaled on its own (docs/disaggregation.md)
    decode = replicas("mci-decode", least, most).bind(
        _role(engine_config, "decode"), server_config, threads
    )
    prefill = replicas(
        "mci-prefill", ray_config.prefill_min_replicas, ray_config.prefill_max_replicas
    ).bind(_role(engine_config, "prefill"), server_config, threads)
    return ingress.bind(decode, server_config, prefill=prefill)


def _role(engine_config: EngineConfig, mode: str) -> EngineConfig:
    section = dataclasses.replace(engine_config.disaggregation, disaggregation_mode=mode)
    return dataclasses.replace(engine_config, disaggregation=section)


def serve_ray(
    engine_config: EngineConfig, server_config: ServerConfig, ray_config: RayServeConfig
) -> int:
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise UserError("mci serve-ray needs Ray Serve: pip install 'mci[ray]'") from exc
    if engine_config.parallel.world_size > 1 or server_config.dp_size > 1:
        raise UserError(
            "mci serve-ray scales by replicas: leave --tp-size/--ep-size/--dp-size at 1"
        )
    if engine_config.disaggregation.enabled:
        raise UserError(
            "mci serve-ray sets each deployment's --disaggregation-mode itself: "
            "use --pd-disaggregation"
        )
    ray.init(address=ray_config.ray_address, include_dashboard=False, namespace="mci")
    stop = threading.Event()  # after ray.init, which installs a SIGTERM handler of its own
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        serve.run(
            build_application(engine_config, server_config, ray_config),
            name=APP_NAME,
            route_prefix="/",
        )
        log.info(
            "Ray Serve on http://%s:%d: %d..%d replica(s), %s routing",
            server_config.host,
            server_config.port,
            ray_config.min_replicas,
            ray_config.max_replicas,
            ray_config.request_router,
        )
        stop.wait()
        log.info("stopping: the replicas finish their requests, then drain")
        serve.delete(APP_NAME)
        if ray_config.ray_address is None:
            serve.shutdown()
    finally:
        ray.shutdown()
    return 0
