"""Two models in a pipeline: the bundled bf16 model drafts, and its FP8 twin continues from the
draft line by line, starting on the first line while the draft is still being written.

    mci workflow run examples/two_models/workflow.py:Pipeline \
        --input '{"prompt": "import os\\n", "draft_tokens": 48}'

Steps: Draft (bf16, streams whole lines of its text), Pipeline (the entry: for each draft line
as it arrives, the FP8 model continues the text so far for a few tokens; yields the draft's
lines and the continuations as they come). Set MCI_DRAFT_MODEL / MCI_SECOND_MODEL to other
checkpoint directories (e.g. made with `mci make-checkpoint`) to pair other models.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator

from pydantic import BaseModel, Field

from mci import workflow as wf
from mci.engine.config import DEFAULT_MODEL

DRAFT_MODEL = os.environ.get("MCI_DRAFT_MODEL", str(DEFAULT_MODEL))
SECOND_MODEL = os.environ.get("MCI_SECOND_MODEL", str(DEFAULT_MODEL.parent / "default-model-fp8"))


class Request(BaseModel):
    prompt: str
    draft_tokens: int = Field(48, ge=1, le=1024)
    continuation_tokens: int = Field(8, ge=1, le=256)


class Line(BaseModel):
    index: int
    text: str


class Segment(BaseModel):
    kind: str  # "draft" (step 1's line) | "continuation" (step 2's text after that line)
    index: int
    text: str
    t_s: float  # seconds since the pipeline started, when this segment was ready


class Draft(wf.Step):
    """The first model's text, a whole line at a time."""

    config = wf.StepConfig(num_cpus=1)

    def __init__(self, llm=wf.model(path=DRAFT_MODEL)):
        self.llm = llm

    async def run(self, r: Request) -> AsyncIterator[Line]:
        text = self.llm.stream(r.prompt, max_tokens=r.draft_tokens)
        index = 0
        async for line in wf.segments(text, by="line"):
            yield Line(index=index, text=line)
            index += 1


class Pipeline(wf.Step):
    """Step 2 (the FP8 model) continues after each draft line while step 1 goes on."""

    config = wf.StepConfig(num_cpus=1)

    def __init__(self, draft=wf.depends(Draft), llm=wf.model(path=SECOND_MODEL)):
        self.draft, self.llm = draft, llm

    async def run(self, r: Request) -> AsyncIterator[Segment]:
        start = time.monotonic()
        so_far = r.prompt
        async for line in self.draft.stream(r):
            so_far += line.text
            yield Segment(
                kind="draft", index=line.index, text=line.text, t_s=time.monotonic() - start
            )
            more = await self.llm.complete(so_far, max_tokens=r.continuation_tokens)
            yield Segment(
                kind="continuation", index=line.index, text=more.text, t_s=time.monotonic() - start
            )
