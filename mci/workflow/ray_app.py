"""`mci workflow deploy`: a workflow on Ray Serve, each step its own deployment (replicas,
autoscaling and CPUs from its StepConfig), one HTTP ingress (the same app as `serve`).

    HTTP ─▶ Serve proxy ─▶ WorkflowIngress (http_app) ─▶ entry step's deployment ─▶ ...
                                                         each StepDeployment: the step's object,
                                                         its models (loaded once per replica),
                                                         RayTransport handles to its own steps

A call crosses a process boundary as plain data: the input as JSON, the CallContext as seconds
left (`to_wire`), the trace as a `traceparent` carrier; the answer as {"ok": output} or
{"error": body, "retryable": bool}, so a step's typed error arrives typed. A Ray failure (the
replica died mid-call, or could not be reached) is `replica_died`: the caller's handle retries
it, and Serve routes the retry to a live replica. Every replica loads the workflow file from
its path, which must therefore exist on every node.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from pathlib import Path

from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException

from mci.errors import UserError
from mci.tracing import Tracing
from mci.workflow.calls import EntryPoint, LocalTransport, StepHandle, Transport, as_type
from mci.workflow.config import WorkflowConfig
from mci.workflow.context import CallContext
from mci.workflow.errors import WorkflowError
from mci.workflow.http_app import build_app
from mci.workflow.local import build_step
from mci.workflow.model_pool import ModelPool
from mci.workflow.steps import StepSpec, graph, load_entry

log = logging.getLogger("mci")
# a call that Ray could not complete: the replica died, none was available, it was overloaded
RAY_FAILURES = (RayError, RayServeException)
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 30.0


class RayTransport(Transport):
    """One attempt at a step through its deployment's handle."""

    def __init__(self, spec: StepSpec, handle):
        self.spec, self.handle = spec, handle

    def _died(self, exc: BaseException) -> WorkflowError:
        return WorkflowError("replica_died", self.spec.name, f"{type(exc).__name__}: {exc}"[:500])

    def _unwrap(self, reply: dict):
        if "error" in reply:
            raise WorkflowError.from_body(reply["error"], reply.get("retryable"))
        return as_type(self.spec.output_type, reply["ok"], "invalid_output", self.spec.name)

    async def call(self, x, call, trace_context):
        carrier = Tracing.inject({}, trace_context)
        response = self.handle.call.remote(x.model_dump(mode="json"), call.to_wire(), carrier)
        try:
            reply = await response
        except asyncio.CancelledError:
            response.cancel()  # awaiting a Serve response does not cancel it by itself
            raise
        except RAY_FAILURES as exc:
            raise self._died(exc) from None
        return self._unwrap(reply)

    async def stream(self, x, call, trace_context):
        carrier = Tracing.inject({}, trace_context)
        replies = self.handle.options(stream=True).stream.remote(
            x.model_dump(mode="json"), call.to_wire(), carrier
        )
        try:
            async for reply in replies:
                yield self._unwrap(reply)
        except RAY_FAILURES as exc:
            raise self._died(exc) from None
        finally:
            replies.cancel()  # the consumer stopped: the replica's step is cancelled too


def _handles(specs: dict[str, StepSpec], spec: StepSpec, deployments: dict, tracing) -> dict:
    return {
        dep.__name__: StepHandle(
            specs[dep.__name__],
            RayTransport(specs[dep.__name__], deployments[dep.__name__]),
            tracing,
        )
        for dep in spec.steps.values()
    }


class StepDeployment:
    """One step of a workflow in a Ray Serve replica."""

    def __init__(self, target: str, step_name: str, deployments: dict, otlp_endpoint):
        specs = graph(load_entry(target))
        self.spec = specs[step_name]
        self.tracing = Tracing(otlp_endpoint, "mci-workflow")
        self.models = ModelPool(self.tracing)
        handles = _handles(specs, self.spec, deployments, self.tracing)
        self.local = LocalTransport(self.spec, build_step(self.spec, handles, self.models))
        self.models.load(self.spec.models.values())  # before the replica takes calls

    def _begin(self, payload, wire, carrier):
        value = as_type(self.spec.input_type, payload, "invalid_input", self.spec.name)
        call = CallContext.from_wire(wire)
        if call.expired():  # it waited past the deadline in Serve's queue: do not start it
            raise WorkflowError("deadline_exceeded", self.spec.name, "the deadline passed")
        return value, call, Tracing.extract(carrier)

    async def call(self, payload: dict, wire: dict, carrier: dict) -> dict:
        try:
            out = await self.local.call(*self._begin(payload, wire, carrier))
        except WorkflowError as err:
            return {"error": err.to_body(), "retryable": err.retryable}
        return {"ok": out.model_dump(mode="json")}

    async def stream(self, payload: dict, wire: dict, carrier: dict):
        try:
            async for item in self.local.stream(*self._begin(payload, wire, carrier)):
                yield {"ok": item.model_dump(mode="json")}
        except WorkflowError as err:
            yield {"error": err.to_body(), "retryable": err.retryable}

    def check_health(self) -> None:
        for engine in self.models.engines():
            if engine.stopped:
                raise RuntimeError(f"step {self.spec.name}: its engine stopped")

    def __del__(self):
        # Ray Serve calls this on a graceful stop: the engines stop, pending spans are sent
        models = getattr(self, "models", None)
        if models is not None:
            for engine in models.engines():
                engine.shutdown()
            self.tracing.shutdown()


