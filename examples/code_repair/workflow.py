"""Code repair: write a function from its docstring, check it, and on failure try again with
the error in the prompt. The first attempt's text streams to the caller while it is written.

    mci workflow run examples/code_repair/workflow.py:RepairCode \
        --input '{"signature": "def add(a, b):", "docstring": "Return a + b.",
                  "test": "assert add(2, 3) == 5"}'

Steps: WriteCode (streams the model's text), CheckCode (ast.parse, then the test in a
subprocess with a time limit; no model), RepairCode (the entry: write -> check -> write again
with the error -> check).
"""

from __future__ import annotations

import ast
import asyncio
import sys
from collections.abc import AsyncIterator

from pydantic import BaseModel, Field

from mci import workflow as wf

STOP = ["\ndef ", "\nclass ", "\nif __name__", "\n\n\n"]


class Task(BaseModel):
    signature: str = Field(description="the function's first line, e.g. 'def add(a, b):'")
    docstring: str = Field(description="what the function does")
    test: str = Field(description="Python code that exercises the function (asserts)")
    max_tokens: int = Field(96, ge=1, le=512)
    test_timeout_s: float = Field(5.0, gt=0, le=60)


class Attempt(BaseModel):
    task: Task
    feedback: str = ""  # the previous attempt and its error, for a second try


class Chunk(BaseModel):
    text: str


class Candidate(BaseModel):
    code: str
    test: str
    timeout_s: float


class Verdict(BaseModel):
    ok: bool
    stage: str  # "parse" | "test" | "passed"
    error: str = ""


class Event(BaseModel):
    kind: str  # "text" (an attempt being written) | "check" | "result"
    attempt: int
    text: str = ""
    ok: bool | None = None


class WriteCode(wf.Step):
    """The model writes the function's body after its signature and docstring."""

    def __init__(self, llm=wf.model()):
        self.llm = llm

    async def run(self, a: Attempt) -> AsyncIterator[Chunk]:
        prompt = f"{a.feedback}{a.task.signature}\n    {a.task.docstring!r}\n"
        yield Chunk(text=prompt[len(a.feedback) :])
        async for text in self.llm.stream(prompt, max_tokens=a.task.max_tokens, stop=STOP):
            yield Chunk(text=text)


class CheckCode(wf.Step):
    """Parse the candidate, then run the test against it in a fresh interpreter."""

    # a failing test is an answer, not a fault; a subprocess's CPU is mostly waiting
    config = wf.StepConfig(retries=0, num_cpus=0.25)

    async def run(self, c: Candidate) -> Verdict:
        try:
            ast.parse(c.code)
        except SyntaxError as exc:
            return Verdict(
                ok=False, stage="parse", error=f"SyntaxError: {exc.msg} (line {exc.lineno})"
            )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            f"{c.code}\n\n{c.test}\n",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), c.timeout_s)
        except asyncio.TimeoutError:
            return Verdict(ok=False, stage="test", error=f"timed out after {c.timeout_s} s")
        finally:  # timed out, or the call was cancelled (deadline, client gone): no orphan
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        if proc.returncode != 0:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or ["failed"]
            return Verdict(ok=False, stage="test", error=last[0])
        return Verdict(ok=True, stage="passed")


class RepairCode(wf.Step):
    """Write, check, and on failure write again with the error; every attempt streams."""

    config = wf.StepConfig(num_cpus=0.25)  # it only orchestrates

    def __init__(self, write=wf.depends(WriteCode), check=wf.depends(CheckCode)):
        self.write, self.check = write, check

    async def run(self, task: Task) -> AsyncIterator[Event]:
        feedback = ""
        for attempt in (1, 2):
            parts = []
            async for chunk in self.write.stream(Attempt(task=task, feedback=feedback)):
                parts.append(chunk.text)
                yield Event(kind="text", attempt=attempt, text=chunk.text)
            code = "".join(parts)
            verdict = await self.check(
                Candidate(code=code, test=task.test, timeout_s=task.test_timeout_s)
            )
            yield Event(
                kind="check", attempt=attempt, text=verdict.error or "passed", ok=verdict.ok
            )
            if verdict.ok or attempt == 2:
                yield Event(kind="result", attempt=attempt, text=code, ok=verdict.ok)
                return
            comment = "\n".join(f"# {line}" for line in code.splitlines())
            feedback = f"# A first attempt failed ({verdict.error}):\n{comment}\n# Fixed:\n"
