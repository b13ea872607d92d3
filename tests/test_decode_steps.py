"""Several decode steps per engine step (`--num-scheduler-steps`, Scheduler._plan_ahead): the
same outputs as one step at a time, the KV pool whole afterwards, and a command arriving
meanwhile ends the call after the step in flight."""

from __future__ import annotations

import contextlib
import dataclasses
import select
import threading
import time

import pytest
import torch
from engine_helpers import drive

from mci.cache.config import CacheConfig
from mci.core.batch import ScheduledItem
from mci.core.request import Request
from mci.core.sampling_params import SamplingParams
from mci.engine.builder import build_engine_core
from mci.engine.config import EngineConfig, ModelPlacement
from mci.engine.engine import Engine
from mci.engine.loop import QueueInbox
from mci.models.loader import load_model
from mci.scheduler.config import SchedulerConfig
from mci.scheduler.steps_ahead import steps_ahead
from mci.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def setup(checkpoint):
    """tiny in bf16: its decode steps run whole on the CPU kernels (the multi-step call)."""
    path = checkpoint(dtype="bfloat16")
    model = load_model(path, "bfloat16")
    return path, model, TextTokenizer.load(path)


def _config(path, steps: int, max_total_tokens: int = 4096, **sched) -> EngineConfig:
    return EngineConfig(
        model=ModelPlacement(model_path=path, dtype="bfloat16", skip_kernel_warmup=True),
        cache=CacheConfig(max_total_tokens=max_total_tokens),
        scheduler=dataclasses.replace(SchedulerConfig(), num_scheduler_steps=steps, **sched),
        check_integrity=True,
    )


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(10, 2000, (int(torch.randint(3, 30, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(n)]  # fmt: skip


def _run(
    setup,
    steps: int,
    params: list[SamplingParams],
    arrivals: list[int],
    same=(),
    budget=0.0,
    **config,
):
    """The requests (prompt i with params i, added at step arrivals[i]; the indices in `same`
    take prompt 0) through an engine core, stepped to the end (drive checks the pool and the
    tree after). `budget`: each call's time budget (0: calls end by their step counts, which
    the tests count). -> (final outputs by id, the core)."""
    path, model, tok = setup
    core = build_engine_core(_config(path, steps, **config), model, tok)
    core.runner.decode_call_budget_s = budget
    by_step: dict[int, list[Request]] = {}
    prompts = _prompts(len(params))
    prompts = [prompts[0] if i in same else p for i, p in enumerate(prompts)]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        by_step.setdefault(arrivals[i], []).append(Request(f"r{i}", prompt, p))
    finals = drive(core, by_step)
    return {rid: (o.output_token_ids, o.finish_reason, o.stop_reason, o.text, o.logprobs)
            for rid, o in finals.items()}, core  # fmt: skip


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, **kw)


@contextlib.contextmanager
def _recorded_calls(model, on_call=None):
    """`model.decode_greedy` recorded: yields the list of (steps asked, steps run) of each
    call; `on_call()` runs as each call begins."""
    calls, greedy = [], model.decode_greedy

    def recorded(*args):
        if on_call is not None:
            on_call()
        tokens = greedy(*args)
        calls.append((args[4], 0 if tokens is None else tokens.shape[0]))
        return tokens

    model.decode_greedy = recorded
    try:
        yield calls
    finally:
        del model.decode_greedy  # the class's method again


def test_several_decode_steps_a_call_give_the_outputs_of_one_at_a_time(setup):
    """Greedy requests that end on a stop id (the call ends there), on a stop string inside a
    call (the steps after it are dropped, their slots freed), at min_tokens' end, at their
    length, arriving while others decode, give the same tokens, texts, finish and stop
    reasons with 8 steps a call as with 1; so do a seeded sampled request and one with
    logprobs beside greedy ones (steps stay single while they run). The calls did run
    several steps."""
    base, _ = _run(setup, 1, [_greedy(40, ignore_eos=True)], [0])
    text, ids = base["r0"][3], base["r0"][0]
    plain = [
        _greedy(40, ignore_eos=True),
        _greedy(33, stop_token_ids=(ids[12],)),  # prompt 0 too: stops at its 13th token
        _greedy(50, stop=(text[len(text) // 2 : len(text) // 2 + 3],)),  # inside a call
        _greedy(25, min_new_tokens=10),
        _greedy(3),
    ]
    mixed = [
        _greedy(30, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=0.8, seed=7),
        _greedy(20, logprobs=2),
        _greedy(24, ignore_eos=True),
    ]
    for params, arrivals in ((plain, [0, 0, 1, 1, 2]), (mixed, [0, 0, 3, 6])):
        one, core_one = _run(setup, 1, params, arrivals, same=(1, 2))
        many, core_many = _run(setup, 8, params, arrivals, same=(1, 2))
        assert many == one
        assert core_one.counters["decode_steps_ahead"] == 0
        assert core_many.counters["decode_steps_ahead"] > 0
    one, _ = _run(setup, 1, plain, [0, 0, 1, 1, 2], same=(1, 2))
    assert one["r1"][1:3] == ("stop", ids[12]) and one["r2"][1] == "stop"
    assert len(one["r2"][0]) < 40
    # alone, the stop string ends it inside a call: the steps after it are dropped, and
    # its tenant is charged for the tokens it got, as one step at a time charges
    runs = [_run(setup, steps, plain[2:3], [0], same=(0,)) for steps in (1, 8)]
    assert runs[0][0] == runs[1][0] and runs[0][0]["r0"] == one["r2"]
    assert runs[1][1].counters["decode_steps_ahead"] > 0
    assert [c.scheduler.fair.snapshot() for _, c in runs] == [
        runs[0][1].scheduler.fair.snapshot()
    ] * 2
    # a lone stream: every step after its first token runs 8 decode steps a call, none in vain
    alone, core = _run(setup, 8, [_greedy(41, ignore_eos=True)], [0])
    assert alone["r0"][0][:40] == ids
    assert core.counters["decode_steps_ahead"] == 5 * 7  # tokens 2-41: 5 calls of 8
    assert core.runner.forwards == 41


def test_steps_ahead_take_only_free_slots_and_wait_for_no_waiting_request(setup):
    """The steps ahead take slots only where the pool has them free, never evicting the tree
    or preempting for them: in a pool of 60 slots, where a finished request's 38 stay in the
    tree, a request of 41 tokens runs shorter calls than in a wide pool, and nothing is
    preempted. With a request waiting for admission (at most 2 running), every step runs one
    decode step until it is admitted. The outputs are those of one step at a time."""
    params = [_greedy(30, ignore_eos=True), _greedy(10, ignore_eos=True)]
    one, _ = _run(setup, 1, params, [0, 0], max_total_tokens=60)
    tight, core_tight = _run(setup, 8, params, [0, 0], max_total_tokens=60)
    wide, core_wide = _run(setup, 8, params, [0, 0])
    assert tight == wide == one
    calls = [c.runner.forwards - c.counters["decode_steps_ahead"] for c in (core_tight, core_wide)]
    assert core_tight.counters["decode_steps_ahead"] > 0
    assert calls[0] > calls[1]  # shorter calls: as many steps ahead as the free slots allow
    assert core_tight.counters["preemptions"] == 0
    params = [_greedy(30, ignore_eos=True)] * 3
    # the third waits while the first two decode (30 tokens each): their steps are single
    # until they finish, then the third runs alone, 8 a call after its first token
    queued, core = _run(setup, 8, params, [0, 0, 0], max_running_requests=2)
    assert queued == _run(setup, 1, params, [0, 0, 0], max_running_requests=2)[0]
    assert core.counters["decode_steps_ahead"] == 29 - 29 // 8 - (29 % 8 > 0)


def _decoding(prompt_len: int, params: SamplingParams, generated: int = 1) -> ScheduledItem:
    """The item of a request decoding after `generated` tokens (its KV computed)."""
    req = Request("r", list(range(10, 10 + prompt_len)), params)
    for token in range(generated):
        req.append_token(100 + token)
    req.num_computed_tokens = req.num_tokens - 1
    return ScheduledItem.plan(req, 1)


def test_the_steps_a_step_may_run():
    """steps_ahead: up to the most, the fewest tokens left and the free slots per item; one
    step for a prompt chunk, a first token, a request not greedy as it is, and, in a batch
    of several, a request with stop strings (alone it may)."""
    plain = _decoding(5, _greedy(20))
    assert steps_ahead([plain], 16, 1000) == 16
    assert steps_ahead([plain, _decoding(3, _greedy(8), generated=2)], 16, 1000) == 6
    assert steps_ahead([plain, plain], 16, 9) == 5  # 9 free slots: 4 more for each
    assert steps_ahead([plain], 1, 1000) == 1 and steps_ahead([], 16, 1000) == 1
    stop = _decoding(5, _greedy(20, stop=("xy",)))
    assert steps_ahead([stop], 16, 1000) == 16 and steps_ahead([stop, plain], 16, 1000) == 1
    first = _decoding(5, _greedy(20), generated=0)
    sampled = _decoding(5, SamplingParams(max_new_tokens=20, temperature=0.5))
    for odd in (first, sampled, _decoding(5, _greedy(20, logprobs=1)),
                _decoding(5, _greedy(20, min_new_tokens=3)),
                _decoding(5, _greedy(20, repetition_penalty=1.1))):  # fmt: skip
        assert steps_ahead([plain, odd], 16, 1000) == 1
    chunk = Request("c", list(range(10, 40)), _greedy(20))
    assert steps_ahead([ScheduledItem.plan(chunk, 30)], 16, 1000) == 1


def test_a_first_token_comes_alone_from_its_step(setup):
    """A request whose prompt leaves one token to compute (a one-token prompt) gets its first
    token from a step of its own, not with the steps ahead: its TTFT waits for nothing."""
    path, model, tok = setup
    core = build_engine_core(_config(path, 8), model, tok)
    core.add_request(Request("one", [42], _greedy(20, ignore_eos=True)))
    first = core.step()
    assert [len(out.new_token_ids) for out in first] == [1]
    assert [len(out.new_token_ids) for out in core.step()] == [8]
    core.abort("one")
    core.check_idle_integrity()


def test_a_call_ends_after_the_step_that_passes_its_time_budget(setup):
    """With a budget a step outlasts, every call runs one step: no step ahead, the same
    outputs, the slots taken for the steps ahead given back."""
    params = [_greedy(30, ignore_eos=True)] * 2
    with _recorded_calls(setup[1]) as calls:
        budgeted, core = _run(setup, 8, params, [0, 0], budget=1e-9)
    assert budgeted == _run(setup, 1, params, [0, 0])[0]
    assert calls and all(asked > 1 and ran == 1 for asked, ran in calls)
    assert core.counters["decode_steps_ahead"] == 0 and core.runner.forwards == 1 + 29


def test_a_deadline_ends_a_call(setup):
    """A call runs no further than the first deadline among its requests: a request due in
    0.01 s, in calls of up to 1,500 steps with no time budget, is aborted at its deadline
    with fewer tokens than one call would have made, and the pool is whole."""
    path, model, tok = setup
    core = build_engine_core(_config(path, 1500), model, tok)
    core.runner.decode_call_budget_s = 0.0
    req = Request("due", _prompts(1)[0], _greedy(1500, ignore_eos=True))
    core.add_request(req)
    core.step()  # its prefill and first token
    req.deadline = time.monotonic() + 0.01
    finals = []
    while core.has_work:
        finals += [out for out in core.step() if out.finished]
    assert [out.finish_reason for out in finals] == ["abort"]
    assert 1 < len(req.output_ids) < 1500 and core.counters["decode_steps_ahead"] > 0
    core.check_idle_integrity()


def test_a_command_ends_a_call_of_decode_steps_after_the_step_in_flight(setup):
    """An in-process engine's inbox makes its eventfd readable with each command: a second
    request put as a lone stream's call of up to 1,499 decode steps begins ends that call
    after its first step, and both requests end as they do alone."""
    path, model, tok = setup
    long_p, short_p = _greedy(1500, ignore_eos=True), _greedy(5, ignore_eos=True)
    prompts = _prompts(2)
    with Engine(_config(path, 1), model, tok) as engine:
        alone = [engine.generate([p], params)[0].outputs[0].output_token_ids
                 for p, params in zip(prompts, (long_p, short_p), strict=True)]  # fmt: skip
    results: dict[str, list[int]] = {}
    done, engines, put = threading.Event(), [], []

    def sink(out):
        if out.finished:
            results[out.request_id] = out.output_token_ids
            if len(results) == 2:
                done.set()

    def put_second():  # on the loop's thread, as the first call begins
        if not put:
            put.append(engines[0].add_request(prompts[1], short_p, sink, request_id="short"))

    with _recorded_calls(model, put_second) as calls:
        with Engine(_config(path, 1500), model, tok) as engine:
            engine.core.runner.decode_call_budget_s = 0.0  # ended by the command alone
            engines.append(engine)
            engine.add_request(prompts[0], long_p, sink, request_id="long")
            assert done.wait(120)
    assert results == {"long": alone[0], "short": alone[1]}
    assert calls[0] == (1499, 1)  # the command waited as it began: one step
    assert any(ran > 1 for _, ran in calls)
    engine.core.check_idle_integrity()


def test_the_queue_inbox_is_readable_while_a_command_waits():
    """QueueInbox's eventfd: readable once a command is put, not after `take` took it; a
    command put while `take` waited leaves at most one wake-up for nothing."""
    inbox = QueueInbox()
    if inbox.wake_fd is None:
        pytest.skip("no eventfd on this system: calls end by their steps and budget")
    poller = select.poll()
    poller.register(inbox.wake_fd, select.POLLIN)
    assert not poller.poll(0)
    inbox.put("command")
    assert poller.poll(0)
    assert inbox.take(wait=False) == [("command", None)]
    assert not poller.poll(0)
    late = threading.Timer(0.01, inbox.put, ("late",))
    late.start()
    assert inbox.take(wait=True) == [("late", None)]  # put while take waited
    late.join()
    # its count may land after `take` cleared it (one call woken for nothing): the next
    # `take` clears it, and none is left
    assert inbox.take(wait=False) == [] and not poller.poll(0)


def test_the_builder_runs_one_step_a_call_where_a_step_cannot_run_whole(setup, checkpoint):
    """Several steps a call only where a decode step runs whole on the CPU kernels: bf16
    weights, no speculative decoding, not --deterministic; elsewhere the scheduler plans
    one step (no slots taken ahead to be given back)."""
    path, model, tok = setup
    config = _config(path, 8)
    assert build_engine_core(config, model, tok).scheduler.decode_steps == 8
    spec = dataclasses.replace(config.speculative, speculative_algorithm="ngram")
    deterministic = dataclasses.replace(config.model, deterministic=True)
    for changed in (dict(speculative=spec), dict(model=deterministic)):
        core = build_engine_core(dataclasses.replace(config, **changed), model, tok)
        assert core.scheduler.decode_steps == 1, changed
    model.set_batch_invariant(False)  # the shared model back on its default path
    path32 = checkpoint()
    core = build_engine_core(
        dataclasses.replace(config, model=dataclasses.replace(config.model, model_path=path32,
                                                              dtype="float32")),
        load_model(path32, "float32"), TextTokenizer.load(path32),
    )  # fmt: skip
    assert core.scheduler.decode_steps == 1


def test_served_streams_carry_several_tokens_a_chunk_with_the_same_text(checkpoint):
    """Through `mci serve` and the official openai client: a greedy stream with 8 steps a
    call comes in fewer chunks than with 1, with the same text, streamed or not; a stream
    dropped mid-way (its abort wakes the call) leaves the pool whole."""
    import httpx
    import openai
    from server_helpers import LiveServer

    from mci.engine.core import check_idle

    path = checkpoint(dtype="bfloat16")
    ask = dict(model="m", prompt="The quick brown fox", max_tokens=60, temperature=0,
               extra_body={"ignore_eos": True})  # fmt: skip
    seen = {}
    for steps in ("1", "8"):
        flags = ("--served-model-name", "m", "--num-scheduler-steps", steps)
        with LiveServer(path, *flags, dtype="bfloat16") as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            chunks = [c.choices[0].text for c in client.completions.create(**ask, stream=True)]
            whole = client.completions.create(**ask).choices[0].text
            body = {**{k: v for k, v in ask.items() if k != "extra_body"}, "ignore_eos": True}
            body.update(max_tokens=1500, stream=True)
            with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
                next(r.iter_lines())  # the first chunk, then the client goes away
            state = server.wait_idle()
            check_idle(state)
            seen[steps] = ("".join(chunks), whole, len(chunks), state["counters"])
    assert seen["8"][:2] == seen["1"][:2] and seen["1"][0] == seen["1"][1]
    assert seen["8"][2] < seen["1"][2]
    assert seen["1"][3].get("decode_steps_ahead", 0) == 0
    assert seen["8"][3]["decode_steps_ahead"] > 0 and seen["8"][3]["aborted"] == 1
