"""Weighted fair scheduling (`--schedule-policy fair`, the Virtual Token Counter) on the
scheduler alone, with a fake runner: deterministic counters, not timings."""

from __future__ import annotations

import pytest
from test_scheduler_policy import FakeRunner, make

from mci.core.request import Request, TenantShare
from mci.core.sampling_params import SamplingParams
from mci.engine.config import DEFAULT_MODEL
from mci.scheduler.fair_share import INPUT_TOKEN_COST, OUTPUT_TOKEN_COST, VirtualTokenCounter
from mci.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.load(DEFAULT_MODEL)


SHAPES = {  # (prompt tokens, output tokens)
    "short": (8, 4),
    "long": (96, 4),
    "prompt_heavy": (64, 2),
    "output_heavy": (4, 48),
}


def req(i: int, tenant: str, weight: float, shape: str, **share) -> Request:
    prompt, out = SHAPES[shape]
    return Request(
        f"{tenant}-{i}",
        [5 + (j + i) % 50 for j in range(prompt)],
        SamplingParams(max_new_tokens=out, temperature=0, ignore_eos=True),
        share=TenantShare(tenant, weight, **share),
    )


def cost(shape: str) -> float:
    prompt, out = SHAPES[shape]
    return INPUT_TOKEN_COST * prompt + OUTPUT_TOKEN_COST * out


def drive(scheduler, steps: int, refill=None):
    """Step `steps` times; `refill(scheduler)` keeps tenants backlogged. Returns the counters
    after every step."""
    runner, history = FakeRunner(), []
    for _ in range(steps):
        if refill:
            refill(scheduler)
        batch = scheduler.schedule()
        if batch:
            scheduler.update(batch, runner.execute(batch))
        history.append({t: scheduler.fair.counter(t) for t in ("a", "b")})
    return history


@pytest.mark.parametrize(
    "shape_a, shape_b", [("short", "long"), ("prompt_heavy", "output_heavy"), ("long", "short")]
)
def test_two_backlogged_tenants_get_service_by_weight_within_the_vtc_bound(
    tokenizer, shape_a, shape_b
):
    # 1 : 3 weights, different shapes; 4 running at most, so the queue decides
    scheduler = make(
        tokenizer,
        num_slots=4096,
        schedule_policy="fair",
        max_running_requests=4,
        max_prefill_tokens=64,
        chunked_prefill_size=32,
    )
    made = {"a": 0, "b": 0}

    def refill(s):
        for tenant, weight, shape in (("a", 1.0, shape_a), ("b", 3.0, shape_b)):
            while sum(r.share.tenant == tenant for r in s.waiting) < 4:
                s.add_request(req(made[tenant], tenant, weight, shape))
                made[tenant] += 1

    history = drive(scheduler, 400, refill)
    # the counters (service / weight) of two backlogged tenants stay within VTC's bound:
    # twice the largest counter one request can add
    bound = 2 * max(cost(shape_a) / 1.0, cost(shape_b) / 3.0)
    gap = max(abs(h["a"] - h["b"]) for h in history[20:])
    assert gap <= bound, (gap, bound)
    accounts = scheduler.fair.accounts
    ratio = accounts["b"].service / accounts["a"].service
    assert 2.6 < ratio < 3.4, ratio  # service in proportion to weight


def test_fcfs_lets_a_flood_take_the_queue_and_fair_does_not(tokenizer):
    """A floods 40 requests, then B sends 4: under fcfs B waits behind the whole flood; under
    fair B's requests are admitted as soon as a running slot frees."""

    def admitted_order(policy):
        s = make(tokenizer, num_slots=4096, schedule_policy=policy, max_running_requests=2)
        for i in range(40):
            s.add_request(req(i, "a", 1.0, "output_heavy"))
        for i in range(4):
            s.add_request(req(i, "b", 1.0, "short"))
        runner, order = FakeRunner(), []
        while s.has_work:
            batch = s.schedule()
            for item in batch.items:
                if item.request.request_id not in order:
                    order.append(item.request.request_id)
            s.update(batch, runner.execute(batch))
        assert s.active_tenants() == set()  # every request left: none counted as still queued
        return order

    fcfs, fair = admitted_order("fcfs"), admitted_order("fair")
    assert fcfs.index("b-0") == 40  # behind the whole flood
    assert fair.index("b-3") < 10  # B's four within the first few admissions


