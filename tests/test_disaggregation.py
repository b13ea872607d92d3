"""Prefill-decode disaggregation in process: a prefill engine and a decode engine (each with
its own model and pool) hand a request's KV over the Mooncake transfer engine on loopback.

Exactness: greedy and seeded outputs, logprobs and prompt logprobs through the pair equal a
colocated engine's, and the rows the decode engine read are the colocated engine's rows bit
for bit. Faults: a prefill engine gone before or during the handoff, a decode request
cancelled mid-transfer, a room the prefill side never received, a mismatched model; after
each, both pools are whole again (every slot free or the tree's, nothing held or
quarantined).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import torch

from mci.core.request import KVHandoff, Request
from mci.core.sampling_params import SamplingParams
from mci.disaggregation.region import KVRegion, read_plan
from mci.engine.config import engine_config_from_fields
from mci.engine.engine import Engine
from mci.layers.linear import bf16_matmuls_supported

# The transfer engine needs libibverbs.so.1 (Debian's libibverbs1; .ci/run installs it): a
# machine without it skips these tests, CI never does.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read once, when the library loads
try:
    import mooncake.engine  # noqa: F401
except ImportError as exc:
    if os.environ.get("CI"):
        raise
    pytest.skip(f"the Mooncake transfer engine does not load: {exc}", allow_module_level=True)

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n" * 24,
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]
TIMEOUT_S = 2.0


def make(path, mode: str, dtype: str = "float32", checked: bool = True, **fields) -> Engine:
    config = engine_config_from_fields(
        {
            "model_path": path,
            "dtype": dtype,
            "skip_kernel_warmup": True,
            "max_total_tokens": 4096,
            "disaggregation_mode": mode,
            "disaggregation_bootstrap_port": 0,
            "disaggregation_transfer_timeout": TIMEOUT_S,
            **fields,
        }
    )
    # slot accounting checked after every step (holds and quarantines included)
    return Engine(dataclasses.replace(config, check_integrity=checked))


class Run:
    """One prompt's outputs into a list; `done` once every sample has its final output."""

    def __init__(self, engine: Engine, prompt, params, handoff=None, rid="r"):
        self.outputs, self.done = [], threading.Event()
        self.finals: dict[str, object] = {}
        command = engine.command(rid, prompt, params)
        if handoff is not None:
            command = dataclasses.replace(command, handoff=handoff)
        self.ids = engine.submit(command, self._sink)

    def _sink(self, out) -> None:
        self.outputs.append(out)
        if out.finished:
            self.finals[out.request_id] = out
            if len(self.finals) == len(self.ids):
                self.done.set()

    def wait(self, timeout_s: float = 60) -> list:
        assert self.done.wait(timeout_s), "no final output"
        return [self.finals[i] for i in self.ids]


def through_pair(prefill: Engine, decode: Engine, prompt, params, room: str):
    source = prefill.scheduler.handoff.address
    first = Run(prefill, prompt, params, KVHandoff(room), rid=f"p-{room}")
    second = Run(decode, prompt, params, KVHandoff(room, source), rid=f"d-{room}")
    return first.wait(), second.wait()


def settled(*engines: Engine, timeout_s: float = 10) -> None:
    """Every engine idle and whole: nothing held, received or quarantined, slots accounted."""
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        while True:
            try:
                engine.check_idle_integrity()
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@pytest.fixture(scope="module")
def trio(checkpoint):
    path = checkpoint()
    engines = make(path, "null"), make(path, "prefill"), make(path, "decode")
    yield engines
    for engine in engines:
        engine.shutdown()


def test_the_pair_gives_the_colocated_outputs(trio):
    colocated, prefill, decode = trio
    cases = [
        SamplingParams(max_new_tokens=12, temperature=0, logprobs=3),
        SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, n=2),
        SamplingParams(max_new_tokens=6, temperature=0, prompt_logprobs=2, stop=["\n\n"]),
        SamplingParams(max_new_tokens=1, temperature=0),
    ]
    for k, params in enumerate(cases):
        for i, prompt in enumerate(PROMPTS):
            want = Run(colocated, prompt, params, rid=f"c{k}-{i}").wait()
            first, got = through_pair(prefill, decode, prompt, params, room=f"exact{k}-{i}")
            for a, b in zip(got, want, strict=True):
                assert a.error is None, a.error
                assert a.output_token_ids == b.output_token_ids, (k, i)
                assert a.text == b.text and a.finish_reason == b.finish_reason
                assert a.logprobs == b.logprobs
                assert a.prompt_logprobs == b.prompt_logprobs
            for out in first:  # the prefill side stops after the first token
                assert len(out.output_token_ids) == 1 and out.error is None
    stats = decode.stats()["disaggregation"]
    assert stats["transfers"] >= len(cases) * len(PROMPTS)
    settled(*trio)