@serve.ingress()
class WorkflowIngress:
    """The workflow's HTTP endpoint (http_app), calling the entry step's deployment."""

    def __init__(self, target: str, entry_name: str, entry_deployment, config: WorkflowConfig):
        specs = graph(load_entry(target))
        self.tracing = Tracing(config.otlp_traces_endpoint, "mci-workflow")
        spec = specs[entry_name]
        handle = StepHandle(spec, RayTransport(spec, entry_deployment), self.tracing)
        self.entry = EntryPoint(handle, self.tracing)
        self.default_timeout = config.default_timeout

    def __serve_build_asgi_app__(self):
        return build_app(self.entry, self.default_timeout)


def build_application(target: str, config: WorkflowConfig):
    """The Serve application: a deployment per step (dependencies bound first), the ingress."""
    entry = load_entry(target)
    specs = graph(entry)
    bound: dict = {}
    for name, spec in specs.items():  # dependencies before dependents
        c = spec.config
        deployment = serve.deployment(StepDeployment).options(
            name=name,
            autoscaling_config={
                "min_replicas": c.min_replicas,
                "initial_replicas": max(1, c.min_replicas),
                "max_replicas": c.max_replicas,
                "target_ongoing_requests": c.target_ongoing_requests,
            },
            max_ongoing_requests=c.max_ongoing_requests,
            ray_actor_options={"num_cpus": c.num_cpus, "num_gpus": c.num_gpus},
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        )
        deps = {dep.__name__: bound[dep.__name__] for dep in spec.steps.values()}
        bound[name] = deployment.bind(target, name, deps, config.otlp_traces_endpoint)
    ingress = serve.deployment(WorkflowIngress).options(
        name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000
    )
    return ingress.bind(target, entry.__name__, bound[entry.__name__], config)


def _check_cpus(specs: dict[str, StepSpec], cluster_cpus: float) -> None:
    """Every step's first replicas must fit the cluster's CPUs: Serve would otherwise wait
    for resources forever, and the deploy with it."""
    wanted = {name: max(1, s.config.min_replicas) * s.config.num_cpus for name, s in specs.items()}
    if sum(wanted.values()) > cluster_cpus:
        each = ", ".join(f"{name} {cpus:g}" for name, cpus in wanted.items())
        raise UserError(
            f"the steps' first replicas need {sum(wanted.values()):g} CPUs ({each}); the Ray "
            f"cluster has {cluster_cpus:g}: lower StepConfig.num_cpus or min_replicas"
        )


def deploy(target: str, config: WorkflowConfig) -> int:
    """Deploy and wait for SIGTERM/SIGINT; then remove the application and leave the cluster."""
    import ray

    file, _, name = target.rpartition(":")
    target = f"{Path(file).resolve()}:{name}"  # replicas may start in another directory
    entry = load_entry(target)  # a broken file fails here, before Ray starts
    app_name = f"workflow-{entry.__name__}"
    ray.init(address=config.ray_address, include_dashboard=False, namespace="mci-workflow")
    stop = threading.Event()  # after ray.init, which installs a SIGTERM handler of its own
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        _check_cpus(graph(entry), ray.cluster_resources().get("CPU", 0.0))
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_application(target, config), name=app_name, route_prefix="/")
        log.info(
            "workflow %s on Ray Serve at http://%s:%d (POST /run): %d step deployment(s)",
            entry.__name__,
            config.host,
            config.port,
            len(graph(entry)),
        )
        stop.wait()
        serve.delete(app_name)
        if config.ray_address is None:
            serve.shutdown()
    except RayError as exc:
        raise UserError(f"Ray Serve could not deploy the workflow: {exc}") from None
    finally:
        ray.shutdown()
    return 0
