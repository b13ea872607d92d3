"""Every step of a workflow in one process (`mci workflow run` and `serve`): one object per
step, built dependencies first, each given handles to the steps it names and clients of its
models (one per model: steps naming the same model share it)."""

from __future__ import annotations

import asyncio

from mci.tracing import Tracing
from mci.workflow.calls import EntryPoint, LocalTransport, StepHandle
from mci.workflow.model_pool import ModelPool
from mci.workflow.steps import Step, StepSpec, graph


def build_step(spec: StepSpec, handles: dict[str, object], models: ModelPool):
    """The step's object, its dependencies resolved: a handle per step, a client per model."""
    kwargs = {param: handles[dep.__name__] for param, dep in spec.steps.items()}
    kwargs |= {param: models.client(model) for param, model in spec.models.items()}
    return spec.cls(**kwargs)


class LocalWorkflow:
    """A workflow in this process. `await start()` loads its in-process models; `entry` is
    the EntryPoint (call / stream); `await close()` stops the engines."""

    def __init__(self, entry: type[Step], tracing: Tracing | None = None):
        self.tracing = tracing or Tracing(None, "mci-workflow")
        self.specs = graph(entry)
        self.models = ModelPool(self.tracing)
        self.handles: dict[str, StepHandle] = {}
        for name, spec in self.specs.items():
            instance = build_step(spec, self.handles, self.models)
            self.handles[name] = StepHandle(spec, LocalTransport(spec, instance), self.tracing)
        self.entry = EntryPoint(self.handles[entry.__name__], self.tracing)

    async def start(self) -> None:
        """Load every in-process model now (a served workflow is ready once they are)."""
        specs = [m for spec in self.specs.values() for m in spec.models.values()]
        await asyncio.to_thread(self.models.load, specs)

    async def close(self) -> None:
        await self.models.close()
