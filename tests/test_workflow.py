"""mci.workflow in one process: typed calls and streams between steps, bounded backpressure,
retries, typed errors, deadlines, models shared and exact, and the CLI (`mci workflow run`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from mci import workflow as wf
from mci.core.sampling_params import SamplingParams
from mci.engine.config import EngineConfig, ModelPlacement
from mci.engine.engine import Engine
from mci.errors import UserError
from mci.workflow.local import LocalWorkflow
from mci.workflow.steps import graph, load_entry

ROOT = Path(__file__).resolve().parents[1]
BASIC = Path(__file__).parent / "workflows" / "basic.py"


class Num(BaseModel):
    value: int


class Text(BaseModel):
    text: str


def run(coro):
    return asyncio.run(coro)


def make_flaky(failures: int, idempotent: bool = True):
    class Flaky(wf.Step):
        config = wf.StepConfig(retries=2, retry_backoff_s=0.001, idempotent=idempotent)
        calls = 0

        async def run(self, x: Num) -> Num:
            type(self).calls += 1
            if type(self).calls <= failures:
                raise RuntimeError(f"failure {type(self).calls}")
            return Num(value=x.value + 1)

    return Flaky


# ---- steps without models ---------------------------------------------------------------------
def test_typed_call_retries_an_idempotent_step_and_never_a_side_effecting_one():
    Flaky = make_flaky(failures=2)
    workflow = LocalWorkflow(Flaky)
    assert run(workflow.entry.call({"value": 1})).value == 2
    assert Flaky.calls == 3

    Once = make_flaky(failures=1, idempotent=False)
    with pytest.raises(wf.WorkflowError) as err:
        run(LocalWorkflow(Once).entry.call(Num(value=1)))
    assert (err.value.kind, err.value.step, Once.calls) == ("step_error", "Flaky", 1)
    assert "RuntimeError: failure 1" in err.value.message
    assert err.value.to_body()["error"]["step"] == "Flaky" and err.value.status == 502


def test_an_inner_failure_crosses_boundaries_typed_and_is_retried_only_where_it_happened():
    Inner = make_flaky(failures=10)

    class Outer(wf.Step):
        config = wf.StepConfig(retries=2, retry_backoff_s=0.001)
        calls = 0

        def __init__(self, inner=wf.depends(Inner)):
            self.inner = inner

        async def run(self, x: Num) -> Num:
            Outer.calls += 1
            return await self.inner(x)

    with pytest.raises(wf.WorkflowError) as err:
        run(LocalWorkflow(Outer).entry.call({"value": 0}))
    assert (err.value.kind, err.value.step) == ("step_error", "Flaky")
    assert (Inner.calls, Outer.calls) == (3, 1)  # the inner step's 3 attempts, the outer's one


def test_input_and_output_are_checked_against_the_step_types():
    class Bad(wf.Step):
        async def run(self, x: Num) -> Num:
            return {"value": "not a number"}

    workflow = LocalWorkflow(Bad)
    with pytest.raises(wf.WorkflowError) as err:
        run(workflow.entry.call({"value": "x"}))
    assert (err.value.kind, err.value.step, err.value.status) == ("invalid_input", "Bad", 422)
    assert "value" in err.value.message
    with pytest.raises(wf.WorkflowError) as err:
        run(workflow.entry.call({"value": 1}))
    assert err.value.kind == "invalid_output"


def test_step_definitions_are_checked():
    class NoTypes(wf.Step):
        async def run(self, x):
            return x

    class NotAsync(wf.Step):
        def run(self, x: Num) -> Num:
            return x

    class NoMarker(wf.Step):
        def __init__(self, helper=None):
            pass

        async def run(self, x: Num) -> Num:
            return x

    for cls in (NoTypes, NotAsync, NoMarker, int):
        with pytest.raises(UserError):
            graph(cls)
    with pytest.raises(UserError, match="retries"):
        wf.StepConfig(retries=-1)


def test_function_steps_and_the_graph_order():
    @wf.step
    async def double(x: Num) -> Num:
        return Num(value=2 * x.value)

    @wf.step(config=wf.StepConfig(retries=0))
    async def twice(x: Num, d=wf.depends(double)) -> Num:
        return await d(await d(x))

    assert list(graph(twice)) == ["double", "twice"]
    assert run(LocalWorkflow(twice).entry.call({"value": 3})).value == 12


def test_streams_overlap_and_backpressure_is_bounded():
    produced: list[int] = []

    class Numbers(wf.Step):
        config = wf.StepConfig(stream_buffer=3)

        async def run(self, x: Num) -> AsyncIterator[Num]:
            for i in range(x.value):
                produced.append(i)
                yield Num(value=i)

    class Slow(wf.Step):
        def __init__(self, numbers=wf.depends(Numbers)):
            self.numbers = numbers

        async def run(self, x: Num) -> AsyncIterator[Num]:
            async for n in self.numbers.stream(x):
                # the producer runs ahead of this consumer by at most its buffer (+1 in hand)
                assert len(produced) - n.value <= 3 + 2, (len(produced), n.value)
                await asyncio.sleep(0.005)
                yield n

    async def first_and_all():
        stream = LocalWorkflow(Slow).entry.stream({"value": 50})
        first = await stream.__anext__()
        at_first = len(produced)
        rest = [n async for n in stream]
        return first, at_first, rest

    first, at_first, rest = run(first_and_all())
    assert first.value == 0 and at_first < 50  # the consumer started before the producer ended
    assert [n.value for n in rest] == list(range(1, 50))


def test_a_stream_is_retried_before_its_first_item_only():
    attempts = []

    class Stream(wf.Step):
        config = wf.StepConfig(retries=2, retry_backoff_s=0.001)

        async def run(self, x: Num) -> AsyncIterator[Num]:
            attempts.append(1)
            if len(attempts) == 1:
                raise RuntimeError("before the first item")
            yield Num(value=1)
            raise RuntimeError("after the first item")

    async def consume():
        return [n.value async for n in LocalWorkflow(Stream).entry.stream({"value": 0})]

    with pytest.raises(wf.WorkflowError, match="after the first item"):
        run(consume())
    assert len(attempts) == 2


def test_a_deadline_cancels_the_running_calls_and_names_the_innermost_step():
    cancelled = []

    class Sleepy(wf.Step):
        async def run(self, x: Num) -> Num:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.append(time.monotonic())
                raise
            return x

    class Entry(wf.Step):
        def __init__(self, sleepy=wf.depends(Sleepy)):
            self.sleepy = sleepy

        async def run(self, x: Num) -> Num:
            return await self.sleepy(x)

    start = time.monotonic()
    with pytest.raises(wf.WorkflowError) as err:
        run(LocalWorkflow(Entry).entry.call({"value": 1}, timeout_s=0.3))
    took = time.monotonic() - start
    assert (err.value.kind, err.value.step, err.value.status) == (
        "deadline_exceeded",
        "Sleepy",
        504,
    )
    assert 0.3 <= took < 0.4 and len(cancelled) == 1


def test_segments_regroup_text_into_lines_and_sentences():
    async def deltas(*parts):
        for p in parts:
            yield p

    async def collect(by, *parts):
        return [s async for s in wf.segments(deltas(*parts), by=by)]

    assert run(collect("line", "a", "b\nc", "\n", "d")) == ["ab\n", "c\n", "d"]
    assert run(collect("sentence", "One. T", "wo! Three")) == ["One. ", "Two! ", "Three"]


def test_load_entry_errors_are_one_line_user_errors(tmp_path):
    with pytest.raises(UserError, match="FILE:ENTRY"):
        load_entry("nofile")
    with pytest.raises(UserError, match="does not exist"):
        load_entry(str(tmp_path / "missing.py") + ":X")
    broken = tmp_path / "broken.py"
    broken.write_text("raise ValueError('boom')\n")
    with pytest.raises(UserError, match="boom"):
        load_entry(f"{broken}:X")
    with pytest.raises(UserError, match="no step named Nope"):
        load_entry(f"{BASIC}:Nope")


# ---- steps with models --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(checkpoint):
    return checkpoint()


@pytest.fixture
def basic(tiny, monkeypatch):
    """tests/workflows/basic.py loaded with the tiny checkpoint as its in-process model."""
    monkeypatch.setenv("MCI_TEST_MODEL_PATH", str(tiny))
    monkeypatch.delenv("MCI_TEST_MODEL_URL", raising=False)
    for name in [n for n in sys.modules if n.startswith("mci_workflow_")]:
        del sys.modules[name]  # each test loads the file afresh, with its own environment
    return lambda entry: load_entry(f"{BASIC}:{entry}")


def test_a_model_call_is_exactly_the_engines_output_and_steps_share_the_model(basic, tiny):
    async def main():
        workflow = LocalWorkflow(basic("Collect"))
        await workflow.start()
        try:
            out = await workflow.entry.call({"text": "def f(x):", "max_tokens": 12})
            streamed = [
                p.text
                async for p in workflow.handles["Write"].stream(
                    {"text": "def f(x):", "max_tokens": 12}
                )
            ]
            return out, streamed, workflow.models.engines()
        finally:
            await workflow.close()

    out, streamed, engines = run(main())
    assert len(engines) == 1  # one model, however many steps name it
    config = EngineConfig(
        model=ModelPlacement(model_path=tiny, dtype="float32", skip_kernel_warmup=True)
    )
    with Engine(config) as engine:
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        expected = engine.generate("def f(x):", params)[0].outputs[0].text
    assert out.text == expected == "".join(streamed)


def test_a_deadline_shorter_than_the_chain_fails_on_time_and_frees_the_kv(basic):
    async def main():
        workflow = LocalWorkflow(basic("Collect"))
        await workflow.start()
        try:
            start = time.monotonic()
            with pytest.raises(wf.WorkflowError) as err:
                await workflow.entry.call(
                    {"text": "x", "max_tokens": 400, "pause_s": 0.01}, timeout_s=0.5
                )
            took = time.monotonic() - start
            engine = workflow.models.engines()[0]
            deadline = time.monotonic() + 5
            while engine.stats()["num_running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            engine.check_idle_integrity()
            return err.value, took
        finally:
            await workflow.close()

    err, took = run(main())
    assert err.kind == "deadline_exceeded" and err.step in ("Write", "Collect")
    assert abs(took - 0.5) < 0.1


# ---- the CLI ------------------------------------------------------------------------------------
def _mci(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mci", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_cli_runs_the_examples_with_the_bundled_model():
    repair = _mci(
        "workflow",
        "run",
        "examples/code_repair/workflow.py:RepairCode",
        "--input",
        '{"signature": "def add(a, b):", "docstring": "Return a + b.", '
        '"test": "assert add(2, 3) == 5", "max_tokens": 24}',
    )
    assert repair.returncode == 0, repair.stderr
    events = [json.loads(line) for line in repair.stdout.splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "text" and kinds[-1] == "result" and "check" in kinds
    first_text = "".join(e["text"] for e in events if e["kind"] == "text" and e["attempt"] == 1)
    assert first_text.startswith("def add(a, b):")

    pipeline = _mci(
        "workflow",
        "run",
        "examples/two_models/workflow.py:Pipeline",
        "--input",
        '{"prompt": "import os\\n", "draft_tokens": 24, "continuation_tokens": 4}',
    )
    assert pipeline.returncode == 0, pipeline.stderr
    segments = [json.loads(line) for line in pipeline.stdout.splitlines()]
    draft = [s for s in segments if s["kind"] == "draft"]
    more = [s for s in segments if s["kind"] == "continuation"]
    assert draft and more and more[0]["t_s"] < draft[-1]["t_s"]  # step 2 began before step 1 ended


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path):
    bad_input = _mci("workflow", "run", f"{BASIC}:Once", "--input", '{"txt": 1}')
    assert bad_input.returncode == 2
    assert (
        bad_input.stderr.strip().splitlines()[-1].startswith("mci: error: step Once: not a Prompt")
    )
    not_json = _mci("workflow", "run", f"{BASIC}:Once", "--input", "{")
    assert not_json.returncode == 2 and "not JSON" in not_json.stderr
    missing = _mci("workflow", "run", "nope.py:X", "--input", "{}")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_a_consumer_that_stops_early_closes_the_stream_in_its_own_context():
    seen = {}

    class Numbers(wf.Step):
        config = wf.StepConfig(stream_buffer=2)

        async def run(self, x: Num) -> AsyncIterator[Num]:
            try:
                for i in range(1000):
                    yield Num(value=i)
            finally:
                seen["path"] = wf.current().path  # the producer's own call context

    class Take(wf.Step):
        def __init__(self, numbers=wf.depends(Numbers)):
            self.numbers = numbers

        async def run(self, x: Num) -> Num:
            async for n in self.numbers.stream(x):
                if n.value == 2:
                    break
            await asyncio.sleep(0.05)
            seen["closed_before_return"] = "path" in seen
            return n

    async def main():
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        out = await LocalWorkflow(Take).entry.call({"value": 0})
        await asyncio.sleep(0.05)
        return out, errors

    out, errors = run(main())
    assert out.value == 2 and errors == []
    assert seen == {"path": ("Take", "Numbers"), "closed_before_return": True}


def test_a_steps_own_timeout_and_a_wrong_input_passed_by_a_step():
    class Slow(wf.Step):
        config = wf.StepConfig(timeout_s=0.1)

        async def run(self, x: Num) -> Num:
            await asyncio.sleep(5)
            return x

    start = time.monotonic()
    with pytest.raises(wf.WorkflowError) as err:
        run(LocalWorkflow(Slow).entry.call({"value": 1}))
    assert (err.value.kind, err.value.step) == ("deadline_exceeded", "Slow")
    assert time.monotonic() - start < 0.3

    class Caller(wf.Step):
        def __init__(self, slow=wf.depends(Slow)):
            self.slow = slow

        async def run(self, x: Num) -> Num:
            return await self.slow({"value": "not a number"})

    with pytest.raises(wf.WorkflowError) as err:
        run(LocalWorkflow(Caller).entry.call({"value": 1}))
    # the caller's bug, not the client's: a step error (502) naming the caller
    assert (err.value.kind, err.value.step, err.value.status) == ("step_error", "Caller", 502)


def test_server_model_merges_usage_never_repeats_text_and_retries_only_refusals():
    import httpx

    from mci.tracing import Tracing
    from mci.workflow.models import ModelSpec
    from mci.workflow.server_model import ServerModel

    def sse(*events):
        return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    chunks = sse(
        {"choices": [{"text": "Hello", "finish_reason": None}]},
        {"choices": [{"text": " world", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    )

    class DropsAfterFirst(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "Hello"}]}\n\n'
            raise httpx.ReadError("connection dropped")

    posts = []

    def handler(request: httpx.Request) -> httpx.Response:
        posts.append(request)
        mode = json.loads(request.content)["prompt"]
        if mode == "drop":
            return httpx.Response(200, stream=DropsAfterFirst())
        if mode == "refused":
            return httpx.Response(503, text="busy")
        if mode == "bad":
            return httpx.Response(400, text="bad request")
        return httpx.Response(200, text=chunks)

    spec = ModelSpec(url="http://model", name="m")
    client = ServerModel(spec, Tracing(None, "t"), transport=httpx.MockTransport(handler))

    async def outcome(prompt):
        posts.clear()
        try:
            return await client.complete(prompt), len(posts)
        except wf.WorkflowError as err:
            return err, len(posts)

    done, n = run(outcome("ok"))
    assert (done.text, done.finish_reason, done.prompt_tokens, done.completion_tokens, n) == (
        "Hello world",
        "length",
        3,
        2,
        1,
    )
    err, n = run(outcome("drop"))
    assert err.kind == "model_error" and "ReadError" in err.message and n == 1  # not re-sent
    err, n = run(outcome("refused"))
    assert err.kind == "model_error" and err.retryable and n == 3  # refusals tried again
    err, n = run(outcome("bad"))
    assert err.kind == "model_error" and not err.retryable and n == 1
    with pytest.raises(TypeError, match="frequency"):
        run(client.complete("ok", frequency=1))


def test_a_consumer_that_stops_early_frees_the_engines_kv(basic):
    async def main():
        workflow = LocalWorkflow(basic("Collect"))
        await workflow.start()
        try:
            out = await workflow.entry.call({"text": "x", "max_tokens": 2000, "take": 2})
            engine = workflow.models.engines()[0]
            deadline = time.monotonic() + 1
            while engine.stats()["num_running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            engine.check_idle_integrity()
            return out
        finally:
            await workflow.close()

    assert run(main()).text