def test_the_rows_read_are_the_rows_computed(trio):
    """The decode engine's cached rows of a prompt (read from the prefill engine) equal the
    colocated engine's rows of it (computed there), every layer, bit for bit."""
    colocated, prefill, decode = trio
    prompt = "def read_rows(path):\n    with open(path) as f:\n" * 6
    params = SamplingParams(max_new_tokens=2, temperature=0)
    Run(colocated, prompt, params, rid="rows-c").wait()
    through_pair(prefill, decode, prompt, params, room="rows")
    ids = colocated.front.encode(prompt)

    def rows(engine: Engine) -> torch.Tensor:
        def read():
            slots, _ = engine.kv.radix.match_prefix(ids)
            return engine.core.runner.kv_cache[:, slots[: len(ids)]].clone()

        return engine.between_steps(read)

    here, there = rows(decode), rows(colocated)
    assert here.shape[1] == len(ids)
    assert torch.equal(here, there)
    settled(*trio)


def test_a_decode_cache_hit_reads_only_the_rest(trio):
    """A later turn whose start the decode engine cached reads only the new positions."""
    colocated, prefill, decode = trio
    base = "def turn(x):\n    return x + 1\n" * 8
    params = SamplingParams(max_new_tokens=4, temperature=0)
    through_pair(prefill, decode, base, params, room="turn1")
    before = decode.stats()["counters"]["kv_transfer_tokens"]
    later = base + "def more(y):\n    return y\n"
    _, got = through_pair(prefill, decode, later, params, room="turn2")
    read = decode.stats()["counters"]["kv_transfer_tokens"] - before
    assert 0 < read < len(decode.front.encode(later)) - 20
    want = Run(colocated, later, params, rid="turn2-c").wait()
    assert got[0].output_token_ids == want[0].output_token_ids
    settled(*trio)


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_bf16_and_fp8_checkpoints_give_the_colocated_outputs(checkpoint, variant):
    """Greedy tokens equal the colocated engine's; with --deterministic (where the CPU runs
    oneDNN's bf16 matmuls) the logprobs too, bit for bit."""
    path = checkpoint(dtype="bfloat16", fp8=variant == "fp8")
    exact = bf16_matmuls_supported()
    engines = [
        make(path, mode, dtype="bfloat16", deterministic=exact)
        for mode in ("null", "prefill", "decode")
    ]
    colocated, prefill, decode = engines
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0, logprobs=2 if exact else None)
        for i, prompt in enumerate(PROMPTS):
            want = Run(colocated, prompt, params, rid=f"c{i}").wait()[0]
            _, got = through_pair(prefill, decode, prompt, params, room=f"{variant}{i}")
            assert got[0].output_token_ids == want.output_token_ids, i
            assert got[0].logprobs == want.logprobs
        settled(*engines)
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_room_the_prefill_side_never_received_fails_and_frees(trio):
    _, prefill, decode = trio
    params = SamplingParams(max_new_tokens=4, temperature=0)
    source = prefill.scheduler.handoff.address
    start = time.monotonic()
    (out,) = Run(decode, PROMPTS[0], params, KVHandoff("nobody-sent-this", source)).wait()
    assert out.error is not None and "KV transfer failed" in out.error
    assert "never received" in out.error
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 5
    settled(*trio)


def test_a_cancelled_decode_request_releases_the_prefill_hold(trio):
    """The decode side aborts while it waits: its slots come back, and the prefill side's
    hold is released when its offer finds the room abandoned."""
    _, prefill, decode = trio
    params = SamplingParams(max_new_tokens=4, temperature=0)
    source = prefill.scheduler.handoff.address
    waiting = Run(decode, PROMPTS[1], params, KVHandoff("cancelled", source), rid="cancel-d")
    time.sleep(0.3)  # reserved, connected, waiting for an offer
    decode.abort("cancel-d")
    (out,) = waiting.wait()
    assert out.finish_reason == "abort"
    time.sleep(0.7)  # the prefill side notices the closed connection (a heartbeat)
    Run(prefill, PROMPTS[1], params, KVHandoff("cancelled"), rid="cancel-p").wait()
    settled(*trio)


def test_another_model_is_refused_by_name(trio, checkpoint):
    """A decode engine of another checkpoint asks: a clear error, nothing read."""
    _, prefill, _ = trio
    other = make(checkpoint(seed=5), "decode")
    try:
        params = SamplingParams(max_new_tokens=2, temperature=0)
        first = Run(prefill, PROMPTS[0], params, KVHandoff("other"), rid="o-p")
        source = prefill.scheduler.handoff.address
        (out,) = Run(other, PROMPTS[0], params, KVHandoff("other", source), rid="o-d").wait()
        assert "another model, dtype or layout" in (out.error or "")
        first.wait()
        settled(other)
    finally:
        other.shutdown()


