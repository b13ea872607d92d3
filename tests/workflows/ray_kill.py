"""The replica-kill workflow of tests/test_workflow_ray.py and benchmarks/workflow.py: an entry
step calling a two-replica model step (the bundled model), so that killing one replica leaves
the other to take the retries."""

from __future__ import annotations

from pydantic import BaseModel

from mci import workflow as wf


class Text(BaseModel):
    text: str
    max_tokens: int = 32


class Out(BaseModel):
    text: str


class Writer(wf.Step):
    config = wf.StepConfig(
        min_replicas=2, max_replicas=2, num_cpus=0.5, retries=3, retry_backoff_s=0.2
    )

    def __init__(self, llm=wf.model(max_total_tokens=8192)):
        self.llm = llm

    async def run(self, t: Text) -> Out:
        done = await self.llm.complete(t.text, max_tokens=t.max_tokens, ignore_eos=True)
        return Out(text=done.text)


class Front(wf.Step):
    config = wf.StepConfig(num_cpus=0.25)

    def __init__(self, writer=wf.depends(Writer)):
        self.writer = writer

    async def run(self, t: Text) -> Out:
        return await self.writer(t)
