"""Workflows the tests load as files (FILE:ENTRY). The model is the checkpoint or server named
by MCI_TEST_MODEL_PATH / MCI_TEST_MODEL_URL (the tests set one before loading)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from pydantic import BaseModel

from mci import workflow as wf

if os.environ.get("MCI_TEST_MODEL_URL"):
    MODEL = wf.model(url=os.environ["MCI_TEST_MODEL_URL"])
else:
    MODEL = wf.model(
        path=os.environ.get("MCI_TEST_MODEL_PATH"), dtype="float32", skip_kernel_warmup=True
    )


class Prompt(BaseModel):
    text: str
    max_tokens: int = 8
    ignore_eos: bool = True
    pause_s: float = 0.0  # per item, in the consumer: makes the chain slow for deadline tests
    take: int | None = None  # Collect stops reading after this many pieces


class Piece(BaseModel):
    text: str


class Write(wf.Step):
    """Stream the model's text."""

    def __init__(self, llm=MODEL):
        self.llm = llm

    async def run(self, p: Prompt) -> AsyncIterator[Piece]:
        async for text in self.llm.stream(p.text, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos):
            yield Piece(text=text)


class Collect(wf.Step):
    """Consume Write's stream (slowly, or only its first pieces, if asked); return the text."""

    def __init__(self, write=wf.depends(Write)):
        self.write = write

    async def run(self, p: Prompt) -> Piece:
        parts = []
        async for piece in self.write.stream(p):
            parts.append(piece.text)
            if len(parts) == p.take:
                break
            await asyncio.sleep(p.pause_s)
        return Piece(text="".join(parts))


class Once(wf.Step):
    """One model call, whole (the overhead benchmark's workflow)."""

    def __init__(self, llm=MODEL):
        self.llm = llm

    async def run(self, p: Prompt) -> Piece:
        done = await self.llm.complete(p.text, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos)
        return Piece(text=done.text)


class SlowStart(Write):
    """Think for pause_s before the first item, then stream as Write does."""

    async def run(self, p: Prompt) -> AsyncIterator[Piece]:
        await asyncio.sleep(p.pause_s)
        async for piece in super().run(p):
            yield piece