def test_a_tenant_returning_from_idle_is_lifted_and_an_idle_share_goes_to_the_others():
    vtc = VirtualTokenCounter()
    vtc.arrive("a", 1.0, set())
    vtc.charge("a", 100, 0)
    vtc.arrive("b", 1.0, {"a"})  # b arrives while a is active: lifted to a's counter
    assert vtc.counter("b") == vtc.counter("a") == 100
    vtc.charge("b", 0, 10)
    vtc.arrive("a", 1.0, {"a", "b"})  # a is active: its counter stays where it is
    assert vtc.counter("a") == 100 and vtc.counter("b") == 120
    vtc.arrive("a", 1.0, {"b"})  # a back from idle while b is active: lifted to b's
    assert vtc.counter("a") == 120
    vtc.arrive("c", 2.0, set())  # nobody active: c starts level with the most served
    assert vtc.counter("c") == 120
    vtc.charge("c", 40, 0)
    assert vtc.counter("c") == 140  # weight 2: 40 input tokens move its counter by 20
    snap = vtc.snapshot()
    assert snap["c"]["weight"] == 2.0 and abs(sum(t["share"] for t in snap.values()) - 1) < 1e-3


def test_preemption_takes_from_the_most_served_tenant(tokenizer):
    """A small pool: decode growth must preempt someone. fcfs takes the newest request (b's);
    fair takes from the tenant that has received the most service (a's, though older)."""

    def victims(policy):
        s = make(
            tokenizer,
            num_slots=120,
            schedule_policy=policy,
            max_running_requests=4,
            decode_reserve_tokens=0,
            radix=False,
        )
        for i in range(2):
            s.add_request(req(i, "a", 1.0, "output_heavy"))
        for i in range(2):
            s.add_request(req(i, "b", 1.0, "output_heavy"))
        s.fair.charge("a", 1000, 0)  # since both are active, a has been served far more
        seen, preempt = [], s._preempt
        s._preempt = lambda r, batch, budget: (seen.append(r.request_id), preempt(r, batch, budget))
        runner = FakeRunner()
        while s.has_work:
            batch = s.schedule()
            s.update(batch, runner.execute(batch))
        return seen

    fcfs, fair = victims("fcfs"), victims("fair")
    assert fcfs and fcfs[0].startswith("b-"), fcfs
    assert fair and fair[0].startswith("a-"), fair


def test_a_tenants_running_cap_holds_and_others_go_ahead(tokenizer):
    s = make(tokenizer, num_slots=4096, schedule_policy="fcfs", max_running_requests=8)
    for i in range(6):
        s.add_request(req(i, "a", 1.0, "output_heavy", max_running=2))
    s.add_request(req(0, "b", 1.0, "output_heavy"))
    runner = FakeRunner()
    for _ in range(3):
        batch = s.schedule()
        s.update(batch, runner.execute(batch))
        running = [r.share.tenant for r in s.running]
        assert running.count("a") <= 2
    assert "b" in [r.share.tenant for r in s.running]


def test_under_fair_a_waiting_tenant_s_prompt_goes_before_a_more_served_tenant_s_prefill(
    tokenizer,
):
    """A's long prompt is running (in chunks); B's short one arrives. Under fair, B (served
    less) is admitted and planned in the same step's budget before A's next chunk; under fcfs
    A's running chunk takes the budget first and B waits a step."""

    def steps_until_b_planned(policy):
        s = make(
            tokenizer,
            num_slots=4096,
            schedule_policy=policy,
            max_prefill_tokens=32,
            chunked_prefill_size=32,
            radix=False,
        )
        s.add_request(req(0, "a", 1.0, "long"))  # 96 tokens: three chunks of 32
        runner = FakeRunner()
        batch = s.schedule()
        s.update(batch, runner.execute(batch))
        s.add_request(req(0, "b", 1.0, "short"))  # lifted level with A, then A is served on
        s.fair.charge("a", 16, 0)
        batch = s.schedule()
        return [item.request.request_id for item in batch.items]

    assert steps_until_b_planned("fair")[0] == "b-0"
    assert steps_until_b_planned("fcfs") == ["a-0"]  # A's chunk filled the budget
