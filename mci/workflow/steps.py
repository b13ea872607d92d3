"""Steps: what a workflow is made of, and how one is read from a Python file.

A step is a class with an async `run(self, x: In) -> Out` (or an async generator
`-> AsyncIterator[Out]`: a streaming step), `In` and `Out` pydantic models. Its dependencies
are the defaults of its `__init__` parameters, so a step can be built by hand in a test:

    class Answer(Step):
        config = StepConfig(max_replicas=4, retries=2)

        def __init__(self, llm=model(), search=depends(Search)):
            self.llm, self.search = llm, search

        async def run(self, q: Question) -> Reply:
            hits = await self.search.call(Query(text=q.text))
            return Reply(text=(await self.llm.complete(prompt(q, hits))).text)

`depends(Step)` is replaced by a handle to that step (`.call`, `.stream`), wherever it runs;
`model(...)` by a ModelClient, shared by every step that names the same model in one process.
A plain async function becomes a step with `@step`. A workflow is its entry step and every step
reachable from it (`graph`); `FILE:ENTRY` names the entry (`load_entry`).
"""

from __future__ import annotations

import collections.abc
import hashlib
import importlib.util
import inspect
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from mci.errors import UserError
from mci.workflow.models import ModelSpec


@dataclass(frozen=True)
class StepConfig:
    """A step's resources, scaling and fault handling (the Ray Serve deployment's settings;
    in one process only the fault handling applies)."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 2.0  # autoscaling aims at this many calls per replica
    max_ongoing_requests: int = 32  # calls one replica takes at once (Ray Serve queues more)
    num_cpus: float = 1.0  # CPUs reserved per replica
    num_gpus: float = 0.0  # GPUs reserved per replica (a replica sees only the GPUs it reserves)
    idempotent: bool = True  # may be run again after a failure (False: never retried)
    retries: int = 2  # further attempts after a retryable failure (idempotent steps only)
    retry_backoff_s: float = 0.1  # first retry's delay, doubled each time (jittered)
    timeout_s: float | None = None  # this step's own bound per call (the deadline may be sooner)
    stream_buffer: int = 8  # items a streaming step may run ahead of its consumer

    def __post_init__(self):
        checks = [
            (0 <= self.min_replicas <= self.max_replicas, "need 0 <= min_replicas <= max_replicas"),
            (self.max_replicas >= 1, "max_replicas must be >= 1"),
            (self.target_ongoing_requests > 0, "target_ongoing_requests must be > 0"),
            (self.max_ongoing_requests >= 1, "max_ongoing_requests must be >= 1"),
            (self.num_cpus >= 0, "num_cpus must be >= 0"),
            (self.num_gpus >= 0, "num_gpus must be >= 0"),
            (self.retries >= 0, "retries must be >= 0"),
            (self.retry_backoff_s >= 0, "retry_backoff_s must be >= 0"),
            (self.timeout_s is None or self.timeout_s > 0, "timeout_s must be > 0"),
            (self.stream_buffer >= 1, "stream_buffer must be >= 1"),
        ]
        for holds, message in checks:
            if not holds:
                raise UserError(f"StepConfig: {message}")

    @property
    def attempts(self) -> int:
        return 1 + self.retries if self.idempotent else 1


class Step:
    """Base class of a workflow step (see the module docstring). `config` is its StepConfig."""

    config: StepConfig = StepConfig()

    def __init__(self):  # a step without dependencies
        pass


@dataclass(frozen=True)
class Depends:
    """`__init__` default: a handle to another step."""

    step: type[Step]


@dataclass(frozen=True)
class UsesModel:
    """`__init__` default: a client of a model."""

    spec: ModelSpec


def depends(step_class: type[Step]) -> typing.Any:
    """Declare a dependency on another step (an `__init__` parameter's default)."""
    return Depends(step_class)


def model(
    path: str | None = None,
    url: str | None = None,
    name: str | None = None,
    api_key: str | None = None,
    **engine_flags,
) -> typing.Any:
    """Declare a model (an `__init__` parameter's default): an in-process engine over the
    checkpoint at `path` (default: the bundled model; `engine_flags` are EngineConfig fields,
    e.g. dtype="bfloat16", max_total_tokens=8192), or an OpenAI-compatible server at `url`
    (`mci serve`, `mci router`, or any other; `name` is the model it serves)."""
    return UsesModel(ModelSpec.of(path, url, name, api_key, engine_flags))


@dataclass(frozen=True)
class StepSpec:
    """A step class, read: its types, whether it streams, its dependencies, its config."""

    name: str
    cls: type[Step]
    input_type: type[BaseModel]
    output_type: type[BaseModel]
    streaming: bool
    steps: dict[str, type[Step]] = field(default_factory=dict)  # __init__ parameter -> step
    models: dict[str, ModelSpec] = field(default_factory=dict)  # __init__ parameter -> model

    @property
    def config(self) -> StepConfig:
        return self.cls.config


def describe(cls: type) -> StepSpec:
    """Read a step class; a one-line UserError says what is wrong with it."""
    name = getattr(cls, "__name__", repr(cls))
    if not (isinstance(cls, type) and issubclass(cls, Step)):
        raise UserError(f"{name} is not a workflow step (subclass mci.workflow.Step)")
    if not isinstance(cls.config, StepConfig):
        raise UserError(f"step {name}: config must be a StepConfig")
    run = getattr(cls, "run", None)
    streaming = inspect.isasyncgenfunction(run)
    if run is None or not (streaming or inspect.iscoroutinefunction(run)):
        raise UserError(f"step {name}: needs `async def run(self, x: In) -> Out`")
    try:
        hints = typing.get_type_hints(run)
    except NameError as exc:
        raise UserError(f"step {name}: run's annotations: {exc}") from None
    params = [p for p in inspect.signature(run).parameters.values()][1:]
    if len(params) != 1 or params[0].name not in hints:
        raise UserError(f"step {name}: run takes one annotated input (a pydantic model)")
    input_type = hints[params[0].name]
    output_type = hints.get("return")
    if streaming:
        output_type = _stream_item(output_type)
    for what, t in (("input", input_type), ("output", output_type)):
        if not (isinstance(t, type) and issubclass(t, BaseModel)):
            raise UserError(f"step {name}: its {what} type must be a pydantic model, not {t!r}")
    steps, models = {}, {}
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if isinstance(param.default, Depends):
            steps[param.name] = param.default.step
        elif isinstance(param.default, UsesModel):
            models[param.name] = param.default.spec
        else:
            raise UserError(
                f"step {name}: __init__ parameter {param.name!r} needs a default of "
                "depends(Step) or model(...)"
            )
    return StepSpec(name, cls, input_type, output_type, streaming, steps, models)


def _stream_item(annotation) -> type | None:
    """X of AsyncIterator[X] / AsyncGenerator[X, None] / AsyncIterable[X]."""
    origin = typing.get_origin(annotation)
    streams = (
        collections.abc.AsyncIterator,
        collections.abc.AsyncGenerator,
        collections.abc.AsyncIterable,
    )
    if origin in streams:
        return typing.get_args(annotation)[0]
    return None


def graph(entry: type[Step]) -> dict[str, StepSpec]:
    """The workflow of `entry`: every step reachable from it, dependencies before dependents
    (the order to build them in). Names are unique; cycles are an error."""
    order: dict[str, StepSpec] = {}
    visiting: list[str] = []

    def visit(cls: type) -> None:
        spec = describe(cls)
        if spec.name in order:
            if order[spec.name].cls is not cls:
                raise UserError(f"two steps are named {spec.name}")
            return
        if spec.name in visiting:
            raise UserError(f"steps depend on each other in a cycle: {' -> '.join(visiting)}")
        visiting.append(spec.name)
        for dep in spec.steps.values():
            visit(dep)
        visiting.pop()
        order[spec.name] = spec

    visit(entry)
    return order


def step(fn=None, *, config: StepConfig | None = None):
    """Make a step of an async function (or async generator) `f(x: In, **deps) -> Out`, its
    keyword parameters' defaults being `depends(...)` / `model(...)` as in a class's
    `__init__`. Use as `@step` or `@step(config=StepConfig(...))`."""

    def make(fn):
        sig = inspect.signature(fn)
        first, *deps = sig.parameters.values()
        hints = typing.get_type_hints(fn)
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)

        def __init__(self, **given):
            self.deps = given

        __init__.__signature__ = inspect.Signature([self_param, *deps])
        if inspect.isasyncgenfunction(fn):

            async def run(self, x):
                async for item in fn(x, **self.deps):
                    yield item
        else:

            async def run(self, x):
                return await fn(x, **self.deps)

        run.__annotations__ = {"x": hints.get(first.name), "return": hints.get("return")}
        namespace = {
            "__init__": __init__,
            "run": run,
            "config": config or StepConfig(),
            "__module__": fn.__module__,
            "__qualname__": fn.__qualname__,
            "__doc__": fn.__doc__,
        }
        return type(fn.__name__, (Step,), namespace)

    return make(fn) if fn is not None else make


def load_entry(target: str) -> type[Step]:
    """`FILE:ENTRY` -> the entry step class, the file run as a module (once per process: the
    module is registered under a name derived from its path, so Ray replicas and pydantic see
    one set of classes)."""
    file, sep, entry = target.rpartition(":")
    if not sep or not file or not entry:
        raise UserError(
            f"expected FILE:ENTRY (e.g. examples/code_repair/workflow.py:Repair), got {target!r}"
        )
    path = Path(file).resolve()
    if not path.is_file():
        raise UserError(f"workflow file {file} does not exist")
    module_name = "mci_workflow_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise UserError(f"{file} failed to load: {type(exc).__name__}: {exc}") from None
    cls = getattr(module, entry, None)
    if cls is None:
        raise UserError(f"{file} has no step named {entry}")
    describe(cls)
    return cls
