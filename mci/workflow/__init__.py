"""Compound workflows (docs/workflows.md): typed steps that call models and each other,
stream between each other, and run in one process (`mci workflow run | serve`) or as Ray Serve
deployments, one per step (`mci workflow deploy`).

    from mci import workflow as wf

    class Write(wf.Step):
        def __init__(self, llm=wf.model()):
            self.llm = llm

        async def run(self, task: Task) -> AsyncIterator[Chunk]:
            async for text in self.llm.stream(task.prompt, max_tokens=128):
                yield Chunk(text=text)
"""

import importlib

# loaded on first use, so that `import mci.workflow.config` (every CLI command) stays light
_EXPORTS = {
    "StepHandle": "mci.workflow.calls",
    "CallContext": "mci.workflow.context",
    "current": "mci.workflow.context",
    "WorkflowError": "mci.workflow.errors",
    "Completion": "mci.workflow.models",
    "ModelClient": "mci.workflow.models",
    "Step": "mci.workflow.steps",
    "StepConfig": "mci.workflow.steps",
    "depends": "mci.workflow.steps",
    "model": "mci.workflow.steps",
    "step": "mci.workflow.steps",
    "pipe": "mci.workflow.streams",
    "segments": "mci.workflow.streams",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mci.workflow' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