def test_a_prefill_engine_gone_mid_handoff_fails_the_decode_request_and_frees_it(checkpoint):
    """The prefill engine shuts down while decode requests wait on it (two of its rooms it
    never got, two it is computing): each one it did not serve fails at once with the
    transfer's error (its connection closes: no timeout is waited out, no hang), and the
    decode pool is whole again."""
    path = checkpoint()
    prefill, decode = make(path, "prefill"), make(path, "decode")
    try:
        source = prefill.scheduler.handoff.address
        params = SamplingParams(max_new_tokens=8, temperature=0)
        long = "x = [" + ", ".join(str(i) for i in range(300)) + "]\n"
        runs = [
            Run(decode, long + str(i), params, KVHandoff(f"gone{i}", source), rid=f"g{i}")
            for i in range(4)
        ]
        for i in range(2):
            Run(prefill, long + str(i), params, KVHandoff(f"gone{i}"), rid=f"gp{i}")
        time.sleep(0.3)
        start = time.monotonic()
        prefill.shutdown()
        outs = [run.wait(TIMEOUT_S + 10)[0] for run in runs]
        for out in outs[2:]:
            assert "KV transfer failed" in (out.error or ""), out.error
        assert time.monotonic() - start < TIMEOUT_S
        for out in outs[:2]:
            assert out.error is None or "KV transfer failed" in out.error, out.error
        settled(decode)
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_a_read_plan_covers_each_row_once_in_runs():
    """Every (layer, position) row is read once, from its slot there into its slot here, with
    runs consecutive on both sides merged (the pool hands slots out descending)."""
    kv = torch.zeros(3, 64, 8)
    here, there = KVRegion.of("here", kv), KVRegion.of("there", torch.zeros(3, 64, 8))
    local, peer = list(range(20, 10, -1)) + [40, 42], list(range(9, -1, -1)) + [50, 51]
    local_addrs, peer_addrs, lengths = read_plan(here, local, there, peer)
    assert len(lengths) == 3 * 3  # per layer: one run of 10, then two single rows
    row = here.row_bytes
    copied = {}
    for a, b, n in zip(local_addrs, peer_addrs, lengths, strict=True):
        for k in range(n // row):
            copied[a + k * row] = b + k * row
    for layer in range(3):
        for mine, theirs in zip(local, peer, strict=True):
            a = here.base + layer * here.layer_stride + mine * row
            assert copied[a] == there.base + layer * there.layer_stride + theirs * row
    assert len(copied) == 3 * len(local)
    with pytest.raises(ValueError, match="layouts differ"):
        read_plan(here, local, KVRegion.of("x", torch.zeros(2, 64, 8)), peer)
    with pytest.raises(ValueError, match="outside the KV pool"):
        read_plan(here, [64], there, [0])


def test_a_room_still_computing_is_never_reaped(trio):
    """However long a prompt takes on the prefill side, its room waits for its offer (a
    reaper that forgot it would tell the decode side it was never received); a room that
    ended is forgotten after the bound."""
    _, prefill, _ = trio
    side = prefill.scheduler.handoff
    req = Request("slow", [1, 2, 3], SamplingParams(max_new_tokens=1), handoff=KVHandoff("slow"))
    side.expect(req)
    side._reap(time.monotonic() + 1e6)
    assert "slow" in side._rooms
    side.withdraw(req, "aborted")
    side._reap(time.monotonic() + 1e6)
    assert "slow" not in side._rooms


def test_a_fragmented_pool_is_read_in_many_batches(checkpoint):
    """Slots scattered over the pool (runs of one): more ranges than the transfer engine takes
    in one batch (6 layers x ~800 positions > 4,096), read in batches, and the outputs still
    the colocated ones."""
    path = checkpoint(num_hidden_layers=6)
    colocated, prefill = make(path, "null"), make(path, "prefill")
    decode = make(path, "decode", checked=False)  # it holds slots of its own below
    try:
        pool = decode.kv.pool

        def fragment():
            taken = pool.alloc(pool.num_free)
            pool.free(taken[::2])  # the free slots alternate with held ones
            return taken[1::2]

        held = decode.between_steps(fragment)
        prompt = "x = [" + ", ".join(str(i) for i in range(250)) + "]\n"
        params = SamplingParams(max_new_tokens=6, temperature=0)
        want = Run(colocated, prompt, params, rid="frag-c").wait()[0]
        _, got = through_pair(prefill, decode, prompt, params, room="fragmented")
        assert got[0].error is None, got[0].error
        assert got[0].output_token_ids == want.output_token_ids
        ranges = decode.stats()["disaggregation"]["transfer_ranges"]
        assert ranges > 4096, ranges
        decode.between_steps(lambda: pool.free(held))
        settled(decode, prefill, colocated)
    finally:
        for engine in (decode, prefill, colocated):
            engine.shutdown()
